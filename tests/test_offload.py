"""The offload tier with layer-ahead prefetch: the schedule, and outputs identical to a resident cache.

The schedule is written out by hand for 4 layers; the oracle for outputs is the same cache
without the offload tier (the copies move bytes unchanged, so logits are bit-identical).
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import GenerationConfig
from minigen.caches.make import make_cache
from minigen.caches.contiguous import KVCache
from minigen.evaluate import score
from minigen.caches.offload import OffloadedKVCache
from minigen.caches.paged import PagedKVCache
from minigen.caches.quantized import QuantizedPagedKVCache


@pytest.fixture(scope="module")
def tiny4():
    """A tiny random Llama with 4 layers (head dim 32, so that 4-bit groups of 32 fit)."""
    torch.set_num_threads(1)  # tiny ops: thread hand-offs cost more than the work (conftest.one_thread)
    model = minigen.from_hf(tiny_hf("llama", hidden_size=128, num_hidden_layers=4, max_position_embeddings=512))
    yield model
    torch.set_num_threads(2)


def ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_schedule_fetches_ahead_and_writes_back(tiny4):
    """prefetch_depth=1 on 4 layers: before layer l runs, layers l and l+1 are resident; layer l+1
    takes the slot of layer l-1, which is written back first."""
    cache = make_cache(tiny4, GenerationConfig(prefetch_depth=1), batch=1, max_len=8)
    assert isinstance(cache, OffloadedKVCache) and cache.n_slots == 2
    with torch.inference_mode():
        tiny4(ids(1, 3), torch.arange(3), cache)
        assert cache.log == [("fetch", 0), ("fetch", 1),  # layer 0 runs with 0, 1 resident
                             ("write_back", 0), ("fetch", 2),  # layer 1
                             ("write_back", 1), ("fetch", 3)]  # layer 2; layer 3 needs nothing new
        cache.log.clear()
        tiny4(ids(1, 1), torch.tensor([3]), cache)
        assert cache.log == [("write_back", 2), ("fetch", 0), ("write_back", 3), ("fetch", 1),
                             ("write_back", 0), ("fetch", 2), ("write_back", 1), ("fetch", 3)]
    assert cache.transfers == 2 * 4  # every layer in and out once per step


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 10])
@pytest.mark.parametrize("chunk", [None, 3])
def test_offloaded_outputs_identical_to_resident(tiny4, depth, chunk):
    """Contiguous and paged caches, prefetch 0 (fetch just in time) to >= L - 1 (all resident)."""
    text = ids(1, 40, seed=1)[0]
    ref = score(tiny4, text, chunk_size=6, cache_chunk_size=chunk)
    got = score(tiny4, text, chunk_size=6, cache_chunk_size=chunk, prefetch_depth=depth)
    assert torch.equal(got.nll, ref.nll)
    prompt = ids(2, 9, seed=2)
    ref = minigen.generate(tiny4, prompt, max_new_tokens=8, stop_token_ids=[], cache_chunk_size=chunk)
    got = minigen.generate(tiny4, prompt, max_new_tokens=8, stop_token_ids=[], cache_chunk_size=chunk,
                           prefetch_depth=depth)
    assert torch.equal(got.tokens, ref.tokens)


def test_everything_resident_moves_each_layer_in_once(tiny4):
    cache = make_cache(tiny4, GenerationConfig(prefetch_depth=3), batch=1, max_len=8)
    with torch.inference_mode():
        for p in range(4):
            tiny4(ids(1, 1, seed=p), torch.tensor([p]), cache)
    assert cache.log == [("fetch", 0), ("fetch", 1), ("fetch", 2), ("fetch", 3)]


def test_device_holds_only_the_layers_in_flight(tiny4):
    resident = make_cache(tiny4, GenerationConfig(), batch=1, max_len=64)
    offloaded = make_cache(tiny4, GenerationConfig(prefetch_depth=1), batch=1, max_len=64)
    assert isinstance(offloaded.inner, KVCache)
    assert offloaded.device_nbytes * 2 == resident.nbytes  # 2 of 4 layers on the device
    assert offloaded.nbytes == offloaded.device_nbytes + resident.nbytes  # + every layer in the tier
    assert offloaded.layer_nbytes * 4 == resident.nbytes


def test_article_composition_wraps_quantized_paged_blocks(tiny4):
    config = GenerationConfig(cache_chunk_size=256, quant_bits=4, window_size=128, sparsity_threshold=0.1,
                              prefetch_depth=2)
    cache = make_cache(tiny4, config, batch=1, max_len=300)
    assert isinstance(cache, OffloadedKVCache) and isinstance(cache.inner, QuantizedPagedKVCache)
    assert cache.inner.window_size == 128 and cache.n_slots == 3
    # The same schedule moves quantized blocks unchanged: identical to the resident quantized cache.
    text = ids(1, 300, seed=3)[0]
    no_tier = config.replace(prefetch_depth=None)
    torch.testing.assert_close(score(tiny4, text, config, chunk_size=50).nll,
                               score(tiny4, text, no_tier, chunk_size=50).nll, rtol=0, atol=0)


def test_wrapper_rejects_an_inner_cache_of_the_wrong_depth():
    with pytest.raises(ValueError, match="prefetch_depth"):
        OffloadedKVCache(PagedKVCache(4, 1, 2, 32, block_size=4, n_blocks=2), n_layers=4, prefetch_depth=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py times it)")
def test_offload_on_cuda_matches_cpu(tiny4):
    model = tiny4.to("cuda")
    try:
        text = ids(1, 40, seed=4)[0]
        ref = score(model, text.cuda(), chunk_size=5)
        got = score(model, text.cuda(), chunk_size=5, prefetch_depth=1)
        torch.testing.assert_close(got.nll, ref.nll, rtol=0, atol=0)
    finally:
        tiny4.to("cpu")
