"""Which step object a generation runs: chosen once, before the prompt, from the config, the model
and the batch (eager.py lists the kinds).

The default is the fastest exact step the config allows. `fused_decode="auto"` (the default) runs
the fused C step wherever it applies: batch 1, on a CPU, a Llama-family model in fp32 precision,
the contiguous cache in fp32 or bf16, no feature that the combination table refuses beside
fused_decode (combinations.REFUSED), no observers; elsewhere the eager step. `fused_decode=True`
demands it (refused, with the reason, where it cannot run) and `False` forbids it. Both steps give
the same greedy tokens (tests/test_fused.py), so "auto" changes the speed, never the text.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..combinations import refused_with
from ..config import GenerationConfig
from ..errors import ConfigError
from . import fused
from .eager import EagerStep, NaiveStep
from .graphs import CompiledStep, GraphedStep


def fused_applies(model, config: GenerationConfig, batch: int, observers: tuple = (), ragged: bool = False) -> bool:
    """Whether fused_decode="auto" runs the fused step for this generation (the module docstring's rules)."""
    if ragged or refused_with(config, "fused_decode"):
        return False
    try:
        fused.check_run(model, batch, config.kv_dtype, observers)
    except ConfigError:  # "auto" asks for the step where it runs; check_run says why it does not
        return False
    return True


def choose_step(model, config: GenerationConfig, batch: int, observers: tuple = (),
                sample: Callable | None = None, generator: torch.Generator | None = None,
                ragged: bool = False) -> EagerStep:
    """The step object for one generation of `batch` rows (sample and generator: for a CUDA graph,
    which samples inside the graph). Refuses, with ConfigError, a demanded step that cannot run."""
    if not config.use_cache:
        return NaiveStep()
    if config.cuda_graphs:
        return GraphedStep(sample, config, generator)
    if config.compile:
        return CompiledStep(model)
    if config.fused_decode is True:  # a ragged batch refused it before (combinations.RAGGED_REFUSED)
        fused.check_run(model, batch, config.kv_dtype, observers)
        return fused.FusedStep()
    if config.fused_decode == "auto" and fused_applies(model, config, batch, observers, ragged):
        return fused.FusedStep()
    return EagerStep()
