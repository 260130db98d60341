"""Chapter 16 exercise: which key tiles a tile of a prompt's queries must load (FlashAttention's
causal tile skipping, with a window and sinks).

`visible_tiles(first, last, block_n, window_size, sink_tokens) -> list[int]`: a tile of queries at
the consecutive positions first..last (all real, first <= last) attends to keys at positions 0, 1,
2, ... cut into tiles of `block_n` (tile j holds positions j * block_n .. j * block_n + block_n - 1).
A query at position t sees key position p when p <= t and, with a window (window_size not None),
p < sink_tokens or t - p < window_size (attention.in_window). Return, in increasing order, the
indices of the tiles that hold a key some query of the tile sees: the tiles a FlashAttention
kernel must load. Every other tile can be skipped without changing a single output.

The checker compares your tiles with minigen's own rule (attention.in_window, applied to every
(query, key) pair of the case) on cases with and without a window, and with minigen's Triton
prompt kernel (kernels/triton_prefill.py), which counts the tiles it loads, run in Triton's
interpreter. It fails when your function calls this module's worked solution or `expected_tiles`
(the rule pair by pair, which is the answer too), by any name (`forbidding` swaps their code while
your function runs).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ...attention import in_window
from . import ExerciseFailed, forbidding

# (label, (first, last, block_n, window_size, sink_tokens))
CASES = [
    ("a prompt's first tile of queries, no window", (0, 15, 16, None, 0)),
    ("a later tile: every earlier tile and its own", (48, 63, 16, None, 0)),
    ("a tile that ends inside a key tile", (40, 50, 16, None, 4)),
    ("a window of 20: the far tiles are skipped", (96, 111, 16, 20, 0)),
    ("a window of 20 with 4 sinks", (96, 111, 16, 20, 4)),
    ("a window wider than the context", (16, 31, 16, 1000, 4)),
    ("sinks that span two tiles", (200, 215, 16, 8, 20)),
    ("one query, a window of 1 (only itself) and 1 sink", (77, 77, 16, 1, 1)),
    ("keys in tiles of 32", (130, 161, 32, 50, 4)),
]
KERNEL_CASES = [(3, 16, None, 0), (5, 16, 20, 4)]  # (query tiles of 16, block_n, window, sinks) run in Triton


# ---------------------------------------------------------------- worked solution
def solution_visible_tiles(first: int, last: int, block_n: int, window_size: int | None,
                           sink_tokens: int) -> list[int]:
    """Causality ends the range at the last query's tile; the first query's window starts it (a
    later query's window starts later); the sinks add the tiles at the start that hold them."""
    end_tile = last // block_n + 1  # keys after `last` are seen by no query of the tile
    if window_size is None:
        return list(range(end_tile))
    far_tile = max(first - window_size + 1, 0) // block_n  # the oldest key the first query still sees
    sink_tiles = math.ceil(min(sink_tokens, last + 1) / block_n)  # tiles holding a sink some query sees
    return sorted(set(range(sink_tiles)) | set(range(far_tile, end_tile)))


# ---------------------------------------------------------------- minigen's rule, pair by pair
def expected_tiles(first: int, last: int, block_n: int, window_size: int | None, sink_tokens: int) -> list[int]:
    """The tiles holding a key that attention.in_window (with causality) lets some query see."""
    keys = torch.arange(last + 1)
    queries = torch.arange(first, last + 1)
    seen = keys[None, :] <= queries[:, None]  # [queries, keys]
    if window_size is not None:
        seen &= in_window(keys[None, :], queries[:, None], window_size, sink_tokens)
    return sorted({int(p) // block_n for p in keys[seen.any(dim=0)]})


def kernel_visits(tiles: int, block_n: int, window_size: int | None, sink_tokens: int) -> list[int]:
    """The key tiles minigen's Triton prompt kernel loads for each of `tiles` query tiles of 16
    queries (a prompt of 16 * tiles tokens from position 0, one head, fp32 blocks of block_n slots)."""
    from ...caches.contract import BlockView
    from ...kernels import triton_prefill
    T, Dh = 16 * tiles, 16
    n_blocks = math.ceil(T / block_n)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(n_blocks, block_n, 1, Dh, generator=g) for _ in range(2))
    view = BlockView(k=k, v=v, block_table=torch.arange(n_blocks)[None], seq_lens=torch.tensor([T]),
                     recent_start=torch.tensor([T]), recent_k=None, recent_v=None, block_size=block_n)
    q = torch.randn(1, 1, T, Dh, generator=g)
    visits = torch.zeros(1, 1, tiles, dtype=torch.int32)
    triton_prefill.prefill_attention(q, view, torch.arange(T), window_size, sink_tokens, block_m=16,
                                     block_n=block_n, visits=visits)
    return visits[0, 0].tolist()


# ---------------------------------------------------------------- the checker
def _guarded(fn: Callable, args: tuple) -> object:
    """fn(*args) with the functions that are the answer made to raise: the worked solution (unless it
    is the answer itself: the chapter checks it so that nbval passes) and expected_tiles."""
    answers = [expected_tiles] + ([] if fn is solution_visible_tiles else [solution_visible_tiles])
    with forbidding(*answers):
        return fn(*args)


def _hint(args: tuple, got: list[int], want: list[int]) -> str:
    first, last, block_n, window, sinks = args
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if extra and min(extra) > last // block_n:
        return "a tile after the last query's position holds only keys no query sees (causality)"
    if missing and window is not None and sinks and max(missing) * block_n < sinks:
        return "the sinks stay visible to every query: their tiles are loaded too"
    if missing and window is not None:
        return ("the range starts at the first query's window, the oldest key any query of the tile "
                "sees (t - p < window_size: the query and the window_size - 1 keys before it)")
    if extra and window is not None:
        return "a tile wholly outside every query's window, holding no sink, is skipped"
    return "list every tile that holds a key some query sees, in increasing order"


def check_visible_tiles(fn: Callable) -> bool:
    """fn(first, last, block_n, window_size, sink_tokens) -> the sorted tile indices to load."""
    for label, args in CASES:
        got = _guarded(fn, args)
        if got is None:
            raise ExerciseFailed("visible_tiles returned None: return a list of tile indices")
        try:
            got = [int(j) for j in got]
        except (TypeError, ValueError):
            raise ExerciseFailed(f"visible_tiles returned {type(got).__name__}: return a list of ints") from None
        want = expected_tiles(*args)
        if got != want:
            raise ExerciseFailed(f"visible_tiles: for {label} {args} the tiles to load are {want}, you gave {got}. "
                                 f"Hint: {_hint(args, got, want)}")
    for tiles, block_n, window, sinks in KERNEL_CASES:  # minigen's kernel loads exactly these tiles
        counts = kernel_visits(tiles, block_n, window, sinks)
        mine = [len(_guarded(fn, (16 * i, 16 * i + 15, block_n, window, sinks))) for i in range(tiles)]
        if mine != counts:
            raise ExerciseFailed(f"visible_tiles: minigen's Triton kernel loads {counts} key tiles for the query "
                                 f"tiles of a {16 * tiles}-token prompt (block_n={block_n}, window={window}, "
                                 f"sinks={sinks}); your tiles count {mine}")
    print(f"✓ visible_tiles: all {len(CASES)} cases agree with attention.in_window, and "
          f"{len(KERNEL_CASES)} prompts with the Triton kernel's own count")
    return True
