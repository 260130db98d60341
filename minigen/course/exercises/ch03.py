"""Chapter 3 exercise: a prompt's activations as int8 codes, one scale a row (W8A8's x side).

`quantize_rows(x, keep) -> (codes, scales)`: x [T, k] fp32, the rows of a prompt about to meet an int8
weight; keep [k] fp32 (1 in the channels that become int8 codes, 0 in the weight's outlier columns,
which a second fp32 product handles) or None (every channel). Multiply each row by keep, then give
it its own scale a = max |x| / 127 over the row, and codes round(x / a) in [-127, 127], int8. A row
of zeros gets scale 1 and codes 0 (no division by zero). Return codes [T, k] torch.int8 and scales
[T, 1] fp32: what `numerics/w8a8.py`'s `quantize_rows` returns, which the prompt's int8 products use.

The checker compares your codes (exactly) and scales with w8a8.quantize_rows on cases with an outlier
channel, a row of zeros and rows of very different sizes, names the usual mistakes (one scale for the
whole prompt, the outlier columns left in, truncating instead of rounding, the scale not divided by
127), and fails an answer that calls w8a8.quantize_rows or the worked solution, by any name
(`forbidding` swaps their code while your function runs).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...numerics import w8a8
from ...numerics.w8a8 import QMAX
from . import ExerciseFailed, forbidding


# ---------------------------------------------------------------- worked solution
def solution_quantize_rows(x: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Each row alone: its largest |x| (outlier columns zeroed first) becomes code 127."""
    if keep is not None:
        x = x * keep  # the outlier columns go to the fp32 product, not into the row's range
    scale = x.abs().amax(dim=-1, keepdim=True) / QMAX  # [T, 1]: one scale a row, never one for the prompt
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a row of zeros: codes 0, scale 1
    return torch.round(x / scale).to(torch.int8), scale


# ---------------------------------------------------------------- the usual mistakes, for the hints
def _one_scale(x: Tensor, keep: Tensor | None) -> Tensor:
    x = x * keep if keep is not None else x
    a = x.abs().amax() / QMAX
    return torch.round(x / (a if a > 0 else 1)).to(torch.int8)


def _truncated(x: Tensor, keep: Tensor | None) -> Tensor:
    x = x * keep if keep is not None else x
    a = x.abs().amax(-1, keepdim=True) / QMAX
    return (x / torch.where(a > 0, a, torch.ones_like(a))).to(torch.int8)  # .to(int8) truncates toward 0


# ---------------------------------------------------------------- the cases
def _cases() -> list[tuple[str, Tensor, Tensor | None]]:
    g = torch.Generator().manual_seed(16)
    k = 64
    plain = torch.randn(4, k, generator=g)
    spiky = torch.randn(3, k, generator=g)
    spiky[:, 5] *= 100  # one channel hundreds of times the rest, as a transformer's activations have
    keep = torch.ones(k)
    keep[5] = 0  # the weight keeps channel 5 in fp32
    sizes = torch.randn(3, k, generator=g) * torch.tensor([[1e-3], [1.0], [1e3]])  # rows of different sizes
    zero_row = torch.randn(3, k, generator=g)
    zero_row[1] = 0
    return [("four rows, every channel int8", plain, None),
            ("an outlier channel that the weight keeps in fp32 (keep[5] = 0)", spiky, keep),
            ("the same rows with every channel int8 (keep=None)", spiky, None),
            ("rows a thousand times apart in size", sizes, None),
            ("a row of zeros", zero_row, None)]


def _hint(x: Tensor, keep: Tensor | None, got: Tensor) -> str:
    if torch.equal(got, _one_scale(x, keep)):
        return "one scale a row, from that row's largest |x|: a prompt's rows must not change each other's codes"
    if keep is not None and torch.equal(got, w8a8.quantize_rows(x, None)[0]):
        return "multiply the row by keep first: an outlier column left in takes the row's whole range"
    if torch.equal(got, _truncated(x, keep)):
        return "round to the nearest code (torch.round); .to(torch.int8) truncates toward zero"
    if got.abs().max() <= 1:
        return "the scale is max |x| / 127, so that the largest value of the row becomes code 127"
    return "each row: zero the outlier columns, a = max |x| / 127 (1 for a row of zeros), codes round(x / a)"


def _answer(fn: Callable, x: Tensor, keep: Tensor | None) -> tuple:
    """fn's answer with the functions that are the answer made to raise (the worked solution is let
    through when it is the answer itself: the chapter checks it so that nbval passes)."""
    answers = [w8a8.quantize_rows] + ([] if fn is solution_quantize_rows else [solution_quantize_rows])
    with forbidding(*answers):
        got = fn(x.clone(), None if keep is None else keep.clone())
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ExerciseFailed("quantize_rows: return a pair (codes [T, k] int8, scales [T, 1] fp32), not "
                             f"{type(got).__name__}")
    return tuple(torch.as_tensor(t) for t in got)


def check_quantize_rows(fn: Callable) -> bool:
    """fn(x [T, k] fp32, keep [k] or None) -> (codes [T, k] int8, scales [T, 1] fp32), as w8a8.quantize_rows."""
    cases = [(label, x, keep, *w8a8.quantize_rows(x, keep)) for label, x, keep in _cases()]  # before forbidding
    for label, x, keep, want_codes, want_scales in cases:
        codes, scales = _answer(fn, x, keep)
        if codes.dtype != torch.int8:
            raise ExerciseFailed(f"quantize_rows: for {label} the codes are {codes.dtype}, not torch.int8")
        if codes.shape != want_codes.shape or scales.reshape(-1).shape != want_scales.reshape(-1).shape:
            raise ExerciseFailed(f"quantize_rows: for {label} expected codes {tuple(want_codes.shape)} and "
                                 f"scales {tuple(want_scales.shape)}, got {tuple(codes.shape)} and {tuple(scales.shape)}")
        if not torch.isfinite(scales.float()).all() or not torch.equal(codes, want_codes):
            row, col = (codes != want_codes).nonzero()[0].tolist() if not torch.equal(codes, want_codes) else (0, 0)
            raise ExerciseFailed(f"quantize_rows: for {label}, row {row} channel {col}: code "
                                 f"{int(codes[row, col])}, expected {int(want_codes[row, col])} (scales "
                                 f"{[round(float(s), 6) for s in scales.reshape(-1)]}). Hint: {_hint(x, keep, codes)}")
        if not torch.allclose(scales.float().reshape(-1), want_scales.reshape(-1), rtol=1e-6, atol=0):
            raise ExerciseFailed(f"quantize_rows: for {label} the codes are right but the scales are "
                                 f"{scales.reshape(-1).tolist()}, expected {want_scales.reshape(-1).tolist()} "
                                 "(max |x| / 127 a row, 1 for a row of zeros)")
    print(f"✓ quantize_rows: all {len(cases)} cases give w8a8.quantize_rows's codes and scales")
    return True
