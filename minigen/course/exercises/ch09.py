"""Chapter 9 exercise: rounding fp32 to bfloat16 by hand, bit by bit.

1. `round_to_bf16(x)`: x is an fp32 tensor; return the 16 bits of x rounded to bf16, as an int16
   tensor (what x.to(torch.bfloat16).view(torch.int16) holds), computed with integer operations on
   x's bits (x.view(torch.int32)). bf16 is the top half of fp32: the same sign bit, the same 8
   exponent bits, and the first 7 of the 23 mantissa bits. Drop the low 16 bits, rounding to the
   nearest bf16 number; when the dropped bits are exactly half (0x8000), round to the neighbour
   whose last kept bit is 0 (round half to even, IEEE 754's default). Infinities stay infinities, a
   finite number past bf16's largest rounds to infinity, and NaN stays NaN (any NaN: exponent bits
   all ones, some mantissa bit set).

   The checker runs your function where torch refuses to do the rounding for you: no bfloat16 tensor
   or dtype (`.to(torch.bfloat16)`, `.bfloat16()`), no conversion between floating-point formats
   (`.half()`, `.double()`), no floating-point arithmetic on a float tensor (`x * 65537.0`,
   `torch.round`), no values read out of torch (`.tolist()`, `.numpy()`), and not this module's
   `round_mantissa`. Comparisons (`x.isnan()`) and integer operations are what is left.

The chapter also uses `round_mantissa(x, bits)` (the same trick for any number of mantissa bits,
e.g. 10 for TF32, which torch has no dtype for) and `bit_fields(value, dtype)` to print a number's
sign, exponent and mantissa.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from . import ExerciseFailed, forbidding

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
    """Keep the top 16 bits of each fp32 number, rounded to nearest, ties to even -> int16 bits."""
    bits = _as_unsigned(x)  # [..] int64 holding the 32 bits
    lsb = (bits >> 16) & 1  # last kept bit
    top = (bits + 0x7FFF + lsb) >> 16  # adding 0x7FFF + lsb carries into bit 16 exactly when rounding up
    # A NaN's bias could carry into the exponent (an infinity) or the sign: keep its top bits, and
    # set the first mantissa bit so that a NaN whose set bits were all dropped stays a NaN.
    nan = (bits & 0x7FFFFFFF) > 0x7F800000  # exponent all ones and a mantissa bit set
    top = torch.where(nan, (bits >> 16) | 0x0040, top)
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16)  # the same 16 bits, signed


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
        # NaNs whose low bits would carry into the sign (0x7FFFFFFF + 0x8000 is 0x80007FFF, -0.0 in
        # bf16), and one whose only set mantissa bits are dropped (0x7F80FFFF: truncated, an infinity)
        ("NaNs with every mantissa bit set, or only low ones", torch.tensor(
            [0x7FFFFFFF, -1, 0x7F80FFFF, 0x7F808000], dtype=torch.int64).to(torch.int32)
         .view(torch.float32)),
    ]


def _is_nan16(b: Tensor) -> Tensor:
    """Which bf16 bit patterns (int64 holding 16 bits) are NaN: exponent all ones, mantissa not 0."""
    return ((b & 0x7F80) == 0x7F80) & ((b & 0x7F) != 0)


def _hint(x: Tensor, got16: Tensor) -> str:
    bits = _as_unsigned(x)
    nan = x.isnan()
    if nan.any() and not _is_nan16(got16[nan]).all():
        return ("NaN must stay NaN: adding the rounding bias to a NaN's bits can carry into the exponent "
                "(an infinity) or the sign, and dropping its low bits can leave no mantissa bit set; "
                "handle NaN apart, e.g. with torch.where(x.isnan(), ...)")
    if torch.equal(got16, bits >> 16):
        return "that truncates (rounds toward zero): add half of the dropped part before shifting"
    if torch.equal(got16, ((bits + 0x8000) >> 16) & 0xFFFF):
        return ("that rounds ties away from zero: when the dropped bits are exactly 0x8000, round to the "
                "even neighbour (add 0x7FFF plus the last kept bit, (bits >> 16) & 1)")
    if ((got16 >> 15) != (bits >> 31)).any():
        return ("a sign bit is wrong: view the bits as int32, then work on them as unsigned numbers "
                "(e.g. .to(torch.int64) & 0xFFFFFFFF), so that shifting a negative number does not fill with ones")
    return ""


# What torch would round for you: the refusals of `_IntegerOnly`.
_FLOAT_ARITHMETIC = {"add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "truediv", "floordiv",
                     "mod", "fmod", "remainder", "round", "floor", "ceil", "trunc", "fix", "frac", "nextafter",
                     "ldexp", "frexp", "addcmul", "addcdiv", "lerp", "copysign", "pow", "exp2", "log2", "sqrt"}
_READ_OUT = {"tolist", "numpy", "item", "__array__"}


def _op_name(func) -> str:
    """torch.Tensor.__iadd__ -> 'add', torch.Tensor.mul_ -> 'mul', torch.round -> 'round'."""
    name = getattr(func, "__name__", "").strip("_")
    if getattr(func, "__name__", "").startswith("__") and name[:1] in "ir" and name[1:] in _FLOAT_ARITHMETIC:
        name = name[1:]  # __radd__, __iadd__, __rtruediv__ ...
    return name


class _IntegerOnly(TorchFunctionMode):
    """Raises ExerciseFailed on the ways to let torch do the rounding: a bfloat16 tensor or dtype, a
    conversion between floating-point formats, floating-point arithmetic, values read out of torch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        inputs = [a for a in tree_flatten((args, kwargs))[0]]
        if name in _READ_OUT:
            raise ExerciseFailed(f"round_to_bf16: your function calls .{name}(), which reads the values out of "
                                 "torch. Hint: work on the tensor of bits, x.view(torch.int32)")
        floats = [a for a in inputs if isinstance(a, Tensor) and a.is_floating_point()]
        if floats and name.rstrip("_") in _FLOAT_ARITHMETIC:
            raise ExerciseFailed(f"round_to_bf16: your function does floating-point arithmetic ({name} on a "
                                 f"{floats[0].dtype} tensor), which rounds in hardware. Hint: the exercise is "
                                 "integer operations on the bits: x.view(torch.int32), shifts, masks, additions")
        out = func(*args, **kwargs)
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, Tensor)]
        if any(a is torch.bfloat16 or (isinstance(a, Tensor) and a.dtype == torch.bfloat16)
               for a in inputs + outputs):
            raise ExerciseFailed(f"round_to_bf16: your function makes or uses a torch.bfloat16 tensor ({name}), "
                                 "so torch does the rounding. Hint: return the 16 bits as int16, computed from "
                                 "x.view(torch.int32) with shifts, masks and additions")
        widths = {a.dtype for a in floats}
        if any(o.is_floating_point() and widths and o.dtype not in widths for o in outputs):
            raise ExerciseFailed(f"round_to_bf16: your function converts between floating-point formats ({name} "
                                 "to another float dtype), so torch does the rounding. Hint: work on the bits, "
                                 "x.view(torch.int32)")
        return out


def check_round_to_bf16(fn) -> bool:
    """fn(x fp32) -> int16 tensor: the bits of x.to(torch.bfloat16) (any NaN for a NaN), computed with
    integer operations only (run under _IntegerOnly, with round_mantissa and the worked solution forbidden)."""
    cases = [(label, x, x.to(torch.bfloat16).view(torch.int16)) for label, x in _cases()]  # expected first
    # minigen's own roundings raise when your function calls them (the worked solution, checked as
    # itself, is the one exception: it is the answer, not a call of it)
    forbidden = [round_mantissa] + ([solution_round_to_bf16] if fn is not solution_round_to_bf16 else [])
    for label, x, want in cases:
        with forbidding(*forbidden), _IntegerOnly():
            got = fn(x.clone())
        if not isinstance(got, Tensor) or got.dtype != torch.int16 or got.shape != x.shape:
            raise ExerciseFailed(f"round_to_bf16: for {label} expected a torch.int16 tensor of shape "
                                 f"{tuple(x.shape)} (the bf16 bits), got " +
                                 (f"{got.dtype} {tuple(got.shape)}" if isinstance(got, Tensor) else type(got).__name__))
        got16, want16 = got.to(torch.int64) & 0xFFFF, want.to(torch.int64) & 0xFFFF
        same = (got16 == want16) | (_is_nan16(got16) & _is_nan16(want16))
        if not same.all():
            i = int((~same).nonzero()[0])
            hint = _hint(x, got16)
            raise ExerciseFailed(
                f"round_to_bf16: for {label}, x = {x[i].item()!r} (bits {int(_as_unsigned(x)[i]):#010x}) should "
                f"give bits {int(want16[i]):#06x} ({want.view(torch.bfloat16)[i].item()!r}), got {int(got16[i]):#06x} "
                f"({got.view(torch.bfloat16)[i].item()!r}); {int((~same).sum())} of {x.numel()} values differ"
                + (f". Hint: {hint}" if hint else ""))
    print(f"✓ round_to_bf16: all {len(cases)} cases agree with torch's .to(torch.bfloat16), bit for bit, "
          "from integer operations only")
    return True
