"""Exact distributions of a tiny model's next tokens, and the tests that compare sampled tokens with
them (chapter 13: speculative sampling must leave the target's distribution exactly as it was).
The course's layer: the core never imports this.

    tiny_llama(vocab_size, seed)                    -> a random Llama small enough to enumerate
    continuation_probabilities(model, prompt, n, config) -> P[x1, ..., xn], shape [V] * n: the exact joint
    outcome_counts(tokens, V)                       -> how often each continuation came out, P's shape
    total_variation(counts, probs)                  -> half the L1 distance of frequencies and P
    chi_square(counts, probs)                       -> (statistic, degrees of freedom, p-value)

Shapes: N sampled rows, n new tokens, V vocabulary. With V = 8, three tokens have 512 possible
continuations: every one of them is a row of a forward, so the distribution is exact, not sampled.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ..config import GenerationConfig
from ..kernels import dispatch
from ..model import Model
from ..checkpoints.model_config import ModelConfig
from ..sampling import probabilities


def tiny_llama(vocab_size: int = 8, seed: int = 0, dim: int = 32, n_layers: int = 2,
               scale: float = 0.3) -> Model:
    """A seeded random Llama (grouped-query attention, untied head, no stop token). `scale`, the
    weights' standard deviation, spreads the logits over a few units: neither one token nor uniform."""
    cfg = ModelConfig(arch="llama", vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                      head_dim=dim // 4, hidden_dim=2 * dim, max_seq_len=64, tie_embeddings=False)
    model = Model(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else scale * noise)  # norm weights near 1
    dispatch.install(model)
    return model.eval()


@torch.inference_mode()
def continuation_probabilities(model: Model, prompt: Tensor, n: int, config: GenerationConfig) -> Tensor:
    """The exact probability of every continuation x1..xn of prompt [T] when each token is sampled
    as `config` samples it (temperature, top-k, top-p: sampling.probabilities) -> [V] * n, summing to 1.
    Step i runs all V^i prefixes in one batch: V^(n-1) rows at the last step."""
    V = model.config.vocab_size
    joint = torch.ones(())  # P of the empty continuation
    prefixes = torch.zeros(1, 0, dtype=torch.long)  # [V^i, i]
    for i in range(n):
        ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes], dim=1)  # [V^i, T + i]
        logits = model(ids, torch.arange(ids.shape[1]), None, last_only=True)[:, -1]  # [V^i, V]
        p = probabilities(logits.double(), config).view(*[V] * i, V)  # P(x_{i+1} | prompt, x_1..x_i)
        joint = joint[..., None] * p  # [V] * (i + 1)
        prefixes = torch.tensor(list(itertools.product(range(V), repeat=i + 1)), dtype=torch.long)
    return joint


def outcome_counts(tokens: Tensor, vocab_size: int) -> Tensor:
    """tokens [N, n] -> how many rows produced each continuation, [V] * n (the layout of the joint)."""
    N, n = tokens.shape
    index = torch.zeros(N, dtype=torch.long)
    for i in range(n):  # row-major: x1 is the slowest axis, as in continuation_probabilities
        index = index * vocab_size + tokens[:, i]
    return torch.bincount(index, minlength=vocab_size ** n).view(*[vocab_size] * n).double()


def total_variation(counts: Tensor, probs: Tensor) -> float:
    """Half the L1 distance between the observed frequencies and probs: the largest difference in
    probability the two give to any set of outcomes (0: the same; 1: disjoint)."""
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def chi_square(counts: Tensor, probs: Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's test of counts against probs -> (statistic, degrees of freedom, p-value): the chance
    that exact sampling would stray at least this far. Cells expected fewer than `min_expected` times
    are pooled into one (the chi-square approximation needs a few counts a cell)."""
    counts, expected = counts.flatten().double(), counts.sum() * probs.flatten().double()
    small = expected < min_expected
    if small.any():  # one pooled cell for the rare continuations (a count there where P is 0 counts too)
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:  # nothing was expected in the pooled cell
        if counts[-1] > 0:  # yet something came out: an outcome the distribution forbids
            return float("inf"), len(counts) - 2, 0.0
        counts, expected = counts[:-1], expected[:-1]
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    # P(chi2(dof) >= statistic) is the regularized upper incomplete gamma function Q(dof / 2, statistic / 2)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value
