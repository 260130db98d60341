"""Chunked prefill in minigen.Engine on SmolLM2: long prompts arrive while short requests decode.
The measurement behind issue 24's chunked-prefill table; chapter 14 runs the same function
(minigen.measure.serve_bench.mixed_prefill).

    python scripts/chunked_prefill.py [--budgets 0 256 128 64] [--long 512] [--threads 2] [--json FILE]

The workload: `--short` requests (a 32-token prompt, `--new` greedy tokens each) start together;
`--n-long` requests of `--long` prompt tokens (real English text) arrive one after another while
they decode, each wanting 4 tokens. Each budget (0: None, whole-prompt prefill) runs the same
workload on a fresh engine; reported: the short requests' time per output token (p50, p99, max:
the stall a whole prompt puts into their steps), the long requests' time to first token, and the
largest step in tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen.measure.serve_bench import mixed_prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 256, 128, 64])
    ap.add_argument("--long", type=int, default=512)
    ap.add_argument("--n-long", type=int, default=2)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = minigen.load("smollm2-135m")
    text = (Path(minigen.__file__).parent / "data" / "english.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    mixed_prefill(model, ids, 64, short=1, new=2, n_long=1, long=64)  # warm-up
    rows = []
    print("| max_num_batched_tokens | steps that decode: p50 ms | p99 ms | max ms | short requests: TPOT mean ms | "
          "long prompts: TTFT s | largest step (tokens) |")
    print("|---|---|---|---|---|---|---|")
    for b in args.budgets:
        r = mixed_prefill(model, ids, b or None, short=args.short, new=args.new, n_long=args.n_long, long=args.long)
        rows.append({k: v for k, v in r.items() if k not in ('tokens', 'metrics')})
        print(f"| {r['budget'] or 'None (whole prompts)'} | {1e3 * r['decode_step_p50_s']:.0f} | "
              f"{1e3 * r['decode_step_p99_s']:.0f} | {1e3 * r['decode_step_max_s']:.0f} | {1e3 * r['tpot_mean_s']:.0f} | "
              f"{', '.join(f'{t:.2f}' for t in r['long_ttft_s'])} | {r['max_step_tokens']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
