"""The rolling buffer for window attention with sinks (chapter 7).

Shapes: L layers, B batch, Hkv key/value heads, S = sink_tokens + window_size + spare slots, T new
tokens, Dh head dim.

It follows the cache contract of cache.py: `prepare(input_pos)` says which position each slot holds
after this step (-1: empty), `update` writes and returns every slot, `nbytes` counts every byte
held. Attention masks come from those positions (attention.py), so the order in which slots are
filled never matters. A decode step (one new token) keeps the slot positions on the device and
does no host sync, so it compiles with torch.compile(fullgraph=True).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .contract import check_fits, key_positions


class WindowKVCache:
    """A rolling buffer of sink_tokens + window_size slots: memory stays flat however long the text.

    Slot rule: position p goes to slot p when p < sink_tokens (the sinks are never overwritten),
    else to slot sink_tokens + (p - sink_tokens) % window_size, overwriting position p - window_size,
    which just left the window of query p (attention.in_window). Positions are the original ones:
    RoPE is applied before keys are cached (model.py), so this cache does not re-index positions as
    StreamingLLM does; generation past the model's trained context is not supported.

    `spare` slots widen the ring past the window (speculative decoding, chapter 13): a verify step
    writes k + 1 positions and may then rewind up to k of them, so the ring must still hold the
    window of the first rewound position; with spare = k nothing a rewind needs was overwritten.
    The mask still shows each query only its window: the spare slots cost memory, never text.
    """
    observers = ()
    blocks = None

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, window_size: int,
                 sink_tokens: int = 4, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 spare: int = 0):
        if window_size < 1 or not 0 <= sink_tokens <= window_size or spare < 0:
            raise ConfigError(f"window_size={window_size}, sink_tokens={sink_tokens}, spare={spare} are invalid: "
                              "need window_size >= 1, 0 <= sink_tokens <= window_size and spare >= 0")
        self.window_size, self.sink_tokens = window_size, sink_tokens
        self.ring = window_size + spare  # slots that rotate; the sinks stay put
        S = sink_tokens + self.ring
        self.k = torch.zeros(n_layers, batch, n_kv_heads, S, head_dim, dtype=dtype, device=device)  # [L, B, Hkv, S, Dh]
        self.v = torch.zeros_like(self.k)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # per-layer views: see kv_cache.py
        self.slot_pos = torch.full((S,), -1, dtype=torch.long, device=device)  # [S]; -1: empty
        self._slots = torch.zeros(1, dtype=torch.long, device=device)  # where this step's tokens go
        self._keep: Tensor | None = None  # a prompt: which of its tokens stay in the buffer
        self.row_pos: Tensor | None = None  # [B, S] per-row positions, once a step gave them (ragged batches)
        self._rows: tuple | None = None  # this step's per-row writes: rows, tokens, slots, several tokens
        self._peak = self.nbytes

    @classmethod
    def for_model(cls, model, batch: int, window_size: int, sink_tokens: int,
                  dtype: torch.dtype | None = None) -> "WindowKVCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, window_size, sink_tokens,
                   dtype or model.dtype, model.device)

    def slot_of(self, pos: Tensor) -> Tensor:
        """The slot of each position [T] -> [T] (the rule in the class docstring)."""
        sinks = self.sink_tokens
        return torch.where(pos < sinks, pos, sinks + (pos - sinks) % self.ring)

    def reserve(self, input_pos: Tensor) -> None:
        """Nothing to hand out before the forward: the slots are preallocated (the contract)."""

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """{ANY_LAYER: the position each slot holds after this step} (contract.py; `_positions`)."""
        return key_positions(self._positions(input_pos))

    def _positions(self, input_pos: Tensor) -> Tensor:
        """Positions seen by this step's queries: [S] for one new token, [S + T] for T > 1."""
        if input_pos.dim() == 2:
            return self._prepare_rows(input_pos)
        self._rows = None
        check_fits(input_pos, capacity=2**62)  # only the sign matters: the buffer wraps
        # Positions at or after this write belong to an older sequence (or were rolled back).
        self.slot_pos.masked_fill_(self.slot_pos >= input_pos[0], -1)
        if input_pos.shape[0] == 1:
            # One token overwrites a slot that just left its window: read after writing, [S] fixed.
            self._keep, self._slots = None, self.slot_of(input_pos)
            self.slot_pos.index_copy_(0, self._slots, input_pos)
            return self.slot_pos
        # Several tokens: an early query still needs keys that a later token of this step evicts,
        # so this step attends over the buffer as it was plus the new tokens, then keeps the
        # survivors: the sinks and the last `ring` (writing just those keeps each slot written
        # once; index_copy_ with repeated slots is undefined).
        before = self.slot_pos.clone()
        self._keep = ((input_pos < self.sink_tokens) | (input_pos > input_pos[-1] - self.ring)).nonzero()[:, 0]
        self._slots = self.slot_of(input_pos[self._keep])
        self.slot_pos.index_copy_(0, self._slots, input_pos[self._keep])
        B, Hkv, S, Dh = self.k.shape[1:]
        # this step's short-lived tensors: one layer's old + new keys and values
        self._peak = max(self._peak, self.nbytes + 2 * B * Hkv * (S + input_pos.shape[0]) * Dh * self.k.element_size())
        return torch.cat([before, input_pos])  # [S + T]

    def _prepare_rows(self, input_pos: Tensor) -> Tensor:
        """Per-row positions [B, T] (-1: padding): the same rule, each row in its own slots ->
        positions [B, S] (every row one token or none) or [B, S + T] (this step's tokens appended)."""
        B, S = self.k.shape[1], self.slot_pos.shape[0]
        if self.row_pos is None:  # from now on each row keeps its own slot positions
            self.row_pos = self.slot_pos.expand(B, S).clone()
        real = input_pos >= 0
        check_fits(input_pos[real], capacity=2**62)
        big = torch.iinfo(torch.long).max
        start = torch.where(real, input_pos, big).amin(dim=1, keepdim=True)  # [B, 1]; big: the row writes nothing
        self.row_pos.masked_fill_(self.row_pos >= start, -1)  # forget positions at or after each row's write
        last = input_pos.amax(dim=1, keepdim=True)  # [B, 1]
        keep = real & ((input_pos < self.sink_tokens) | (input_pos > last - self.ring))
        rows, cols = keep.nonzero(as_tuple=True)
        slots = self.slot_of(input_pos[rows, cols])
        before = self.row_pos.clone() if input_pos.shape[1] > 1 else None
        self.row_pos[rows, slots] = input_pos[rows, cols]
        self._rows = (rows, cols, slots, before is not None)
        if before is None:  # one token per row: read after writing, [B, S]
            return self.row_pos
        self._peak = max(self._peak, self.nbytes + 2 * B * self.k.shape[2] * (S + input_pos.shape[1]) * self.k.shape[-1]
                         * self.k.element_size())
        return torch.cat([before, input_pos], dim=1)  # [B, S + T]; padding stays -1

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh]; return the keys/values that match the positions of prepare."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)  # stored in the cache's dtype (kv_dtype)
        if self._rows is not None:  # per-row positions
            rows, cols, slots, several = self._rows
            out = (torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)) if several else None
            self.k_layers[layer][rows, :, slots] = k[rows, :, cols]
            self.v_layers[layer][rows, :, slots] = v[rows, :, cols]
            return out or (self.k_layers[layer], self.v_layers[layer])
        if self._keep is None:
            self.k_layers[layer].index_copy_(2, self._slots, k)
            self.v_layers[layer].index_copy_(2, self._slots, v)
            return self.k_layers[layer], self.v_layers[layer]
        # copy the old buffer before overwriting it: [B, Hkv, S + T, Dh]
        k_all, v_all = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer].index_copy_(2, self._slots, k[:, :, self._keep])
        self.v[layer].index_copy_(2, self._slots, v[:, :, self._keep])
        return k_all, v_all

    def reset(self) -> None:
        """Forget every position (prepare does it too when a write starts at position 0)."""
        self.slot_pos.fill_(-1)
        self.row_pos = None

    def reorder_rows(self, index: Tensor) -> None:
        """Row b takes what row index[b] held, in every layer (beam search, beam.py): index [B], in place.
        The ring's slots hold the same positions in every row, so only the keys and values move."""
        self.k.copy_(self.k.index_select(1, index))  # [L, B, Hkv, S, Dh]
        self.v.copy_(self.v.index_select(1, index))
        if self.row_pos is not None:  # per-row positions [B, S]
            self.row_pos.copy_(self.row_pos.index_select(0, index))

    def layer_tensors(self) -> list[Tensor]:
        return [self.k, self.v]

    @property
    def nbytes(self) -> int:
        """Bytes held: sinks + window (+ spare) slots of keys and values, and their positions, whatever the length."""
        rows = self.row_pos.nbytes if self.row_pos is not None else 0
        return self.k.nbytes + self.v.nbytes + self.slot_pos.nbytes + rows

    @property
    def peak_nbytes(self) -> int:
        """nbytes, plus one layer's old + new keys and values during a step of several tokens."""
        return self._peak

    device_nbytes = nbytes
