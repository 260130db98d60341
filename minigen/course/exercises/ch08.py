"""Chapter 8 exercises: which keys dynamic sparse attention keeps, and the entropy of attention.

1. `keep_keys(scores, top_k, threshold)`: for one head and one query, scores [S] are q.k/sqrt(Dh)
   of the visible keys. Return a bool tensor [S]: True for the keys among the `top_k` largest
   |score| whose |score| is also >= threshold x the largest |score|. None disables a rule.
2. `attention_entropy(p)`: -sum p log p in nats of one attention distribution p [S] (a float),
   where keys with probability 0 contribute 0.
3. `victim(slot_pos, score, recent)`: H2O's eviction choice, for one row of a heavy-hitter cache
   (caches.h2o.HeavyHitterCache). slot_pos [S] holds the position cached in each slot (-1: empty),
   score [S] the attention each slot has received so far. Return the slot (an int) that the next
   token is written to: an empty slot if there is one; otherwise the least attended slot, never one
   of the `recent` slots holding the newest positions (by position: slots are reused out of order).
   The checker runs it with the cache's own ranking (HeavyHitterCache.rank, prepare) patched to raise.
"""

from __future__ import annotations

import math

import torch

from ...attention import sparse_keep
from ...caches.h2o import HeavyHitterCache
from ...entropy import entropy
from . import ExerciseFailed, compare, forbidding, known_mistake


def _unless_given(solution, fn) -> tuple:
    """The worked solution is forbidden too, except when it is the answer being checked."""
    return () if fn is solution else (solution,)


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
    wants = [sparse_keep(scores.view(1, 1, 1, -1), torch.ones(1, 16, dtype=torch.bool), top_k, threshold).view(-1)
             for top_k, threshold in cases]  # expected values first: the package is forbidden below
    with forbidding(sparse_keep, *_unless_given(solution_keep_keys, fn)):
        _compare_keep(fn, scores, cases, wants)
    print(f"✓ keep_keys: all {len(cases)} cases agree with the package")
    return True


def _compare_keep(fn, scores: torch.Tensor, cases: list, wants: list) -> None:
    for (top_k, threshold), want in zip(cases, wants):
        label = f"top_k={top_k}, threshold={threshold}"
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
    with forbidding(entropy, *_unless_given(solution_attention_entropy, fn)):
        return compare("attention_entropy", cases, fn, hints, rel_tol=1e-4)


# ---------------------------------------------------------------- 3. H2O's victim
def solution_victim(slot_pos: torch.Tensor, score: torch.Tensor, recent: int) -> int:
    """An empty slot first; else the least attended slot outside the `recent` newest positions."""
    empty = (slot_pos < 0).nonzero().flatten()
    if len(empty):
        return int(empty[0])
    protected = slot_pos.topk(recent).indices  # the slots of the `recent` largest positions
    candidates = score.clone()
    candidates[protected] = float("inf")
    return int(candidates.argmin())


def _least(score: torch.Tensor, excluded: torch.Tensor) -> int:
    """The slot of the least score outside `excluded` (a bool mask [S])."""
    return int(score.masked_fill(excluded, float("inf")).argmin())


def _mistakes(slot_pos: torch.Tensor, score: torch.Tensor, recent: int) -> list[tuple[int, str]]:
    """(the slot a common wrong rule picks, its hint), for the hints."""
    S, held = len(score), slot_pos >= 0
    newest = lambda n: torch.zeros_like(held).index_fill_(0, slot_pos.topk(n).indices, True)  # noqa: E731
    out = [(_least(score, ~held), "never evict the `recent` newest positions: H2O always keeps them"),
           (_least(-score, ~held | newest(recent)), "evict the least attended slot; the heavy hitters stay"),
           (_least(slot_pos.float(), ~held | newest(recent)),
            "that evicts the oldest position, as a window does: H2O evicts the least attended"),
           (_least(score, ~held | newest(min(recent + 1, S - 1))), "protect exactly `recent` newest positions, "
                                                                   "not recent + 1"),
           (_least(score, ~held | (torch.arange(S) >= S - recent)),
            "the newest by position, not by slot index: the cache reuses slots out of order")]
    if recent > 1:
        out.append((_least(score, ~held | newest(recent - 1)), "protect exactly `recent` newest positions, "
                                                                "not recent - 1"))
    if not held.all():
        out.append((_least(score, ~held | newest(recent)), "write into an empty slot first"))
    return out


def _victim_cases() -> list[tuple[str, tuple, int]]:
    """Rows of heavy-hitter caches, and the slot the package's HeavyHitterCache writes next."""
    g = torch.Generator().manual_seed(60)
    cases = []
    for budget, recent in ((8, 4), (6, 3), (10, 5), (5, 1), (7, 2)):
        for i in range(8):
            positions = torch.randperm(4 * budget, generator=g)[:budget]  # distinct, shuffled across slots
            score = torch.rand(budget, generator=g) * 5  # distinct with probability 1
            if i == 0:  # one slot left empty: the next token goes there
                positions[int(torch.randint(budget, (1,), generator=g))] = -1
            cache = HeavyHitterCache(1, 1, 1, 1, budget, recent)
            cache.slot_pos[0], cache.score[0] = positions, score
            nxt = int(positions.max()) + 1
            cache.prepare(torch.tensor([nxt]))  # the next token
            label = f"budget {budget}, recent {recent}, positions {positions.tolist()}"
            cases.append((label, (positions, score, recent), int((cache.slot_pos[0] == nxt).nonzero()[0, 0])))
    return cases


def check_victim(fn) -> bool:
    """fn(slot_pos [S], score [S], recent) -> int, the slot HeavyHitterCache writes the next token to."""
    cases = _victim_cases()  # expected values first, from the package's own cache

    def hints(args, got):
        return known_mistake(got, _mistakes(*args))

    answer = lambda slot_pos, score, recent: fn(slot_pos.clone(), score.clone(), recent)  # noqa: E731
    with forbidding(HeavyHitterCache.rank, HeavyHitterCache.prepare, *_unless_given(solution_victim, fn)):
        return compare("victim", cases, answer, hints)
