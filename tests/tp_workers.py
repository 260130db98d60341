"""What each rank of tests/test_tensor_parallel.py runs: module-level functions, so that a spawned rank
imports this small module (and minigen) to unpickle them, not the test module and its fixtures.

Every worker runs torch's own ops (build.enabled(False)), as the single-process reference does: the
comparison is then of the split alone, not of two kernels' rounding."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import minigen
from minigen.kernels import build
from minigen.loading import build_model
from minigen.parallel import shard_model


def greedy(rank: int, tp_size: int, cfg, hf_state: dict, ids: torch.Tensor, new: int,
           settings: dict | None = None) -> dict:
    """Rank `rank`'s greedy tokens [B, T+new] (or those `settings` choose: generate's overrides), prompt
    logits [B, T, V], cache bytes, local KV heads and the plan in words."""
    with build.enabled(False):
        model = shard_model(build_model(cfg, hf_state), rank, tp_size)
        out = minigen.generate(model, ids, max_new_tokens=new, **(settings or {"do_sample": False}))
        with torch.inference_mode():
            logits = model(ids, torch.arange(ids.shape[1]))
    return {"tokens": out.tokens, "logits": logits, "kv_bytes": out.stats.kv_cache_bytes,
            "kv_heads": model.config.n_kv_heads, "plan": out.stats.plan}


def greedy_each(rank: int, tp_size: int, cases: list[tuple]) -> list[dict]:
    """greedy for each (cfg, hf_state, ids, new) of `cases`, in one group: one start for several models."""
    return [greedy(rank, tp_size, *case) for case in cases]


def smollm2(rank: int, tp_size: int, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Rank `rank`'s greedy tokens of SmolLM2-135M loaded with minigen.load(..., tp_size=tp_size)."""
    with build.enabled(False):
        model, _ = minigen.load("smollm2-135m", tp_size=tp_size)
        return minigen.generate(model, ids, max_new_tokens=new, do_sample=False, stop_token_ids=()).tokens


def down_sums(rank: int, tp_size: int, seed: int, rows: int, dim: int, width: int) -> dict:
    """One row-parallel product both ways, on the same numbers: each rank's hidden slice h_r [rows, F/N]
    times its columns of W [D, F], summed over the ranks by all-reduce, and the whole h [rows, F] times
    the whole W in one product (every rank draws the same h and W from `seed`)."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(rows, width, generator=g), torch.randn(dim, width, generator=g)
    part = width // tp_size
    cols = slice(rank * part, (rank + 1) * part)
    split = F.linear(h[:, cols], w[:, cols].contiguous())  # [rows, D]: this rank's partial sum
    dist.all_reduce(split)
    return {"split": split, "whole": F.linear(h, w), "abs": F.linear(h.abs(), w.abs())}


def dies_mid_generation(rank: int, tp_size: int, cfg, hf_state: dict, ids: torch.Tensor, new: int,
                        victim: int, at_call: int) -> torch.Tensor:
    """greedy's generation, in which rank `victim` kills itself (SIGKILL: no Python cleanup, as the
    out-of-memory killer would) when its first block runs for the `at_call`-th time."""
    calls = 0

    def maybe_die(module, args, out):
        nonlocal calls
        calls += 1
        if rank == victim and calls == at_call:
            os.kill(os.getpid(), signal.SIGKILL)
    with build.enabled(False):
        model = shard_model(build_model(cfg, hf_state), rank, tp_size)
        model.blocks[0].register_forward_hook(maybe_die)
        return minigen.generate(model, ids, max_new_tokens=new, do_sample=False).tokens


def raises(rank: int, tp_size: int) -> int:
    """Rank 1 raises before any collective; the others wait in a barrier that it never reaches."""
    if rank == 1:
        raise ValueError("rank 1 found something wrong")
    dist.barrier()
    return rank


def hangs(rank: int, tp_size: int) -> int:
    """Rank 1 hangs (sleeps far past the group's timeout) before a barrier that rank 0 waits in."""
    if rank == 1:
        time.sleep(300)
    dist.barrier()
    return rank
