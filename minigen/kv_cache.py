"""The preallocated contiguous KV cache (chapter 2).

Shapes: L layers, B batch, Hkv key/value heads, S allocated token slots, T new tokens, Dh head dim.

The whole cache is allocated once, sized to prompt + max_new_tokens, so a decode step reads and
writes tensors of one fixed shape: the precondition for capturing it in a CUDA graph later. Slot s
holds position s; slots not yet written are masked out by `causal_mask` because their position is
after every query.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import CacheFullError


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)  # [L, B, Hkv, S, Dh]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.slot_pos = torch.arange(max_len, device=device)  # [S]: slot s holds position s

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, dtype: torch.dtype | None = None) -> "KVCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim,
                   dtype or model.dtype, model.device)

    def key_positions(self, input_pos: Tensor) -> Tensor:
        """The position held by each slot after this step's write: [S]. Checks the write fits."""
        # One host sync per forward call; it buys an error that names the fix instead of an
        # index error from deep inside torch.
        last = int(input_pos[-1])
        if last >= self.max_len or int(input_pos[0]) < 0:
            raise CacheFullError(
                f"the KV cache holds {self.max_len} tokens but position {last} was written. "
                f"Allocate a cache of at least {last + 1} tokens (prompt + max_new_tokens).")
        return self.slot_pos

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] at slots input_pos [T]; return all slots [B, Hkv, S, Dh]."""
        self.k[layer].index_copy_(2, input_pos, k)
        self.v[layer].index_copy_(2, input_pos, v)
        return self.k[layer], self.v[layer]

    def layer_tensors(self) -> list[Tensor]:
        """The tensors holding per-layer state, layer first (what an offload tier moves)."""
        return [self.k, self.v]

    @property
    def nbytes(self) -> int:
        """Bytes held: the whole allocation, written or not."""
        return self.k.nbytes + self.v.nbytes
