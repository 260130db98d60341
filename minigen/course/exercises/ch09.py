"""Chapter 9 exercise: the dequantize-on-load step of a kernel that reads 4-bit codes.

1. `dequantize_on_load(codes, scales, zeros, channel, group_size)`: the values of channels
   `channel` [D] (int64) of rows stored as quant.py stores 4-bit values (grouped per token over
   channels): codes [..., Dh / 2] uint8, two codes to a byte with the first in the low four bits;
   scales and zeros [..., Dh / G]. Return [..., D] fp32, what `triton_steps._int4_load` computes
   for each lane: the byte holding the channel, its four bits, then zero + code * scale. Write it
   with the same index arithmetic (// and % on `channel`, >> and &), in torch.

The checker compares yours with quant.dequantize on several shapes, group sizes and orders of
channels, and names the common mistakes (a missing `& 0xF`, the high nibble first, the group
index taken from the byte index).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...numerics.quant import dequantize, quantize
from . import ExerciseFailed


def solution_dequantize_on_load(codes: Tensor, scales: Tensor, zeros: Tensor, channel: Tensor,
                                group_size: int) -> Tensor:
    byte = codes[..., channel // 2].to(torch.int32)  # [..., D]: the byte holding each channel
    code = (byte >> ((channel % 2) * 4)) & 0xF  # even channels in the low four bits, odd in the high
    group = channel // group_size  # the scale and zero each channel shares with its group
    return zeros[..., group].float() + code.float() * scales[..., group].float()


# Wrong versions the checker recognizes, each with its hint.
def _no_mask(codes, scales, zeros, channel, group_size):
    byte = codes[..., channel // 2].to(torch.int32)
    group = channel // group_size
    return zeros[..., group].float() + (byte >> ((channel % 2) * 4)).float() * scales[..., group].float()


def _high_first(codes, scales, zeros, channel, group_size):
    byte = codes[..., channel // 2].to(torch.int32)
    group = channel // group_size
    code = (byte >> ((1 - channel % 2) * 4)) & 0xF
    return zeros[..., group].float() + code.float() * scales[..., group].float()


def _group_of_byte(codes, scales, zeros, channel, group_size):
    byte = codes[..., channel // 2].to(torch.int32)
    group = (channel // 2) // group_size
    code = (byte >> ((channel % 2) * 4)) & 0xF
    return zeros[..., group].float() + code.float() * scales[..., group].float()


MISTAKES = [
    (_no_mask, "keep only this channel's four bits: (byte >> shift) & 0xF; without the mask an even "
               "channel keeps its odd neighbour's code in bits 4-7"),
    (_high_first, "quant.pack puts the first code of a pair in the low bits: shift by (channel % 2) * 4"),
    (_group_of_byte, "the group of a channel is channel // group_size (channels, not bytes, are grouped)"),
]


def _cases() -> list[tuple[str, tuple, Tensor]]:
    g = torch.Generator().manual_seed(9)
    out = []
    for label, shape, G, order in (("one row, Dh 16, G 8, channels in order", (1, 16), 8, "in order"),
                                   ("rows [3, 2], Dh 64, G 32, channels shuffled", (3, 2, 64), 32, "shuffled"),
                                   ("rows [4], Dh 32, G 16, every other channel", (4, 32), 16, "odd"),
                                   ("bf16 values, Dh 64, G 16", (2, 64), 16, "in order")):
        x = 3 * torch.randn(shape, generator=g)
        if label.startswith("bf16"):
            x = x.to(torch.bfloat16)
        q = quantize(x, 4, G, -1)
        Dh = shape[-1]
        channel = {"in order": torch.arange(Dh), "shuffled": torch.randperm(Dh, generator=g),
                   "odd": torch.arange(1, Dh, 2)}[order]
        # in fp32, as a kernel keeps it (dequantize would round to the values' own dtype)
        want = dequantize(dataclasses.replace(q, dtype=torch.float32))[..., channel]
        out.append((label, (q.data, q.scales, q.zeros, channel, G), want))
    return out


def check_dequantize_on_load(fn) -> bool:
    """fn(codes, scales, zeros, channel, group_size) -> [..., D] fp32: equals quant.dequantize's values
    of those channels on every case."""
    for label, args, want in _cases():
        got = fn(*args)
        if not isinstance(got, Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
            raise ExerciseFailed(f"dequantize_on_load: for {label}, return a tensor of shape {tuple(want.shape)} "
                                 f"(the rows, then one value per channel asked for), got {shape}")
        if not torch.allclose(got.float(), want, rtol=1e-6, atol=1e-6):
            hints = [hint for wrong, hint in MISTAKES if torch.allclose(got.float(), wrong(*args), rtol=1e-6, atol=1e-6)]
            i = int((got.float() - want).abs().flatten().argmax())
            raise ExerciseFailed(f"dequantize_on_load: for {label}, value {i} (flattened) should be "
                                 f"{want.flatten()[i].item():.5g}, got {got.float().flatten()[i].item():.5g}"
                                 + (f". Hint: {hints[0]}" if hints else ". Hint: zero + code * scale, "
                                    "with the code from byte channel // 2"))
    print(f"✓ dequantize_on_load: all {len(_cases())} cases agree with quant.dequantize")
    return True
