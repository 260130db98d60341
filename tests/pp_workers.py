"""What each rank of tests/test_pipeline_parallel.py runs: module-level functions, so that a spawned rank
imports this small module (and minigen) to unpickle them, not the test module and its fixtures.

Every worker runs torch's own ops (torch_ops=True, build.enabled(False)), as the one-process reference
does: the comparison is then of the split alone, not of two kernels' rounding."""

from __future__ import annotations

import os
import signal

import torch

from minigen.kernels import build
from minigen.loading import build_model
from minigen.parallel import make_stage, pipeline_generate, pipeline_worker


def runs(rank: int, n_stages: int, sources: list, ids: torch.Tensor, settings: list[tuple[int, dict]]) -> list[dict]:
    """pipeline_worker's answer (with logits) for every source, then every (micro_batches, config dict), in
    one group: a group's start costs seconds of imports, its generations milliseconds."""
    return [pipeline_worker(rank, n_stages, source, ids, m, config, logits=True, torch_ops=True)
            for source in sources for m, config in settings]


def dies_mid_generation(rank: int, n_stages: int, source: tuple, ids: torch.Tensor, micro_batches: int, new: int,
                        victim: int, at_call: int) -> torch.Tensor:
    """A pipeline's generation in which stage `victim` kills itself (SIGKILL: no Python cleanup, as the
    out-of-memory killer would) when its first block runs for the `at_call`-th time."""
    calls = 0

    def maybe_die(module, args, out):
        nonlocal calls
        calls += 1
        if rank == victim and calls == at_call:
            os.kill(os.getpid(), signal.SIGKILL)
    with build.enabled(False):
        stage = make_stage(build_model(*source), rank, n_stages)
        stage.model.blocks[0].register_forward_hook(maybe_die)
        return pipeline_generate(stage, ids, micro_batches, max_new_tokens=new).tokens
