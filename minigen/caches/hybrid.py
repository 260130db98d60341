"""The hybrid cache of models trained with sliding windows (Mistral, Qwen2, Gemma 2 and 3): a
ring of `sliding_window` slots for each sliding layer, every position for each full layer, one
object behind the cache contract (chapter 7).

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

The serving engine's form, HybridPagedKVCache, keeps the same split in blocks: full layers in the
engine's pool (paged.py over its prefix-caching allocator), sliding layers in a second pool whose
blocks go back as they leave the window, sized so that it never runs out (vLLM's hybrid KV-cache
manager: one group of blocks per kind of layer).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .contiguous import KVCache
from .contract import ANY_LAYER
from .paged import PagedKVCache
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

    def reserve(self, input_pos: Tensor) -> None:
        """Nothing to hand out before the forward: both parts are preallocated (the contract)."""

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """Each part plans this step -> {layer type: the positions its slots hold} (the contract)."""
        return {kind: part.prepare(input_pos)[ANY_LAYER] for kind, part in self.parts.items()}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] into the part holding `layer`; return what its attention reads."""
        part, j = self.where[layer]
        return part.update(j, k, v)

    def reset(self) -> None:
        for part in self.parts.values():
            part.reset()

    def reorder_rows(self, index: Tensor) -> None:
        """Row b takes what row index[b] held, in both parts (beam search, beam.py): index [B], in place."""
        for part in self.parts.values():
            part.reorder_rows(index)

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


class HybridPagedKVCache:
    """The serving engine's cache (serving/engine.py) for a model with sliding layers: two pools of
    blocks, as vLLM's hybrid KV-cache manager keeps one group of blocks per kind of layer.

    Full layers live in a PagedKVCache over the engine's own allocator (a PrefixAllocator, which
    its scheduler reads: admission, preemption); the engine's sequence ids are that pool's. Sliding
    layers live in a second PagedKVCache over a plain BlockAllocator of `sliding_blocks` blocks,
    with window_size=sliding_window and no sinks, so each block wholly outside the window goes
    back to that pool (paged.py). Each engine sequence gets its own sequence in the sliding pool on
    first sight (`select_rows`); `free(seq)` gives both back.

    The sliding pool never runs out when it holds `sliding_pool_blocks(...)` blocks: a step that
    writes positions a .. e - 1 (T = e - a tokens) first frees every block whose last position is
    before a - W + 1 (paged.py, before it allocates), so during and after the step a row holds only
    blocks touching a - W + 1 .. e - 1, n = W + T - 1 positions. n positions touch at most
    1 + ceil((n - 1) / bs) blocks (the most when the first of them sits in a block's last slot);
    a row never holds more than its context's blocks either. At most max_batch_size rows are alive
    at once, so max_batch_size times that bound is enough (tests/test_hybrid_engine.py checks it
    by exhaustion over small sizes, and that some alignment reaches it).
    """
    observers = ()

    def __init__(self, layer_types: tuple[str, ...], n_kv_heads: int, head_dim: int, block_size: int,
                 allocator, sliding_window: int, sliding_blocks: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        # the full pool is the engine's bookkeeping even without full layers (then it holds no tensors)
        self.full = PagedKVCache(len(full), 0, n_kv_heads, head_dim, block_size, allocator.n_blocks, dtype, device,
                                 allocator=allocator)
        self.ring = PagedKVCache(len(sliding), 0, n_kv_heads, head_dim, block_size, sliding_blocks, dtype, device,
                                 window_size=sliding_window, sink_tokens=0)
        self.where = {layer: (self.full, j) for j, layer in enumerate(full)}
        self.where.update({layer: (self.ring, j) for j, layer in enumerate(sliding)})
        self.kinds = [kind for kind, layers in (("full_attention", full), ("sliding_attention", sliding)) if layers]
        self.sliding_of: dict[int, int] = {}  # engine (full pool) sequence -> its sequence in the sliding pool
        self.sliding_window, self.block_size = sliding_window, block_size

    @staticmethod
    def sliding_pool_blocks(max_batch_size: int, sliding_window: int, block_size: int, context: int,
                            step_tokens: int) -> int:
        """Blocks the sliding pool needs so that it never runs out (the class docstring proves the bound):
        rows x min(the context's blocks, the blocks a window and a step's `step_tokens` new tokens
        touch, 1 + ceil((window + step_tokens - 2) / bs))."""
        per_row = min(math.ceil(context / block_size),
                      1 + math.ceil((sliding_window + min(step_tokens, context) - 2) / block_size))
        return max_batch_size * per_row

    def reserve(self, input_pos: Tensor) -> None:
        """Both pools give the rows this step's blocks, before the forward (paged.py's reserve): the
        full pool's are usually the engine's already (its scheduler claims them); the sliding pool
        frees the blocks that left the window, then allocates."""
        self.full.reserve(input_pos)
        self.ring.reserve(input_pos)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write's data in the full pool, whose allocator is the engine's (contract.BlockCache)."""
        self.full.copy_blocks(copies)

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """Both pools read their block tables -> {layer type: key positions [B, S]} (the contract).
        The full pool reads even without full layers: the engine schedules by it."""
        key_pos = {"full_attention": self.full.prepare(input_pos)[ANY_LAYER],
                   "sliding_attention": self.ring.prepare(input_pos)[ANY_LAYER]}
        return {kind: key_pos[kind] for kind in self.kinds}

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] into the pool holding `layer`; return what its attention reads."""
        part, j = self.where[layer]
        return part.update(j, k, v)

    def select_rows(self, sequences: list[int]) -> None:
        """The engine's sequences (the full pool's ids) the next forward runs; each gets its own
        sequence in the sliding pool the first time it is seen."""
        self.full.select_rows(sequences)
        for seq in sequences:
            if seq not in self.sliding_of:
                self.sliding_of[seq] = self.ring.add_sequence()
        self.ring.select_rows([self.sliding_of[seq] for seq in sequences])

    def free(self, seq: int | None = None) -> None:
        """Give back the sliding pool's blocks of engine sequence `seq` (its full blocks are the
        engine's: it frees them in its allocator, which keeps full blocks for prefix hits); None:
        every sequence of the current rows, in both pools."""
        if seq is None:
            for s in list(self.full.rows):
                self.free(s)
            self.full.free()
            return
        sliding = self.sliding_of.pop(seq, None)
        if sliding is not None:
            self.ring.free_sequence(sliding)
        self.full.rows = [r for r in self.full.rows if r != seq]

    def reset(self) -> None:
        self.full.reset()
        self.ring.reset()

    def layer_tensors(self) -> list[Tensor]:
        return [*self.full.layer_tensors(), *self.ring.layer_tensors()]

    @property
    def nbytes(self) -> int:
        """Both pools, whole, their block tables and their gather buffers."""
        return self.full.nbytes + self.ring.nbytes

    @property
    def peak_nbytes(self) -> int:
        return self.full.peak_nbytes + self.ring.peak_nbytes

    device_nbytes = nbytes

    @property
    def blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks in the pool), both pools together."""
        (full_used, full_pool), (ring_used, ring_pool) = self.full.blocks, self.ring.blocks
        return full_used + ring_used, full_pool + ring_pool
