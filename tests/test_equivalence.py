"""minigen equals `transformers` on tiny random models of every supported architecture.

Oracle: Hugging Face's own eager implementation of each model, run in fp32 on the same weights.
Greedy token ids must be identical (with and without the KV cache, batch 1 and 2); full-sequence
logits must agree within a tolerance derived below.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from minigen.caches.contiguous import KVCache
from conftest import tiny_hf

# Tolerance for fp32 logits. Both sides compute the same math with a different summation order
# (fused q/k/v, [in, out] weights, SDPA instead of an explicit softmax). Each dot product of
# length K <= 64 over O(1) values carries a rounding error of about sqrt(K) * 2^-24 ~ 5e-7
# relative; through 2 layers and the head, with logits of magnitude ~1-5, that grows to ~1e-5
# at most. ATOL = 1e-4 leaves a 10x margin, yet is far below the ~1e-1 differences that any real
# bug (a wrong RoPE frequency, a dropped bias, a wrong mask) produces, as `test_tolerance_can_fail`
# checks.
ATOL = RTOL = 1e-4
N_NEW = 20
pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {
    "llama_gqa_untied": dict(kind="llama"),
    "qwen2_bias": dict(kind="qwen2"),
    "gpt2": dict(kind="gpt2"),
    "mistral": dict(kind="mistral"),
    # original context 16 < the positions used here, so every RoPE branch is exercised: with head
    # dim 8 the wavelengths 2*pi*[1, 10, 100, 1000] fall below, between and above 16/4 and 16/1.
    "llama3_rope": dict(kind="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear_rope": dict(kind="llama", rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request):
    spec = dict(MODELS[request.param])
    hf = tiny_hf(spec.pop("kind"), seed=len(request.param), **spec)
    return hf, minigen.from_hf(hf)


def prompt(batch: int, length: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (batch, length), generator=g)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_tokens_match_transformers(pair, batch, use_cache):
    hf, model = pair
    ids = prompt(batch)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW,
                           do_sample=False, use_cache=use_cache)
    got = minigen.generate(model, ids, max_new_tokens=N_NEW, stop_token_ids=[], use_cache=use_cache)
    assert got.tokens.shape == (batch, 7 + N_NEW)
    assert torch.equal(got.tokens, want)


def test_logits_match_transformers(pair):
    hf, model = pair
    ids = prompt(2, length=40, seed=1)  # 40 > 16: past the llama3 model's original context
    with torch.no_grad():
        want = hf(ids).logits.float()  # [2, 40, V]
    pos = torch.arange(ids.shape[1])
    naive = model(ids, pos)
    cache = KVCache.for_model(model, 2, 40)
    cached = model(ids, pos, cache)
    for got in (naive, cached):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # the comparison has teeth: the logits spread over several units
    assert want.std() > 0.5


def test_tolerance_can_fail():
    """A real bug (here: RoPE scaling ignored) moves logits far outside ATOL."""
    hf = tiny_hf("llama", rope_parameters=MODELS["llama3_rope"]["rope_parameters"])
    model = minigen.from_hf(hf)
    model.inv_freq = minigen.model.rope_frequencies(
        minigen.ModelConfig(**{**model.config.__dict__, "rope_scaling": None}))
    ids = prompt(1, length=40)
    with torch.no_grad():
        diff = (model(ids, torch.arange(40)) - hf(ids).logits).abs().max()
    assert diff > 100 * ATOL


def test_casting_a_model_keeps_rope_frequencies_in_fp32():
    """Regression: model.to(torch.bfloat16) cast RoPE's inverse frequencies to bf16 (load(dtype=...)
    kept them in fp32), and at positions 3,072-4,096 SmolLM2's top-1 agreement with fp32 fell to
    0.30. A cast now keeps them fp32, so the two ways of making a bf16 model agree exactly."""
    hf = tiny_hf("llama", max_position_embeddings=4096)
    built = minigen.from_hf(hf, dtype=torch.bfloat16)
    cast = minigen.from_hf(hf).to(torch.bfloat16)
    assert cast.inv_freq.dtype == built.inv_freq.dtype == torch.float32
    assert torch.equal(cast.inv_freq, built.inv_freq)
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(4000, 4008)
    with torch.inference_mode():
        assert torch.equal(cast(ids, pos), built(ids, pos))
