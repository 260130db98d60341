"""Picking the next token from logits: greedy, or temperature / top-k / top-p / min-p sampling (chapter 1).

Shapes: B batch, V vocabulary.

Every sampled row draws from its own generator, so that its tokens never depend on the rows it is
batched with: row r of a batch draws from a generator seeded with `(seed + r) mod 2**64`
(make_generators). Row 0 of a batch is the same prompt generated alone with that seed, and the
serving Engine's request with that seed; `parallel_sample(model, ids, n, seed=s)`'s sample r is the
prompt alone with seed s + r. With seed=None each row gets fresh entropy of its own.

A temperature below GREEDY_TEMPERATURE (the smallest normal float32, about 1.2e-38) is greedy by
rule (`greedy`): there it is 0 or subnormal in float32, 1/T overflows, and the tempered logits
would be 0/0 = NaN (whose argmax is token 0) instead of the greedy token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .config import GenerationConfig

# Below this a temperature samples greedily (see the module docstring): torch.finfo(torch.float32).tiny.
GREEDY_TEMPERATURE = torch.finfo(torch.float32).tiny

# One generator for every row (the caller's), one per row (make_generators), or None (torch's global one).
Generators = torch.Generator | Sequence[torch.Generator] | None


def greedy(config: GenerationConfig) -> bool:
    """Whether `config` picks the argmax: do_sample=False, or a temperature below GREEDY_TEMPERATURE."""
    return not config.do_sample or config.temperature < GREEDY_TEMPERATURE


def sample(logits: Tensor, config: GenerationConfig, generator: Generators = None) -> Tensor:
    """Pick the next token [B] from logits [B, V]: greedy, or temperature / top-k / top-p / min-p sampling.

    Stays on the device (no .item()), so it adds no host sync to a decode step. Sampling is the
    exponential race: argmax over p_i / E_i with E_i ~ Exp(1) drawn independently picks token i
    with probability p_i (the first of independent exponential clocks with rates p_i to ring), with
    fixed-shape tensor ops only, so a CUDA graph can hold it (graphs.py). `generator`: one per row
    (make_generators) keeps each row's draws its own.
    """
    if greedy(config):
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, config), generator)


def draw(probs: Tensor, generator: Generators = None) -> Tensor:
    """One token from each distribution probs [..., V] -> [...]: the exponential race (see `sample`).
    A sequence of generators gives row b of probs [B, V] the clocks of generator b alone."""
    if generator is None or isinstance(generator, torch.Generator):
        clocks = torch.empty_like(probs).exponential_(generator=generator)  # [..., V] ~ Exp(1)
    else:  # B is small: a loop of B draws, each row from its own generator, no host sync
        assert probs.dim() == 2 and len(generator) == probs.shape[0], "one generator per row of probs [B, V]"
        clocks = torch.stack([torch.empty_like(row).exponential_(generator=g) for row, g in zip(probs, generator)])
    return (probs / clocks).argmax(dim=-1)


def probabilities(logits: Tensor, config: GenerationConfig) -> Tensor:
    """The distribution `sample` draws from, [..., V] from logits [..., V]: tempered, then cut to the
    top-k, top-p and min-p tokens, in transformers' order of its warpers. Speculative sampling
    (steps/speculative.py) compares two of these.
    A temperature below GREEDY_TEMPERATURE gives the argmax probability 1 (ties: the first)."""
    if config.temperature < GREEDY_TEMPERATURE:  # greedy by rule, not by how 1/T overflows
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    # Temper in float32 at least: a small temperature is 0 in float16 (6e-8 and below), and the
    # division by it NaN.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # Subtract the best logit before dividing: a tiny temperature then sends every other logit to
    # -inf and the best to 0 (greedy), instead of everything to +-inf and NaN.
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if config.min_p is not None and config.min_p > 0:
        # min-p (Nguyen et al. 2024; transformers' MinPLogitsWarper): drop a token less likely than
        # min_p x the top token's probability; the top token always stays (min_p <= 1)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < config.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits.softmax(dim=-1)


def make_generators(config: GenerationConfig, rows: int, device: torch.device) -> list[torch.Generator] | None:
    """One sampling generator per row: row r seeded with (config.seed + r) mod 2**64, or fresh
    entropy of its own when seed is None; None where the config is greedy (it draws nothing)."""
    if greedy(config):
        return None
    generators = [torch.Generator(device=device) for _ in range(rows)]
    for r, generator in enumerate(generators):
        if config.seed is not None:
            generator.manual_seed((config.seed + r) % 2**64)
        else:  # fresh entropy for this generator only; torch.seed() would reseed the caller's global RNG
            generator.seed()
    return generators


def make_generator(config: GenerationConfig, device: torch.device) -> torch.Generator | None:
    """The generator of one row (a lone prompt, an Engine request): seeded with config.seed itself."""
    generators = make_generators(config, 1, device)
    return generators[0] if generators is not None else None
