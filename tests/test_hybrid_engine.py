"""The serving Engine on models that bring their own sliding window (Mistral; Qwen2 with sliding
layers): full layers in the engine's pool, sliding layers in a bounded pool of windows
(caches/hybrid.py, HybridPagedKVCache).

Oracle: `transformers`' own greedy generate of each request alone, on the same tiny random model
(fp32, eager attention), which applies each layer's window as its modelling code says. Sizes: a
window of 8, prompts of 5 to 30 tokens and 16 new ones, so prompts and generations both run past
the window; blocks of 4 tokens, so the window spans several blocks and blocks leave it.
"""

from __future__ import annotations

import math

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import Engine, GenerationConfig
from minigen.caches.hybrid import HybridPagedKVCache
from minigen.caches.paged import PagedKVCache
from minigen.measure import plan as planner

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW, NEW, BS = 8, 16, 4
LENGTHS = (5, 30, 12, 21, 9)
KINDS = {"mistral": dict(sliding_window=WINDOW),  # every layer slides
         "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                       num_hidden_layers=3)}  # layer 0 full, layers 1 and 2 sliding


@pytest.fixture(scope="module", params=list(KINDS))
def sliding(request):
    """(kind, minigen model, prompts, transformers' greedy tokens of each prompt alone)."""
    hf = tiny_hf(request.param, **KINDS[request.param])
    model = minigen.from_hf(hf)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=g) for n in LENGTHS]
    with torch.no_grad():
        want = [hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW,
                            do_sample=False)[0] for p in prompts]
    return request.param, model, prompts, want


def engine(model, **kw) -> Engine:
    return Engine(model, GenerationConfig(stop_token_ids=[], cache_chunk_size=BS), max_batch_size=3, **kw)


def step_all(e: Engine, budget: int | None) -> dict:
    """Run the engine step by step, checking the sliding pool's bound after every step -> run()'s tokens."""
    c = e.model.config
    step_tokens = min(budget or c.max_seq_len, c.max_seq_len)
    per_row = min(math.ceil(c.max_seq_len / BS), 1 + math.ceil((WINDOW + step_tokens - 2) / BS))
    ring = e.cache.ring.allocator
    freed = 0  # block-table entries given back because they left the window
    while e.unfinished():
        e.step()
        held = {seq: sum(b >= 0 for b in table) for seq, table in ring.tables.items()}
        assert len(held) <= e.max_batch_size and all(n <= per_row for n in held.values()), held
        assert ring.n_used <= e.sliding_blocks == e.max_batch_size * per_row
        freed = max(freed, sum(b < 0 for table in ring.tables.values() for b in table))
    assert freed > 0  # the window really gave blocks back: the bound is not a uniform pool's
    assert ring.n_used == 0 and not e.cache.sliding_of  # every finished request freed its window
    return e.run()


@pytest.mark.parametrize("num_blocks,budget", [(None, None), (None, 7), (12, 7), (13, None)])
def test_engine_tokens_equal_transformers_past_the_window(sliding, num_blocks, budget):
    """Several requests longer than the window, batched 3 at a time, whole or chunked by a budget, and
    with a pool so small that requests are preempted and recomputed: each one's tokens are
    transformers' greedy tokens for it alone."""
    kind, model, prompts, want = sliding
    e = engine(model, num_blocks=num_blocks, max_num_batched_tokens=budget)
    assert isinstance(e.cache, HybridPagedKVCache)
    for p in prompts:
        e.add_request(p, max_new_tokens=NEW, arrival_s=0.0)
    got = step_all(e, budget)
    for i, w in enumerate(want):
        assert torch.equal(got[i], w), (kind, i)
    if num_blocks is not None:
        assert e.preemptions > 0  # the small pool did force recomputation


def test_prefix_sharing_requests_get_the_right_tokens_without_hits(sliding):
    """Two requests sharing a prefix of 20 tokens, the second arriving after the first finished (its
    blocks are cached): both get transformers' tokens, and no position is served from a cached block,
    which would lack the sliding layers' keys. The same workload on a model without sliding layers
    does hit, so the scenario would show a hit."""
    kind, model, prompts, _ = sliding
    prefix = prompts[1][:20]
    pair = [torch.cat([prefix, prompts[0]]), torch.cat([prefix, prompts[4]])]
    singles = [minigen.generate(model, p[None], max_new_tokens=NEW, stop_token_ids=[]).tokens[0] for p in pair]

    def serve(m):
        e = engine(m)
        first = e.add_request(pair[0], max_new_tokens=NEW)
        e.run()
        second = e.add_request(pair[1], max_new_tokens=NEW)
        return e, e.run(), first, second

    e, got, first, second = serve(model)
    assert torch.equal(got[first], singles[0]) and torch.equal(got[second], singles[1])
    assert e.metrics()["prefix_cache_hit_rate"] == 0 and e.hit_tokens == 0
    plain, _, _, _ = serve(minigen.from_hf(tiny_hf("llama")))
    assert plain.hit_tokens > 0


def test_generate_matches_transformers_too(sliding):
    """The other oracle the engine's tokens are held against (test_engine.py): generate alone."""
    _, model, prompts, want = sliding
    for p, w in zip(prompts, want):
        assert torch.equal(minigen.generate(model, p[None], max_new_tokens=NEW, stop_token_ids=[]).tokens[0], w)


def test_cancel_and_finish_free_the_window_pool(sliding):
    """A cancelled request's window blocks go back at once; after the run both pools are empty."""
    _, model, prompts, want = sliding
    e = engine(model)
    ids = [e.add_request(p, max_new_tokens=NEW, arrival_s=0.0) for p in prompts[:3]]
    e.step()
    e.step()
    used = e.cache.ring.allocator.n_used
    seq = e.requests[ids[1]].seq
    assert seq in e.cache.sliding_of
    e.cancel(ids[1])
    assert seq not in e.cache.sliding_of and e.cache.ring.allocator.n_used < used
    got = e.run()
    assert torch.equal(got[ids[0]], want[0]) and torch.equal(got[ids[2]], want[2])
    assert e.cache.ring.allocator.n_used == 0 and e.alloc.tables == {}


def test_an_imposed_window_keeps_one_pool(sliding):
    """window_size (with sinks) masks every layer itself: the engine keeps its one windowed pool, and
    each request's tokens equal generate's with the same window."""
    _, model, prompts, _ = sliding
    config = GenerationConfig(stop_token_ids=[], cache_chunk_size=BS, window_size=6, sink_tokens=2)
    e = Engine(model, config, max_batch_size=3)
    assert type(e.cache) is PagedKVCache and e.sliding_blocks == 0
    for p in prompts[:3]:
        e.add_request(p, max_new_tokens=NEW, arrival_s=0.0)
    got = e.run()
    for i, p in enumerate(prompts[:3]):
        assert torch.equal(got[i], minigen.generate(model, p[None], config, max_new_tokens=NEW).tokens[0])


@pytest.mark.parametrize("window", [1, 3, 8, 9])
@pytest.mark.parametrize("block_size", [1, 3, 4])
@pytest.mark.parametrize("step", [1, 2, 5, 7])
def test_the_window_pool_bound_holds_and_is_reached(window, block_size, step):
    """The bound of sliding_pool_blocks, by exhaustion over small sizes: one sequence written `step`
    tokens at a time (after a first chunk of 1..step tokens, which shifts every later step against the
    blocks) through a windowed paged cache whose pool holds just the bound never runs out (it would
    raise CacheFullError), and for some alignment it holds all of them: no smaller pool is safe."""
    context = 60
    bound = HybridPagedKVCache.sliding_pool_blocks(1, window, block_size, context, step)
    most = 0
    for first in range(1, step + 1):
        cache = PagedKVCache(0, 1, 1, 1, block_size, bound, window_size=window)
        start, end = 0, first
        while start < context:
            cache.reserve(torch.arange(start, min(end, context))[None])  # CacheFullError past the bound
            most = max(most, cache.allocator.n_used)
            start, end = end, end + step
    assert most == bound, (most, bound)
