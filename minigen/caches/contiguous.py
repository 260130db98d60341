"""The preallocated contiguous KV cache (chapter 2).

Shapes: L layers, B batch, Hkv key/value heads, S allocated token slots, T new tokens, Dh head dim.

The whole cache is allocated once, sized to prompt + max_new_tokens, so a decode step reads and
writes tensors of one fixed shape: the precondition for capturing it in a CUDA graph later. Slot s
holds position s; slots not yet written are masked out by `causal_mask` because their position is
after every query. It follows the cache contract of cache.py, with no host sync in a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import check_fits, key_positions


class KVCache:
    observers = ()  # plain attention: nothing to watch

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)  # [L, B, Hkv, S, Dh]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # One view per layer, made here: a compiled step that wrote through self.k[layer] would
        # write into a view of one large input, which torch.compile turns into a copy of all of it
        # (measured: 10 ms a step instead of 0.4); views it receives ready-made are written in place.
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        self.max_len = max_len
        self.slot_pos = torch.arange(max_len, device=device)  # [S]: slot s holds position s
        self._input_pos = torch.zeros(1, dtype=torch.long, device=device)  # this step's slots, set by prepare
        self._ragged: tuple[Tensor, Tensor, Tensor] | None = None  # per-row positions: (rows, tokens, slots)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, dtype: torch.dtype | None = None) -> "KVCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim,
                   dtype or model.dtype, model.device)

    def reserve(self, input_pos: Tensor) -> None:
        """Nothing to hand out before the forward: the slots are preallocated (the contract)."""

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """{ANY_LAYER: the position each slot holds after this step} (contract.py; `_positions`)."""
        return key_positions(self._positions(input_pos))

    def _positions(self, input_pos: Tensor) -> Tensor:
        """This step writes slots input_pos [T] -> the position of every slot [S] (slot s: s).

        input_pos [B, T] (a ragged batch) writes row b's token t at slot input_pos[b, t], padding
        (-1) nowhere; slot s still holds position s in every row. A new sequence needs no clearing:
        a query at p sees slots <= p, all rewritten by then.
        """
        if input_pos.dim() == 2:  # one host sync: which (row, token) pairs are real
            rows, cols = (input_pos >= 0).nonzero(as_tuple=True)
            check_fits(input_pos[rows, cols], self.max_len)
            self._input_pos, self._ragged = input_pos, (rows, cols, input_pos[rows, cols])
            return self.slot_pos
        check_fits(input_pos, self.max_len)
        self._input_pos, self._ragged = input_pos, None
        return self.slot_pos

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] at this step's slots; return all slots [B, Hkv, S, Dh], in the
        cache's own dtype (kv_dtype)."""
        if self._ragged is not None:
            rows, cols, slots = self._ragged
            self.k_layers[layer][rows, :, slots] = k[rows, :, cols].to(self.k.dtype)  # [N, Hkv, Dh]
            self.v_layers[layer][rows, :, slots] = v[rows, :, cols].to(self.v.dtype)
            return self.k_layers[layer], self.v_layers[layer]
        self.k_layers[layer].index_copy_(2, self._input_pos, k.to(self.k.dtype))
        self.v_layers[layer].index_copy_(2, self._input_pos, v.to(self.v.dtype))
        return self.k_layers[layer], self.v_layers[layer]

    def reset(self) -> None:
        """Nothing to forget: slot s always holds position s (see prepare)."""

    def reorder_rows(self, index: Tensor) -> None:
        """Row b takes what row index[b] held, in every layer (beam search, beam.py): index [B].
        In place, so the tensors keep the addresses their layer views and the fused C step hold."""
        self.k.copy_(self.k.index_select(1, index))  # [L, B, Hkv, S, Dh]
        self.v.copy_(self.v.index_select(1, index))

    def layer_tensors(self) -> list[Tensor]:
        """The tensors holding per-layer state, layer first (what an offload tier moves)."""
        return [self.k, self.v]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values: the whole allocation, written or not. (Slot s holds position s,
        so the positions are no state; `slot_pos` is a constant arange kept for the masks.)"""
        return self.k.nbytes + self.v.nbytes

    peak_nbytes = device_nbytes = nbytes  # nothing short-lived, nothing off the device
    blocks = None
