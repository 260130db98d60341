"""Picking the next token from logits: greedy, or temperature / top-k / top-p sampling (chapter 1).

Shapes: B batch, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import GenerationConfig


def sample(logits: Tensor, config: GenerationConfig, generator: torch.Generator | None = None) -> Tensor:
    """Pick the next token [B] from logits [B, V]: greedy, or temperature / top-k / top-p sampling.

    Stays on the device (no .item()), so it adds no host sync to a decode step. Sampling is the
    exponential race: argmax over p_i / E_i with E_i ~ Exp(1) drawn independently picks token i
    with probability p_i (the first of independent exponential clocks with rates p_i to ring), with
    fixed-shape tensor ops only, so a CUDA graph can hold it (graphs.py).
    """
    if not config.do_sample:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, config), generator)


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token from each distribution probs [..., V] -> [...]: the exponential race (see `sample`)."""
    clocks = torch.empty_like(probs).exponential_(generator=generator)  # [..., V] ~ Exp(1)
    return (probs / clocks).argmax(dim=-1)


def probabilities(logits: Tensor, config: GenerationConfig) -> Tensor:
    """The distribution `sample` draws from, [..., V] from logits [..., V]: tempered, then cut to the
    top-k and top-p tokens. Speculative sampling (steps/speculative.py) compares two of these."""
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
    return logits.softmax(dim=-1)


def make_generator(config: GenerationConfig, device: torch.device) -> torch.Generator | None:
    """The sampling generator a config asks for: seeded with config.seed, else fresh entropy; None for greedy."""
    if not config.do_sample:
        return None
    generator = torch.Generator(device=device)
    if config.seed is not None:
        generator.manual_seed(config.seed)
    else:  # fresh entropy for this generator only; torch.seed() would reseed the caller's global RNG
        generator.seed()
    return generator
