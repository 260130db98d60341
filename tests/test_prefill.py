"""Prefill, the other half of a request (chapter 16): a prompt that starts a sequence attends
through SDPA's own causal tiles (attention.Causal) instead of a [T, S] mask. Oracles: the explicit
mask's logits and greedy tokens, and the rule `prefix_causal` stated on positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minigen
from minigen import GenerationConfig, attention
from minigen.attention import Causal, prefix_causal

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prefix_causal_holds_only_where_the_mask_is_the_lower_triangle_of_the_first_slots():
    pos = torch.arange(6)
    assert prefix_causal(pos, pos)  # the naive loop: keys are the queries
    assert prefix_causal(pos, torch.tensor([0, 1, 2, 3, 4, 5, -1, -1]))  # a cache with room left
    assert not prefix_causal(pos[:1], pos[:1])  # one token: a decode step's own path
    assert not prefix_causal(pos + 2, torch.arange(8))  # a later chunk: earlier positions are cached
    assert not prefix_causal(pos, torch.tensor([0, 1, 2, 3, 4, 5, 2, -1]))  # a slot repeats a position
    assert not prefix_causal(pos, torch.tensor([5, 1, 2, 3, 4, 0, -1, -1]))  # slots in another order
    assert not prefix_causal(torch.tensor([[0, 1, 2], [-1, 0, 1]]), torch.arange(3))  # ragged rows
    # the rule and causal_mask agree wherever it holds
    for keys in (pos, torch.tensor([0, 1, 2, 3, 4, 5, -1, 9])):
        if prefix_causal(pos, keys):
            full = attention.causal_mask(pos, keys)
            assert torch.equal(full[:, :6], torch.ones(6, 6, dtype=torch.bool).tril()) and not full[:, 6:].any()


def _without_causal(monkeypatch):
    monkeypatch.setattr("minigen.model.prefix_causal", lambda q, k: False)


@pytest.mark.parametrize("kv", ["naive", "contiguous", "paged", "window", "quantized", "bf16 cache"])
def test_a_prompt_through_causal_tiles_matches_the_explicit_mask(tiny_llama, monkeypatch, kv):
    model = tiny_llama[1]
    settings = {"naive": {"use_cache": False}, "contiguous": {}, "paged": {"cache_chunk_size": 16},
                "window": {"window_size": 64, "sink_tokens": 4}, "quantized": {"quant_bits": 8, "quant_group_size": 8},
                "bf16 cache": {"kv_dtype": "bfloat16"}}[kv]
    config = GenerationConfig(max_new_tokens=8, stop_token_ids=[], **settings)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kw):
        calls.append(kw.get("is_causal", False) and kw.get("attn_mask") is None)
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    fast = minigen.generate(model, ids, config)
    took_tiles = any(calls)
    with monkeypatch.context() as m:
        _without_causal(m)
        slow = minigen.generate(model, ids, config)
    assert torch.equal(fast.tokens, slow.tokens)
    # a window of 64 over a 40-token prompt is a mask of its own (the policy's): the tiles are for plain causal
    assert took_tiles == (kv != "window"), (kv, calls[:3])  # a window is the policy's own mask
    with torch.inference_mode():
        pos = torch.arange(40)
        a = model(ids, pos)
        _without_causal(monkeypatch)
        b = model(ids, pos)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_attend_with_causal_equals_the_bool_mask_in_16_bits_without_fp32_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 16, generator=g).bfloat16(), torch.randn(1, 2, 20, 16, generator=g).bfloat16(),
               torch.randn(1, 2, 20, 16, generator=g).bfloat16())
    pos = torch.arange(12)
    keys = torch.cat([pos, torch.full((8,), -1)])
    for fp32 in (True, False):
        ref = attention.attend(q, k, v, attention.causal_mask(pos, keys), fp32)
        assert torch.equal(attention.attend(q, k, v, Causal(12), fp32), ref) or fp32
        torch.testing.assert_close(attention.attend(q, k, v, Causal(12), fp32), ref, atol=2e-2, rtol=2e-2)
