"""The paged KV cache: token-identical to the contiguous cache, blocks shared and freed correctly.

Oracles: the contiguous KVCache (chapter 2) for every full-precision setting, a batch of n copies
of the prompt for prefix sharing, a float round trip block by block for quantized blocks, and
block counts worked out by hand for the allocator.
"""

from __future__ import annotations

import math

import pytest
import torch

import minigen
from minigen.caches.contract import ANY_LAYER
from conftest import tiny_hf
from minigen import CacheFullError, ConfigError, GenerationConfig
from minigen.caches.make import make_cache
from minigen.evaluate import score
from minigen.generate import parallel_sample
from minigen.caches.paged import PagedKVCache
from minigen.caches.blocks import BlockAllocator
from minigen.caches.quantized import QuantizedPagedKVCache
from minigen.course.simulation import simulate
from minigen.numerics.quant import round_trip


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (2 layers, 4 heads, 2 KV heads, head dim 32) with a 512-token context."""
    torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than the work (conftest.one_thread)
    model = minigen.from_hf(tiny_hf("llama", hidden_size=128, max_position_embeddings=512))
    yield model
    torch.set_num_threads(2)


def random_ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- equivalence with the contiguous cache
@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 256])
def test_paged_logits_equal_contiguous_tiny(tiny, block_size):
    """Teacher-forced in appends of 7 tokens (several per call, crossing block edges); 300
    positions cross a 256-token block too."""
    ids = random_ids(1, 300)
    ref = score(tiny, ids, chunk_size=7)
    got = score(tiny, ids, chunk_size=7, cache_chunk_size=block_size)
    # Same keys, same values, same mask: only the order of fp32 sums differs (the gathered view has
    # fewer masked slots and other strides), a few ulps (1.2e-7 relative) per softmax and product.
    # NLLs are ~5 nats, so 1e-5 relative allows ~100 ulps while a wrong or missing key moves them
    # by far more (a dropped block changes an NLL by > 1e-2 here).
    torch.testing.assert_close(got.nll, ref.nll, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_size", [1, 3, 16, 256])
def test_paged_generate_batch_equals_contiguous_tiny(tiny, block_size):
    prompt = random_ids(2, 250, seed=1)  # 250 + 12: the generation crosses position 256
    ref = minigen.generate(tiny, prompt, max_new_tokens=12, stop_token_ids=[])
    got = minigen.generate(tiny, prompt, max_new_tokens=12, stop_token_ids=[], cache_chunk_size=block_size)
    assert torch.equal(got.tokens, ref.tokens)


@pytest.mark.parametrize("block_size,prompt_len", [(1, 40), (3, 40), (16, 40), (256, 250)])
def test_paged_token_identical_smollm2(smollm2, english_text_ids, block_size, prompt_len):
    """Greedy SmolLM2, a batch of two equal-length English prompts; prompt and generation cross
    block edges (for 256: the generation crosses position 256)."""
    model, _ = smollm2
    ids = english_text_ids
    prompt = torch.stack([ids[:prompt_len], ids[300:300 + prompt_len]])  # [2, T]
    ref = minigen.generate(model, prompt, max_new_tokens=10, stop_token_ids=[])
    got = minigen.generate(model, prompt, max_new_tokens=10, stop_token_ids=[], cache_chunk_size=block_size)
    assert torch.equal(got.tokens, ref.tokens)


def test_make_cache_builds_a_paged_cache_and_counts_its_bytes(tiny):
    cache = make_cache(tiny, GenerationConfig(cache_chunk_size=16), batch=2, max_len=40)
    assert isinstance(cache, PagedKVCache)
    assert cache.allocator.n_blocks == 2 * 3  # ceil(40 / 16) blocks per sequence
    # 2 layers x (K and V) x 6 blocks x 16 slots x 2 KV heads x 32 dims x 4 bytes, no table yet
    assert cache.nbytes == 2 * 2 * 6 * 16 * 2 * 32 * 4


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_block_size_raises_config_error(bad):
    with pytest.raises(ConfigError, match="cache_chunk_size"):
        GenerationConfig(cache_chunk_size=bad)
    with pytest.raises(ConfigError, match="cache_chunk_size"):
        BlockAllocator(n_blocks=4, block_size=bad)


def test_full_pool_raises_cache_full_error_naming_the_fix(tiny):
    cache = PagedKVCache(2, 1, 2, 32, block_size=4, n_blocks=3)  # 12 slots
    cache.reserve(torch.arange(12))  # exactly fits
    tiny(random_ids(1, 12), torch.arange(12), cache)
    with pytest.raises(CacheFullError, match="n_blocks"):
        cache.reserve(torch.tensor([12]))


def test_quantized_blocks_need_whole_groups():
    with pytest.raises(ConfigError, match="multiple of quant_group_size"):
        QuantizedPagedKVCache(1, 1, 2, 32, block_size=16, n_blocks=4, bits=4, group_size=32)


# ---------------------------------------------------------------- the allocator
def test_allocator_counts_blocks_waste_and_frees():
    alloc = BlockAllocator(n_blocks=10, block_size=4)
    a, b = alloc.add_sequence(), alloc.add_sequence()
    alloc.write(a, 0, 9)  # 3 blocks, 9 of 12 slots
    alloc.write(b, 0, 4)  # 1 full block
    assert alloc.n_used == 4 and alloc.used_slots == 13
    assert alloc.waste == pytest.approx(1 - 13 / 16)
    alloc.free_sequence(a)
    assert alloc.n_used == 1 and sorted(alloc.free) == sorted(set(range(10)) - set(alloc.tables[b]))
    alloc.free_sequence(b)
    assert alloc.n_used == 0 and len(alloc.free) == 10


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    alloc = BlockAllocator(n_blocks=10, block_size=4)
    a = alloc.add_sequence()
    alloc.write(a, 0, 6)  # block 0 full, block 1 holds 2 of 4
    (b,) = alloc.fork(a, 1)
    assert alloc.tables[b] == alloc.tables[a] and alloc.n_used == 2
    assert alloc.shared_hit_rate == 1.0
    copies = alloc.write(b, 6, 7)  # b writes into the shared partial block: it gets its own copy
    assert copies == [(alloc.tables[a][1], alloc.tables[b][1])]
    assert alloc.tables[b][0] == alloc.tables[a][0] and alloc.tables[b][1] != alloc.tables[a][1]
    assert alloc.write(a, 6, 7) == []  # a is now the only holder: it writes in place
    alloc.free_sequence(a)
    assert alloc.n_used == 2  # b still holds the shared block 0 and its copy
    alloc.free_sequence(b)
    assert alloc.n_used == 0


def test_simulated_workload_paging_wastes_little():
    """vLLM reports under 4% waste for paging vs 60-80% for contiguous preallocation."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, 200, (64,), generator=g).tolist()
    outputs = torch.randint(1, 400, (64,), generator=g).tolist()
    sim = simulate(list(zip(prompts, outputs)), block_size=16, max_len=600)
    assert sim.paged_waste < 0.04 < 0.5 < sim.contiguous_waste
    assert simulate([(5, 0)], block_size=4, max_len=8).paged_waste == pytest.approx(1 - 5 / 8)


# ---------------------------------------------------------------- prefix sharing
@pytest.mark.parametrize("block_size", [3, 16])
def test_parallel_sample_equals_a_batch_of_copies(tiny, block_size):
    """n forked rows sharing the prompt's blocks sample exactly what a batch of n copies samples."""
    prompt, n, new = random_ids(1, 37, seed=2), 3, 9
    cfg = dict(max_new_tokens=new, do_sample=True, seed=5, stop_token_ids=[])
    got = parallel_sample(tiny, prompt, n, cache_chunk_size=block_size, **cfg)
    ref = minigen.generate(tiny, prompt.expand(n, -1), **cfg)
    assert torch.equal(got.tokens, ref.tokens)
    assert len(set(map(tuple, got.tokens[:, 37:].tolist()))) > 1  # the rows really differ
    T = 37
    assert got.blocks_after_fork == math.ceil(T / block_size)  # the prompt is stored once
    per_row = math.ceil((T + new - 1) / block_size)  # the last sampled token is never written
    assert got.blocks_used == T // block_size + n * (per_row - T // block_size)
    assert got.shared_hit_rate == pytest.approx((T // block_size) / per_row)


def test_parallel_sample_greedy_smollm2(smollm2, english_text_ids):
    model, _ = smollm2
    prompt = english_text_ids[None, :35]
    got = parallel_sample(model, prompt, 2, max_new_tokens=6, stop_token_ids=[], cache_chunk_size=16)
    ref = minigen.generate(model, prompt, max_new_tokens=6, stop_token_ids=[])
    assert torch.equal(got.tokens, ref.tokens.expand(2, -1))


# ---------------------------------------------------------------- window hook
def test_window_frees_blocks_and_matches_the_ring_buffer(tiny):
    prompt = random_ids(1, 30, seed=3)
    cfg = dict(max_new_tokens=20, stop_token_ids=[], window_size=8, sink_tokens=2)
    ref = minigen.generate(tiny, prompt, **cfg)  # W's rolling buffer
    got = minigen.generate(tiny, prompt, cache_chunk_size=4, **cfg)
    assert torch.equal(got.tokens, ref.tokens)
    # Held at the end: the sinks' block and the blocks that overlap the last query's window.
    cache = make_cache(tiny, GenerationConfig(cache_chunk_size=4, **cfg), 1, 50)
    with torch.inference_mode():
        for p in range(49):
            cache.reserve(torch.tensor([p]))  # the blocks, before the forward
            tiny(random_ids(1, 1, seed=p), torch.tensor([p]), cache)
    assert cache.allocator.tables[0][0] >= 0  # sinks stay
    held = [j for j, b in enumerate(cache.allocator.tables[0]) if b >= 0]
    assert held == [0, 10, 11, 12]  # window of query 48: positions 41..48 -> blocks 10..12


def test_window_wider_than_the_text_changes_nothing(tiny):
    prompt = random_ids(1, 30, seed=4)
    ref = minigen.generate(tiny, prompt, max_new_tokens=10, stop_token_ids=[])
    got = minigen.generate(tiny, prompt, max_new_tokens=10, stop_token_ids=[], cache_chunk_size=4,
                           window_size=100)
    assert torch.equal(got.tokens, ref.tokens)


# ---------------------------------------------------------------- quantized blocks
@pytest.mark.parametrize("key_axis", ["channel", "token"])
def test_quantized_blocks_read_back_as_their_round_trip(key_axis):
    """Full blocks come back as dequantize(quantize(block)); the open block and this call's tokens
    in full precision. The oracle quantizes each block the obvious way, on its own."""
    torch.manual_seed(0)
    bs, G, Hkv, Dh = 32, 32, 2, 32
    cache = QuantizedPagedKVCache(1, 2, Hkv, Dh, block_size=bs, n_blocks=8, bits=4, group_size=G,
                                  key_axis=key_axis)
    k_all = torch.randn(2, Hkv, 90, Dh)
    v_all = torch.randn(2, Hkv, 90, Dh)
    for start, end in [(0, 40), (40, 41), (41, 70), (70, 90)]:  # prefill, then appends crossing blocks
        pos = torch.arange(start, end)
        cache.reserve(pos)
        assert torch.equal(cache.prepare(pos)[ANY_LAYER], torch.arange(end))
        k, v = cache.update(0, k_all[:, :, start:end], v_all[:, :, start:end])
        n_q = start // bs * bs  # positions in blocks that were full before this call
        for got, x, axis in [(k, k_all, -2 if key_axis == "channel" else -1), (v, v_all, -1)]:
            blocks = [round_trip(x[:, :, i:i + bs], 4, G, axis) for i in range(0, n_q, bs)]
            expect = torch.cat(blocks + [x[:, :, n_q:end]], dim=2)
            torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)


def test_article_config_runs_and_stays_close(smollm2, english_text_ids, tmp_path):
    """The article's generation_config.json loads and runs as is: paged 256-token blocks, 4-bit,
    window 128, sparsity 0.1, offload with prefetch 2. Quantization alone (4-bit blocks) is measured
    by perplexity on real text: within 5% of full precision (Q's chapter bounds the 4-bit loss)."""
    model, _ = smollm2
    path = tmp_path / "generation_config.json"
    path.write_text('{"cache_chunk_size": 256, "quant_bits": 4, "window_size": 128, '
                    '"sparsity_threshold": 0.1, "prefetch_depth": 2}')
    config = GenerationConfig.from_json(path)
    out = minigen.generate(model, english_text_ids[None, :40], config, max_new_tokens=5)
    assert out.tokens.shape == (1, 45)
    ids = english_text_ids[:600]
    fp = score(model, ids, chunk_size=100).perplexity
    q4 = score(model, ids, chunk_size=100, cache_chunk_size=256, quant_bits=4).perplexity
    assert q4 != fp and abs(q4 / fp - 1) < 0.05


# ---------------------------------------------------------------- chapter 5's exercises
def test_exercise_solutions_pass_and_wrong_answers_fail():
    from minigen.course.exercises import ExerciseFailed, ch05
    assert ch05.check_slot_of(ch05.solution_slot_of)
    assert ch05.check_blocks_held(ch05.solution_blocks_held)
    with pytest.raises(ExerciseFailed, match="multiply the physical block"):
        ch05.check_slot_of(lambda table, p, bs: table[p // bs] + p % bs)

    def shares_the_partial_block_too(T, w, n, bs):  # forgets copy-on-write
        shared = math.ceil(T / bs)
        return shared + n * (math.ceil((T + w) / bs) - shared)

    with pytest.raises(ExerciseFailed, match="copied on write"):
        ch05.check_blocks_held(shares_the_partial_block_too)


def test_stats_show_blocks_in_use_and_the_pool(tiny):
    """Two rows, 10 prompt tokens + 7 new: positions 0..15 are written (the last token sampled is
    never fed back), so each row holds ceil(16 / 4) = 4 blocks of a pool sized for 17 tokens a row."""
    out = minigen.generate(tiny, random_ids(2, 10), max_new_tokens=7, stop_token_ids=[], cache_chunk_size=4)
    s = out.stats
    assert (s.kv_blocks_in_use, s.kv_blocks_in_pool) == (2 * 4, 2 * 5)
    block = 2 * tiny.config.n_layers * 4 * tiny.config.n_kv_heads * tiny.config.head_dim * 4  # K and V, fp32
    # The K and V buffers attention reads gathered blocks from grow by doubling: 2 rows x 3 blocks
    # at the prefill, then 2 x 4 > 6 -> 12 blocks.
    gather = 2 * 12 * 4 * tiny.config.n_kv_heads * tiny.config.head_dim * 4
    assert s.kv_cache_bytes == 2 * 5 * block + 4 * 2 * 4 + gather  # pool + int32 table entries + gather buffers
    assert s.kv_device_bytes == s.kv_cache_bytes and s.peak_kv_cache_bytes >= s.kv_cache_bytes
    contiguous = minigen.generate(tiny, random_ids(2, 10), max_new_tokens=7, stop_token_ids=[]).stats
    assert contiguous.kv_blocks_in_use is None and contiguous.kv_blocks_in_pool is None
