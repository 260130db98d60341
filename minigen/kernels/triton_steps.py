"""The small kernels of chapter 12, each one step from the last toward triton_attention.py.

Shapes: N elements, R rows, C columns, H heads, S positions, Dh head dim, bs slots per block,
G elements per quantization group.

Each `*_kernel` is the body of one Triton program; the function after it launches a grid of them
and returns what the torch one-liner in its docstring returns. In order:

    add                   the grid, program ids, and masks for the ragged end
    row_dot               a loop over tiles, summed in fp32
    softmax               one row per program: max, exp, sum, divide
    online_softmax        one pass over tiles: the running max and sum of flash attention
    head_attention        one query per head over a contiguous cache [H, S, Dh]
    paged_head_attention  the same through a block table into a pool [N, bs, H, Dh]
    paged_int4_attention  the same over 4-bit codes, dequantized as they load
    flash_attention       a prompt (chapter 12, section 10): tiles of queries against tiles of keys, the
                          online softmax on tiles, key tiles past the diagonal never loaded

The last step, split-K with grouped-query heads, windows and 8-bit codes, is the package's kernel:
triton_attention.decode_attention; for a prompt, with the paged blocks, grouped-query heads,
windows and sinks, triton_prefill.prefill_attention. On a machine without CUDA every launch runs in Triton's
interpreter (triton_attention sets TRITON_INTERPRET=1 before Triton is imported).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .triton_attention import jit, tl, triton

TILE = 16  # elements (or positions) per tile: a power of 2, as tl.arange needs


# ---------------------------------------------------------------- 1. the grid and masks
@jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # program pid handles elements pid * BLOCK .. pid * BLOCK + BLOCK - 1
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the last program runs past the end: its masked lanes load and store nothing
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def add(x: Tensor, y: Tensor, block: int = TILE) -> Tensor:
    """x + y for x, y [N]: one program per BLOCK elements."""
    out = torch.empty_like(x)
    add_kernel[(triton.cdiv(x.numel(), block),)](x, y, out, x.numel(), BLOCK=block)
    return out


# ---------------------------------------------------------------- 2. a loop over tiles
@jit
def row_dot_kernel(x_ptr, y_ptr, out_ptr, C, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)  # BLOCK partial sums, added up once at the end
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < C
        x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)  # fp32 after every load
        y = tl.load(y_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        acc += x * y
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def row_dot(x: Tensor, y: Tensor, block: int = TILE) -> Tensor:
    """x @ y in fp32 for x [R, C], y [C] -> [R]: one program per row, BLOCK columns at a time."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    row_dot_kernel[(x.shape[0],)](x.contiguous(), y.contiguous(), out, x.shape[1], BLOCK=block)
    return out


# ---------------------------------------------------------------- 3. softmax, then online
@jit
def softmax_kernel(x_ptr, out_ptr, C, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # the whole row in one tile: BLOCK >= C
    x = tl.load(x_ptr + row * C + cols, mask=cols < C, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # minus the max: exp never overflows, the largest term is 1
    tl.store(out_ptr + row * C + cols, e / tl.sum(e, axis=0), mask=cols < C)


def softmax(x: Tensor) -> Tensor:
    """x.softmax(-1) in fp32 for x [R, C]: one program per row."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    softmax_kernel[(x.shape[0],)](x.contiguous(), out, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


@jit
def online_softmax_kernel(s_ptr, v_ptr, out_ptr, C, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    m = tl.full([1], float("-inf"), tl.float32)  # the largest score so far
    l = tl.zeros([1], tl.float32)  # sum of exp(score - m) so far
    acc = tl.zeros([1], tl.float32)  # sum of exp(score - m) * value so far
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(s_ptr + row * C + cols, mask=cols < C, other=float("-inf")).to(tl.float32)
        v = tl.load(v_ptr + row * C + cols, mask=cols < C, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)  # a larger max shrinks everything summed so far by exp(m - m_new)
        p = tl.exp(s - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * v, axis=0)
        m = m_new
    tl.store(out_ptr + row + tl.arange(0, 1), acc / l)


def online_softmax(s: Tensor, v: Tensor, block: int = TILE) -> Tensor:
    """(s.softmax(-1) * v).sum(-1) in fp32 for s, v [R, C], reading each row once, BLOCK at a time."""
    out = torch.empty(s.shape[0], dtype=torch.float32, device=s.device)
    online_softmax_kernel[(s.shape[0],)](s.contiguous(), v.contiguous(), out, s.shape[1], BLOCK=block)
    return out


# ---------------------------------------------------------------- 4. attention, one head at a time
@jit
def head_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, S, Dh, sm_scale, BLOCK: tl.constexpr, D: tl.constexpr):
    h = tl.program_id(0)
    d = tl.arange(0, D)  # channels, padded to a power of 2
    q = tl.load(q_ptr + h * Dh + d, mask=d < Dh, other=0.0).to(tl.float32) * sm_scale  # [D]
    m, l, acc = tl.full([1], float("-inf"), tl.float32), tl.zeros([1], tl.float32), tl.zeros([D], tl.float32)
    for start in range(0, S, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        mask = (pos < S)[:, None] & (d < Dh)[None, :]
        k = tl.load(k_ptr + (h * S + pos[:, None]) * Dh + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.where(pos < S, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [BLOCK] scores
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha, p = tl.exp(m - m_new), tl.exp(s - m_new)
        v = tl.load(v_ptr + (h * S + pos[:, None]) * Dh + d[None, :], mask=mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)  # [D]
        m = m_new
    tl.store(out_ptr + h * Dh + d, acc / l, mask=d < Dh)


def head_attention(q: Tensor, k: Tensor, v: Tensor, block: int = TILE) -> Tensor:
    """softmax(q k^T / sqrt(Dh)) v for q [H, Dh], k, v [H, S, Dh] -> [H, Dh] fp32: one program per head."""
    H, S, Dh = k.shape
    out = torch.empty(H, Dh, dtype=torch.float32, device=q.device)
    head_attention_kernel[(H,)](q.contiguous(), k.contiguous(), v.contiguous(), out, S, Dh, 1 / math.sqrt(Dh),
                                BLOCK=block, D=triton.next_power_of_2(Dh))
    return out


# ---------------------------------------------------------------- 5. through a block table
@jit
def paged_head_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, S, H, Dh, bs, sm_scale,
                                BLOCK: tl.constexpr, D: tl.constexpr):
    h = tl.program_id(0)
    d = tl.arange(0, D)  # channels, padded to a power of 2
    q = tl.load(q_ptr + h * Dh + d, mask=d < Dh, other=0.0).to(tl.float32) * sm_scale  # [D]
    m, l, acc = tl.full([1], float("-inf"), tl.float32), tl.zeros([1], tl.float32), tl.zeros([D], tl.float32)
    for start in range(0, S, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        block = tl.load(table_ptr + pos // bs, mask=pos < S, other=0)  # where position pos lives
        slot = ((block * bs + pos % bs) * H + h)[:, None] * Dh + d[None, :]  # [BLOCK, D] in the pool [N, bs, H, Dh]
        mask = (pos < S)[:, None] & (d < Dh)[None, :]
        k = tl.load(k_ptr + slot, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(pos < S, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [BLOCK] scores
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha, p = tl.exp(m - m_new), tl.exp(s - m_new)
        v = tl.load(v_ptr + slot, mask=mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)  # [D]
        m = m_new
    tl.store(out_ptr + h * Dh + d, acc / l, mask=d < Dh)


def paged_head_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, S: int,
                         block: int = TILE) -> Tensor:
    """head_attention over positions 0..S-1 stored in pools [N, bs, H, Dh] through block_table [n]."""
    N, bs, H, Dh = k_pool.shape
    out = torch.empty(H, Dh, dtype=torch.float32, device=q.device)
    paged_head_attention_kernel[(H,)](q.contiguous(), k_pool, v_pool, block_table, out, S, H, Dh, bs,
                                      1 / math.sqrt(Dh), BLOCK=block, D=triton.next_power_of_2(Dh))
    return out


# ---------------------------------------------------------------- 6. 4-bit codes, dequantized on load
@jit
def _int4_load(codes_ptr, scales_ptr, zeros_ptr, row, d, mask, Dh, G: tl.constexpr):
    """Values [BLOCK, D] of rows `row` [BLOCK, 1] (block * bs + slot) * H + h, channels d [1, D], from
    codes [.., Dh / 2] (two per byte, the first in the low bits) and scales, zeros [.., Dh / G]."""
    byte = tl.load(codes_ptr + row * (Dh // 2) + d // 2, mask=mask, other=0)
    code = (byte.to(tl.int32) >> ((d % 2) * 4)) & 0xF  # the low nibble for even channels, the high for odd
    scale = tl.load(scales_ptr + row * (Dh // G) + d // G, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zeros_ptr + row * (Dh // G) + d // G, mask=mask, other=0.0).to(tl.float32)
    return zero + code.to(tl.float32) * scale


@jit
def paged_int4_attention_kernel(q_ptr, k_codes, k_scales, k_zeros, v_codes, v_scales, v_zeros, table_ptr, out_ptr,
                                S, H, Dh, bs, sm_scale, G: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
    h = tl.program_id(0)
    d = tl.arange(0, D)  # channels, padded to a power of 2
    q = tl.load(q_ptr + h * Dh + d, mask=d < Dh, other=0.0).to(tl.float32) * sm_scale  # [D]
    m, l, acc = tl.full([1], float("-inf"), tl.float32), tl.zeros([1], tl.float32), tl.zeros([D], tl.float32)
    for start in range(0, S, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        block = tl.load(table_ptr + pos // bs, mask=pos < S, other=0)  # where position pos lives
        row = ((block * bs + pos % bs) * H + h)[:, None]  # [BLOCK, 1]: the (block, slot, head) of each lane
        mask = (pos < S)[:, None] & (d < Dh)[None, :]
        k = _int4_load(k_codes, k_scales, k_zeros, row, d[None, :], mask, Dh, G)  # the new step
        s = tl.where(pos < S, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [BLOCK] scores
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha, p = tl.exp(m - m_new), tl.exp(s - m_new)
        v = _int4_load(v_codes, v_scales, v_zeros, row, d[None, :], mask, Dh, G)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)  # [D]
        m = m_new
    tl.store(out_ptr + h * Dh + d, acc / l, mask=d < Dh)


def paged_int4_attention(q: Tensor, k, v, block_table: Tensor, S: int, block: int = TILE) -> Tensor:
    """paged_head_attention over quant.QuantizedTensor pools k, v (4 bits, grouped per token over
    channels: codes [N, bs, H, Dh / 2], scales and zeros [N, bs, H, Dh / G])."""
    N, bs, H, half = k.data.shape
    Dh = 2 * half
    out = torch.empty(H, Dh, dtype=torch.float32, device=q.device)
    paged_int4_attention_kernel[(H,)](q.contiguous(), k.data, k.scales, k.zeros, v.data, v.scales, v.zeros,
                                      block_table, out, S, H, Dh, bs, 1 / math.sqrt(Dh), G=k.group_size,
                                      BLOCK=block, D=triton.next_power_of_2(Dh))
    return out


# ---------------------------------------------------------------- 7. a prompt: tiles of queries (chapter 12, section 10)
@jit
def flash_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, visits_ptr, T, Dh, sm_scale, CAUSAL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    i, h = tl.program_id(0), tl.program_id(1)  # queries i * BLOCK_M .. i * BLOCK_M + BLOCK_M - 1 of head h
    M = tl.num_programs(0)
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)  # channels, padded to a power of 2
    base = h * T * Dh
    q = tl.load(q_ptr + base + rows[:, None] * Dh + d[None, :], mask=(rows < T)[:, None] & (d < Dh)[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_M, D]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # per query: the running max,
    l = tl.zeros([BLOCK_M], tl.float32)  # the running sum of exponentials,
    acc = tl.zeros([BLOCK_M, D], tl.float32)  # and the running weighted sum of values
    if CAUSAL:
        end = tl.minimum((i + 1) * BLOCK_M, T)  # no query of this tile sees a key after its last query
    else:
        end = T
    loaded = 0
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = (cols < T)[:, None] & (d < Dh)[None, :]
        k = tl.load(k_ptr + base + cols[:, None] * Dh + d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * sm_scale  # [BLOCK_M, BLOCK_N]: one tile of the score matrix, never more
        seen = (cols < T)[None, :]
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # the first tile holds key 0, which every query sees: finite
        alpha, p = tl.exp(m - m_new), tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + base + cols[:, None] * Dh + d[None, :], mask=mask, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
        loaded += 1
    tl.store(out_ptr + base + rows[:, None] * Dh + d[None, :], acc / l[:, None],
             mask=(rows < T)[:, None] & (d < Dh)[None, :])
    tl.store(visits_ptr + h * M + i + tl.arange(0, 1), loaded + tl.zeros([1], tl.int32))


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, block_m: int = TILE,
                    block_n: int = TILE) -> tuple[Tensor, Tensor]:
    """softmax(q k^T / sqrt(Dh) (+ the causal mask)) v for q, k, v [H, T, Dh] -> ([H, T, Dh] fp32, the key
    tiles each program loaded [H, M]): one program per tile of block_m queries of one head, walking tiles
    of block_n keys with an online softmax (FlashAttention's forward). Tiles are at least 16 (tl.dot)."""
    H, T, Dh = q.shape
    M = triton.cdiv(T, block_m)
    out = torch.empty(H, T, Dh, dtype=torch.float32, device=q.device)
    visits = torch.zeros(H, M, dtype=torch.int32, device=q.device)
    flash_attention_kernel[(M, H)](q.contiguous(), k.contiguous(), v.contiguous(), out, visits, T, Dh,
                                   1 / math.sqrt(Dh), CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n,
                                   D=max(16, triton.next_power_of_2(Dh)))
    return out, visits
