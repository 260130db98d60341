"""Chapter 10 exercises: packing and unpacking int4 weights.

1. `pack4(codes)`: uint8 codes [.., k] in [0, 15] (k a multiple of 32) -> bytes [.., k / 2]. In each
   block of 32 codes, byte j (0 <= j < 16) holds code j in its low nibble and code j + 16 in its
   high nibble: the layout of GGUF's Q4_1, which the C kernel unpacks with one mask and one shift.
2. `unpack4(data)`: the inverse, bytes [.., k / 2] -> uint8 codes [.., k].
"""

from __future__ import annotations

import torch

from ...numerics import weight_quant
from ...numerics.weight_quant import BLOCK
from ...numerics.weight_quant import pack4 as _pack4
from ...numerics.weight_quant import unpack4 as _unpack4
from . import ExerciseFailed, forbidding


# ---------------------------------------------------------------- worked solutions
def solution_pack4(codes: torch.Tensor) -> torch.Tensor:
    """Split each block of 32 into its first and second 16 codes; the second half goes high."""
    block = codes.unflatten(-1, (-1, BLOCK))  # [.., k / 32, 32]
    low, high = block[..., :16], block[..., 16:]  # codes j and j + 16, side by side
    return (low | (high << 4)).flatten(-2).to(torch.uint8)  # [.., k / 2]


def solution_unpack4(data: torch.Tensor) -> torch.Tensor:
    """Each byte gives back two codes: its low nibble (& 0xF) first, its high nibble (>> 4) 16 later."""
    b = data.unflatten(-1, (-1, BLOCK // 2))  # [.., k / 32, 16]
    return torch.cat([b & 0xF, b >> 4], dim=-1).flatten(-2)  # [.., k]


# ---------------------------------------------------------------- the cases
def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(14)
    ramp = torch.arange(32, dtype=torch.uint8) % 16  # codes 0..15, 0..15: each byte shows its pair
    return [("one block, codes 0..15 twice", ramp),
            ("one block, all 15 (every bit set)", torch.full((32,), 15, dtype=torch.uint8)),
            ("a row of 4 blocks", torch.randint(0, 16, (128,), dtype=torch.uint8, generator=g)),
            ("a matrix [3, 64]", torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=g))]


def _as_uint8(name: str, label: str, got) -> torch.Tensor:
    if got is None:
        raise ExerciseFailed(f"{name} returned None for {label}: return a tensor")
    got = torch.as_tensor(got)
    if got.dtype != torch.uint8:
        raise ExerciseFailed(f"{name}: for {label} the result is {got.dtype}, not torch.uint8. Hint: "
                             "torch.uint8 holds exactly one byte; (high << 4) of a wider type can exceed 255")
    return got


def _solutions(fn) -> tuple:
    """The functions that ARE the answers: an answer that calls one of them fails. The worked
    solution checked as itself is let through (it calls none of the others); the package's never is."""
    worked = tuple(f for f in (solution_pack4, solution_unpack4) if f is not fn)
    return (weight_quant.pack4, weight_quant.unpack4, *worked)


def check_pack4(fn) -> bool:
    """fn(codes [.., k]) -> bytes [.., k / 2] in the package's layout (weight_quant.pack4)."""
    cases = [(label, codes, _pack4(codes)) for label, codes in _cases()]  # expected, before forbidding
    for label, codes, want in cases:
        pairs = codes.unflatten(-1, (-1, 2))  # codes j and j + 1: the layout many people expect
        adjacent = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
        swapped = _pack4(codes.unflatten(-1, (-1, 2, 16)).flip(-2).flatten(-3))
        with forbidding(*_solutions(fn)):
            got = fn(codes.clone())
        got = _as_uint8("pack4", label, got)
        if got.shape != want.shape:
            raise ExerciseFailed(f"pack4: for {label} expected shape {tuple(want.shape)}, got {tuple(got.shape)}")
        if not torch.equal(got, want):
            hint = (" Hint: byte j pairs code j with code j + 16 of its block, not with code j + 1"
                    if torch.equal(got, adjacent) else
                    " Hint: code j goes in the low nibble, code j + 16 in the high one" if torch.equal(got, swapped)
                    else "")
            i = int((got != want).flatten().nonzero()[0])
            raise ExerciseFailed(f"pack4: for {label} byte {i} is {int(got.flatten()[i]):#04x}, expected "
                                 f"{int(want.flatten()[i]):#04x}.{hint}")
    print(f"✓ pack4: all {len(cases)} cases agree with the package")
    return True


def check_unpack4(fn) -> bool:
    """fn(bytes [.., k / 2]) -> codes [.., k]: the inverse of pack4."""
    cases = [(label, codes, _pack4(codes)) for label, codes in _cases()]  # inputs, before forbidding
    for label, codes, data in cases:
        with forbidding(*_solutions(fn)):
            got = fn(data.clone())
        got = _as_uint8("unpack4", label, got)
        if got.shape != codes.shape:
            raise ExerciseFailed(f"unpack4: for {label} expected shape {tuple(codes.shape)}, got {tuple(got.shape)}")
        if not torch.equal(got, codes):
            b = data.unflatten(-1, (-1, BLOCK // 2))  # [.., k / 32, 16]
            interleaved = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-3)  # low, high, low, high...
            high_first = torch.cat([b >> 4, b & 0xF], dim=-1).flatten(-2)
            hint = (" Hint: mask the low nibble with & 0xF" if got.max() > 15 else
                    " Hint: the low nibbles are codes 0..15 of the block, the high ones codes 16..31, "
                    "not every other code" if torch.equal(got, interleaved) else
                    " Hint: the low nibble (& 0xF) comes first" if torch.equal(got, high_first) else "")
            i = int((got != codes).flatten().nonzero()[0])
            raise ExerciseFailed(f"unpack4: for {label} code {i} is {int(got.flatten()[i])}, expected "
                                 f"{int(codes.flatten()[i])}.{hint}")
    assert torch.equal(_unpack4(cases[2][2]), cases[2][1])  # the package's own round trip
    print(f"✓ unpack4: all {len(cases)} cases come back exactly")
    return True
