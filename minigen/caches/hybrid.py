"""The hybrid cache of models trained with sliding windows (Mistral, Qwen2, Gemma 2 and 3): a
ring of `sliding_window` slots for each sliding layer, every position for each full layer, one
object behind the cache contract (chapter 5).

Shapes: Lf full layers, Ls sliding layers, B batch, Hkv key/value heads, T new tokens, Dh head dim.

A sliding layer's query at position p sees p - sliding_window + 1 .. p (attention.in_window); a
key that left that window is never read again by that layer, so the layer keeps only a ring
(window.py's WindowKVCache, without sinks). Full layers keep the contiguous cache (contiguous.py).
This is what vLLM's hybrid KV-cache manager and `transformers`' per-layer caches do. For Gemma 3
(five sliding layers of 512 tokens to one full layer) it holds about a sixth of a uniform cache
at long contexts: `nbytes` is (Lf x context + Ls x window) x 2 x Hkv x Dh x bytes, plus the ring's
positions.

`prepare` answers with the positions of each kind of layer, {"full_attention": [S_full],
"sliding_attention": [S_ring]} (or [B, S] each, for per-row positions), from which Model.forward
builds one mask per kind; `update(layer, ...)` goes to the part that holds that layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .contiguous import KVCache
from .window import WindowKVCache


class HybridKVCache:
    """Full layers in a contiguous cache of `max_len` slots, sliding layers in a ring of
    `sliding_window` (+ `spare`) slots. `spare`: the positions a speculative rewind may need back
    (window.py)."""
    observers = ()
    blocks = None

    def __init__(self, layer_types: tuple[str, ...], batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 sliding_window: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 spare: int = 0):
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        # each model layer -> (its part, its index there)
        self.full = KVCache(len(full), batch, n_kv_heads, max_len, head_dim, dtype, device) if full else None
        # a ring never longer than the sequence: below the window, nothing ever leaves it
        self.ring = (WindowKVCache(len(sliding), batch, n_kv_heads, head_dim, min(sliding_window, max_len), 0, dtype,
                                   device, spare=spare) if sliding else None)
        self.where = {layer: (self.full, j) for j, layer in enumerate(full)}
        self.where.update({layer: (self.ring, j) for j, layer in enumerate(sliding)})
        self.parts = {kind: part for kind, part in (("full_attention", self.full), ("sliding_attention", self.ring))
                      if part is not None}
        self.max_len, self.sliding_window = max_len, sliding_window

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, dtype: torch.dtype | None = None,
                  spare: int = 0) -> "HybridKVCache":
        c = model.config
        return cls(c.layer_types, batch, c.n_kv_heads, max_len, c.head_dim, c.sliding_window,
                   dtype or model.dtype, model.device, spare)

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """Each part plans this step -> {layer type: the positions its slots hold} (the contract)."""
        return {kind: part.prepare(input_pos) for kind, part in self.parts.items()}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] into the part holding `layer`; return what its attention reads."""
        part, j = self.where[layer]
        return part.update(j, k, v)

    def reset(self) -> None:
        for part in self.parts.values():
            part.reset()

    def layer_tensors(self) -> list[Tensor]:
        return [t for part in self.parts.values() for t in part.layer_tensors()]

    @property
    def nbytes(self) -> int:
        """The full layers' whole allocation plus the rings and their positions."""
        return sum(part.nbytes for part in self.parts.values())

    @property
    def peak_nbytes(self) -> int:
        return sum(part.peak_nbytes for part in self.parts.values())

    device_nbytes = nbytes
