"""The cache contract (minigen/caches/contract.py), checked the same way on every cache class.

Oracle: the keys and values written, position by position, kept in a plain dict by the test; a
cache must give back exactly those of the positions it says it holds (8-bit caches: within half a
quantization step), and nothing of an older sequence.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import CacheFullError, GenerationConfig
from minigen.caches.contract import Cache, positions_of
from minigen.caches.make import make_cache
from minigen.run_plan import make_policy
from minigen.steps.eager import decode_step, prefill
from minigen.caches.blocks import BlockAllocator
from minigen.caches.h2o import HeavyHitterCache
from minigen.caches.hybrid import HybridKVCache, HybridPagedKVCache
from minigen.caches.contiguous import KVCache
from minigen.caches.offload import OffloadedKVCache
from minigen.caches.paged import PagedKVCache
from minigen.caches.quantized import QuantizedKVCache, QuantizedPagedKVCache
from minigen.caches.rowwise import RowwiseCache
from minigen.caches.window import WindowKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

L, B, Hkv, Dh = 2, 2, 2, 8
TYPES = ("full_attention", "sliding_attention")  # the hybrid caches' layers: one of each kind


def hybrid_paged(n_blocks: int = B * 16) -> HybridPagedKVCache:
    """The serving engine's hybrid cache, its rows one fresh sequence each of the full pool."""
    alloc = BlockAllocator(n_blocks, 4)
    cache = HybridPagedKVCache(TYPES, Hkv, Dh, 4, alloc, sliding_window=8,
                               sliding_blocks=HybridPagedKVCache.sliding_pool_blocks(B, 8, 4, 64, 8))
    cache.select_rows([alloc.add_sequence() for _ in range(B)])
    return cache
FACTORIES = {  # small instances of every cache class, all holding at least 8 positions per row
    "contiguous": lambda: KVCache(L, B, Hkv, 64, Dh),
    "window": lambda: WindowKVCache(L, B, Hkv, Dh, window_size=8, sink_tokens=2),
    "heavy hitters": lambda: HeavyHitterCache(L, B, Hkv, Dh, kv_budget=8),
    "paged": lambda: PagedKVCache(L, B, Hkv, Dh, block_size=4, n_blocks=B * 16),
    "quantized": lambda: QuantizedKVCache(L, B, Hkv, 64, Dh, bits=8, group_size=4, residual=4),
    "quantized paged": lambda: QuantizedPagedKVCache(L, B, Hkv, Dh, block_size=4, n_blocks=B * 16, bits=8,
                                                     group_size=4),
    "offloaded": lambda: OffloadedKVCache(KVCache(L, B, Hkv, 64, Dh), n_layers=L + 1, prefetch_depth=1),
    "hybrid": lambda: HybridKVCache(TYPES, B, Hkv, 64, Dh, sliding_window=8),
    "hybrid paged": hybrid_paged,
}
LAYERS = {"offloaded": L + 1}  # the offload tier serves more layers than its inner cache holds
# 8-bit codes in groups of 4 of N(0, 1) values: an error of at most half a step, (max - min) / 255 / 2
TOLERANCE = {"quantized": 0.05, "quantized paged": 0.05}


def cache_classes() -> set[type]:
    """Every class of minigen.caches that implements the contract's two moves (prepare, update)."""
    found = set()
    for info in pkgutil.iter_modules(minigen.caches.__path__, "minigen.caches."):
        for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
            if cls.__module__ == info.name and {"prepare", "update"} <= set(vars(cls)) and cls is not Cache:
                found.add(cls)
    return found


def test_every_cache_class_is_covered():
    built = {type(make()) for make in FACTORIES.values()}
    classes = cache_classes()
    assert KVCache in classes and PagedKVCache in classes  # the discovery sees the package
    assert built == classes - {RowwiseCache}  # one cache per row: its rows are the classes above


class Written:
    """What the test wrote: position -> k, v [L, B, Hkv, Dh] of every layer and row."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def new(self, positions: range, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh k, v [layers, B, Hkv, T, Dh] for these positions, remembered per position."""
        T = len(positions)
        k, v = (torch.randn(layers, B, Hkv, T, Dh, generator=self.g) for _ in range(2))
        for i, p in enumerate(positions):
            self.k[p], self.v[p] = k[:, :, :, i], v[:, :, :, i]
        return k, v


def layer_pos(key_pos, layer: int):
    """The key positions `layer` reads: a hybrid cache answers prepare per kind of layer (TYPES)."""
    return positions_of(key_pos, TYPES[layer] if layer < len(TYPES) else "full_attention")  # (the tier's extra layer)


def touched(cache, layer: int) -> tuple[list, int]:
    """(the tensors holding `layer`, its index in them): a hybrid cache keeps it in one part."""
    part, j = cache.where[layer] if hasattr(cache, "where") else (cache, layer)
    return part.layer_tensors(), j


def step(cache, written: Written, positions: range, layers: int):
    """One forward's worth of cache calls -> per layer (key positions [B, S], k and v read [B, Hkv, S, Dh])."""
    k_new, v_new = written.new(positions, layers)
    cache.reserve(torch.tensor(list(positions)))  # the blocks, before the forward
    key_pos = cache.prepare(torch.tensor(list(positions)))
    reads = []
    for layer in range(layers):
        before = [t.clone() for t in cache.layer_tensors()]
        k, v = cache.update(layer, k_new[layer], v_new[layer])
        pos = layer_pos(key_pos, layer)
        assert k.shape == v.shape == (B, Hkv, pos.shape[-1], Dh), (k.shape, pos.shape)
        reads.append((pos.expand(B, -1), k.clone(), v.clone()))
        if not isinstance(cache, OffloadedKVCache):  # (the tier's slots map layers differently)
            own, j = touched(cache, layer)
            for t, old in zip(cache.layer_tensors(), before):  # update(layer) touches only that layer
                other = [i for i in range(t.shape[0]) if not (i == j and any(t is o for o in own))]
                assert torch.equal(t[other], old[other]), "update() changed another layer's state"
    return reads


def check_read(name, reads, written: Written, newest: range) -> None:
    """Every slot a query of this step can see (holding a position p in [0, newest]) gives back what
    was written at p; p at most once per row; this step's positions always there. (A slot holding
    a later position, like the contiguous cache's slots not yet written, is hidden by causality.)"""
    atol = TOLERANCE.get(name, 0.0)
    for layer, (key_pos, k, v) in enumerate(reads):
        for row in range(B):
            visible = [int(p) for p in key_pos[row] if 0 <= p <= newest[-1]]
            assert len(visible) == len(set(visible)), f"row {row} holds a position twice: {sorted(visible)}"
            assert set(newest) <= set(visible)
            for s, p in enumerate(key_pos[row].tolist()):
                if 0 <= p <= newest[-1]:
                    torch.testing.assert_close(k[row, :, s], written.k[p][layer, row], atol=atol, rtol=0)
                    torch.testing.assert_close(v[row, :, s], written.v[p][layer, row], atol=atol, rtol=0)


@pytest.mark.parametrize("name", FACTORIES)
def test_prepare_then_update_gives_back_what_was_written(name):
    cache, layers = FACTORIES[name](), LAYERS.get(name, L)
    assert isinstance(cache, Cache)
    assert isinstance(cache.observers, tuple) and all(callable(o) for o in cache.observers)
    written, start = Written(0), 0
    for size in (5, 1, 3, 1, 1, 6, 1, 1, 4, 1):  # a prompt, then appends of several tokens and of one
        positions = range(start, start + size)
        check_read(name, step(cache, written, positions, layers), written, positions)
        assert cache.peak_nbytes >= cache.nbytes >= cache.device_nbytes > 0
        if cache.blocks is not None:
            used, pool = cache.blocks
            assert 0 < used <= pool
        start += size


@pytest.mark.parametrize("how", ["position 0", "reset"])
@pytest.mark.parametrize("name", FACTORIES)
def test_a_new_sequence_never_sees_the_old_one(name, how):
    """Regression: a ring buffer reused for a new prompt attended the old sequence's sinks."""
    cache, layers = FACTORIES[name](), LAYERS.get(name, L)
    old = Written(1)
    for positions in (range(0, 12), range(12, 13), range(13, 20)):
        step(cache, old, positions, layers)
    if how == "reset":
        cache.reset()
    new = Written(2)
    for positions in (range(0, 5), range(5, 6)):
        check_read(name, step(cache, new, positions, layers), new, positions)  # only the new sequence's values


@pytest.mark.parametrize("name", FACTORIES)
def test_peak_bytes_never_fall(name):
    cache, layers = FACTORIES[name](), LAYERS.get(name, L)
    written, peaks = Written(3), []
    for positions in (range(0, 20), range(20, 21), range(21, 22)):
        step(cache, written, positions, layers)
        peaks.append(cache.peak_nbytes)
    assert peaks == sorted(peaks) and peaks[-1] >= cache.nbytes


# ---------------------------------------------------------------- the paged allocator's step
def allocator_state(cache: PagedKVCache):
    a = cache.allocator
    return (list(a.free), list(a.refs), list(a.fill), {s: list(t) for s, t in a.tables.items()}, dict(a.lengths))


@pytest.mark.parametrize("name", ["paged", "quantized paged"])
def test_a_rejected_step_leaves_the_allocator_untouched(name):
    """Regression: row 0 took its block before row 1 found the pool empty, and kept it."""
    cache = FACTORIES[name]()
    written = Written(4)
    step(cache, written, range(0, 4 * 16 - 4), L)  # 15 of 16 blocks per row: 30 of 32 in use
    step(cache, written, range(60, 64), L)
    before = allocator_state(cache)
    with pytest.raises(CacheFullError, match="needs 2 more blocks and 0 are free"):
        cache.reserve(torch.tensor([64]))
    assert allocator_state(cache) == before


def test_a_window_frees_blocks_before_a_step_needs_them():
    """A full pool is not full when the window gives blocks back in the same step."""
    cache = PagedKVCache(L, B, Hkv, Dh, block_size=4, n_blocks=2 * B, window_size=4, sink_tokens=0)
    written = Written(5)
    for p in range(40):  # needs a new block every 4 positions; the window frees the old ones
        step(cache, written, range(p, p + 1), L)
    assert cache.blocks == (B, 2 * B)  # positions 36..39: one block per row; the rest went back


# ---------------------------------------------------------------- no host sync, and torch.compile
@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


SYNC_FREE = {"contiguous": GenerationConfig(), "window": GenerationConfig(window_size=6, sink_tokens=2),
             "hybrid": GenerationConfig()}
# the hybrid cache is the default of a model trained with windows: a Qwen2 with layer 0 full and
# layer 1 sliding over 4 tokens, so the steps below run past the window
SLIDING = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)


def sync_free_model(name: str):
    return minigen.from_hf(tiny_hf("qwen2", **SLIDING) if name == "hybrid" else tiny_hf("llama"))


@pytest.mark.parametrize("name", SYNC_FREE)
def test_the_decode_step_reads_no_tensor_value_on_the_host(tiny, name):
    """On the meta device, where tensors have shapes but no values, anything that reads a value
    on the host (.item(), int(), bool(), a data-dependent shape) raises: the decode step runs."""
    config = SYNC_FREE[name]
    model = sync_free_model(name).to("meta")
    cache = make_cache(model, config, 2, 16)
    assert isinstance(cache, HybridKVCache) == (name == "hybrid")
    policy = make_policy(config, cache)
    with torch.inference_mode():
        for p in range(3, 9):  # the prompt's step is allowed to sync; decode steps are not
            logits = decode_step(model, torch.zeros(2, 1, dtype=torch.long, device="meta"),
                                 torch.tensor([p], device="meta"), cache, policy)
    assert logits.shape == (2, model.config.vocab_size)


def test_the_meta_device_check_catches_a_cache_that_syncs(tiny):
    """The paged cache plans its blocks on the host (one sync per step): the check above sees it."""
    config = GenerationConfig(cache_chunk_size=4)
    model = minigen.from_hf(tiny_hf("llama")).to("meta")
    cache = make_cache(model, config, 1, 16)
    with torch.inference_mode(), pytest.raises((RuntimeError, NotImplementedError)):
        decode_step(model, torch.zeros(1, 1, dtype=torch.long, device="meta"), torch.tensor([0], device="meta"), cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", SYNC_FREE)
def test_the_decode_step_compiles_as_one_graph(tiny, name):
    """torch.compile(fullgraph=True) fails on any graph break (a host sync, a Python list of
    positions); the compiled step must also give eager's logits, step after step, without recompiling."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    config, T, n = SYNC_FREE[name], 5, 10
    tiny = sync_free_model(name) if name == "hybrid" else tiny
    ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(0))
    eager_cache, compiled_cache = make_cache(tiny, config, 2, T + n), make_cache(tiny, config, 2, T + n)
    policy = make_policy(config, eager_cache)
    compiled = torch.compile(decode_step, fullgraph=True)
    with torch.inference_mode():
        tokens = [prefill(tiny, ids, c, policy).argmax(-1) for c in (eager_cache, compiled_cache)]
        for i in range(n - 1):
            pos = torch.tensor([T + i])
            want = decode_step(tiny, tokens[0][:, None], pos, eager_cache, policy)
            got = compiled(tiny, tokens[1][:, None], pos, compiled_cache, policy)
            # the same fp32 math, fused differently by inductor: a few ulps on logits of size ~5
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            tokens = [want.argmax(-1), got.argmax(-1)]
            assert torch.equal(tokens[0], tokens[1])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # compiled once, every step reused it


# ---------------------------------------------------------------- per-row positions [B, T] (ragged batches)
ONE_ROW = {  # batch-1 instances for the caches that take per-row positions one row at a time (rowwise.py)
    "quantized": lambda: QuantizedKVCache(L, 1, Hkv, 64, Dh, bits=8, group_size=4, residual=4),
    "quantized paged": lambda: QuantizedPagedKVCache(L, 1, Hkv, Dh, block_size=4, n_blocks=16, bits=8, group_size=4),
}
NATIVE_ROWS = ("contiguous", "paged", "window", "hybrid", "hybrid paged")  # take [B, T] themselves
NO_ROWS = ("heavy hitters", "offloaded")  # refuse it (make_cache refuses their features for a ragged batch)


@pytest.mark.parametrize("name", FACTORIES)
def test_per_row_positions_give_back_each_rows_own_writes(name):
    """Rows at different positions in one call, padding (-1) in between: each row reads back exactly
    what was written at its own positions, and padding is never written."""
    from minigen.caches.rowwise import RowwiseCache
    if name in NO_ROWS:
        with pytest.raises(minigen.PositionError, match=r"one position vector \[T\].*ragged=True"):
            FACTORIES[name]().prepare(torch.tensor([[0, 1], [0, -1]]))
        return
    cache = FACTORIES[name]() if name in NATIVE_ROWS else RowwiseCache([ONE_ROW[name](), ONE_ROW[name]()])
    g, written = torch.Generator().manual_seed(6), [{}, {}]  # per row: position -> k, v [L, Hkv, Dh]
    lengths = [0, 0]
    for sizes in ((5, 2), (1, 1), (0, 3), (1, 0), (2, 1), (1, 1), (6, 1), (1, 1)):  # 0: the row sits this step out
        T = max(sizes)
        pos = torch.full((B, T), -1)
        for row, n in enumerate(sizes):  # left padding, as generate lays a ragged prompt out
            pos[row, T - n:] = torch.arange(lengths[row], lengths[row] + n)
        k_new, v_new = (torch.randn(L, B, Hkv, T, Dh, generator=g) for _ in range(2))
        cache.reserve(pos)
        key_pos = cache.prepare(pos)
        reads = [tuple(t.clone() for t in cache.update(layer, k_new[layer], v_new[layer])) for layer in range(L)]
        for row, n in enumerate(sizes):
            for t in range(T - n, T):
                p = int(pos[row, t])
                written[row][p] = (k_new[:, row, :, t], v_new[:, row, :, t])
            lengths[row] += n
            if n == 0:
                continue
            for layer, (k, v) in enumerate(reads):
                held = layer_pos(key_pos, layer).expand(B, -1)[row]
                visible = [int(p) for p in held if 0 <= p < lengths[row]]
                assert sorted(visible) == sorted(set(visible)) and set(range(lengths[row] - n, lengths[row])) <= set(visible)
                for s, p in enumerate(held.tolist()):
                    if 0 <= p < lengths[row]:
                        atol = TOLERANCE.get(name, 0.0)
                        torch.testing.assert_close(k[row, :, s], written[row][p][0][layer], atol=atol, rtol=0)
                        torch.testing.assert_close(v[row, :, s], written[row][p][1][layer], atol=atol, rtol=0)
