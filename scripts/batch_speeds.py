"""Output tokens/s of SmolLM2 against batch size, in turns in one process: the measurement behind
issue 12's target (a batch of 8 at 4x the output tokens/s of one prompt at a time) and README's
batching row.

    python scripts/batch_speeds.py [--prompts 8] [--prompt-len 32] [--new-tokens 32] [--rounds 5]
                                   [--batches 1 2 4 8] [--json FILE]

`--prompts` different windows of the benchmark's English text, `--prompt-len` tokens each, each
generating `--new-tokens` greedy tokens (no stop token), fp32, the default config. Each round runs,
in turn: every prompt alone, one after the other (batch 1); the prompts in static batches of each
`--batches` size (`minigen.generate` on [B, T]); and all of them through `minigen.Engine` with
`max_batch_size` = the largest batch. Times are wall clock from the first call to the last token,
prefill included. The table gives the median over rounds of output tokens/s and of each round's
ratio to batch 1 in the same round (neighbours on a shared machine slow whole rounds). The tokens
of every batch and of the Engine are checked against batch 1's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import minigen  # noqa: E402
from minigen.kernels import build as kernel_build  # noqa: E402
from minigen.measure import bench  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", help="write the rounds and the table to this file")
    args = parser.parse_args(argv)
    if args.prompts % max(args.batches) or 1 not in args.batches:
        parser.error("--batches must include 1, and each batch size must divide --prompts")
    model, tokenizer = minigen.load("smollm2-135m")
    text = bench.prompt_ids(tokenizer, args.prompts * args.prompt_len)[0]
    prompts = torch.stack([text[i * args.prompt_len:(i + 1) * args.prompt_len] for i in range(args.prompts)])
    settings = {"max_new_tokens": args.new_tokens, "stop_token_ids": []}
    n_out = args.prompts * args.new_tokens

    def static(B: int) -> tuple[float, Tensor]:
        began = time.perf_counter()
        tokens = [minigen.generate(model, prompts[i:i + B], **settings).tokens for i in range(0, args.prompts, B)]
        return time.perf_counter() - began, torch.cat(tokens)

    def engine() -> tuple[float, Tensor]:
        e = minigen.Engine(model, max_batch_size=max(args.batches))
        ids = [e.add_request(p, **settings) for p in prompts]
        began = time.perf_counter()
        done = e.run()
        return time.perf_counter() - began, torch.stack([done[i] for i in ids])

    runs = {f"batch {B}": (lambda B=B: static(B)) for B in args.batches} | {"Engine": engine}
    for run in runs.values():  # warm-up: builds the kernel, touches the weights
        run()
    rounds = []
    for r in range(args.rounds):
        seconds, tokens = {}, {}
        for name, run in runs.items():
            seconds[name], tokens[name] = run()
        for name in runs:
            assert torch.equal(tokens[name], tokens["batch 1"]), f"{name}: tokens differ from one prompt at a time"
        rounds.append({name: n_out / s for name, s in seconds.items()})
        print(f"round {r + 1}: " + ", ".join(f"{name} {v:.1f}" for name, v in rounds[-1].items()), flush=True)
    print(f"\nSmolLM2-135M fp32, {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new each, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; kernel: {kernel_build.status()}")
    print(f"{'':<10}{'output tok/s':>14}{'x batch 1 (median of rounds)':>31}{'each round':>40}")
    table = []
    for name in runs:
        ratios = [rd[name] / rd["batch 1"] for rd in rounds]
        row = {"run": name, "tok_s": statistics.median(rd[name] for rd in rounds),
               "x_batch1": statistics.median(ratios), "x_batch1_rounds": ratios}
        table.append(row)
        print(f"{name:<10}{row['tok_s']:>14.1f}{row['x_batch1']:>30.2f}x{'':>4}"
              + " ".join(f"{x:.2f}" for x in ratios))
    if args.json:
        import json
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                                               "kernel": kernel_build.status(), "args": vars(args),
                                               "rounds": rounds, "table": table}, indent=1))


if __name__ == "__main__":
    main()
