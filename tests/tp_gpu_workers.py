"""What each rank of tests/test_parallel_gpu.py runs (module-level, so that a spawned rank can unpickle it)."""

from __future__ import annotations

import torch

import minigen
from minigen.loading import build_model
from minigen.parallel import shard_model


def greedy_on_gpu(rank: int, tp_size: int, cfg, hf_state: dict, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Rank `rank`'s greedy tokens [B, T + new] (on the CPU), its shard on GPU `rank`, all-reduced by NCCL."""
    model = shard_model(build_model(cfg, hf_state, device=f"cuda:{rank}"), rank, tp_size)
    return minigen.generate(model, ids.to(f"cuda:{rank}"), max_new_tokens=new, do_sample=False).tokens.cpu()
