"""Rotary position embeddings (RoPE, Su et al. 2021): the frequencies, the tables of a step's positions,
and the rotation of queries and keys. model.py applies them; a checkpoint's scaling is read here.

Shapes: B batch, T new tokens, Dh head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .checkpoints.model_config import ModelConfig


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> Tensor:
    """Inverse frequencies [Dh/2] of RoPE (Su et al. 2021), with the checkpoint's scaling.
    local=True: those of Gemma 3's sliding layers, which have their own base (and scaling)."""
    theta, scaling = (cfg.rope_local_theta, cfg.rope_local_scaling) if local else (cfg.rope_theta, cfg.rope_scaling)
    inv_freq = 1.0 / theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    scaling = scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":  # positions divided by `factor` (Chen et al. 2023, position interpolation)
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":  # Llama 3.1: slow down only the low frequencies, blend in between
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor,
                               torch.where(wavelen < old_ctx / high, inv_freq, blended))
    elif kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported: minigen knows default, linear, llama3")
    return inv_freq.float()


def apply_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotate pairs (i, i + Dh/2) of x [B, T, heads, Dh] by the angles of their positions.

    HF checkpoints pair dimension i with i + Dh/2 ("rotate_half"): x * cos + [-x2, x1] * sin.
    Rolling x by Dh/2 gives [x2, x1], so with `sin_signed` = [-sin, sin] the rotation is one
    multiply and one fused multiply-add. cos and sin_signed are [T, 1, Dh] (or [B, T, 1, Dh])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def rope_tables(at: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin of positions `at` [T] (or [B, T]): [T, 1, Dh] (or [B, T, 1, Dh]) each,
    broadcast over heads; see apply_rope for the signs."""
    angles = at.float()[..., None] * inv_freq  # [T, Dh/2] or [B, T, Dh/2]
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat((cos, cos), dim=-1)[..., None, :].to(dtype),
            torch.cat((-sin, sin), dim=-1)[..., None, :].to(dtype))
