"""FlashAttention forward over paged blocks in Triton (chapter 12): a prompt's T queries per row
attend to the positions their row holds, read in place through the block table, as the decode
kernel (triton_attention.py) reads them for one query.

Shapes: B batch rows, T queries per row, H query heads, Hkv key/value heads, G = H / Hkv query
heads per key/value head (G_PAD: rounded up to a power of 2), Dh head dim, bs = block_size, n table
entries per row, R recent positions, M = ceil(T / BLOCK_M) query tiles per row, ROWS = BLOCK_M x G_PAD.

The layout is the decode kernel's (its docstring draws it): a BlockView's pool, full precision or
8-/4-bit codes dequantized as they load (its `load_tile` and `pool_parts`), then the
recent full-precision positions. Row b's queries sit at query_pos[b] [T]: consecutive positions
start_b .. start_b + T_b - 1 (start_b > 0 when earlier positions are already cached: a chunked
prompt, a prefix-cache hit, a verify step), -1 for padding. A query sees the positions <= its own,
restricted to the window and sinks (attention.in_window).

The grid is (M, B, Hkv): one program per tile of BLOCK_M queries of one row, with the G query
heads that share one key/value head (grouped-query attention): a tile's rows are BLOCK_M x G_PAD
(query, head) pairs, so each key tile is loaded once for all of them. Each program keeps an fp32
online softmax (running max m, sum l, weighted values acc; FlashAttention-2, Dao 2023) over tiles
of BLOCK_N key positions, and visits only the key tiles some query of the tile can see:

    key positions  0 ........ sink_end ..... far ......... lo ................ hi ........ end = last query + 1
    key tiles      [  sinks  ]  skipped      [ far edge   | interior, no mask | diagonal ]  above: skipped

Tiles above the last query's position (the causal upper triangle: half the work of a prompt from
position 0) and tiles wholly outside every query's window that hold no sink are never loaded. The
interior tiles are visible to every query of the tile, so they skip the mask; the others mask from
positions. A padding query sees nothing and writes 0 (finite, discarded).

Supported: every pool the decode kernel reads (float pools; 8- and 4-bit codes, keys per channel or
per token; recent buffers), any G, any window and sinks, ragged rows. Refused with ConfigError
(by `pool_parts`): 2-bit codes. Precondition: every position some query sees lies in a held block
(the paged cache frees only blocks outside the window of the chunk's first query, which no later
query sees either). fp16 and bf16 inputs meet in 16-bit dot products with fp32 sums, as in
FlashAttention, except bf16 in Triton's interpreter (no CUDA), whose bf16 arithmetic is wrong: there
q, k and v go to fp32 as they load (the tests run fp32 and fp16). scripts/gpu_check.py times the
kernel against SDPA's flash kernel on a GPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..caches.contract import BlockView
from ..errors import ConfigError
# Triton comes through triton_attention, which sets TRITON_INTERPRET (no CUDA) before importing it
from .triton_attention import AVAILABLE, INTERPRETED, MIN_DOT, jit, load_tile, pool_parts, tl, triton

NO_WINDOW = 2**30  # window_size=None: wider than any distance between positions, small enough for int32 sums
LOG2_E = 1.4426950408889634  # scores are scaled into base 2 so that the softmax uses exp2 (FlashAttention's trick)


@jit
def _prefill_attention_kernel(
        q_ptr, out_ptr, qpos_ptr, visits_ptr,  # q [B, H, T, Dh], out [B, T, H, Dh], [B, T], visits [B, Hkv, M]
        k_ptr, k_scales_ptr, k_zeros_ptr, v_ptr, v_scales_ptr, v_zeros_ptr,  # one layer's pool
        table_ptr, recent_start_ptr, recent_k_ptr, recent_v_ptr,  # [B, n], [B], [B, R, Hkv, Dh]
        q_stride_b, q_stride_h, q_stride_t, out_stride_b, out_stride_t, out_stride_h,  # Dh is contiguous
        T, n, R, bs, Hkv, Dh, window_size, sink_tokens, qk_scale,
        G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_ALONG_SLOTS: tl.constexpr,
        LOW_PRECISION: tl.constexpr, COUNT: tl.constexpr):
    tile, row, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # The tile's rows: BLOCK_M queries x the G_PAD query heads of this key/value head, [BLOCK_M * G_PAD] each
    r = tl.arange(0, BLOCK_M * G_PAD)
    t, g = tile * BLOCK_M + r // G_PAD, r % G_PAD
    head = kv_head * G + g
    d = tl.arange(0, D_PAD)
    q_mask = ((t < T) & (g < G))[:, None] & (d[None, :] < Dh)
    q = tl.load(q_ptr + row * q_stride_b + head[:, None] * q_stride_h + t[:, None] * q_stride_t + d[None, :],
                mask=q_mask, other=0.0)  # [ROWS, D_PAD]
    if not LOW_PRECISION:
        q = q.to(tl.float32)  # fp32 products (and the interpreter's only correct arithmetic)
    qpos = tl.load(qpos_ptr + row * T + t, mask=t < T, other=-1).to(tl.int32)  # [ROWS], -1: padding
    recent_start = tl.load(recent_start_ptr + row).to(tl.int32)

    # The key tiles to visit, from the first and last query's positions (all >= 0, so // floors).
    last = tl.max(qpos)  # -1: the tile is all padding, and every range below is empty
    first = tl.min(tl.where(qpos >= 0, qpos, last))
    end = last + 1  # the causal bound: no query of the tile sees a position >= end
    sink_end = tl.cdiv(tl.minimum(sink_tokens, end), BLOCK_N) * BLOCK_N  # tiles holding a sink
    far = tl.maximum(tl.maximum(first - window_size + 1, 0) // BLOCK_N * BLOCK_N, sink_end)  # first query's window
    # Interior tiles lie inside the last query's window and at or below the first query: no mask.
    lo = tl.maximum(far, tl.minimum(tl.cdiv(tl.maximum(last - window_size + 1, 0), BLOCK_N) * BLOCK_N,
                                    (first + 1) // BLOCK_N * BLOCK_N))
    hi = tl.maximum(lo, (first + 1) // BLOCK_N * BLOCK_N)

    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)  # running max of the scores (base 2), per row
    l = tl.zeros([BLOCK_M * G_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)  # running sum of exp2(score - m) * value
    visits = tl.zeros([], tl.int32)  # key tiles loaded (tests check the skipping with it)
    for phase in tl.static_range(4):  # unrolled: four loops over disjoint ranges of tiles, in order
        if phase == 0:
            start_at, stop = 0, sink_end  # the sinks (masked: a sink tile also holds window keys)
        elif phase == 1:
            start_at, stop = far, lo  # the window's far edge: some queries see a key, others not
        elif phase == 2:
            start_at, stop = lo, hi  # the interior: every query sees every key
        else:
            start_at, stop = hi, end  # the diagonal: causal
        for start in range(start_at, stop, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] the positions of this tile
            live = pos < end
            block = tl.load(table_ptr + row * n + pos // bs, mask=live & (pos < recent_start), other=-1)
            in_pool = live & (pos < recent_start) & (block >= 0)
            in_recent = live & (pos >= recent_start)
            pool_mask, recent_mask = in_pool[:, None] & (d[None, :] < Dh), in_recent[:, None] & (d[None, :] < Dh)
            recent = ((row * R + (pos - recent_start)[:, None]) * Hkv + kv_head) * Dh + d[None, :]
            # [BLOCK_N, D_PAD]: each position from the pool or from the recent buffer (the other load is masked)
            k = load_tile(k_ptr, k_scales_ptr, k_zeros_ptr, block[:, None], (pos % bs)[:, None], kv_head, d[None, :],
                          pool_mask, bs, Hkv, Dh, K_BITS, GROUP, K_ALONG_SLOTS)
            k += tl.load(recent_k_ptr + recent, mask=recent_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale  # [ROWS, BLOCK_N]
            if phase != 2:  # causal, window and sinks from positions (attention.window_mask)
                seen = ((pos[None, :] <= qpos[:, None])
                        & ((pos[None, :] < sink_tokens) | (qpos[:, None] - pos[None, :] < window_size))
                        & (in_pool | in_recent)[None, :])
                scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every term is 0, not NaN
            alpha = tl.exp2(m - m_safe)  # rescales what was summed under the old max
            p = tl.exp2(scores - m_safe[:, None])  # [ROWS, BLOCK_N]
            v = load_tile(v_ptr, v_scales_ptr, v_zeros_ptr, block[:, None], (pos % bs)[:, None], kv_head, d[None, :],
                          pool_mask, bs, Hkv, Dh, V_BITS, GROUP, False)
            v += tl.load(recent_v_ptr + recent, mask=recent_mask, other=0.0).to(tl.float32)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
            m = m_new
            visits += 1
    l_safe = tl.where(l > 0, l, 1.0)  # a padding query saw nothing: its output is 0
    out = acc / l_safe[:, None]
    tl.store(out_ptr + row * out_stride_b + t[:, None] * out_stride_t + head[:, None] * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if COUNT:
        tl.store(visits_ptr + (row * Hkv + kv_head) * tl.num_programs(0) + tile, visits)


def _check_tile(name: str, size: int, low: int) -> None:
    if size < low or size & (size - 1):
        raise ValueError(f"{name}={size} is invalid: a power of 2 (tl.arange) and >= {low} (tl.dot on a GPU)")


def prefill_attention(q: Tensor, view: BlockView, query_pos: Tensor, window_size: int | None = None,
                      sink_tokens: int = 0, block_m: int | None = None, block_n: int | None = None,
                      visits: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v for T queries per row over the keys `view` holds, read in place.

    q [B, H, T, Dh] at query_pos [B, T] (or [T] for every row; -1: padding) -> [B, H, T, Dh] in q's
    dtype (a view of [B, T, H, Dh] storage: the output projection reads it without a copy). block_m:
    queries per tile (with G_PAD heads: >= 16 rows), block_n: keys per tile; both powers of 2.
    visits: an int32 [B, Hkv, M] tensor to receive the key tiles each program loaded (M = ceil(T / block_m)).
    """
    if not AVAILABLE:
        raise ConfigError("attention_backend='triton' needs the triton package, which ships for Linux only: "
                          "pip install triton, or use attention_backend='torch'")
    B, H, T, Dh = q.shape
    k_codes, k_scales, k_zeros, k_bits, k_group, k_along_slots = pool_parts(view.k)
    v_codes, v_scales, v_zeros, v_bits, v_group, _ = pool_parts(view.v)
    Hkv = k_codes.shape[2]  # every pool layout keeps [N, slots, Hkv, channels]
    assert H % Hkv == 0 and view.block_table is not None and view.block_table.shape[0] == B, \
        (q.shape, k_codes.shape, view.block_table)
    G = H // Hkv
    G_PAD = triton.next_power_of_2(G)
    gpu, wide = q.device.type == "cuda", q.dtype != torch.float32
    # On a GPU 128 (query, head) rows x 64 keys per tile in 16 bits (FlashAttention-2's), half in fp32,
    # whose tiles take twice the registers; in the interpreter, few large tiles run fastest.
    rows = (128 if wide else 64) if gpu else 64
    block_m = block_m or max(1, rows // G_PAD)
    block_n = block_n or (64 if gpu and wide else 32)
    _check_tile("block_m x G_PAD", block_m * G_PAD, MIN_DOT)
    _check_tile("block_n", block_n, MIN_DOT)
    M = triton.cdiv(T, block_m)
    assert visits is None or (visits.shape == (B, Hkv, M) and visits.dtype == torch.int32), (visits, (B, Hkv, M))
    query_pos = query_pos.expand(B, T).contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(B, T, H, Dh, dtype=q.dtype, device=q.device)  # heads side by side: [B, T, H * Dh] for wo
    recent_k = view.recent_k.contiguous() if view.recent_k is not None else q  # never read: recent_start = seq_lens
    recent_v = view.recent_v.contiguous() if view.recent_v is not None else q
    D_PAD = max(MIN_DOT, triton.next_power_of_2(Dh))
    # 16-bit inputs meet in 16-bit dot products (tensor cores); not in the interpreter, whose bf16 is wrong
    low_precision = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and not INTERPRETED)
    _prefill_attention_kernel[(M, B, Hkv)](
        q, out, query_pos, visits if visits is not None else query_pos,
        k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros,
        view.block_table.contiguous(), view.recent_start, recent_k, recent_v,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        T, view.block_table.shape[1], recent_k.shape[1] if view.recent_k is not None else 0, view.block_size,
        Hkv, Dh, window_size if window_size is not None else NO_WINDOW, sink_tokens, LOG2_E / math.sqrt(Dh),
        G=G, G_PAD=G_PAD, D_PAD=D_PAD, BLOCK_M=block_m, BLOCK_N=block_n, GROUP=max(k_group, v_group),
        K_BITS=k_bits, V_BITS=v_bits, K_ALONG_SLOTS=k_along_slots, LOW_PRECISION=low_precision,
        COUNT=visits is not None, num_warps=8 if gpu and block_m * G_PAD * D_PAD >= 128 * 128 else 4)
    return out.transpose(1, 2)
