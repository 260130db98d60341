"""The article's window on its paged cache frees whole blocks (chapter 17, section 3): the blocks the
model in article_bench says a row holds are the ones minigen's paged cache keeps, and the C6 memory
model counts those blocks."""

import pytest
import torch

from minigen.caches.paged import PagedKVCache
from minigen.measure import article_bench as ab


@pytest.mark.parametrize("prompt", [300, 1024, 2047, 2100])
def test_window_blocks_are_the_blocks_the_paged_cache_keeps(prompt):
    cache = PagedKVCache(1, 1, 1, 4, block_size=256, n_blocks=12, window_size=128, sink_tokens=ab.SINK_TOKENS)
    cache.reserve(torch.arange(prompt))  # the prompt, then one decode step at position `prompt`
    cache.reserve(torch.tensor([prompt]))
    table = cache.allocator.tables[cache.rows[0]]
    assert [j for j, b in enumerate(table) if b >= 0] == ab.window_blocks(prompt, 128, ab.SINK_TOKENS, 256)
    assert all(b == -1 for j, b in enumerate(table) if j not in ab.window_blocks(prompt))


def test_freed_per_block_the_7b_fit_misses_12_7_gb():
    # the sinks' block and two that a straddling window touches: 3 x 256 slots, not 128 + 4
    assert ab.paged_window_slots(2048) == 768 and ab.paged_window_slots(200) == 256
    rows = {(c.model, c.batch): c for c in ab.a100_table(block=256)}
    ring = {(c.model, c.batch): c for c in ab.a100_table()}
    seven, seven_ring = rows["Llama-2-7B", 24], ring["Llama-2-7B", 24]
    assert seven_ring.optimized_memory < seven.optimized_memory
    assert ab.matches(seven_ring)["12.7 GB"] and not ab.matches(seven)["12.7 GB"]
