"""The cache contract: what every KV cache promises, and `make_cache`, the one place that builds
the cache a GenerationConfig selects.

Shapes: L layers, B batch rows, Hkv key/value heads, T new tokens, S key slots, Dh head dim.

A forward pass uses a cache in two moves:

    key_pos = cache.prepare(input_pos)        once per forward, before the first layer
    k, v = cache.update(layer, k_new, v_new)  once per layer

`prepare(input_pos)` is the only place where a cache's state moves: it allocates blocks,
evicts, rotates a ring buffer, compacts. It returns the position each key slot holds after this
step's write, `[S]` (the same for every row) or `[B, S]` (rows that hold different positions),
with -1 for an empty slot; attention masks are built from these positions (attention.py), so a
cache may store its slots in any order. input_pos is [T], one position vector for every row, or
[B, T], each row at its own positions with -1 for padding (a ragged batch, the serving engine):
padding is never written and never attended. The contiguous and paged caches take [B, T]
themselves; the others refuse it (PositionError), and `make_cache(..., ragged=True)` runs one of
them per row (rowwise.py) or refuses the feature up front (combinations.RAGGED_REFUSED). A write that starts at position p forgets every position
>= p that the cache held: a cache reused for a new sequence (p = 0) never shows the old one's keys.

`update(layer, k, v)` writes the new keys and values [B, Hkv, T, Dh] where `prepare` decided and
returns what attention reads, [B, Hkv, S, Dh]. It touches only that layer's state.

`nbytes` is every byte the cache holds between steps (on all tiers, metadata included; a
preallocated cache counts its whole allocation); `peak_nbytes` the most it has held at any moment,
the short-lived tensors of a step included. `device_nbytes` is the part on the model's device.
`blocks` is (blocks in use, blocks in the pool) for a paged cache, None otherwise. `observers`
are the attention observers the cache needs to see (heavy hitters learn from attention); none for
most. `layer_tensors()` lists the per-layer state, layer first, which an offload tier moves.

The contiguous cache and the ring buffer keep positions on the device and run a decode step
(T = 1) without a host sync or a Python list: what torch.compile(fullgraph=True) and CUDA graphs
need. The others sync once per step (block tables, eviction), which is their bookkeeping.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from .attention import AttentionObserver
from .combinations import RAGGED_REFUSED, check_rows
from .config import GenerationConfig
from .errors import ConfigError
from .h2o import HeavyHitterCache
from .kv_cache import KVCache
from .offload import OffloadedKVCache
from .paged import PagedKVCache
from .precision import DTYPES
from .quant import QuantizedKVCache, QuantizedPagedKVCache
from .rowwise import RowwiseCache
from .window import WindowKVCache


@runtime_checkable
class Cache(Protocol):
    """What every KV cache implements (the module docstring says what each member promises)."""

    observers: tuple[AttentionObserver, ...]

    def prepare(self, input_pos: Tensor) -> Tensor: ...

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def reset(self) -> None: ...

    def layer_tensors(self) -> list[Tensor]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def peak_nbytes(self) -> int: ...

    @property
    def device_nbytes(self) -> int: ...

    @property
    def blocks(self) -> tuple[int, int] | None: ...


CACHE_CLASSES = (KVCache, WindowKVCache, HeavyHitterCache, PagedKVCache, QuantizedKVCache,
                 QuantizedPagedKVCache, OffloadedKVCache)


def check_for_model(config: GenerationConfig, model_config) -> None:
    """The settings whose validity depends on the model's shapes, refused before any work."""
    if config.quant_bits is None:
        return
    G, Dh, bits = config.quant_group_size, model_config.head_dim, config.quant_bits
    if Dh % G:  # values (and keys per token) are grouped over the channels of one head
        per_byte = 8 // bits
        fits = [g for g in range(per_byte, Dh + 1, per_byte) if Dh % g == 0]  # divisors filling whole bytes
        fix = (f"use a divisor of {Dh} that fills whole bytes, e.g. quant_group_size="
               f"{max([g for g in fits if g <= G] or fits[:1])}" if fits else "use quant_bits=8")
        raise ConfigError(f"quant_group_size={G} does not divide this model's head dim {Dh}: values (and "
                          f"keys with quant_key_axis='token') are grouped over the {Dh} channels of a head, "
                          f"so at quant_bits={bits} {fix}")
    bs = config.cache_chunk_size
    if bs is not None and config.quant_key_axis == "channel" and bs % G:
        raise ConfigError(f"cache_chunk_size={bs} is not a multiple of quant_group_size={G}: keys are "
                          f"quantized per channel over {G} tokens of one block, so use "
                          f"cache_chunk_size={G * math.ceil(bs / G)}, or quant_key_axis='token'")


def make_cache(model, config: GenerationConfig, batch: int, max_len: int, pool_rows: int | None = None,
               ragged: bool = False):
    """The cache `config` selects for `batch` rows of up to `max_len` positions; None for the naive loop.
    A paged pool holds `pool_rows` rows (default `batch`; more for rows forked later).
    ragged=True: a cache that takes per-row positions [B, T] (features that cannot are refused,
    combinations.RAGGED_REFUSED); the ring buffer and the quantized caches then run one cache per row.

    Storage is contiguous or paged (cache_chunk_size), in kv_dtype (default: the weights' dtype);
    values full precision or quantized (quant_bits); what is kept all, a window with sinks
    (window_size) or heavy hitters (kv_budget); with prefetch_depth, an offload tier wraps it.
    config.py's REFUSED says which pairs combine.
    """
    if ragged:
        check_rows(config, "a ragged batch (rows at different positions)", RAGGED_REFUSED)
        if config.quant_bits is not None or (config.window_size is not None and config.cache_chunk_size is None):
            return RowwiseCache([make_cache(model, config, 1, max_len) for _ in range(batch)])
    if not config.use_cache:
        return None
    check_for_model(config, model.config)
    c, device = model.config, model.device
    dtype = DTYPES[config.kv_dtype] if config.kv_dtype is not None else model.dtype  # storage (chapter 7)
    # With an offload tier, the device holds only the layers in flight: prefetch_depth + 1.
    L = c.n_layers if config.prefetch_depth is None else min(c.n_layers, config.prefetch_depth + 1)
    window, sinks = config.window_size, (config.sink_tokens if config.window_size is not None else 0)
    quant = dict(bits=config.quant_bits, group_size=config.quant_group_size, key_axis=config.quant_key_axis)
    if config.cache_chunk_size is not None:  # blocks from a pool sized for every row's max_len
        bs = config.cache_chunk_size
        paged = dict(block_size=bs, n_blocks=(pool_rows or batch) * math.ceil(max_len / bs), dtype=dtype, device=device,
                     window_size=window, sink_tokens=sinks)
        if config.quant_bits is not None:
            cache = QuantizedPagedKVCache(L, batch, c.n_kv_heads, c.head_dim, **quant, **paged)
        else:
            cache = PagedKVCache(L, batch, c.n_kv_heads, c.head_dim, **paged)
    elif config.quant_bits is not None:  # a window still applies, through the mask
        cache = QuantizedKVCache(L, batch, c.n_kv_heads, max_len, c.head_dim, residual=config.quant_residual,
                                 dtype=dtype, device=device, **quant)
    elif config.kv_budget is not None:  # kv_budget slots per row, evicting the least attended
        cache = HeavyHitterCache(L, batch, c.n_kv_heads, c.head_dim, config.kv_budget, dtype=dtype, device=device)
    elif window is not None:  # a ring buffer of sinks + window slots, whatever max_len
        cache = WindowKVCache(L, batch, c.n_kv_heads, c.head_dim, window, sinks, dtype=dtype, device=device)
    else:
        cache = KVCache(L, batch, c.n_kv_heads, max_len, c.head_dim, dtype=dtype, device=device)
    if config.prefetch_depth is not None:
        cache = OffloadedKVCache(cache, c.n_layers, config.prefetch_depth)
    return cache
