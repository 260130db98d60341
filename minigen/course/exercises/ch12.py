"""Chapter 12 exercises: the dequantize-on-load step of a kernel that reads 4-bit codes, the merge of
flash-decoding's splits written as a Triton kernel, and the key tiles a FlashAttention program loads.

1. `dequantize_on_load(codes, scales, zeros, channel, group_size)`: the values of channels
   `channel` [D] (int64) of rows stored as quant.py stores 4-bit values (grouped per token over
   channels): codes [..., Dh / 2] uint8, two codes to a byte with the first in the low four bits;
   scales and zeros [..., Dh / G]. Return [..., D] fp32, what `triton_steps._int4_load` computes
   for each lane: the byte holding the channel, its four bits, then zero + code * scale. Write it
   with the same index arithmetic (// and % on `channel`, >> and &), in torch.

The checker compares yours with quant.dequantize on several shapes, group sizes and orders of
channels, and names the common mistakes (a missing `& 0xF`, the high nibble first, the group
index taken from the byte index). It fails an answer that calls quant.dequantize or quant.unpack
(or the worked solution).

2. `merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P, BLOCK_D)`: a @triton.jit kernel, one
   program per row, that merges the row's P splits of flash-decoding. Split i ran online softmax
   over its part of the positions and left its largest score m_i, its sum l_i = sum exp(s - m_i)
   and its unnormalised output o_i = sum exp(s - m_i) v (m [R, P], l [R, P], o [R, P, D], fp32,
   contiguous; a split that saw no key has m_i = -inf, l_i = 0, o_i = 0). Store out [R, D], the
   softmax-weighted sum over all of the row's positions. `run_merge(kernel, m, l, o)` launches it
   (in Triton's interpreter on a CPU). The checker compares it with a dense softmax over the
   positions the splits came from, and with minigen's own reduction (triton_attention.merge_splits);
   it names the usual mistakes and fails a kernel that calls minigen's merge or the worked solution.

3. `visible_tiles(first, last, block_n, window_size, sink_tokens) -> list[int]`: a tile of a prompt's
   queries at the consecutive positions first..last (first <= last) attends to keys at positions 0,
   1, 2, ... cut into tiles of `block_n` (tile j holds positions j * block_n .. j * block_n + block_n - 1).
   A query at position t sees key position p when p <= t and, with a window (window_size not None),
   p < sink_tokens or t - p < window_size (attention.in_window). Return, in increasing order, the
   indices of the tiles holding a key some query of the tile sees: the tiles FlashAttention loads.
   The checker compares yours with that rule pair by pair and with the Triton prompt kernel's own
   counts (kernels/triton_prefill.py); it fails an answer calling the solution or `expected_tiles`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable

import torch
from torch import Tensor

from ...attention import in_window
from ...caches.contract import BlockView
from ...kernels import triton_attention, triton_prefill
from ...kernels.triton_attention import jit, tl, triton
from ...numerics import quant
from ...numerics.quant import dequantize, quantize
from . import ExerciseFailed, forbidding


def solution_dequantize_on_load(codes: Tensor, scales: Tensor, zeros: Tensor, channel: Tensor,
                                group_size: int) -> Tensor:
    byte = codes[..., channel // 2].to(torch.int32)  # [..., D]: the byte holding each channel
    code = (byte >> ((channel % 2) * 4)) & 0xF  # even channels in the low four bits, odd in the high
    group = channel // group_size  # the scale and zero each channel shares with its group
    return zeros[..., group].float() + code.float() * scales[..., group].float()


# Wrong versions the checker recognizes, each with its hint.
def _no_mask(codes, scales, zeros, channel, group_size):
    byte = codes[..., channel // 2].to(torch.int32)
    group = channel // group_size
    return zeros[..., group].float() + (byte >> ((channel % 2) * 4)).float() * scales[..., group].float()


def _high_first(codes, scales, zeros, channel, group_size):
    byte = codes[..., channel // 2].to(torch.int32)
    group = channel // group_size
    code = (byte >> ((1 - channel % 2) * 4)) & 0xF
    return zeros[..., group].float() + code.float() * scales[..., group].float()


def _group_of_byte(codes, scales, zeros, channel, group_size):
    byte = codes[..., channel // 2].to(torch.int32)
    group = (channel // 2) // group_size
    code = (byte >> ((channel % 2) * 4)) & 0xF
    return zeros[..., group].float() + code.float() * scales[..., group].float()


MISTAKES = [
    (_no_mask, "keep only this channel's four bits: (byte >> shift) & 0xF; without the mask an even "
               "channel keeps its odd neighbour's code in bits 4-7"),
    (_high_first, "quant.pack puts the first code of a pair in the low bits: shift by (channel % 2) * 4"),
    (_group_of_byte, "the group of a channel is channel // group_size (channels, not bytes, are grouped)"),
]


def _cases() -> list[tuple[str, tuple, Tensor]]:
    g = torch.Generator().manual_seed(9)
    out = []
    for label, shape, G, order in (("one row, Dh 16, G 8, channels in order", (1, 16), 8, "in order"),
                                   ("rows [3, 2], Dh 64, G 32, channels shuffled", (3, 2, 64), 32, "shuffled"),
                                   ("rows [4], Dh 32, G 16, every other channel", (4, 32), 16, "odd"),
                                   ("bf16 values, Dh 64, G 16", (2, 64), 16, "in order")):
        x = 3 * torch.randn(shape, generator=g)
        if label.startswith("bf16"):
            x = x.to(torch.bfloat16)
        q = quantize(x, 4, G, -1)
        Dh = shape[-1]
        channel = {"in order": torch.arange(Dh), "shuffled": torch.randperm(Dh, generator=g),
                   "odd": torch.arange(1, Dh, 2)}[order]
        # in fp32, as a kernel keeps it (dequantize would round to the values' own dtype)
        want = dequantize(dataclasses.replace(q, dtype=torch.float32))[..., channel]
        out.append((label, (q.data, q.scales, q.zeros, channel, G), want))
    return out


def check_dequantize_on_load(fn) -> bool:
    """fn(codes, scales, zeros, channel, group_size) -> [..., D] fp32: equals quant.dequantize's values
    of those channels on every case."""
    cases = _cases()  # the expected values first: the checker forbids quant's own unpacking below
    # minigen's dequantization is the answer (and the worked solution, unless it is the one checked)
    forbidden = [quant.dequantize, quant.unpack] + ([solution_dequantize_on_load]
                                                    if fn is not solution_dequantize_on_load else [])
    for label, args, want in cases:
        with forbidding(*forbidden):
            got = fn(*args)
        if not isinstance(got, Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
            raise ExerciseFailed(f"dequantize_on_load: for {label}, return a tensor of shape {tuple(want.shape)} "
                                 f"(the rows, then one value per channel asked for), got {shape}")
        if not torch.allclose(got.float(), want, rtol=1e-6, atol=1e-6):
            hints = [hint for wrong, hint in MISTAKES if torch.allclose(got.float(), wrong(*args), rtol=1e-6, atol=1e-6)]
            i = int((got.float() - want).abs().flatten().argmax())
            raise ExerciseFailed(f"dequantize_on_load: for {label}, value {i} (flattened) should be "
                                 f"{want.flatten()[i].item():.5g}, got {got.float().flatten()[i].item():.5g}"
                                 + (f". Hint: {hints[0]}" if hints else ". Hint: zero + code * scale, "
                                    "with the code from byte channel // 2"))
    print(f"✓ dequantize_on_load: all {len(cases)} cases agree with quant.dequantize")
    return True


# ---------------------------------------------------------------- 2. merging the splits, in Triton
@jit
def solution_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)  # splits and channels, padded to powers of 2
    m = tl.load(m_ptr + row * P + p, mask=p < P, other=float("-inf"))  # [BLOCK_P]
    l = tl.load(l_ptr + row * P + p, mask=p < P, other=0.0)
    o = tl.load(o_ptr + (row * P + p[:, None]) * D + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :],
                other=0.0)  # [BLOCK_P, BLOCK_D]
    # Each split summed exp(s - m_i); rescaled to the row's largest max M, every term is exp(s - M),
    # and no exp overflows. A split that saw no key (m_i = -inf) gets weight exp(-inf) = 0.
    w = tl.exp(m - tl.max(m, axis=0))  # [BLOCK_P]
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w * l, axis=0)  # divide once, after the sum
    tl.store(out_ptr + row * D + d, out, mask=d < D)


# Wrong kernels the checker recognizes, each with its hint.
@jit
def _no_rescale(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    l = tl.load(l_ptr + row * P + p, mask=p < P, other=0.0)
    o = tl.load(o_ptr + (row * P + p[:, None]) * D + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :], other=0.0)
    tl.store(out_ptr + row * D + d, tl.sum(o, axis=0) / tl.sum(l, axis=0), mask=d < D)


@jit
def _divide_first(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row * P + p, mask=p < P, other=float("-inf"))
    l = tl.load(l_ptr + row * P + p, mask=p < P, other=1.0)
    o = tl.load(o_ptr + (row * P + p[:, None]) * D + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    normalised = o / tl.where(l > 0, l, 1.0)[:, None]  # each split's own softmax, then a weighted mean
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * normalised, axis=0) / tl.sum(w, axis=0), mask=d < D)


@jit
def _no_max(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row * P + p, mask=p < P, other=float("-inf"))
    l = tl.load(l_ptr + row * P + p, mask=p < P, other=0.0)
    o = tl.load(o_ptr + (row * P + p[:, None]) * D + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(m)  # right in exact arithmetic, inf in fp32 once a score passes about 88
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w * l, axis=0), mask=d < D)


@jit
def _inverse_rescale(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row * P + p, mask=p < P, other=float("inf"))
    l = tl.load(l_ptr + row * P + p, mask=p < P, other=0.0)
    o = tl.load(o_ptr + (row * P + p[:, None]) * D + d[None, :], mask=(p < P)[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(tl.max(m, axis=0) - m)
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w * l, axis=0), mask=d < D)


@jit
def _last_split_lost(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    live = p < P - 1  # off by one
    m = tl.load(m_ptr + row * P + p, mask=live, other=float("-inf"))
    l = tl.load(l_ptr + row * P + p, mask=live, other=0.0)
    o = tl.load(o_ptr + (row * P + p[:, None]) * D + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w * l, axis=0), mask=d < D)


@jit
def _splits_as_channels(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    p, d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row * P + p, mask=p < P, other=float("-inf"))
    l = tl.load(l_ptr + row * P + p, mask=p < P, other=0.0)
    o = tl.load(o_ptr + (row * D + d[None, :]) * P + p[:, None], mask=(p < P)[:, None] & (d < D)[None, :], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    tl.store(out_ptr + row * D + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w * l, axis=0), mask=d < D)


MERGE_MISTAKES = [
    (_no_rescale, "rescale each split by exp(m_i - M), M the row's largest m_i: split i summed exp(s - m_i), "
                  "so its o_i and l_i are on its own scale"),
    (_divide_first, "do not divide each split by its own l_i first: a split's weight is its share of the "
                    "denominator, exp(m_i - M) * l_i; sum the rescaled o_i and l_i, then divide once"),
    (_no_max, "subtract the row's largest m_i before exp: exp(m_i) overflows in fp32 once a score passes 88"),
    (_inverse_rescale, "the factor is exp(m_i - M), at most 1 (M is the largest m_i), not exp(M - m_i)"),
    (_last_split_lost, "every split counts: mask the loads with p < P (not P - 1)"),
    (_splits_as_channels, "o is [R, P, D], contiguous: split p of row r starts at (r * P + p) * D"),
]


def run_merge(kernel, m: Tensor, l: Tensor, o: Tensor) -> Tensor:
    """Launch `kernel` as merge_kernel on m, l [R, P] and o [R, P, D] -> out [R, D] (NaN where it stored
    nothing): one program per row, BLOCK_P and BLOCK_D the next powers of 2 of P and D."""
    R, P, D = o.shape
    out = torch.full((R, D), float("nan"), device=o.device)
    kernel[(R,)](m.contiguous(), l.contiguous(), o.contiguous(), out, P, D,
                 BLOCK_P=triton.next_power_of_2(P), BLOCK_D=triton.next_power_of_2(D))
    return out


def merge_cases() -> list[tuple[str, tuple[Tensor, Tensor, Tensor], Tensor]]:
    """(label, (m, l, o), the dense softmax-weighted values [R, D]): real rows of scores and values cut into
    splits, each split's m, l, o computed in float64 as online softmax leaves them."""
    g = torch.Generator().manual_seed(19)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter reads CPU tensors
    out = []
    for label, R, bounds, D, scale in (
            ("2 rows, 4 equal splits, D 16", 2, (0, 8, 16, 24, 32), 16, 3.0),
            ("3 rows, 3 uneven splits, D 20 (masked channels)", 3, (0, 5, 29, 40), 20, 3.0),
            ("1 row, 1 split, D 8", 1, (0, 12), 8, 3.0),
            ("2 rows, 5 splits (BLOCK_P 8), D 64", 2, (0, 9, 17, 30, 31, 50), 64, 3.0),
            ("scores up to about 300: exp alone overflows", 2, (0, 10, 20, 30), 16, 100.0),
            ("a split that saw no key (m = -inf, l = 0, o = 0)", 2, (0, 10, 10, 25), 16, 3.0)):
        S = bounds[-1]
        s = scale * torch.randn(R, S, generator=g, dtype=torch.float64)
        v = torch.randn(R, S, D, generator=g, dtype=torch.float64)
        P = len(bounds) - 1
        m = torch.full((R, P), float("-inf"), dtype=torch.float64)
        l, o = torch.zeros(R, P, dtype=torch.float64), torch.zeros(R, P, D, dtype=torch.float64)
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if b > a:
                m[:, i] = s[:, a:b].amax(-1)
                e = torch.exp(s[:, a:b] - m[:, i, None])  # [R, b - a]: online softmax's terms
                l[:, i], o[:, i] = e.sum(-1), (e[..., None] * v[:, a:b]).sum(1)
        want = (s.softmax(-1)[..., None] * v).sum(1)  # [R, D]: the dense reference
        out.append((label, tuple(t.float().to(device) for t in (m, l, o)), want.float().to(device)))
    return out


def _calls_the_solution(kernel, args) -> tuple[Tensor, bool]:
    """run_merge(kernel, *args), noting whether the worked kernel ran inside it (the interpreter runs a
    kernel from a copy of its source, so forbidding cannot swap its code: a profile hook sees it)."""
    called = []
    code = solution_merge_kernel.fn.__code__

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == code.co_name and frame.f_code.co_filename == code.co_filename:
            called.append(True)

    before = sys.getprofile()
    sys.setprofile(hook)
    try:
        got = run_merge(kernel, *args)
    finally:
        sys.setprofile(before)
    return got, bool(called)


def check_merge_splits(kernel) -> bool:
    """kernel: a @triton.jit merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, P, D, BLOCK_P, BLOCK_D) -> True when
    its out equals the dense softmax on every case (and minigen's merge_splits agrees there too)."""
    if not isinstance(kernel, triton.runtime.KernelInterface):
        raise ExerciseFailed(f"merge_kernel: pass the @triton.jit kernel itself, not a {type(kernel).__name__}")
    cases = merge_cases()
    for label, (m, l, o), want in cases:  # minigen's own reduction, on the same splits (before it is forbidden)
        minigens = triton_attention.merge_splits(o / l.clamp_min(1e-30)[..., None], m + l.log())
        assert torch.allclose(minigens, want, rtol=1e-4, atol=1e-5), label
    for label, args, want in cases:
        with forbidding(triton_attention.merge_splits):
            got, called = _calls_the_solution(kernel, args)
        if called and kernel is not solution_merge_kernel:
            raise ExerciseFailed("merge_kernel: your kernel calls this module's worked solution "
                                 "(solution_merge_kernel): write the merge yourself")
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            hints = [hint for wrong, hint in MERGE_MISTAKES
                     if torch.allclose(got, run_merge(wrong, *args), rtol=1e-5, atol=1e-6, equal_nan=True)]
            if not hints and torch.isnan(got).all():
                hints = [f"your kernel stored nothing: tl.store the row's {want.shape[1]} values at "
                         "out_ptr + row * D + d, masked with d < D"]
            bad = torch.nan_to_num(got - want, nan=float("inf")).abs()
            r, i = divmod(int(bad.flatten().argmax()), want.shape[1])
            raise ExerciseFailed(f"merge_kernel: for {label}, row {r} channel {i} should be {want[r, i].item():.5g}, "
                                 f"got {got[r, i].item():.5g}" + (f". Hint: {hints[0]}" if hints else
                                 ". Hint: out = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) l_i, M = max_i m_i"))
    print(f"✓ merge_kernel: all {len(cases)} cases equal the dense softmax (and minigen's merge_splits)")
    return True


# ================================================================ 3. the key tiles of a prompt's queries
TILE_CASES = [  # (label, (first, last, block_n, window_size, sink_tokens))
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
TILE_KERNEL_CASES = [(3, 16, None, 0), (5, 16, 20, 4)]  # (query tiles of 16, block_n, window, sinks) run in Triton


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


def _tiles_guarded(fn: Callable, args: tuple) -> object:
    """fn(*args) with the functions that are the answer made to raise: the worked solution (unless it
    is the answer itself: the chapter checks it so that nbval passes) and expected_tiles."""
    answers = [expected_tiles] + ([] if fn is solution_visible_tiles else [solution_visible_tiles])
    with forbidding(*answers):
        return fn(*args)


def _tiles_hint(args: tuple, got: list[int], want: list[int]) -> str:
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
    for label, args in TILE_CASES:
        got = _tiles_guarded(fn, args)
        if got is None:
            raise ExerciseFailed("visible_tiles returned None: return a list of tile indices")
        try:
            got = [int(j) for j in got]
        except (TypeError, ValueError):
            raise ExerciseFailed(f"visible_tiles returned {type(got).__name__}: return a list of ints") from None
        want = expected_tiles(*args)
        if got != want:
            raise ExerciseFailed(f"visible_tiles: for {label} {args} the tiles to load are {want}, you gave {got}. "
                                 f"Hint: {_tiles_hint(args, got, want)}")
    for tiles, block_n, window, sinks in TILE_KERNEL_CASES:  # minigen's kernel loads exactly these tiles
        counts = kernel_visits(tiles, block_n, window, sinks)
        mine = [len(_tiles_guarded(fn, (16 * i, 16 * i + 15, block_n, window, sinks))) for i in range(tiles)]
        if mine != counts:
            raise ExerciseFailed(f"visible_tiles: minigen's Triton kernel loads {counts} key tiles for the query "
                                 f"tiles of a {16 * tiles}-token prompt (block_n={block_n}, window={window}, "
                                 f"sinks={sinks}); your tiles count {mine}")
    print(f"✓ visible_tiles: all {len(TILE_CASES)} cases agree with attention.in_window, and "
          f"{len(TILE_KERNEL_CASES)} prompts with the Triton kernel's own count")
    return True
