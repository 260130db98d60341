"""`make_cache`: the one place that builds the cache a GenerationConfig selects (the contract is
contract.py; which features combine, combinations.py)."""

from __future__ import annotations

import math

from ..run_rules import Run, check_run
from ..places import RAGGED_REFUSED, check_rows
from ..config import GenerationConfig
from ..numerics.precision import DTYPES
from .contiguous import KVCache
from .h2o import HeavyHitterCache
from .hybrid import HybridKVCache
from .offload import OffloadedKVCache
from .paged import PagedKVCache
from .quantized import QuantizedKVCache, QuantizedPagedKVCache
from .rowwise import RowwiseCache
from .window import WindowKVCache


def make_cache(model, config: GenerationConfig, batch: int, max_len: int, pool_rows: int | None = None,
               ragged: bool = False):
    """The cache `config` selects for `batch` rows of up to `max_len` positions; None for the naive loop.
    A paged pool holds `pool_rows` rows (default `batch`; more for rows forked later).
    ragged=True: a cache that takes per-row positions [B, T] (features that cannot are refused,
    places.RAGGED_REFUSED); the quantized caches then run one cache per row (rowwise.py).

    Storage is contiguous or paged (cache_chunk_size), in kv_dtype (default: the weights' dtype);
    a model trained with sliding layers (ModelConfig.layer_types) gets the hybrid cache (hybrid.py)
    unless a feature below chooses the storage: those keep every position of every layer, and the
    model still masks each sliding layer to its window;
    values full precision or quantized (quant_bits); what is kept all, a window with sinks
    (window_size) or heavy hitters (kv_budget); with prefetch_depth, an offload tier wraps it.
    config.py's REFUSED says which pairs combine.
    """
    if ragged:
        check_rows(config, "a ragged batch (rows at different positions)", RAGGED_REFUSED)
        if config.quant_bits is not None:
            return RowwiseCache([make_cache(model, config, 1, max_len) for _ in range(batch)])
    if not config.use_cache:
        return None
    check_run(config, Run.of_shapes(model.config))  # the rules that read the model's shapes (head dim)
    c, device = model.config, model.device
    dtype = DTYPES[config.kv_dtype] if config.kv_dtype is not None else model.dtype  # storage (chapter 9)
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
        spare = config.num_speculative_tokens if config.speculative_method else 0  # what a rewind may need back
        cache = WindowKVCache(L, batch, c.n_kv_heads, c.head_dim, window, sinks, dtype=dtype, device=device,
                              spare=spare)
    elif c.sliding_layers and config.prefetch_depth is None:  # the model's own windows: a ring per sliding layer
        spare = config.num_speculative_tokens if config.speculative_method else 0
        cache = HybridKVCache(c.layer_types, batch, c.n_kv_heads, max_len,
                              c.head_dim, c.sliding_window, dtype=dtype, device=device, spare=spare)
    else:
        cache = KVCache(L, batch, c.n_kv_heads, max_len, c.head_dim, dtype=dtype, device=device)
    if config.prefetch_depth is not None:
        cache = OffloadedKVCache(cache, c.n_layers, config.prefetch_depth)
    return cache
