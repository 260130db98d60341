"""Perplexity of SmolLM2 with a quantized KV cache, the longer run that chapter 04 renders and that
`minigen.measure.plan.QUALITY_LOSS` cites: each setting feeds the text one token at a time
(chunk_size=1), so every prediction reads every earlier token back from the quantized cache.

    python scripts/kv_quant_quality.py [--tokens 600] [--json minigen/data/kv_quant_quality.json]

About 30 to 100 s per row at 600 tokens on one thread of a two-core CPU (eight rows). The JSON keeps
the date, the machine and the settings with the rows, so a chapter that quotes it says where it came from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen.evaluate import score  # noqa: E402

ROWS = [(8, "channel", 32), (4, "channel", 32), (4, "token", 32), (2, "channel", 32), (2, "token", 32),
        (4, "channel", 128), (4, "token", 128), (2, "channel", 128)]  # (bits, keys per, window)
DEFAULT_JSON = Path(minigen.__file__).parent / "data" / "kv_quant_quality.json"


def machine() -> str:
    """The CPU's model name and core count, as /proc/cpuinfo says (platform's guess elsewhere)."""
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {torch.get_num_threads()} thread(s) of {torch.multiprocessing.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the chapter runs: a second thread waits on a shared machine
    model, tokenizer = minigen.load("smollm2-135m")
    text = (Path(minigen.__file__).parent / "data" / "english.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[0][:args.tokens]  # [T]
    base = score(model, ids)  # fp32 cache, one pass: the same logits as fed token by token
    rows = []
    for bits, key_axis, residual in ROWS:
        s = score(model, ids, chunk_size=1, quant_bits=bits, quant_key_axis=key_axis, quant_residual=residual)
        rows.append({"bits": bits, "key_axis": key_axis, "window": residual, "perplexity": s.perplexity,
                     "change": s.perplexity / base.perplexity - 1,
                     "top1_agreement": (s.top1 == base.top1).float().mean().item()})
        print(rows[-1], flush=True)
    run = {"date": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
           "tokens": args.tokens, "group_size": 32, "scales": "bf16 scales and zeros (an fp32 model)",
           "baseline_perplexity": base.perplexity, "rows": rows}
    args.json.write_text(json.dumps(run, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
