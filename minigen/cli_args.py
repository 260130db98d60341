"""The command line's checked flag types (argparse `type=` functions), used by __main__.py."""

from __future__ import annotations

import argparse
import json
import math
import os


# A flag's number is checked as it is parsed, because an unchecked one fails far from its cause: a
# negative `profile --prompt-len` would slice the text [:, :-5] and profile nearly all of it, and a
# negative `serve-bench --seed` would end in numpy's traceback. argparse prints the usage and
# "argument --flag: <message>", and exits 2. Flags that are GenerationConfig
# fields (generate's --max-new-tokens, --temperature, --top-k, --top-p, --seed) are checked by the
# config, and bench's sizes by bench.check_bench_args, each before the model loads.
def int_at_least(low: int, below: int | None = None):
    """An argparse type: an integer >= low (and < below, when given)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (below is not None and value >= below):
            bound = f">= {low}"
            if below is not None:  # 2**64 reads better than 18,446,744,073,709,551,616
                bound += f" and < 2**{below.bit_length() - 1}" if below & (below - 1) == 0 else f" and < {below:,}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: use an integer {bound}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (float('nan') and 'inf' parse, and are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{value} is out of range: use a finite number > 0")
    return value


positive_int = int_at_least(1)
seed = int_at_least(0, 2**64)  # numpy's and torch's generators take any seed in [0, 2**64)


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1] (a share of requests, e.g. serve-bench --disconnect-fraction)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range: use a number in [0, 1]")
    return value


def response_format_file(path: str) -> dict:
    """An argparse type: a JSON file holding OpenAI's response_format ({"type": "json_schema", ...}) or a
    bare JSON schema, which becomes {"type": "json_schema", "json_schema": {"name": <file stem>, "schema": ...}}.
    The config checks the shape; the schema compiles when the run's plan is built."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise argparse.ArgumentTypeError(f"{path!r} is not a JSON file ({type(e).__name__}): give a JSON schema, "
                                         "or OpenAI's response_format object") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{path!r} holds a JSON {type(data).__name__}: give a JSON schema (an "
                                         "object), or OpenAI's response_format object")
    if "type" in data and data["type"] in ("json_schema", "json_object", "text") and "properties" not in data:
        return data
    return {"type": "json_schema", "json_schema": {"name": os.path.splitext(os.path.basename(path))[0], "schema": data}}
