"""Attention from positions: the causal mask and the attention product.

Shapes: B batch, H query heads, Hkv key/value heads, T queries, S key slots, Dh head dim.
Every mask is built from positions (which token each query is, which token each cache slot holds),
so a cache can store its slots in any order (blocks, a ring buffer) and attention stays correct.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(query_pos: Tensor, key_pos: Tensor) -> Tensor:
    """[T, S] bool: query t may attend slot s when the slot holds a real token (position >= 0)
    at or before the query's position."""
    return (key_pos[None, :] >= 0) & (key_pos[None, :] <= query_pos[:, None])


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(Dh) + mask) v with grouped-query heads.

    q [B, H, T, Dh], k and v [B, Hkv, S, Dh], mask [T, S] bool -> [B, H, T, Dh].
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
