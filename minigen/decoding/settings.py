"""The decoding settings' values, checked: min_p, the penalties, n, logprobs and logit_bias, and the settings
that read text (stop strings; what structured output constrains a reply to, response_format,
guided_regex and guided_grammar, and who compiles it, guided_backend) (chapter 4).

config.py calls `check_decoding` and `check_text_settings` when a config is built, with the other
values; each refusal is a ConfigError naming the key, the value and what to write instead. What needs the
model (a logit_bias id inside its vocabulary) is `check_vocabulary`, called when a plan is built
and when a prompt is checked. The ranges are the ones the names come from: transformers' for
repetition_penalty and min_p, OpenAI's for frequency_penalty, presence_penalty and logit_bias.
"""

from __future__ import annotations

import math
from typing import Any

from ..checks import is_number
from ..errors import ConfigError
from .detokenize import MAX_STOPS
from .logprobs import logprobs_count

LOGIT_BIAS_MAX = 100  # OpenAI's bound on a bias: -100 bans a token in effect, +100 all but forces it
OPENAI_PENALTY_MAX = 2.0  # OpenAI's bound on |frequency_penalty| and |presence_penalty|
TOKEN_ID_MAX = 2**63 - 1  # token ids travel as int64 tensors


def logit_bias_ids(bias: Any) -> Any:
    """logit_bias with JSON's string keys ("123": JSON objects have no integer keys) as ints, in a new
    dict (the caller's stays theirs); anything else is returned as it is, for check_decoding to refuse."""
    if not isinstance(bias, dict):
        return bias
    return {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v for k, v in bias.items()}


def check_decoding(c) -> None:
    """Refuse a min_p, a penalty, n, logprobs or a logit_bias out of its range, naming the key, the value and the range."""
    if c.min_p is not None and (not is_number(c.min_p) or not 0 <= c.min_p <= 1):
        raise ConfigError(f"min_p={c.min_p!r} is invalid: use a number in [0, 1] (keep the tokens at least min_p "
                          "times as likely as the top one; 0.05 is common), or None to keep every token")
    r = c.repetition_penalty
    if not is_number(r) or not (r > 0 and math.isfinite(r)):
        raise ConfigError(f"repetition_penalty={r!r} is invalid: use a finite number > 0 (1.0 is off; 1.1 to 1.3 "
                          "discourage repeats, below 1 encourages them)")
    for key in ("frequency_penalty", "presence_penalty"):
        v = getattr(c, key)
        if not is_number(v) or not -OPENAI_PENALTY_MAX <= v <= OPENAI_PENALTY_MAX:
            raise ConfigError(f"{key}={v!r} is invalid: use a number in [-2, 2] (OpenAI's range; 0 is off)")
    if not isinstance(c.n, int) or isinstance(c.n, bool) or c.n < 1:
        raise ConfigError(f"n={c.n!r} is invalid: use an integer >= 1 (samples a prompt, each its own row)")
    logprobs_count(c.logprobs)
    bias = c.logit_bias
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias={bias!r} is invalid: use a mapping of token ids to biases in [-100, 100], "
                          "e.g. {\"50256\": -100}, or None")
    for k, v in bias.items():
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= TOKEN_ID_MAX:
            raise ConfigError(f"logit_bias has the key {k!r}, which is no token id: use integer ids >= 0 (or their "
                              "decimal strings, as JSON writes them) mapped to biases in [-100, 100]")
        if not is_number(v) or not -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX:
            raise ConfigError(f"logit_bias[{k}]={v!r} is invalid: use a number in [-100, 100] (OpenAI's range; "
                              "-100 bans the token in effect)")


def check_vocabulary(c, vocab_size: int) -> None:
    """Refuse a logit_bias id that the model's vocabulary [0, vocab_size - 1] does not hold."""
    outside = sorted(k for k in (c.logit_bias or {}) if k >= vocab_size)
    if outside:
        raise ConfigError(f"logit_bias names the token id {outside[0]}, outside this model's vocabulary "
                          f"[0, {vocab_size - 1}]: use ids from the model's tokenizer")


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
GUIDED_BACKENDS = ("auto", "minigen", "llguidance")
_FORMAT_SHAPE = ('{"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object", ...}}}, '
                 '{"type": "json_object"} or {"type": "text"}')


def check_text_settings(c) -> None:
    """stop, response_format, guided_regex, guided_grammar and guided_backend (chapter 4)."""
    if c.stop is not None:
        if not isinstance(c.stop, tuple) or not all(isinstance(s, str) for s in c.stop):
            raise ConfigError(f"stop={c.stop!r} is invalid: use a string or a list of up to {MAX_STOPS} "
                              "strings, or None for no stop strings")
        if not 1 <= len(c.stop) <= MAX_STOPS or not all(c.stop):
            raise ConfigError(f"stop={list(c.stop)!r} is invalid: use 1 to {MAX_STOPS} non-empty strings "
                              "(an empty string would match before any text), or None for no stop strings")
    fmt = c.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in RESPONSE_FORMATS:
            raise ConfigError(f"response_format={fmt!r} is invalid: use {_FORMAT_SHAPE}, or None")
        extra = set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
        inner = fmt.get("json_schema")
        if extra or (kind == "json_schema" and not (isinstance(inner, dict) and isinstance(inner.get("schema"), dict))):
            raise ConfigError(f"response_format={fmt!r} is invalid: a json_schema format holds its schema under "
                              f"json_schema.schema (OpenAI's shape), and no other keys: use {_FORMAT_SHAPE}")
        if kind == "text":  # no constraint, stored as None so that nothing downstream asks twice
            object.__setattr__(c, "response_format", None)
    for key in ("guided_regex", "guided_grammar"):
        value = getattr(c, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{key}={value!r} is invalid: use a non-empty string, or None")
    named = [k for k in ("response_format", "guided_regex", "guided_grammar") if getattr(c, k) is not None]
    if len(named) > 1:
        raise ConfigError(f"{' and '.join(named)} are both set: a reply follows one structure. Keep one of them")
    if c.guided_backend not in GUIDED_BACKENDS:
        raise ConfigError(f"guided_backend={c.guided_backend!r} is invalid: use \"auto\" (minigen's own automaton "
                          "where the spec is in its subset, else llguidance), \"minigen\" or \"llguidance\"")
