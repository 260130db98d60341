"""Chapter 7 exercises: the window's slot rule, and fixing the article's window snippet.

1. `slot_of(pos, window_size, sink_tokens)`: the slot of the rolling buffer (window.WindowKVCache)
   that position `pos` is written to: sinks keep their own slots, every other position cycles
   through the window_size slots after them. The chapter shows the buffer in use (which position
   each slot holds, step by step), not the rule's code: infer it, then write it with integer
   arithmetic. The checker runs it with WindowKVCache.slot_of patched to raise.
2. `window_attention(q, k, v, query_pos, key_pos, window_size, sink_tokens)`: attention of the
   queries q [B, H, T, Dh] at positions query_pos [T] over the cached k, v [B, Hkv, S, Dh] holding
   positions key_pos [S] (in any order), restricted to the window plus the sinks. Start from the
   article's snippet below (`article_window_attention`) and fix its three bugs. Build the mask
   from positions yourself: the checker runs it with the package's window_attention, window_mask
   and in_window patched to raise.
"""

from __future__ import annotations

import torch

from ...attention import attend, in_window, window_attention as package_window_attention, window_mask
from ...caches.window import WindowKVCache
from . import ExerciseFailed, compare, forbidding, known_mistake


def article_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 64) -> torch.Tensor:
    """The article's window snippet as it is written: the last `window` stored keys, q k^T, softmax, v.

    q [B, H, T, Dh], k, v [B, H, S, Dh] (no grouped-query heads) -> [B, H, T, Dh]. Its bugs: no
    1/sqrt(Dh) scaling, no causal mask inside the window (with several queries, an early query
    reads later keys), and "the last W" by storage index instead of by position (a ring buffer or
    a paged cache stores positions out of order). It also has no sinks.
    """
    k_window, v_window = k[:, :, -window:], v[:, :, -window:]
    return torch.softmax(q @ k_window.transpose(-1, -2), dim=-1) @ v_window


def _unless_given(solution, fn) -> tuple:
    """The worked solution is forbidden too, except when it is the answer being checked (the cell
    that checks it until the reader writes theirs): a wrapper around it still fails."""
    return () if fn is solution else (solution,)


# ---------------------------------------------------------------- 1. the slot rule
def solution_slot_of(pos: int, window_size: int, sink_tokens: int) -> int:
    """Sinks stay put; after them, the window_size slots are reused in turn."""
    if pos < sink_tokens:
        return pos
    return sink_tokens + (pos - sink_tokens) % window_size


def check_slot_of(fn) -> bool:
    """fn(pos, window_size, sink_tokens) -> int, the slot WindowKVCache writes `pos` to."""
    cases = []
    for W, s in ((8, 0), (8, 4), (5, 2), (128, 4), (3, 3)):
        cache = WindowKVCache(1, 1, 1, 1, W, s)
        for p in (0, 1, s, W - 1, W, W + s, W + s + 1, 3 * W + 1, 1000):
            cases.append((f"position {p}, window {W}, {s} sinks", (p, W, s), int(cache.slot_of(torch.tensor(p)))))

    def hints(args, got):
        p, W, s = args
        return known_mistake(got, [
            (p % W, "keep the sink slots: positions >= sink_tokens cycle through the slots after them"),
            (s + p % W, "count the cycle from the first non-sink position: (pos - sink_tokens) % window_size"),
            (p % (W + s), "the sinks are never overwritten: only the window_size slots after them cycle"),
            (s + (p - s) % (W - 1), "the ring has window_size slots, not window_size - 1"),
            (s + (p - s) % (W + 1), "the ring has window_size slots, not window_size + 1"),
            (s + (p - s - 1) % W, "the first position after the sinks goes to the first slot after them: "
                                  "do not shift by one"),
        ])
    with forbidding(WindowKVCache.slot_of, *_unless_given(solution_slot_of, fn)):  # expected values computed above
        return compare("slot_of", cases, fn, hints)


# ---------------------------------------------------------------- 2. the snippet, fixed
def solution_window_attention(q, k, v, query_pos, key_pos, window_size, sink_tokens=0):
    """Scale by 1/sqrt(Dh), mask by position (causal, in the window, or a sink), then softmax."""
    p, j = query_pos[:, None], key_pos[None, :]  # [T, 1] query positions, [1, S] key positions
    mask = (j <= p) & ((j < sink_tokens) | (p - j < window_size))  # [T, S]: causal, and a sink or in the window
    return attend(q, k, v, mask)


def _cases():
    g = torch.Generator().manual_seed(5)

    def qkv(T, S, Dh=16):
        return (3 * torch.randn(1, 2, T, Dh, generator=g), 3 * torch.randn(1, 2, S, Dh, generator=g),
                torch.randn(1, 2, S, Dh, generator=g))

    q, k, v = qkv(1, 12)
    pos = torch.arange(12)
    perm = torch.randperm(12, generator=g)
    q6, k6, v6 = qkv(6, 6)
    return [
        ("one query, keys in order (tests the 1/sqrt(Dh) scaling)", (q, k, v, pos[-1:], pos, 6, 0),
         "scale the scores by 1/sqrt(Dh) before the softmax"),
        ("six queries over six keys (tests causality inside the window)", (q6, k6, v6, torch.arange(6), torch.arange(6), 6, 0),
         "mask keys whose position is after the query's: a prompt has several queries"),
        ("keys stored out of order (tests choosing the window by position)", (q, k[:, :, perm], v[:, :, perm], pos[-1:], pos[perm], 5, 0),
         "choose the window by key_pos, not by storage index: a ring buffer stores positions out of order"),
        ("a window of 4 with 2 sinks", (q, k, v, pos[-1:], pos, 4, 2),
         "keep the sink_tokens first positions visible to every query"),
    ]


def check_window_attention(fn) -> bool:
    """fn(q, k, v, query_pos, key_pos, window_size, sink_tokens) -> [B, H, T, Dh], equal to
    minigen.attention.window_attention on cases that each expose one of the snippet's bugs."""
    cases = [(label, args, hint, package_window_attention(*args)) for label, args, hint in _cases()]
    with forbidding(package_window_attention, window_mask, in_window, *_unless_given(solution_window_attention, fn)):
        for label, args, hint, want in cases:
            got = fn(*args)
            if got is None or tuple(got.shape) != tuple(want.shape):
                raise ExerciseFailed(f"window_attention: for {label} expected shape {tuple(want.shape)}, got "
                                     f"{None if got is None else tuple(got.shape)}")
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                err = (got - want).abs().max().item()
                raise ExerciseFailed(f"window_attention: for {label} the output is off by up to {err:.3g}. "
                                     f"Hint: {hint}")
    print(f"✓ window_attention: all {len(cases)} cases agree with the package")
    return True
