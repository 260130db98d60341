"""The real model: SmolLM2-135M-Instruct through minigen equals it through `transformers`.

Oracle: `AutoModelForCausalLM.from_pretrained` on the folder that minigen converted from the
bundled GGUF, run in fp32. These tests share the session fixture `smollm2` (tests/conftest.py)
and are marked slow: each generates a few dozen tokens with a 30-layer model.
"""

from __future__ import annotations

import math

import pytest
import torch

import minigen
from minigen import loading

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPT = "The capital of France is"
N_NEW = 32


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(loading.prepare_default(), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly N_NEW tokens, like stop_token_ids=[]
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    return smollm2[1](PROMPT, return_tensors="pt").input_ids  # [1, 5]


@pytest.fixture(scope="module")
def cached(smollm2, prompt_ids):
    return minigen.generate(smollm2[0], prompt_ids, max_new_tokens=N_NEW, stop_token_ids=[])


def test_the_capital_of_france_is_paris(smollm2, prompt_ids, cached):
    new = cached.tokens[0, prompt_ids.shape[1]:]
    assert smollm2[1].decode(new[:2]).startswith(" Paris")


def test_greedy_matches_transformers(hf_smollm2, prompt_ids, cached):
    with torch.no_grad():
        want = hf_smollm2.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                   max_new_tokens=N_NEW, do_sample=False)
    assert want.shape == (1, prompt_ids.shape[1] + N_NEW)
    assert torch.equal(cached.tokens, want)


def test_naive_equals_cached(smollm2, prompt_ids, cached):
    n = 8  # the naive loop recomputes the whole sequence each step: keep it short
    naive = minigen.generate(smollm2[0], prompt_ids, max_new_tokens=n, stop_token_ids=[], use_cache=False)
    assert torch.equal(naive.tokens, cached.tokens[:, :prompt_ids.shape[1] + n])
    assert naive.stats.kv_cache_bytes == 0


def test_stats_of_the_real_model(smollm2, prompt_ids, cached):
    T, s = prompt_ids.shape[1], cached.stats
    # 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (fp32) x (prompt + new) slots
    assert s.kv_cache_bytes == 2 * 30 * 3 * 64 * 4 * (T + N_NEW) == 1_704_960
    assert s.new_tokens == N_NEW and s.decode_tokens_per_s > 0 and s.ttft_s >= s.prefill_s > 0


def test_logits_match_transformers_on_english(smollm2, hf_smollm2, english_text_ids):
    ids = english_text_ids[None, :64]
    with torch.no_grad():
        want = hf_smollm2(ids).logits
    got = smollm2[0](ids, torch.arange(64))
    # 30 layers in fp32: rounding of ~1e-6 relative per matmul grows through the residual stream
    # to ~1e-4 on logits of magnitude up to ~40 (measured 9e-5 on 256 tokens); 1e-3 leaves 10x.
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_perplexity_on_english_text(smollm2, hf_smollm2, english_text_ids):
    model, ids = smollm2[0], english_text_ids[:64]
    with torch.no_grad():
        logits = hf_smollm2(ids[None]).logits[0, :-1]
    want = math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())
    for chunk in (1, 7, None):  # decoding's view (1 token per step), ragged chunks, one pass
        assert minigen.perplexity(model, ids, chunk_size=chunk) == pytest.approx(want, rel=1e-4)
    # Real English reads as English (measured 19.8 on the first 128 tokens); the same tokens
    # shuffled are far less likely, so the check can tell text from noise.
    shuffled = ids[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    assert want < 40 < 10 * want < minigen.perplexity(model, shuffled)
