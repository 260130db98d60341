"""Group-wise 8/4/2-bit quantization: codes, scales and zeros, packing (chapter 6; the caches that
store them are caches/quantized.py, the weights numerics/weight_quant.py).

Shapes: L layers, B batch, Hkv key/value heads, S token slots, T new tokens, Dh head dim,
G group size (`group_size`), n codes per byte (8 // bits).

A group of G consecutive elements along one axis shares a scale and a zero (asymmetric min-max):

    code = round((x - zero) / scale)  in [0, 2^bits - 1],      x_hat = zero + code * scale

so every element comes back within scale / 2. 4- and 2-bit codes are packed two or four to a
byte. Scales and zeros take 2 bytes each, in a dtype that holds every value they describe: fp16
for an fp16 model (no fp16 value lies beyond it), bf16 for an fp32 or bf16 model (bf16 has fp32's
exponent, so a key past fp16's 65,504 cannot turn its scale into inf and the key into NaN; its
8-bit mantissa costs what meta_dtype's comment measures). Per element that costs bits + 2 x 16 / G
bits: 5 bits for 4-bit codes in groups of 32, which is why the quantized store is at best
16 / 5 = 3.2x (not 4x) smaller than fp16.

Which axis a group runs along matters (KIVI, Liu et al. 2024): keys have outlier *channels* (a few
of the Dh dimensions are large for every token), so keys are grouped per channel over G tokens
(axis -2 of [.., S, Dh]) and each outlier channel gets its own scale; values have no such
structure and are grouped per token over G channels (axis -1). A per-channel group can only be
quantized once its G tokens exist, so the newest tokens wait in a small full-precision window and
leave it one whole group at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError


# The axis of a [.., S, Dh] key/value tensor along which a group of G elements runs.
GROUP_AXIS = {"channel": -2, "token": -1}  # per channel: G tokens of one channel; per token: G channels
VALUE_AXIS = GROUP_AXIS["token"]  # KIVI: values per token


@dataclass
class QuantizedTensor:
    data: Tensor  # uint8, the input's shape with `axis` divided by 8 // bits: the packed codes
    scales: Tensor  # meta_dtype(dtype), the input's shape with `axis` divided by group_size: each group's step
    zeros: Tensor  # like scales: the value of code 0 (the group's minimum, rounded down)
    bits: int  # 8, 4 or 2
    group_size: int  # G, elements along `axis` that share one scale and zero
    axis: int  # the dimension (negative) along which groups run and codes are packed
    dtype: torch.dtype  # the dtype `dequantize` returns

    @property
    def nbytes(self) -> int:
        """Every byte held: codes, scales and zeros."""
        return self.data.nbytes + self.scales.nbytes + self.zeros.nbytes


# ---------------------------------------------------------------- packing
def pack(codes: Tensor, bits: int, axis: int = -1) -> Tensor:
    """uint8 codes < 2**bits -> bytes holding n = 8 // bits consecutive codes along `axis`
    (the first code in the lowest bits). The size of `axis` must be a multiple of n."""
    n = 8 // bits
    if n == 1:
        return codes
    ax = axis % codes.dim()
    c = codes.unflatten(ax, (-1, n))  # [.., N/n, n, ..]
    packed = c.select(ax + 1, 0).clone()
    for i in range(1, n):
        packed |= c.select(ax + 1, i) << (i * bits)
    return packed


def unpack(data: Tensor, bits: int, axis: int = -1) -> Tensor:
    """Inverse of `pack`: bytes -> uint8 codes, `axis` n = 8 // bits times longer."""
    n = 8 // bits
    if n == 1:
        return data
    ax = axis % data.dim()
    codes = [(data >> shift) & (2**bits - 1) for shift in range(0, 8, bits)]  # & 0xF for 4 bits
    return torch.stack(codes, dim=ax + 1).flatten(ax, ax + 1)  # [.., N/n, n, ..] -> [.., N, ..]


# ---------------------------------------------------------------- quantize / dequantize
def meta_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 2-byte dtype of scales and zeros for values of `dtype`: one that holds every such value."""
    # fp16 has 3 more mantissa bits than bf16 but ends at 65,504, and an fp32 key may lie beyond it
    # (the scale becomes inf, the key NaN). fp32 holds everything but costs 2 bits per element
    # instead of 1 (a 4-bit store 2.67x smaller than fp16 instead of 3.2x). What bf16's coarser zero
    # costs is within the noise: SmolLM2, fed one token at a time, groups of 32, perplexity change
    # against the fp32 cache with fp32 / bf16 / fp16 scales: 4-bit keys per channel +0.56% / +0.48% /
    # +0.45% (1,024 tokens); 8-bit +0.02% / -0.03% / +0.01%, 4-bit keys per token +0.25% / +0.45% / +0.53%
    # (256 tokens: the finer fp16 did no better). Chapter 06 measures the round trip with each.
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def round_to(x: Tensor, dtype: torch.dtype, down: bool) -> Tensor:
    """The closest value of `dtype` <= x (down) or >= x (up); a plain cast rounds to nearest, either way."""
    h = x.to(dtype)
    if dtype == x.dtype:
        return h
    wrong = h.to(x.dtype) > x if down else h.to(x.dtype) < x
    return torch.where(wrong, torch.nextafter(h, torch.full_like(h, -math.inf if down else math.inf)), h)


def quantize(x: Tensor, bits: int, group_size: int, axis: int = -1,
             scale_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Asymmetric min-max quantization of x in groups of `group_size` elements along `axis`.

    Every element of dequantize(quantize(x)) is within scales / 2 of x. Scales and zeros are
    stored in `scale_dtype` (default: meta_dtype(x.dtype), 2 bytes that hold every finite x).
    """
    if bits not in (8, 4, 2):
        raise ConfigError(f"bits={bits!r} is invalid: use 8, 4 or 2")
    ax = axis % x.dim()
    N, G, n = x.shape[ax], group_size, 8 // bits
    if G < 1 or N % G or G % n:
        raise ConfigError(f"group_size={G} must divide the {N} elements along axis {axis} and be a "
                          f"multiple of {n} (the codes per byte at {bits} bits)")
    scale_dtype = scale_dtype or meta_dtype(x.dtype)
    g = x.float().unflatten(ax, (N // G, G))  # [.., N/G, G, ..]: a group runs along dim ax + 1
    lo, hi = g.amin(ax + 1), g.amax(ax + 1)  # [.., N/G, ..]
    # The zero is rounded down and the scale up, so that the grid zero + [0, 2^bits-1] * scale
    # still covers [lo, hi] after rounding: this is what keeps every error within scale / 2. The
    # range is taken in fp64, where hi - lo cannot overflow.
    zeros = round_to(lo, scale_dtype, down=True)
    scales = round_to((hi.double() - zeros.double()) / (2**bits - 1), scale_dtype, down=False)
    step = torch.where(scales > 0, scales.float(), 1.0)  # a constant group has scale 0: every code 0
    codes = ((g - zeros.float().unsqueeze(ax + 1)) / step.unsqueeze(ax + 1)).round_()
    codes = codes.clamp_(0, 2**bits - 1).to(torch.uint8).flatten(ax, ax + 1)  # x's shape
    return QuantizedTensor(pack(codes, bits, ax), scales, zeros, bits, G, ax - x.dim(), x.dtype)


def dequantize(q: QuantizedTensor) -> Tensor:
    """zeros + codes * scales, in q.dtype, with the shape that was quantized."""
    ax = q.axis % q.data.dim()
    codes = unpack(q.data, q.bits, ax).unflatten(ax, (-1, q.group_size))  # [.., N/G, G, ..]
    x = torch.addcmul(q.zeros.float().unsqueeze(ax + 1), codes.float(), q.scales.float().unsqueeze(ax + 1))
    return x.flatten(ax, ax + 1).to(q.dtype)


def round_trip(x: Tensor, bits: int, group_size: int, axis: int = -1) -> Tensor:
    """dequantize(quantize(x)): what a reader of the quantized cache sees instead of x."""
    return dequantize(quantize(x, bits, group_size, axis))
