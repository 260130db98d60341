"""Fused decode attention in Triton (chapter 12): one query token per sequence attends over its
paged blocks in place, through the block table, dequantizing 8- and 4-bit codes as they load.

Shapes: B batch rows, H query heads, Hkv key/value heads, G = H / Hkv query heads per key/value
head, Dh head dim, N blocks in the pool, bs = block_size slots per block, n table entries per
row, R recent positions, P splits of the positions, n_b = 8 // bits codes per byte.

What one layer's decode step reads (paged.BlockView):

    block_table [B, n]   logical block j of row b (positions j*bs .. j*bs + bs - 1) -> physical block
                           row 0: [ 7 | 2 | -1 | 5 ]    -1: freed, outside the window: never read
                           row 1: [ 3 | 0 |  4 ]      (ragged: rows hold different lengths)
    pool, full precision [N, bs, Hkv, Dh]               a block's slots, then its heads, then channels
    pool, quantized      codes [N, bs / n_b, Hkv, Dh]   scales, zeros [N, bs / G, Hkv, Dh]
                           keys per channel (KIVI): a byte packs n_b slots, a group runs over slots
                         codes [N, bs, Hkv, Dh / n_b]   scales, zeros [N, bs, Hkv, Dh / G]
                           values (and keys per token): a byte packs n_b channels, first in the low bits
    recent k, v          [B, R, Hkv, Dh] full precision: positions recent_start .. seq_len - 1
                           (a quantized cache's open block; empty for a full-precision pool)

    position p of row b  ->  p <  recent_start[b]: block block_table[b, p // bs], slot p % bs
                             p >= recent_start[b]: recent[b, p - recent_start[b]]

The grid is (B, Hkv, P): one program per row, key/value head and split of the positions
(flash-decoding, Dao et al. 2023). A decode step has one query per row, so without the split a
long context would run on only B x Hkv programs, too few to fill a GPU. Each program loads its
keys and values once for the G query heads that share them (grouped-query attention), keeps an
fp32 online softmax (running max m, sum l, weighted values acc) over tiles of BLOCK_N positions,
and writes acc / l with its log-sum-exp; `decode_attention` merges the P partial results. The
window and sinks are masks from positions, as in attention.py; a masked load reads no bytes.

A prompt's queries (T > 1) read the same layout through `load_tile` and `pool_parts`, imported by
triton_prefill.py (FlashAttention over the blocks, its tiles of queries skipping the causal upper
triangle).

Without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before Triton
is imported, for this whole process): numpy runs each program in turn, in fp32. It proves the
kernel correct, and says nothing about its speed (scripts/gpu_check.py measures that on a GPU).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..caches.contract import BlockView
from ..numerics.quant import QuantizedTensor

if not torch.cuda.is_available():  # must come first: @triton.jit reads it as it decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships wheels for Linux only (pyproject.toml)
    triton = tl = None

AVAILABLE = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
jit = triton.jit if AVAILABLE else (lambda fn: fn)  # without Triton the kernel is defined, never launched

BLOCK_N = 32  # positions per tile: a power of 2 (tl.arange), and >= 16 (tl.dot on a GPU)
MIN_DOT = 16  # tl.dot on a GPU needs every dim >= 16: the G query heads and Dh are padded up to it
PROGRAMS_PER_SM = 4  # splits are added until the grid holds this many programs per multiprocessor


@jit
def _offsets(block, slot, head, channel, bs, Hkv, Dh, PER_SLOT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Element offsets in storage [N, bs / PER_SLOT, Hkv, Dh / PER_CHANNEL]: PER_SLOT slots (or
    PER_CHANNEL channels) in a row share one element, a packed byte or a group's scale."""
    return ((block * (bs // PER_SLOT) + slot // PER_SLOT) * Hkv + head) * (Dh // PER_CHANNEL) + channel // PER_CHANNEL


@jit
def load_tile(ptr, scales_ptr, zeros_ptr, block, slot, head, channel, mask, bs, Hkv, Dh,
              BITS: tl.constexpr, GROUP: tl.constexpr, ALONG_SLOTS: tl.constexpr):
    """[BLOCK_N, D_PAD] fp32 values of block [BLOCK_N, 1], slot [BLOCK_N, 1], channel [1, D_PAD]: as
    stored (BITS=0), or unpacked and dequantized, zeros + codes * scales (quant.dequantize)."""
    if BITS == 0:  # constexpr branches: the compiler keeps only the one taken (one return, at the end)
        # fp32 right after the load: the interpreter mishandles bf16 arithmetic
        x = tl.load(ptr + _offsets(block, slot, head, channel, bs, Hkv, Dh, 1, 1), mask=mask, other=0.0).to(tl.float32)
    else:
        if ALONG_SLOTS:  # keys per channel: a byte packs 8 // BITS slots, a group runs over GROUP slots
            byte = tl.load(ptr + _offsets(block, slot, head, channel, bs, Hkv, Dh, 8 // BITS, 1), mask=mask, other=0)
            shift = (slot % (8 // BITS)) * BITS
            meta = _offsets(block, slot, head, channel, bs, Hkv, Dh, GROUP, 1)
        else:  # per token: a byte packs 8 // BITS channels, a group runs over GROUP channels
            byte = tl.load(ptr + _offsets(block, slot, head, channel, bs, Hkv, Dh, 1, 8 // BITS), mask=mask, other=0)
            shift = (channel % (8 // BITS)) * BITS
            meta = _offsets(block, slot, head, channel, bs, Hkv, Dh, 1, GROUP)
        codes = (byte.to(tl.int32) >> shift) & ((1 << BITS) - 1)  # & 0xF at 4 bits: only this code's bits
        scales = tl.load(scales_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        zeros = tl.load(zeros_ptr + meta, mask=mask, other=0.0).to(tl.float32)
        x = zeros + codes.to(tl.float32) * scales
    return x


@jit
def _decode_attention_kernel(
        q_ptr, out_ptr, lse_ptr,  # q [B, H, Dh] (rows q_row_stride apart); out [B, H, P, Dh], lse [B, H, P]
        k_ptr, k_scales_ptr, k_zeros_ptr, v_ptr, v_scales_ptr, v_zeros_ptr,  # one layer's pool
        table_ptr, seq_lens_ptr, recent_start_ptr, recent_k_ptr, recent_v_ptr,  # [B, n], [B], [B], [B, R, Hkv, Dh]
        q_row_stride, n, R, bs, Hkv, Dh, split_len, window_size, sink_tokens, sm_scale,
        G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
        K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_ALONG_SLOTS: tl.constexpr):
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    P = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + row)
    recent_start = tl.load(recent_start_ptr + row)
    query_pos = seq_len - 1
    # The G query heads this key/value head serves, padded to G_PAD rows: q [G_PAD, D_PAD]
    g, d = tl.arange(0, G_PAD), tl.arange(0, D_PAD)
    head = kv_head * G + g
    q_mask = (g[:, None] < G) & (d[None, :] < Dh)
    q = tl.load(q_ptr + row * q_row_stride + head[:, None] * Dh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32) * sm_scale
    m = tl.full([G_PAD], float("-inf"), tl.float32)  # running max of the scores, per query head
    l = tl.zeros([G_PAD], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)  # running sum of exp(score - m) * value
    lo = split * split_len
    for start in range(lo, tl.minimum(lo + split_len, seq_len), BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] the positions of this tile
        seen = (pos < seq_len) & ((pos < sink_tokens) | (query_pos - pos < window_size))  # causal, window, sinks
        block = tl.load(table_ptr + row * n + pos // bs, mask=seen & (pos < recent_start), other=-1)
        in_pool = seen & (pos < recent_start) & (block >= 0)
        in_recent = seen & (pos >= recent_start)
        pool_mask, recent_mask = in_pool[:, None] & (d[None, :] < Dh), in_recent[:, None] & (d[None, :] < Dh)
        recent = ((row * R + (pos - recent_start)[:, None]) * Hkv + kv_head) * Dh + d[None, :]
        # [BLOCK_N, D_PAD]: each position from the pool or from the recent buffer (the other load is masked)
        k = load_tile(k_ptr, k_scales_ptr, k_zeros_ptr, block[:, None], (pos % bs)[:, None], kv_head, d[None, :],
                      pool_mask, bs, Hkv, Dh, K_BITS, GROUP, K_ALONG_SLOTS)
        k += tl.load(recent_k_ptr + recent, mask=recent_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_PAD, BLOCK_N], fp32 products
        scores = tl.where((in_pool | in_recent)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every term is 0, not NaN
        alpha = tl.exp(m - m_safe)  # rescales what was summed under the old max
        p = tl.exp(scores - m_safe[:, None])  # [G_PAD, BLOCK_N]
        v = load_tile(v_ptr, v_scales_ptr, v_zeros_ptr, block[:, None], (pos % bs)[:, None], kv_head, d[None, :],
                      pool_mask, bs, Hkv, Dh, V_BITS, GROUP, False)
        v += tl.load(recent_v_ptr + recent, mask=recent_mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    # This split's attention and log-sum-exp; a split that saw no key writes lse = -inf (weight 0).
    l_safe = tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + ((row * Hkv * G + head[:, None]) * P + split) * Dh + d[None, :], acc / l_safe[:, None],
             mask=q_mask)
    tl.store(lse_ptr + (row * Hkv * G + head) * P + split, tl.where(l > 0, m + tl.log(l_safe), float("-inf")),
             mask=g < G)


def pool_parts(x) -> tuple[Tensor, Tensor, Tensor, int, int, bool]:
    """(codes, scales, zeros, bits, group size, packed along slots) of a pool; bits 0: full precision."""
    if isinstance(x, QuantizedTensor):
        if x.bits not in (8, 4):
            raise ConfigError(f"quant_bits={x.bits} is not supported by attention_backend='triton': use 8 or 4")
        return x.data, x.scales, x.zeros, x.bits, x.group_size, x.axis == -3
    return x, x, x, 0, 1, False  # scales and zeros are never read at 0 bits


def default_splits(batch: int, n_kv_heads: int, tiles: int, device: torch.device) -> int:
    """P: on a GPU, enough splits for PROGRAMS_PER_SM programs per multiprocessor; one in the interpreter."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, math.ceil(PROGRAMS_PER_SM * sms / (batch * n_kv_heads))))


@dataclass(frozen=True)
class DecodeMetadata:
    """What every layer's decode attention of one step shares, computed once for the step
    (plan_decode) and passed to each layer's `decode_attention`, which then only launches.

    Nothing here depends on the rows' lengths unless the planner gave them (max_len): by default the
    positions are bounded by what the view can hold, n * bs + R, so planning reads no tensor
    (no host sync, and the same launch replays in a CUDA graph at every length). A split whose
    positions lie past a row's length runs no tile and weighs 0 in the merge.
    """
    num_splits: int  # P, the splits of the positions
    split_len: int  # positions per split, whole tiles of BLOCK_N
    window: int  # the window the kernel applies (the bound on positions when attention has none)
    sink_tokens: int
    grid: tuple[int, int, int]  # (B, Hkv, P)
    scalars: tuple  # the kernel's integer and float arguments after the pointers, in order
    constexprs: dict  # the kernel's compile-time arguments
    out: Tensor  # [B, H, P, Dh] fp32 partial outputs; with P = 1 the result itself, [B, H, 1, Dh] in q's dtype
    lse: Tensor  # [B, H, P] fp32 log-sum-exps (read only to merge P > 1 splits)


def plan_decode(q: Tensor, view: BlockView, window_size: int | None = None, sink_tokens: int = 0,
                num_splits: int | None = None, max_len: int | None = None) -> DecodeMetadata:
    """The metadata of one decode step's attention over every layer's `view` (the layers share the
    block table's shape, the pool's format and the heads): splits, grid, kernel arguments and the
    scratch outputs. q [B, H, Dh] gives the shapes and dtype only. num_splits: P (default:
    default_splits); max_len: the longest row, when the planner knows it on the host (default: the
    view's capacity, which needs no read of seq_lens)."""
    if not AVAILABLE:
        raise ConfigError("attention_backend='triton' needs the triton package, which ships for Linux only: "
                          "pip install triton, or use attention_backend='torch'")
    B, H, Dh = q.shape
    k_codes, _, _, k_bits, k_group, k_along_slots = pool_parts(view.k)
    _, _, _, v_bits, v_group, _ = pool_parts(view.v)
    Hkv = k_codes.shape[2]  # every pool layout keeps [N, slots, Hkv, channels]
    assert H % Hkv == 0 and view.block_table.shape[0] == B, (q.shape, k_codes.shape, view.block_table.shape)
    R = view.recent_k.shape[1] if view.recent_k is not None else 0
    bound = max_len if max_len is not None else view.block_table.shape[1] * view.block_size + R
    tiles = max(1, math.ceil(bound / BLOCK_N))
    P = num_splits or default_splits(B, Hkv, tiles, q.device)
    split_len = math.ceil(tiles / P) * BLOCK_N  # positions per split, whole tiles
    window = window_size if window_size is not None else max(bound, 1)
    # one split: the kernel's acc / l is the result, stored in q's dtype (tl.store casts); no merge
    out = torch.empty(B, H, P, Dh, dtype=torch.float32 if P > 1 else q.dtype, device=q.device)
    lse = torch.empty(B, H, P, dtype=torch.float32, device=q.device)
    G = H // Hkv
    scalars = (view.block_table.shape[1], R, view.block_size, Hkv, Dh, split_len, window, sink_tokens,
               1 / math.sqrt(Dh))
    constexprs = dict(G=G, G_PAD=max(MIN_DOT, triton.next_power_of_2(G)), D_PAD=max(MIN_DOT, triton.next_power_of_2(Dh)),
                      BLOCK_N=BLOCK_N, GROUP=max(k_group, v_group), K_BITS=k_bits, V_BITS=v_bits,
                      K_ALONG_SLOTS=k_along_slots)
    return DecodeMetadata(P, split_len, window, sink_tokens, (B, Hkv, P), scalars, constexprs, out, lse)


def decode_attention(q: Tensor, view: BlockView, window_size: int | None = None, sink_tokens: int = 0,
                     num_splits: int | None = None, plan: DecodeMetadata | None = None) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v for one query per row over the keys `view` holds.

    q [B, H, Dh]: row b's query sits at position view.seq_lens[b] - 1 and sees every earlier
    position (with window_size: only sinks and the window, attention.in_window) -> [B, H, Dh] in
    q's dtype. `plan` (plan_decode, made once per step for every layer) holds the splits, grid and
    scratch outputs: with it a call is its launch, and with one split only its launch (the result
    is then a view of plan.out, valid until the next call with the same plan). Without a plan the
    call makes one from window_size, sink_tokens and num_splits (P, default: default_splits).
    """
    if plan is None:
        plan = plan_decode(q, view, window_size, sink_tokens, num_splits)
    k_codes, k_scales, k_zeros, _, _, _ = pool_parts(view.k)
    v_codes, v_scales, v_zeros, _, _, _ = pool_parts(view.v)
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # any row stride; each row's heads packed
        q = q.contiguous()
    recent_k = view.recent_k if view.recent_k is not None else q  # never read: recent_start = seq_lens
    recent_v = view.recent_v if view.recent_v is not None else q
    _decode_attention_kernel[plan.grid](
        q, plan.out, plan.lse, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros,
        view.block_table.contiguous(), view.seq_lens, view.recent_start, recent_k.contiguous(), recent_v.contiguous(),
        q.stride(0), *plan.scalars,
        **plan.constexprs)
    if plan.num_splits == 1:
        return plan.out[:, :, 0]
    return merge_splits(plan.out, plan.lse).to(q.dtype)


def merge_splits(out: Tensor, lse: Tensor) -> Tensor:
    """Flash-decoding's reduction: out [..., P, Dh] (each split's softmax-weighted values) and lse
    [..., P] (each split's log-sum-exp, -inf for a split that saw no key) -> [..., Dh] in fp32."""
    # A split's share of the softmax's denominator is exp(lse_p), taken relative to the largest so
    # that exp never overflows
    weights = torch.exp(lse - lse.amax(dim=-1, keepdim=True))  # [..., P]; 0 for a split that saw nothing
    return (weights[..., None] * out).sum(dim=-2) / weights.sum(dim=-1)[..., None]
