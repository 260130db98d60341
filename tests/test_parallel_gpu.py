"""Tensor parallelism through NCCL: the same code as gloo's, one GPU a rank (pytest -m gpu).

Runs at tp_size = the number of GPUs, and is skipped with fewer than two; scripts/gpu_check.py runs it
where there are two or more. The tiny model's 24 query heads, 24 key/value heads and MLP of 240 divide
by 2, 3, 4, 6 and 8 GPUs."""

from __future__ import annotations

import pytest
import torch

import minigen
import tp_gpu_workers
from conftest import tiny_hf
from minigen.checkpoints.hf_config import config_from_hf
from minigen.loading import build_model
from minigen.parallel import run_ranks

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more GPUs, this machine has {GPUS}")]


def test_nccl_ranks_write_one_gpus_greedy_tokens():
    hf = tiny_hf("llama", hidden_size=96, num_attention_heads=24, num_key_value_heads=24, intermediate_size=240)
    cfg, state = config_from_hf(hf.config.to_dict()), {k: v.clone() for k, v in hf.state_dict().items()}
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    alone = minigen.generate(build_model(cfg, state, device="cuda:0"), ids.cuda(), max_new_tokens=16).tokens.cpu()
    tokens = run_ranks(tp_gpu_workers.greedy_on_gpu, GPUS, args=(cfg, state, ids, 16), timeout=300, backend="nccl")
    for rank, t in enumerate(tokens):
        assert torch.equal(t, alone), f"rank {rank} of {GPUS}"
