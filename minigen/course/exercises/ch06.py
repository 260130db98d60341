"""Chapter 6 exercises: which keys dynamic sparse attention keeps, and the entropy of attention.

1. `keep_keys(scores, top_k, threshold)`: for one head and one query, scores [S] are q.k/sqrt(Dh)
   of the visible keys. Return a bool tensor [S]: True for the keys among the `top_k` largest
   |score| whose |score| is also >= threshold x the largest |score|. None disables a rule.
2. `attention_entropy(p)`: -sum p log p in nats of one attention distribution p [S] (a float),
   where keys with probability 0 contribute 0.
"""

from __future__ import annotations

import math

import torch

from ...attention import sparse_keep
from ...entropy import entropy
from . import ExerciseFailed, compare, known_mistake


# ---------------------------------------------------------------- 1. the keys kept
def solution_keep_keys(scores: torch.Tensor, top_k: int | None, threshold: float | None) -> torch.Tensor:
    """Importance is |score|; keep the top k, then those at or above threshold x the maximum."""
    importance = scores.abs()
    keep = torch.ones_like(scores, dtype=torch.bool)
    if top_k is not None and top_k < len(scores):
        keep = torch.zeros_like(keep)
        keep[importance.topk(top_k).indices] = True
    if threshold is not None:
        keep &= importance >= threshold * importance.max()
    return keep


def check_keep_keys(fn) -> bool:
    """fn(scores [S], top_k, threshold) -> bool [S], equal to minigen.attention.sparse_keep."""
    g = torch.Generator().manual_seed(6)
    scores = torch.randn(16, generator=g) * 2
    scores[3] = -5.0  # the most important key has a negative score: importance is |q.k|
    cases = [(None, None), (4, None), (1, None), (16, None), (40, None), (None, 0.0), (None, 0.1),
             (None, 0.5), (None, 1.0), (4, 0.5), (8, 0.3)]
    for top_k, threshold in cases:
        label = f"top_k={top_k}, threshold={threshold}"
        want = sparse_keep(scores.view(1, 1, 1, -1), torch.ones(1, 16, dtype=torch.bool), top_k, threshold).view(-1)
        got = fn(scores.clone(), top_k, threshold)
        if got is None or torch.as_tensor(got).shape != want.shape:
            raise ExerciseFailed(f"keep_keys: for {label} return a bool tensor of shape {tuple(want.shape)}")
        got = torch.as_tensor(got).bool()
        if not torch.equal(got, want):
            hint = ""
            if not got[3]:
                hint = " Hint: rank keys by |score|; a large negative q.k is an important key"
            elif int(got.sum()) != int(want.sum()) and threshold is not None:
                hint = " Hint: the threshold is a fraction of the largest |score| of this head, kept when >="
            raise ExerciseFailed(f"keep_keys: for {label} expected keys {want.nonzero().flatten().tolist()}, "
                                 f"got {got.nonzero().flatten().tolist()}.{hint}")
    print(f"✓ keep_keys: all {len(cases)} cases agree with the package")
    return True


# ---------------------------------------------------------------- 2. entropy
def solution_attention_entropy(p: torch.Tensor) -> float:
    """-sum p log p, skipping p = 0 (the limit of p log p is 0)."""
    nz = p[p > 0]
    return float(-(nz * nz.log()).sum())


def check_attention_entropy(fn) -> bool:
    """fn(p [S]) -> float, the entropy in nats; masked keys (p = 0) included in the cases."""
    g = torch.Generator().manual_seed(7)
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01])
    masked = torch.cat([torch.randn(6, generator=g).softmax(0), torch.zeros(4)])  # 4 masked keys
    cases = [("uniform over 8 keys", (torch.full((8,), 1 / 8),), math.log(8)),
             ("one key", (torch.tensor([1.0, 0.0, 0.0]),), 0.0),
             ("a peaked head", (peaked,), float(entropy(peaked))),
             ("a softmax with 4 masked keys", (masked,), float(entropy(masked)))]

    def hints(args, got):
        p = args[0]
        nz = p[p > 0]
        return known_mistake(round(float(got), 5), [
            (round(float(-(nz * nz.log2()).sum()), 5), "use the natural log (nats), not log2 (bits)"),
            (round(float((nz * nz.log()).sum()), 5), "entropy is minus the sum of p log p"),
        ]) or ("0 log 0 counts as 0: skip the zero probabilities" if got != got else "")
    return compare("attention_entropy", cases, fn, hints, rel_tol=1e-4)
