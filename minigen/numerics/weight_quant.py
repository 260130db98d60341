"""Weight-only quantization (chapter 10): int8 and int4 weights, group-wise along each row.

Shapes: n outputs, k inputs (a weight is [n, k], as nn.Linear keeps it), G group size, k / G
groups per row.

At batch 1 a decode step reads every weight once and does one multiply-add with it, so its time
is the time to read the weights: fewer bytes per weight is the largest speed-up left on a CPU.
Groups of G consecutive weights of a row (along the input, the axis a matrix-vector product sums
over) share their metadata, as GGUF does:

    int8 (Q8_0):  w = scale * q,        q in [-127, 127]   8 + 16/G bits a weight
    int4 (Q4_1):  w = min + scale * q,  q in [0, 15]       4 + 32/G bits a weight (two codes a byte)

Scales and minimums are fp16 (weights are far inside its range; quantize_weights checks). In each
block of 32 int4 weights, byte j holds weight j in its low nibble and weight j + 16 in its high
one (GGUF's order), which the C kernel unpacks with one mask and one shift. A weight stays packed
in memory: a decode step's matrix-vector product (kernels/cpu.py) turns codes into fp32 in registers;
a prompt or a batch turns them into fp32 a panel of rows at a time in each thread's cache, where every
row of the prompt meets them (kernels/cpu.py: quantized_linear); `dequantize()` of the whole matrix is
the reference's way, and a lookup's (the embedding's rows).

Which weights: every linear layer at `bits`; the output head at `head_bits` (8 by default, as the
GGUF this course ships does: the logits are the most sensitive product); a tied head is the
embedding, so the embedding is quantized with it (its lookups dequantize one row each), counted
once; an untied embedding and the norms stay as they are (a step reads one row of the embedding).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from .quant import round_to

BLOCK = 32  # int4 codes are packed in blocks of 32 weights, so a group is a whole number of blocks


class QuantizedWeight(nn.Module):
    """A weight matrix [n, k] kept as group-wise codes; `dequantize()` gives it back in `dtype`."""

    def __init__(self, codes: Tensor, scales: Tensor, mins: Tensor | None, bits: int, group_size: int,
                 shape: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.register_buffer("codes", codes)  # int8 [n, k], or uint8 [n, k / 2] for int4
        self.register_buffer("scales", scales)  # fp16 [n, k / G]
        self.register_buffer("mins", mins)  # fp16 [n, k / G] for int4; None for int8
        self.bits, self.group_size, self.shape, self.dtype = bits, group_size, tuple(shape), dtype

    @property
    def nbytes(self) -> int:
        """Every byte held: codes, scales and minimums."""
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, rows: Tensor | None = None) -> Tensor:
        """The weights [n, k] (or the rows asked for [.., k]) in self.dtype."""
        codes, scales, mins = self.codes, self.scales, self.mins
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            mins = mins[rows] if mins is not None else None
        q = unpack4(codes) if self.bits == 4 else codes  # [.., k]
        G = self.group_size
        q = q.float().unflatten(-1, (-1, G))  # [.., k / G, G]
        w = q * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.flatten(-2).to(self.dtype)

    def __getitem__(self, rows: Tensor) -> Tensor:
        """Rows of the matrix, dequantized: an embedding lookup, weight[tokens] -> [.., k]."""
        return self.dequantize(rows)

    def extra_repr(self) -> str:
        return f"int{self.bits}, shape={self.shape}, group_size={self.group_size}"


# ---------------------------------------------------------------- packing
def pack4(codes: Tensor) -> Tensor:
    """uint8 codes [.., k] in [0, 15] -> bytes [.., k / 2]: in each block of 32, byte j holds code j
    (low nibble) and code j + 16 (high nibble)."""
    c = codes.unflatten(-1, (-1, 2, BLOCK // 2))  # [.., k / 32, 2, 16]
    return (c[..., 0, :] | (c[..., 1, :] << 4)).flatten(-2)


def unpack4(data: Tensor) -> Tensor:
    """Inverse of pack4: bytes [.., k / 2] -> uint8 codes [.., k]."""
    b = data.unflatten(-1, (-1, BLOCK // 2))  # [.., k / 32, 16]
    return torch.stack([b & 0xF, b >> 4], dim=-2).flatten(-3)  # mask the nibbles: & 0xF, >> 4


# ---------------------------------------------------------------- quantizing one matrix
def quantize_matrix(w: Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """w [n, k] -> its group-wise codes. Every weight comes back within half a step of its group."""
    n, k = w.shape
    G = group_size
    g = w.detach().float().unflatten(-1, (k // G, G))  # [n, k / G, G]
    if bits == 8:  # symmetric: the scale covers the largest magnitude; rounded up, so |q| <= 127
        scales = round_to(g.abs().amax(-1) / 127, torch.float16, down=False)  # [n, k / G]
        step = torch.where(scales > 0, scales.float(), 1.0)[..., None]
        codes = (g / step).round_().clamp_(-127, 127).to(torch.int8).flatten(-2)
        return QuantizedWeight(codes, scales, None, 8, G, (n, k), w.dtype)
    lo, hi = g.amin(-1), g.amax(-1)  # asymmetric: the minimum rounded down, the scale up (quant.py)
    mins = round_to(lo, torch.float16, down=True)
    scales = round_to((hi.double() - mins.double()) / 15, torch.float16, down=False)
    step = torch.where(scales > 0, scales.float(), 1.0)[..., None]
    codes = ((g - mins.float()[..., None]) / step).round_().clamp_(0, 15).to(torch.uint8).flatten(-2)
    return QuantizedWeight(pack4(codes), scales, mins, 4, G, (n, k), w.dtype)


# ---------------------------------------------------------------- quantizing a model
def check_weight_bits(bits, key: str = "weight_bits") -> None:
    """8 or 4, as an int: 8.0 == 8 in Python, but a bit count is no float (GenerationConfig's quant_bits agrees)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (8, 4):
        raise ConfigError(f"{key}={bits!r} is invalid: weights are quantized to 8 or 4 bits, so use the integer "
                          "8 or 4 (load(name, weight_bits=8); quantize_weights(model, bits=4))")


def _check(bits, group_size, key: str = "bits") -> None:
    check_weight_bits(bits, key)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < BLOCK or group_size % BLOCK:
        raise ConfigError(f"group_size={group_size!r} is invalid: use a multiple of {BLOCK} (32, as GGUF's "
                          f"Q8_0 and Q4_1; 64 or 128 trade quality for bytes)")


def quantized(model) -> bool:
    """True when quantize_weights has been applied to `model`."""
    return any(isinstance(m, QuantizedWeight) for m in model.modules())


def linear_weights(model) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every linear layer's weight, the output head excluded."""
    names = ("wqkv", "wo", "w_gate_up", "w_down", "w_fc", "w_proj")
    return [(m, name) for block in model.blocks for m in block.modules() for name in names
            if isinstance(getattr(m, name, None), (nn.Parameter, QuantizedWeight))]


def quantize_weights(model, bits: int = 4, group_size: int = 32, head_bits: int = 8):
    """Quantize `model`'s weights in place (see the module docstring for which) -> the model."""
    _check(bits, group_size)
    _check(head_bits, group_size, "head_bits")
    if quantized(model):
        raise ConfigError("the model's weights are already quantized: quantize a model loaded in "
                          "float (minigen.load(name) or load(name, weight_bits=...) once)")
    targets = [(m, name, bits) for m, name in linear_weights(model)]
    targets.append((model, "lm_head" if model.lm_head is not None else "embed", head_bits))
    for m, name, b in targets:  # check every shape before changing any
        w = getattr(m, name)
        if w.shape[1] % group_size:
            raise ConfigError(f"group_size={group_size} does not divide the input width {w.shape[1]} of "
                              f"{name}: use group_size=32 (a divisor of every width of this model)")
        if not torch.isfinite(w).all() or w.abs().max() > 60000:
            raise ConfigError(f"{name} holds weights beyond fp16's range: its scales would overflow; "
                              "keep this model in float")
    for m, name, b in targets:
        q = quantize_matrix(getattr(m, name), b, group_size)
        delattr(m, name)
        setattr(m, name, q)
    return model


def weight_bytes(model) -> int:
    """Bytes of every weight, each tensor once (a tied head is the embedding), packed or not."""
    seen, total = set(), 0
    for t in [*model.parameters(), *(q for q in model.modules() if isinstance(q, QuantizedWeight))]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes
    return total
