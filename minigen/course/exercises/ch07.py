"""Chapter 7 exercise: rounding fp32 to bfloat16 by hand, bit by bit.

1. `round_to_bf16(x)`: x is an fp32 tensor; return a torch.bfloat16 tensor equal, bit for bit, to
   x.to(torch.bfloat16), computed with integer operations on x's bits (x.view(torch.int32)).
   bf16 is the top half of fp32: the same sign bit, the same 8 exponent bits, and the first 7 of
   the 23 mantissa bits. Drop the low 16 bits, rounding to the nearest bf16 number; when the
   dropped bits are exactly half (0x8000), round to the neighbour whose last kept bit is 0
   (round half to even, IEEE 754's default). NaN stays NaN.

The chapter also uses `round_mantissa(x, bits)` (the same trick for any number of mantissa bits,
e.g. 10 for TF32, which torch has no dtype for) and `bit_fields(value, dtype)` to print a number's
sign, exponent and mantissa.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ExerciseFailed

# name: (exponent bits, mantissa bits, torch dtype; None where torch has no storage dtype)
FORMATS = {
    "fp32": (8, 23, torch.float32),
    "tf32": (8, 10, None),  # a GPU matmul input format (Ampere and newer): fp32's range, fp16's mantissa
    "bf16": (8, 7, torch.bfloat16),
    "fp16": (5, 10, torch.float16),
    "fp8 e4m3": (4, 3, torch.float8_e4m3fn),
    "fp8 e5m2": (5, 2, torch.float8_e5m2),
}
_INT = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def bit_fields(value: float, dtype: torch.dtype) -> str:
    """The bits of `value` stored in `dtype`, as 'sign | exponent | mantissa', e.g. for 1.0 in bf16:
    '0 | 01111111 | 0000000'."""
    info = torch.finfo(dtype)
    mantissa = -int(torch.tensor(info.eps).log2())  # eps = 2^-mantissa bits
    exponent = info.bits - 1 - mantissa
    raw = int(torch.tensor([value]).to(dtype).view(_INT[info.bits]).item()) % 2**info.bits
    text = format(raw, f"0{info.bits}b")
    return f"{text[0]} | {text[1:1 + exponent]} | {text[1 + exponent:]}"


def _as_unsigned(x: Tensor) -> Tensor:
    """The 32 bits of fp32 x as non-negative int64 numbers (no sign-extension surprises)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def round_mantissa(x: Tensor, mantissa_bits: int) -> Tensor:
    """fp32 x rounded to `mantissa_bits` of fp32's 23 mantissa bits, round half to even, returned
    as fp32 (the range stays fp32's): 10 bits is TF32, 7 is bf16. NaN and infinities pass through;
    a value past the largest finite one rounds to infinity, as IEEE 754 says."""
    drop = 23 - mantissa_bits
    if drop == 0:
        return x.clone()
    bits = _as_unsigned(x)
    lsb = (bits >> drop) & 1  # the last kept bit: a tie rounds toward making it 0
    rounded = ((bits + (1 << (drop - 1)) - 1 + lsb) >> drop) << drop
    signed = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32)
    return torch.where(x.isnan(), x, signed.view(torch.float32))


# ---------------------------------------------------------------- 1. fp32 -> bf16 by hand
def solution_round_to_bf16(x: Tensor) -> Tensor:
    """Keep the top 16 bits of each fp32 number, rounded to nearest, ties to even."""
    bits = _as_unsigned(x)  # [..] int64 holding the 32 bits
    lsb = (bits >> 16) & 1  # last kept bit
    top = (bits + 0x7FFF + lsb) >> 16  # adding 0x7FFF + lsb carries into bit 16 exactly when rounding up
    as_int16 = torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16)  # same 16 bits, signed
    out = as_int16.view(torch.bfloat16)
    return torch.where(x.isnan(), torch.full_like(out, float("nan")), out)  # a carry would turn NaN to inf


def _cases() -> list[tuple[str, Tensor]]:
    g = torch.Generator().manual_seed(7)
    top = torch.randint(0, 2**16, (512,), generator=g, dtype=torch.int64)  # random bf16 patterns

    def from_bits(top16: Tensor, low16: int) -> Tensor:
        bits = (top16 << 16) | low16
        finite = ((top16 >> 7) & 0xFF) != 0xFF  # skip the inf/NaN exponent: cases below test those
        bits = bits[finite]
        return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)

    return [
        ("standard normal numbers", torch.randn(1000, generator=g)),
        ("magnitudes from 1e-30 to 1e30, both signs",
         torch.randn(1000, generator=g) * 10.0 ** (torch.rand(1000, generator=g) * 60 - 30)),
        ("exact ties: the dropped 16 bits are 0x8000 (round half to even)", from_bits(top, 0x8000)),
        ("just above a tie: dropped bits 0x8001", from_bits(top, 0x8001)),
        ("just below a tie: dropped bits 0x7FFF", from_bits(top, 0x7FFF)),
        ("the largest fp32 numbers (round up to infinity) and the largest bf16", torch.tensor(
            [3.4028235e38, -3.4028235e38, 3.3895314e38, 3.39e38])),
        ("subnormals (below 1.2e-38)", torch.tensor([1e-40, -3e-39, 1.4e-45, 9.2e-41])),
        ("zeros, infinities and NaN", torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])),
        # NaNs whose low bits would carry into the sign: 0x7FFFFFFF + 0x8000 is 0x80007FFF (-0.0 in bf16)
        ("NaNs with every mantissa bit set", torch.tensor([0x7FFFFFFF, -1, 0x7F80FFFF], dtype=torch.int32)
         .view(torch.float32)),
    ]


def _hint(x: Tensor, got: Tensor) -> str:
    bits = _as_unsigned(x)
    got16 = got.view(torch.int16).to(torch.int64) & 0xFFFF
    if x.isnan().any() and not got[x.isnan()].isnan().all():
        return ("NaN must stay NaN: adding the rounding bias to a NaN's bits can carry into the exponent "
                "(an infinity) or the sign; handle NaN apart, e.g. with torch.where(x.isnan(), ...)")
    if torch.equal(got16, bits >> 16):
        return "that truncates (rounds toward zero): add half of the dropped part before shifting"
    if torch.equal(got16, ((bits + 0x8000) >> 16) & 0xFFFF):
        return ("that rounds ties away from zero: when the dropped bits are exactly 0x8000, round to the "
                "even neighbour (add 0x7FFF plus the last kept bit, (bits >> 16) & 1)")
    if ((got16 >> 15) != (bits >> 31)).any():
        return ("a sign bit is wrong: view the bits as int32, then work on them as unsigned numbers "
                "(e.g. .to(torch.int64) & 0xFFFFFFFF), so that shifting a negative number does not fill with ones")
    return ""


def check_round_to_bf16(fn) -> bool:
    """fn(x fp32) -> bf16 tensor, bit for bit x.to(torch.bfloat16) (any NaN for a NaN)."""
    cases = _cases()
    for label, x in cases:
        got = fn(x.clone())
        if not isinstance(got, Tensor) or got.dtype != torch.bfloat16 or got.shape != x.shape:
            raise ExerciseFailed(f"round_to_bf16: for {label} expected a torch.bfloat16 tensor of shape "
                                 f"{tuple(x.shape)}, got " + (f"{got.dtype} {tuple(got.shape)}" if isinstance(got, Tensor)
                                                               else type(got).__name__))
        want = x.to(torch.bfloat16)
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        if not same.all():
            i = int((~same).nonzero()[0])
            hint = _hint(x, got)
            raise ExerciseFailed(
                f"round_to_bf16: for {label}, x = {x[i].item()!r} (bits {int(_as_unsigned(x)[i]):#010x}) should "
                f"give {want[i].item()!r} (bits {int(want.view(torch.int16)[i]) & 0xFFFF:#06x}), got "
                f"{got[i].item()!r} (bits {int(got.view(torch.int16)[i]) & 0xFFFF:#06x}); {int((~same).sum())} of "
                f"{x.numel()} values differ" + (f". Hint: {hint}" if hint else ""))
    print(f"✓ round_to_bf16: all {len(cases)} cases agree with torch's .to(torch.bfloat16), bit for bit")
    return True
