"""int8 activations for int4 / int8 weights (chapter 14): integer dot products, as llama.cpp's Q4_0 and
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
    int8 (w = s q):      y[r, i] = sum_b s[i, g(b)] dx[r, b] isum[r, i, b]
    int4 (w = s q + m):  y[r, i] = sum_b s[i, g(b)] dx[r, b] isum[r, i, b] + sum_g m[i, g] xsum[r, g]
    isum[r, i, b] = sum_{j in b} q[i, j] qx[r, j]   exact (|q qx| <= 127 * 127, 32 of them fit 2^24)
    xsum[r, g] = sum_{j in g} x[r, j]               int4's minimums meet the fp32 activations, not their codes

- One scale per block of 32 activations (llama.cpp's Q8_0 / Q8_1), not per row: a row of the residual
  stream has a few channels far larger than the rest, and one scale per row would round the others to a
  handful of levels (numerics/w8a8.py keeps those channels in fp32 instead). A row's codes come from that
  row alone, so rows of a batch never influence each other.
- int4's minimums are multiplied by the exact sums of x over each group, so they add no error of their
  own (llama.cpp's Q4_1 x Q8_1 uses the sums of the codes).
- The codes round half to even (torch.round; C's nearbyintf), from the same fp32 product, so the C
  kernels' codes are these bit for bit; only the order of the fp32 sums of the scaled blocks differs
  (~1e-6 relative, tests/test_int8_act.py).
- What it costs: each product's result is no longer the fp32 dot product. tests/test_int8_act.py bounds
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


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., k] fp32 (k a multiple of BLOCK) -> (codes int8 [..., k], scales fp32 [..., k / BLOCK])."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    # fp32 division, as C's 127.0f / amax: a Python number over a tensor (`127.0 / amax`) is torch's
    # reciprocal times 127, two roundings, which moved a code of x * inv = 77.49999 by one
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8)
    return codes.flatten(-2), (amax / 127.0).squeeze(-1)


def reference_linear(x: Tensor, w: QuantizedWeight) -> Tensor:
    """x [..., k] @ w.T with x quantized per block of 32 -> [..., n] fp32: the scheme above, sums in fp64
    (every integer sum is exact, the scaled ones close to any fp32 order)."""
    n, k = w.shape
    G = w.group_size
    x2 = x.reshape(-1, k).float()
    qx, dx = quantize_activations(x2)  # [M, k], [M, k / 32]
    q = (unpack4(w.codes) if w.bits == 4 else w.codes).double()  # [n, k]
    isum = torch.einsum("mbj,nbj->mnb", qx.double().unflatten(-1, (-1, BLOCK)), q.unflatten(-1, (-1, BLOCK)))
    scale = w.scales.double().repeat_interleave(G // BLOCK, dim=1)  # [n, k / 32]: each block its group's scale
    y = (isum * scale[None] * dx.double()[:, None, :]).sum(-1)
    if w.mins is not None:
        xsum = x2.double().unflatten(-1, (-1, G)).sum(-1)  # [M, k / G]
        y = y + xsum @ w.mins.double().T
    return y.float().view(*x.shape[:-1], n)
