"""Ragged batches: prompts of different lengths in one batch, each row at its own positions.

Oracle: generating each prompt alone (fp32 greedy, the same config), and transformers' own
left-padded batched generation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minigen
from conftest import tiny_hf
from minigen import ConfigError, PromptError

pytestmark = pytest.mark.usefixtures("one_thread")

CACHES = {  # every cache that takes a ragged batch: native ([B, T] positions) or one cache per row
    "contiguous": {},
    "paged": dict(cache_chunk_size=4),
    "window": dict(window_size=5, sink_tokens=1),
    "quantized": dict(quant_bits=8, quant_group_size=4),
    "paged window": dict(cache_chunk_size=4, window_size=6, sink_tokens=2),
    "quantized paged": dict(cache_chunk_size=4, quant_bits=8, quant_group_size=4),
}


@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


def prompts_of(lengths, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def assert_rows_equal_alone(model, prompts, **config):
    out = minigen.generate(model, prompts, **config)
    assert isinstance(out.tokens, list) and len(out.tokens) == len(prompts)
    for p, got in zip(prompts, out.tokens):
        alone = minigen.generate(model, p[None], **config).tokens[0]
        if alone[p.numel():].numel() and config.get("stop_token_ids"):  # alone pads after its stop: cut there
            stops = [i for i, t in enumerate(alone[p.numel():].tolist()) if t in config["stop_token_ids"]]
            alone = alone[:p.numel() + stops[0] + 1] if stops else alone
        assert torch.equal(got, alone), (p.numel(), got.tolist(), alone.tolist())


@pytest.mark.parametrize("name", CACHES)
@settings(max_examples=12, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 11), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_every_row_equals_generating_it_alone(tiny, name, lengths, seed):
    assert_rows_equal_alone(tiny, prompts_of(lengths, seed), max_new_tokens=7, stop_token_ids=[], **CACHES[name])


def test_a_ragged_batch_fills_the_stats_a_tensor_batch_fills(tiny):
    # the same timing fields as generate on a [B, T] tensor: one latency per new token, percentiles
    # of the decode tokens, the decode rate and the cache's bytes
    prompts = prompts_of([3, 9], seed=2)
    stats = minigen.generate(tiny, prompts, max_new_tokens=6, stop_token_ids=[]).stats
    assert stats.new_tokens == 6 and len(stats.token_latencies_s) == 6
    assert 0 < stats.prefill_s <= stats.ttft_s and stats.decode_s > 0 and stats.decode_tokens_per_s > 0
    assert 0 < stats.latency_p50_s <= stats.latency_p90_s <= stats.latency_p99_s
    assert stats.kv_cache_bytes > 0


@pytest.mark.parametrize("name", ["contiguous", "paged"])
def test_each_row_stops_at_its_own_stop(tiny, name):
    prompts = prompts_of([2, 8, 5], seed=3)
    free = [minigen.generate(tiny, p[None], max_new_tokens=8, stop_token_ids=[]).tokens[0] for p in prompts]
    stop = int(free[1][8 + 2])  # row 1's third new token: row 1 stops there, the others maybe elsewhere
    out = minigen.generate(tiny, prompts, max_new_tokens=8, stop_token_ids=[stop], **CACHES[name])
    assert out.tokens[1].numel() == 8 + 3 and int(out.tokens[1][-1]) == stop
    assert len({t.numel() - p.numel() for t, p in zip(out.tokens, prompts)}) > 1  # rows end at different lengths
    assert_rows_equal_alone(tiny, prompts, max_new_tokens=8, stop_token_ids=[stop], **CACHES[name])


def test_rows_equal_transformers_left_padded_batch():
    hf = tiny_hf("llama", seed=1)
    model = minigen.from_hf(hf)
    prompts = prompts_of([3, 9, 6, 1], seed=5)
    T = max(p.numel() for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(T - p.numel(), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(T - p.numel(), dtype=torch.long), torch.ones_like(p)]) for p in prompts])
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, T:]
    got = minigen.generate(model, prompts, max_new_tokens=6, stop_token_ids=[]).tokens
    for b, p in enumerate(prompts):
        assert got[b][p.numel():].tolist() == want[b].tolist()


def test_smollm2_rows_equal_alone(smollm2):
    model, tok = smollm2
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
    prompts = [tok(t, return_tensors="pt").input_ids[0] for t in texts]
    for name in ("contiguous", "paged", "window", "quantized"):
        config = dict(CACHES[name], window_size=8, sink_tokens=2) if name == "window" else CACHES[name]
        config = dict(config, quant_group_size=32) if name == "quantized" else config
        assert_rows_equal_alone(model, prompts, max_new_tokens=4, stop_token_ids=[], **config)


def test_bad_prompt_lists(tiny):
    with pytest.raises(PromptError, match="prompt list is empty"):
        minigen.generate(tiny, [])
    with pytest.raises(PromptError, match="prompt 1 of 2 is empty"):
        minigen.generate(tiny, [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])
    with pytest.raises(PromptError, match="1-D"):
        minigen.generate(tiny, [torch.tensor([[1, 2]])])


@pytest.mark.parametrize("key, value", [("kv_budget", 8), ("prefetch_depth", 1), ("sparse_top_k", 4),
                                        ("compile", True), ("use_cache", False)])
def test_features_without_per_row_positions_are_refused_up_front(tiny, key, value):
    with pytest.raises(ConfigError, match=f"{key if key != 'use_cache' else 'use_cache=False'}.*ragged.*Fix"):
        minigen.generate(tiny, prompts_of([2, 4]), max_new_tokens=2, **{key: value})
