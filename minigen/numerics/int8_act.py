"""int8 activations for int4 / int8 weights (chapter 10): integer dot products, as llama.cpp's Q4_0 and
Q8_0 run on a CPU.

Shapes: M rows of x (a decode step's one, a verify's few, a prompt's many), n outputs, k inputs (a
weight is [n, k]), G the weight's group size (a multiple of BLOCK), BLOCK = 32 activations a scale.

A product of quantized weights with fp32 activations widens every code to fp32 before it multiplies
(weight_quant.py). Quantize the activations too, and a CPU multiplies the codes as integers: x86's
`vpdpbusd` (AVX512-VNNI, AVX-VNNI) multiplies 4 unsigned bytes by 4 signed bytes into an int32 in each
lane, 64 multiply-adds an AVX-512 instruction, 4x an fp32 FMA's 16. One side must be unsigned: int4
codes are (0..15); int8 codes give their sign to the activations (|q| times sign(q) x, llama.cpp's way).

    qx[r, j] = round(x[r, j] * (127 / a[r, b]))    a[r, b] = max |x[r, j]| over block b (32 activations)
    dx[r, b] = a[r, b] / 127                        the block's scale (0 for a block of zeros: codes 0)
    (+ residual codes rx[r, j], scale rdx[r, b] of the marked blocks: the same sums, rdx and rx for dx and qx)
    int8 (w = s q):      y[r, i] = sum_b s[i, g(b)] dx[r, b] isum[r, i, b]
    int4 (w = s q + m):  y[r, i] = sum_b s[i, g(b)] dx[r, b] isum[r, i, b] + sum_g m[i, g] xsum[r, g]
    isum[r, i, b] = sum_{j in b} q[i, j] qx[r, j]   exact (|q qx| <= 127 * 127, 32 of them fit 2^24)
    xsum[r, g] = sum_{b in g} dx[r, b] sum_{j in b} qx[r, j]    the quantized x's sums, for int4's minimums

- One scale per block of 32 activations (llama.cpp's Q8_0 / Q8_1), not per row: a row of the residual
  stream has a few channels far larger than the rest, and one scale per row would round the others to a
  handful of levels (numerics/w8a8.py keeps those channels in fp32 instead). A row's codes come from that
  row alone, so rows of a batch never influence each other.
- A block with an outlier is quantized twice. A block whose largest |x| is more than RESIDUAL_RATIO (2)
  times its second largest spends its 255 levels on that one value: the other 31 round to a few levels
  (SmolLM2's residual stream has a few channels hundreds of times larger than the rest, which RMSNorm
  keeps). Its residual x - dx qx is quantized as a block of its own (codes rx, scale rdx), and the
  product adds s rdx sum(q rx): one more integer dot product for such a block, about 16-bit activations
  there. At most RESIDUAL_BLOCKS (8) blocks a row, those of the largest ratio (ties: the lower block), so
  a row's work is bounded; a row's blocks come from that row alone. Measured on SmolLM2 (int4, the Xeon,
  family 6 model 167, 3 slices of 512 tokens, teacher-forced): top-1 agreement with fp32 activations
  96.5% without it, 98.1-98.8% with it, 4.3 blocks a row marked on average (a fake-quantized run).
- int4's minimums meet the sums of the *quantized* x (llama.cpp's Q4_1 x Q8_1 keeps them beside the
  codes), not of x: then each weight w = s q + m meets the same x, and a rounding error e of x costs
  w e. With the exact sums it would cost s q e = (w - m) e, and since m is about a group's lowest
  weight, w - m is up to the group's whole range, about twice |w|: on SmolLM2, 512 tokens, top-1
  agreement with fp32 activations fell from 97% to 92% (measured on the Xeon, family 6 model 167).
- The codes round half to even (torch.round; C's nearbyintf), from the same fp32 product, so the C
  kernels' codes are these bit for bit; only the order of the fp32 sums of the scaled blocks differs
  (~1e-6 relative: tests/test_int8_act_rows.py, tests/test_int8_act_gemm.py).
- What it costs: each product's result is no longer the fp32 dot product. tests/test_int8_activations.py bounds
  SmolLM2's perplexity within +1% of the fp32-activation int4 path and its greedy top-1 agreement at 97%
  or more. fp32 weights never take this path: their decode stays exact.

`quantize_activations` and `reference_linear` are the scheme in plain torch; the C kernels are
csrc/rows_s8.c (one row: a decode step) and csrc/gemm_q_s8.c (a prompt), called by kernels/cpu.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .weight_quant import QuantizedWeight, unpack4

BLOCK = 32  # activations sharing one scale
# A block whose largest |x| is more than RESIDUAL_RATIO times its second largest is quantized twice: its
# codes, then what they miss (x - dx qx) as codes of their own; at most RESIDUAL_BLOCKS blocks a row, those
# of the largest ratio (ties: the lower block)
RESIDUAL_RATIO = 2.0
RESIDUAL_BLOCKS = 8


def _quantize(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """blocks [..., BLOCK] fp32 -> (codes int8 [..., BLOCK], scales fp32 [...])."""
    amax = blocks.abs().amax(-1, keepdim=True)
    # fp32 division, as C's 127.0f / amax: a Python number over a tensor (`127.0 / amax`) is torch's
    # reciprocal times 127, two roundings, which moved a code of x * inv = 77.49999 by one
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8)
    return codes, (amax / 127.0).squeeze(-1)


def residual_blocks(x: Tensor) -> Tensor:
    """x [..., k] -> bool [..., k / BLOCK]: the blocks quantized twice (RESIDUAL_RATIO, RESIDUAL_BLOCKS)."""
    top2 = x.float().unflatten(-1, (-1, BLOCK)).abs().topk(2, dim=-1).values
    amax, second = top2[..., 0], top2[..., 1]
    wanted = (second > 0) & (amax > RESIDUAL_RATIO * second)
    ratio = torch.where(wanted, amax / torch.where(wanted, second, torch.ones_like(second)), torch.zeros_like(amax))
    order = torch.sort(-ratio, dim=-1, stable=True).indices[..., :RESIDUAL_BLOCKS]  # the largest ratios first
    kept = torch.zeros_like(wanted).scatter_(-1, order, True)
    return wanted & kept


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [..., k] fp32 (k a multiple of BLOCK) -> (codes int8 [..., k], scales fp32 [..., k / BLOCK], residual
    codes int8 [..., k], residual scales fp32 [..., k / BLOCK]): the residual's codes and scales are 0 outside
    the blocks residual_blocks() marks."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    codes, dx = _quantize(blocks)
    # what the codes miss, x - qx dx rounded once (as C's fmaf): exact in fp64, then rounded to fp32
    rest = (blocks.double() - codes.double() * dx.double()[..., None]).float()
    rcodes, rdx = _quantize(rest)
    marked = residual_blocks(x)
    rcodes = torch.where(marked[..., None], rcodes, torch.zeros_like(rcodes))
    return codes.flatten(-2), dx, rcodes.flatten(-2), torch.where(marked, rdx, torch.zeros_like(rdx))


def reference_linear(x: Tensor, w: QuantizedWeight) -> Tensor:
    """x [..., k] @ w.T with x quantized per block of 32 -> [..., n] fp32: the scheme above, sums in fp64
    (every integer sum is exact, the scaled ones close to any fp32 order)."""
    n, k = w.shape
    G = w.group_size
    x2 = x.reshape(-1, k).float()
    qx, dx, rx, rdx = quantize_activations(x2)  # [M, k], [M, k / 32] twice
    q = (unpack4(w.codes) if w.bits == 4 else w.codes).double().unflatten(-1, (-1, BLOCK))  # [n, k / 32, 32]
    scale = w.scales.double().repeat_interleave(G // BLOCK, dim=1)  # [n, k / 32]: each block its group's scale
    y = torch.zeros(x2.shape[0], n, dtype=torch.float64)
    xsum = torch.zeros(x2.shape[0], k // BLOCK, dtype=torch.float64)  # the quantized x's sums a block
    for codes, d in ((qx, dx), (rx, rdx)):
        blocks = codes.double().unflatten(-1, (-1, BLOCK))
        isum = torch.einsum("mbj,nbj->mnb", blocks, q)
        y += (isum * scale[None] * d.double()[:, None, :]).sum(-1)
        xsum += d.double() * blocks.sum(-1)
    if w.mins is not None:  # int4's minimums meet the quantized x's sums over each group [M, k / G]
        y += xsum.unflatten(-1, (-1, G // BLOCK)).sum(-1) @ w.mins.double().T
    return y.float().view(*x.shape[:-1], n)
