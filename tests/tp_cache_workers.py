"""What each rank of tests/test_tensor_parallel_caches.py runs (module-level, so that a spawned rank can unpickle it)."""

from __future__ import annotations

import torch

import minigen
from minigen import GenerationConfig
from minigen.kernels import build
from minigen.loading import build_model
from minigen.parallel import shard_model


def greedy_under(rank: int, tp_size: int, cfg, hf_state: dict, ids: torch.Tensor, configs: list[dict]) -> list:
    """Rank `rank`'s greedy tokens under each config (a GenerationConfig's dict), or the ConfigError's words."""
    with build.enabled(False):
        model = shard_model(build_model(cfg, hf_state), rank, tp_size)
        out = []
        for fields in configs:
            try:
                out.append(minigen.generate(model, ids, GenerationConfig(**fields)).tokens)
            except minigen.errors.ConfigError as e:
                out.append(str(e))
        return out
