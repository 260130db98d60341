"""Per-row positions for a cache that takes one position vector: one batch-1 cache per row.

Shapes: B rows, T new tokens, Hkv key/value heads, S_b slots of row b's cache, S = max S_b, Dh head dim.

The contiguous, paged and ring-buffer caches take per-row positions [B, T] themselves (cache.py).
The quantized caches keep per-batch state that advances in lockstep (one write position, one
full-precision window of the newest tokens), so for a ragged batch `make_cache(..., ragged=True)` gives
each row a cache of its own and this adapter runs them side by side: a row's real tokens go to its
cache, padding (-1) nowhere, and the rows' reads are padded to one [B, Hkv, S, Dh] with key
position -1, which no query attends. It costs a Python loop over the rows in every layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contract import ANY_LAYER, key_positions


class RowwiseCache:
    """B batch-1 caches behind the cache contract, for input_pos [B, T] (or [T], every row alike)."""
    observers = ()

    def __init__(self, caches: list):
        self.caches = caches
        self._cols: list[Tensor | None] = [None] * len(caches)  # this step: the real tokens of each row
        self._sizes: list[int] = [0] * len(caches)  # this step: the slots each row's cache reads

    def reserve(self, input_pos: Tensor) -> None:
        """Each row's real positions to its own cache's reserve (a row of padding only reserves nothing)."""
        input_pos = input_pos.expand(len(self.caches), -1) if input_pos.dim() == 1 else input_pos
        for b, cache in enumerate(self.caches):
            cols = (input_pos[b] >= 0).nonzero()[:, 0]
            if cols.numel():
                cache.reserve(input_pos[b, cols])

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """Each row's real positions to its own cache -> {ANY_LAYER: key positions [B, S]}, -1 where a
        row holds nothing."""
        B = len(self.caches)
        input_pos = input_pos.expand(B, -1) if input_pos.dim() == 1 else input_pos
        held = []
        for b, cache in enumerate(self.caches):
            cols = (input_pos[b] >= 0).nonzero()[:, 0]
            # A row with padding only writes nothing and reads nothing (its query is padding too).
            self._cols[b] = cols if cols.numel() else None
            held.append(cache.prepare(input_pos[b, cols])[ANY_LAYER].reshape(-1) if cols.numel() else input_pos[b, :0])
            self._sizes[b] = held[-1].shape[0]
        key_pos = torch.full((B, max(self._sizes)), -1, dtype=torch.long, device=input_pos.device)
        for b, pos in enumerate(held):
            key_pos[b, :pos.shape[0]] = pos
        return key_positions(key_pos)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write each row's real tokens of k, v [B, Hkv, T, Dh] into its cache -> [B, Hkv, S, Dh]."""
        B, Hkv, _, Dh = k.shape
        reads = [cache.update(layer, k[b:b + 1, :, cols], v[b:b + 1, :, cols]) if cols is not None else None
                 for b, (cache, cols) in enumerate(zip(self.caches, self._cols))]
        dtype = next(r[0].dtype for r in reads if r is not None)
        out_k, out_v = (torch.zeros(B, Hkv, max(self._sizes), Dh, dtype=dtype, device=k.device) for _ in range(2))
        for b, r in enumerate(reads):
            if r is not None:
                out_k[b, :, :r[0].shape[2]], out_v[b, :, :r[1].shape[2]] = r[0][0], r[1][0]
        return out_k, out_v

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()

    def layer_tensors(self) -> list[Tensor]:
        return [t for cache in self.caches for t in cache.layer_tensors()]

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)

    @property
    def peak_nbytes(self) -> int:
        return sum(cache.peak_nbytes for cache in self.caches)  # an upper bound: rows peak at different steps

    @property
    def device_nbytes(self) -> int:
        return sum(cache.device_nbytes for cache in self.caches)

    @property
    def blocks(self) -> tuple[int, int] | None:
        counts = [cache.blocks for cache in self.caches]
        return None if counts[0] is None else (sum(c[0] for c in counts), sum(c[1] for c in counts))
