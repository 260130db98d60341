"""Tensor parallelism on this CPU (issue 45's benchmark): SmolLM2 at tp_size 1 and 3, each rank a process.

    python scripts/parallel_speeds.py [--new-tokens 64] [--repeats 2] [--json docs/runs/parallel_speeds.json]

For each tp_size, a greedy generation over ranks (parallel/launch.py: each rank loads its shard and
streams the tokens) of the same prompt: the decode rate, the all-reduces per decode step (count and
bytes, against the prediction 2 x layers x B x D x 4 bytes for fp32 activations) and their time (a
rank's all-reduce time includes waiting for the slowest rank), and each rank's memory (weights, KV
cache, peak resident set). tp_size 1 runs in one rank process too (no all-reduce), at one thread as
every rank does (with the fused C step it picks, and with the eager step a shard runs), and again at one
thread per core (the machine's whole compute in one process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from minigen import GenerationConfig, load  # noqa: E402
from minigen.measure.machine import hardware_info  # noqa: E402
from minigen.parallel import launch  # noqa: E402
from minigen.parallel.group import run_ranks  # noqa: E402

PROMPT = "The history of the printing press begins"


def one(model: str, ids: torch.Tensor, config: GenerationConfig, tp_size: int, threads: int) -> dict:
    """One generation over `tp_size` rank processes of `threads` threads each: rank 0's report, and
    whether every rank wrote the same tokens."""
    reports = run_ranks(launch.rank_generate, tp_size, args=(model, ids, config.to_dict(), {}), threads=threads,
                        timeout=launch.RANKS_TIMEOUT_S)
    same = all(torch.equal(r["tokens"], reports[0]["tokens"]) for r in reports)
    r = reports[0]
    steps = max(r["decode_steps"], 1)
    return {"tp_size": tp_size, "threads_per_rank": threads, "ranks_agree": same, "tokens": r["tokens"][0].tolist(),
            "decode_tokens_per_s": r["decode_tokens_per_s"], "decode_steps": r["decode_steps"],
            "all_reduces_per_step": r["all_reduces"]["count"] / steps,
            "all_reduce_bytes_per_step": r["all_reduces"]["bytes"] / steps,
            "all_reduce_ms_per_step": r["all_reduces"]["seconds"] / steps * 1e3,
            "all_reduce_share_of_step": r["all_reduces"]["seconds"] / r["decode_s"] if r["decode_s"] else 0.0,
            "param_bytes_per_rank": r["param_bytes"], "kv_cache_bytes_per_rank": r["kv_cache_bytes"],
            "peak_rss_bytes_per_rank": max(x["peak_rss_bytes"] for x in reports), "step": r["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting; the fastest is kept")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, tok = load(args.model)
    cfg = model.config
    ids = tok(PROMPT, return_tensors="pt").input_ids
    config = GenerationConfig(max_new_tokens=args.new_tokens, stop_token_ids=[])
    predicted = 2 * cfg.n_layers * 1 * cfg.dim * 4  # bytes a rank sends into all-reduces per decode token (B = 1)
    del model
    cores = os.cpu_count() or 1
    rows = []
    for tp_size, threads, fused in ((1, 1, "auto"), (1, 1, False), (1, cores, "auto"), (3, 1, "auto")):
        runs = [one(args.model, ids, config.replace(fused_decode=fused), tp_size, threads) for _ in range(args.repeats)]
        best = max(runs, key=lambda r: r["decode_tokens_per_s"])
        rows.append(best)
        print(f"tp_size {tp_size}, {threads} thread(s) a rank, {best['step']} step: {best['decode_tokens_per_s']:5.1f} tok/s | "
              f"{best['all_reduces_per_step']:.0f} all-reduces a step, {best['all_reduce_bytes_per_step']:,.0f} bytes "
              f"(predicted {predicted if tp_size > 1 else 0:,}), {best['all_reduce_ms_per_step']:.2f} ms "
              f"({best['all_reduce_share_of_step']:.0%} of a step) | a rank: {best['param_bytes_per_rank'] / 2**20:.0f} MiB "
              f"weights, {best['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB KV, peak RSS "
              f"{best['peak_rss_bytes_per_rank'] / 2**20:.0f} MiB | ranks agree: {best['ranks_agree']}")
    same_tokens = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"every setting wrote the same {args.new_tokens} greedy tokens: {same_tokens}")
    if args.json:
        out = {"date": datetime.date.today().isoformat(), "hardware": hardware_info(), "model": args.model,
               "prompt": PROMPT, "new_tokens": args.new_tokens, "repeats": args.repeats,
               "predicted_all_reduce_bytes_per_step": predicted, "same_tokens": same_tokens, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
