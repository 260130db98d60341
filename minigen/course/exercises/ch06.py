"""Chapter 6 exercises: quantizing one group, and what a quantized cache really holds.

1. `quantize_group(x, bits)`: asymmetric min-max quantization of one group x [G] (a 1-D float
   tensor) -> (codes, scale, zero), with integer codes in [0, 2^bits - 1] such that
   zero + codes * scale is within scale / 2 of x, and the smallest such scale. Write the arithmetic:
   the checker runs it with the package's quantizers (numerics.quant.quantize and round_trip,
   weight_quant.quantize_matrix) patched to raise.
2. `quantized_cache_bytes(cfg, tokens, bits, group_size, residual)`: every byte the
   `QuantizedKVCache` of an fp16 model allocated for `tokens` positions of one sequence holds:
   packed codes (keys per channel, values per token), an fp16 scale and zero per group, and the
   fp16 full-precision window of `residual` tokens. Only whole groups are quantized, so the store
   is rounded up to whole groups of the tokens beyond the window:
   group_size * ceil(max(0, tokens - residual) / group_size).
"""

from __future__ import annotations

import torch

from ...checkpoints.model_config import ModelConfig
from ...caches.quantized import QuantizedKVCache
from ...numerics import quant, weight_quant
from . import ExerciseFailed, compare, forbidding, known_mistake
from .ch01 import LLAMA2_7B, SMOLLM2_135M


# ---------------------------------------------------------------- 1. one group
def solution_quantize_group(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, float, float]:
    """The grid starts at the minimum and has 2^bits points up to the maximum: 2^bits - 1 steps."""
    lo, hi = x.min().item(), x.max().item()
    scale = (hi - lo) / (2**bits - 1)
    if scale == 0:  # a constant group: every element is the zero itself
        return torch.zeros_like(x, dtype=torch.long), 0.0, lo
    codes = torch.round((x - lo) / scale).clamp(0, 2**bits - 1).long()
    return codes, scale, lo


def _groups() -> list[tuple[str, torch.Tensor, int]]:
    g = torch.Generator().manual_seed(4)
    normal = torch.randn(32, generator=g)
    outlier = normal.clone()
    outlier[7] = 25.0  # one large value stretches the whole group's step
    shifted = torch.rand(32, generator=g) + 10.0  # all positive, far from 0: the zero matters
    return [(f"{name}, {bits} bits", x, bits)
            for name, x in (("32 normal values", normal), ("an outlier of 25", outlier),
                            ("values in [10, 11]", shifted), ("a constant group", torch.full((32,), 0.75)))
            for bits in (8, 4, 2)]


def check_quantize_group(fn) -> bool:
    """fn(x [G], bits) -> (codes, scale, zero): codes integers in [0, 2^bits - 1], reconstruction
    within scale / 2, and scale equal to (max - min) / (2^bits - 1)."""
    forbidden = (quant.quantize, quant.round_trip, weight_quant.quantize_matrix)
    with forbidding(*forbidden, *(() if fn is solution_quantize_group else (solution_quantize_group,))):
        _check_groups(fn)
    print(f"✓ quantize_group: all {len(_groups())} groups come back within scale / 2")
    return True


def _check_groups(fn) -> None:
    for label, x, bits in _groups():
        out = fn(x.clone(), bits)
        if out is None:
            raise ExerciseFailed("quantize_group returned None: return (codes, scale, zero)")
        codes, scale, zero = out
        codes = torch.as_tensor(codes)
        scale, zero = float(scale), float(zero)
        best = (x.max() - x.min()).item() / (2**bits - 1)
        if codes.dtype.is_floating_point and not torch.equal(codes, codes.round()):
            raise ExerciseFailed(f"quantize_group: for {label} the codes are not whole numbers: round them")
        if codes.min() < 0:
            raise ExerciseFailed(f"quantize_group: for {label} some codes are negative. Hint: asymmetric "
                                 "quantization subtracts the group's minimum first, so codes are unsigned")
        if codes.max() > 2**bits - 1:
            raise ExerciseFailed(f"quantize_group: for {label} a code exceeds {2**bits - 1}: clamp to "
                                 f"[0, 2^bits - 1]")
        if scale != scale or zero != zero:
            raise ExerciseFailed(f"quantize_group: for {label} the scale or zero is NaN. Hint: a constant "
                                 "group has range 0; use scale 0 and code 0")
        if abs(scale - best) > 1e-5 * max(best, 1e-12):
            hint = " Hint: 2^bits codes make 2^bits - 1 steps" if abs(scale - best * (2**bits - 1) / 2**bits) \
                < 1e-5 * best else ""
            raise ExerciseFailed(f"quantize_group: for {label} expected scale {best:.6g}, got {scale:.6g}.{hint}")
        error = (zero + codes.double() * scale - x.double()).abs().max().item()
        if error > scale / 2 + 1e-5 * (1 + x.abs().max().item()):
            raise ExerciseFailed(f"quantize_group: for {label} an element comes back {error:.4g} away, "
                                 f"more than scale / 2 = {scale / 2:.4g}. Hint: round, do not truncate")


# ---------------------------------------------------------------- 2. bytes held
def solution_quantized_cache_bytes(cfg: ModelConfig, tokens: int, bits: int, group_size: int,
                                   residual: int) -> int:
    """Codes + scales and zeros (fp16) for the quantized store; fp16 for the window."""
    G, channels = group_size, cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # per K (or V) per token
    stored = G * -(-max(0, tokens - residual) // G)  # whole groups beyond the window
    codes = 2 * stored * channels * bits // 8  # keys and values
    key_meta = (stored // G) * channels * 2 * 2  # one fp16 scale + zero per channel per G tokens
    value_meta = stored * (channels // G) * 2 * 2  # one fp16 scale + zero per token per G channels
    window = 2 * min(residual, tokens) * channels * 2  # fp16 keys and values
    return codes + key_meta + value_meta + window


def _reference_bytes(cfg: ModelConfig, tokens: int, bits: int, group_size: int, residual: int) -> int:
    cache = QuantizedKVCache(cfg.n_layers, 1, cfg.n_kv_heads, tokens, cfg.head_dim, bits, group_size,
                             "channel", residual, torch.float16, device="meta")  # sizes only, no memory
    return cache.nbytes


def _mistaken_bytes(cfg: ModelConfig, tokens: int, bits: int, G: int, R: int, whole_groups: bool = True,
                    meta_numbers: int = 2, window_bytes: int = 2) -> int:
    """The byte count with one common mistake switched on (for the hints)."""
    channels = cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    stored = G * -(-max(0, tokens - R) // G) if whole_groups else max(0, tokens - R)
    meta = meta_numbers * 2 * ((stored // G) * channels + stored * (channels // G))
    return 2 * stored * channels * bits // 8 + meta + 2 * min(R, tokens) * channels * window_bytes


def check_quantized_cache_bytes(fn) -> bool:
    """fn(cfg, tokens, bits, group_size, residual) -> int, exactly QuantizedKVCache(...).nbytes."""
    cases = [(f"{name}, {tokens} tokens, {bits} bits, groups of {G}, window {R}", (cfg, tokens, bits, G, R),
              _reference_bytes(cfg, tokens, bits, G, R))
             for name, cfg in (("SmolLM2-135M", SMOLLM2_135M), ("Llama-2-7B", LLAMA2_7B))
             for tokens, bits, G, R in ((4096, 4, 32, 32), (1000, 8, 64, 128), (100, 2, 32, 40), (20, 4, 32, 32))]

    def hints(args, got):
        return known_mistake(got, [
            (_mistaken_bytes(*args, meta_numbers=0), "count the fp16 scale and zero of every group"),
            (_mistaken_bytes(*args, meta_numbers=1), "each group has a scale and a zero: two fp16 numbers"),
            (_mistaken_bytes(*args, window_bytes=0), "count the full-precision window of `residual` tokens"),
            (_mistaken_bytes(*args, window_bytes=4), "the window is in the model's dtype, fp16: 2 bytes a number"),
            (_mistaken_bytes(*args, whole_groups=False), "only whole groups are quantized: round the store "
                                                         "up to a multiple of group_size"),
        ])

    return compare("quantized_cache_bytes", cases, fn, hints)
