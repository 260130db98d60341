"""The generation loop on tiny random models: cache appends, perplexity, sampling, stops, stream, stats.

Oracles: one full forward pass (for chunked appends), `transformers.generate` (for stop tokens and
padding), and closed-form probabilities (for temperature, top-k and top-p).
"""

from __future__ import annotations

import math

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import CacheFullError, GenerationConfig, drafts, sample
from minigen.caches.contiguous import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

# Chunked vs one-pass logits differ only by the summation order of matmuls of different shapes:
# fp32 rounding ~1e-6 on logits of magnitude ~5 (see test_equivalence.py); 1e-5 leaves margin.
ATOL = RTOL = 1e-5


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gpt2():
    return minigen.from_hf(tiny_hf("gpt2"))


# ---------------------------------------------------------------- the cache
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("cache_len", [13, 20])  # exactly full, and with empty slots left over
def test_several_token_appends_equal_one_pass(tiny_llama, gpt2, arch, cache_len):
    model = tiny_llama[1] if arch == "llama" else gpt2
    ids = ids_of(2, 13)
    full = model(ids, torch.arange(13))  # [2, 13, V]
    cache = KVCache.for_model(model, 2, cache_len)
    parts, start = [], 0
    for size in (5, 3, 1, 4):  # prefill 5, then append chunks to a non-empty cache
        pos = torch.arange(start, start + size)
        parts.append(model(ids[:, start:start + size], pos, cache))
        start += size
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=ATOL, rtol=RTOL)


def test_writing_past_the_cache_raises_cache_full(tiny_llama):
    model = tiny_llama[1]
    cache = KVCache.for_model(model, 1, 8)
    model(ids_of(1, 6), torch.arange(6), cache)
    with pytest.raises(CacheFullError, match=r"holds 8 tokens.*position 8"):
        model(ids_of(1, 3), torch.arange(6, 9), cache)


def test_perplexity_is_independent_of_chunk_size(tiny_llama):
    hf, model = tiny_llama
    ids = ids_of(1, 30)[0]
    # reference written the obvious way: exp(mean cross-entropy) of transformers' logits
    with torch.no_grad():
        logits = hf(ids[None]).logits[0, :-1]
    want = math.exp(torch.nn.functional.cross_entropy(logits, ids[1:]).item())
    got = [minigen.perplexity(model, ids, chunk_size=c) for c in (1, 7, None)]
    got.append(minigen.perplexity(model, ids, use_cache=False))
    # exp(mean nll): an nll error of 1e-5 moves perplexity by a relative 1e-5
    for p in got:
        assert p == pytest.approx(want, rel=2e-5)
    assert want > 2  # a random model is far from certain, so the comparison is not trivial


# ---------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_llama):
    model, ids = tiny_llama[1], ids_of(1, 5)
    a = minigen.generate(model, ids, max_new_tokens=20, do_sample=True, seed=5, stop_token_ids=[])
    b = minigen.generate(model, ids, max_new_tokens=20, do_sample=True, seed=5, stop_token_ids=[])
    c = minigen.generate(model, ids, max_new_tokens=20, do_sample=True, seed=6, stop_token_ids=[])
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)


def test_sampling_draws_each_row_independently(tiny_llama):
    ids = ids_of(1, 5).repeat(2, 1)  # two identical prompts
    out = minigen.generate(tiny_llama[1], ids, max_new_tokens=20, do_sample=True, seed=0,
                           stop_token_ids=[])
    assert not torch.equal(out.tokens[0], out.tokens[1])


def test_unseeded_rows_draw_their_own_entropy(tiny_llama):
    ids = ids_of(1, 5).repeat(2, 1)  # two identical prompts, seed=None: each row's generator its own
    out = minigen.generate(tiny_llama[1], ids, max_new_tokens=20, do_sample=True, stop_token_ids=[])
    assert not torch.equal(out.tokens[0], out.tokens[1])


def test_draft_speculative_sampled_rows_equal_alone(tiny_llama):
    """Regression (issue 25): a batch's rows shared one generator, so the draft's proposals and the
    acceptance draws of row 0 depended on row 1. Row r now draws from its own, seeded seed + r."""
    model = tiny_llama[1]
    draft = drafts.layer_skip(model, 1)
    prompts = [torch.tensor([3, 1, 4, 3, 1, 4, 3, 1]), torch.tensor([9, 2, 9, 2, 9])]
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.0, stop_token_ids=[], speculative_method="draft",
              num_speculative_tokens=3, draft_model=draft)
    out = minigen.generate(model, prompts, seed=11, **kw).tokens
    for r, p in enumerate(prompts):
        assert out[r].tolist() == minigen.generate(model, p[None], seed=11 + r, **kw).tokens[0].tolist(), r


def test_a_denormal_temperature_is_greedy_in_every_path(tiny_llama):
    """Regression (issue 25): temperature=5e-324 is 0.0 in float32 and gave token 0 (the argmax of
    0/0 = NaN). Below torch.finfo(float32).tiny sampling is greedy by rule, on every path."""
    model = tiny_llama[1]
    draft = drafts.layer_skip(model, 1)
    prompts = [torch.tensor([3, 1, 4, 3, 1, 4, 3, 1]), torch.tensor([9, 2, 9, 2, 9])]
    greedy = [t.tolist() for t in minigen.generate(model, prompts, max_new_tokens=8, stop_token_ids=[]).tokens]
    tiny = dict(max_new_tokens=8, stop_token_ids=[], do_sample=True, temperature=5e-324, seed=0)
    for extra in ({}, {"speculative_method": "ngram"}, {"speculative_method": "draft", "draft_model": draft}):
        assert [t.tolist() for t in minigen.generate(model, prompts, **tiny, **extra).tokens] == greedy, extra
    forked = minigen.parallel_sample(model, prompts[0][None], 3, **tiny).tokens
    assert [row.tolist() for row in forked] == [greedy[0]] * 3
    engine = minigen.Engine(model, {"cache_chunk_size": 4})
    for p in prompts:
        engine.add_request(p, **tiny)
    served = engine.run()
    assert [served[r].tolist() for r in range(2)] == greedy


def test_unseeded_sampling_leaves_global_rng_alone(tiny_llama):
    """Regression: seed=None used torch.seed(), which reseeded the global RNG of the caller."""
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    minigen.generate(tiny_llama[1], ids_of(1, 5), max_new_tokens=3, do_sample=True)
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("setting", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=3.0)])
def test_degenerate_sampling_equals_greedy(tiny_llama, setting):
    model, ids = tiny_llama[1], ids_of(2, 5)
    greedy = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[])
    sampled = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[], do_sample=True,
                               seed=0, **setting)
    assert torch.equal(sampled.tokens, greedy.tokens)


def test_top_k_never_draws_outside_the_top_k():
    logits = torch.arange(50.0)[torch.randperm(50, generator=torch.Generator().manual_seed(0))] / 10
    top = set(torch.topk(logits, 5).indices.tolist())
    cfg = GenerationConfig(do_sample=True, top_k=5)
    drawn = {int(sample(logits[None], cfg, torch.Generator().manual_seed(s))) for s in range(300)}
    # without top-k, 300 draws from 50 near-uniform tokens would land outside `top` ~270 times
    assert drawn == top


def draw(logits: torch.Tensor, n: int = 20_000, **config) -> torch.Tensor:
    """n draws [n] from one logits vector [V], seeded."""
    cfg = GenerationConfig(do_sample=True, **config)
    return sample(logits.expand(n, -1), cfg, torch.Generator().manual_seed(0))


def within(freq: float, p: float, n: int) -> bool:
    """freq is within 5 standard errors of p for n Bernoulli draws (false alarm rate < 1e-6)."""
    return abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sharpens_or_flattens(temperature):
    # two tokens with logits 0 and 1: P(token 1) = sigmoid(1 / temperature)
    p = 1 / (1 + math.exp(-1 / temperature))  # 0.881, 0.731, 0.622
    tokens = draw(torch.tensor([0.0, 1.0]), temperature=temperature)
    assert within((tokens == 1).float().mean().item(), p, len(tokens))


@pytest.mark.parametrize("top_p, support", [(0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, support):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = draw(probs.log(), top_p=top_p)
    assert set(tokens.tolist()) == support
    kept = probs[sorted(support)].sum().item()  # renormalized over the kept tokens
    assert within((tokens == 0).float().mean().item(), 0.5 / kept, len(tokens))


# ---------------------------------------------------------------- stop tokens, stream, stats
def first_new(row: torch.Tensor, step: int) -> bool:
    """True when the token at new-token index `step` appears nowhere before it in `row`."""
    return bool((row[:step] != row[step]).all())


def test_stop_tokens_stop_early_and_pad_like_transformers(tiny_llama):
    hf, model = tiny_llama
    ids = ids_of(2, 6, seed=3)
    free = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[]).tokens[:, 6:]
    # a stop token that row 0 emits at step 3 for the first time and row 1 never emits
    stop = int(free[0, 3])
    assert first_new(free[0], 3) and stop not in free[1].tolist(), "pick another seed"
    got = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[stop]).tokens
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                           do_sample=False, eos_token_id=stop, pad_token_id=stop)
    assert torch.equal(got, want)
    assert (got[0, 6 + 3:] == stop).all() and torch.equal(got[1], torch.cat([ids[1], free[1]]))


def test_all_rows_stopped_ends_generation(tiny_llama):
    hf, model = tiny_llama
    ids = ids_of(1, 6, seed=4)
    free = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[]).tokens[0, 6:]
    stop = int(free[5])
    assert first_new(free, 5), "pick another seed"
    got = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[stop]).tokens
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                           do_sample=False, eos_token_id=stop, pad_token_id=stop)
    assert got.shape == (1, 6 + 6) and torch.equal(got, want)


def test_model_eos_is_the_default_stop(tiny_llama):
    model = tiny_llama[1]
    ids = ids_of(1, 6, seed=4)
    free = minigen.generate(model, ids, max_new_tokens=20, stop_token_ids=[]).tokens[0, 6:]
    model.config.eos_token_ids = (int(free[5]),)
    try:
        assert minigen.generate(model, ids, max_new_tokens=20).tokens.shape == (1, 12)
    finally:
        model.config.eos_token_ids = ()


@pytest.mark.parametrize("setting", [dict(), dict(do_sample=True, seed=1, top_k=20), dict(use_cache=False)])
def test_stream_yields_the_tokens_of_generate(tiny_llama, setting):
    model, ids = tiny_llama[1], ids_of(2, 5)
    out = minigen.generate(model, ids, max_new_tokens=12, stop_token_ids=[], **setting)
    streamed = list(minigen.stream(model, ids, max_new_tokens=12, stop_token_ids=[], **setting))
    assert all(t.shape == (2,) for t in streamed)
    assert torch.equal(torch.stack(streamed, dim=1), out.tokens[:, 5:])


def test_stream_validates_at_call_time(tiny_llama):
    """Regression: stream() is lazy, so a bad setting used to surface only at the first next()."""
    with pytest.raises(minigen.ConfigError, match="temperature"):
        minigen.stream(tiny_llama[1], ids_of(1, 5), temperature=0)
    with pytest.raises(minigen.PromptError, match="empty"):
        minigen.stream(tiny_llama[1], ids_of(1, 0))


def test_stats_are_filled(tiny_llama):
    model = tiny_llama[1]
    c = model.config
    T, n = 7, 9
    out = minigen.generate(model, ids_of(2, T), max_new_tokens=n, stop_token_ids=[])
    s = out.stats
    # K and V x layers x KV heads x head dim x 4 bytes (fp32) x every allocated slot; the cache
    # holds one sequence's slots per batch row, so the batch multiplies it too.
    assert s.kv_cache_bytes == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4 * (T + n) * 2
    assert s.peak_kv_cache_bytes == s.kv_cache_bytes
    assert s.new_tokens == n and len(s.token_latencies_s) == n
    assert 0 < s.prefill_s <= s.ttft_s and s.decode_s > 0
    assert s.decode_tokens_per_s == pytest.approx((n - 1) / s.decode_s)
    naive = minigen.generate(model, ids_of(1, T), max_new_tokens=n, use_cache=False, stop_token_ids=[])
    assert naive.stats.kv_cache_bytes == 0 and naive.stats.new_tokens == n


def test_zero_new_tokens_returns_the_prompt(tiny_llama):
    ids = ids_of(2, 5)
    out = minigen.generate(tiny_llama[1], ids, max_new_tokens=0)
    assert torch.equal(out.tokens, ids) and out.stats.new_tokens == 0


# ---------------------------------------------------------------- config plumbing
def test_overrides_apply_without_touching_the_config(tiny_llama, tmp_path):
    model, ids = tiny_llama[1], ids_of(1, 5)
    cfg = GenerationConfig(max_new_tokens=5, stop_token_ids=[])
    assert minigen.generate(model, ids, cfg, max_new_tokens=3).tokens.shape == (1, 8)
    assert cfg.max_new_tokens == 5
    assert minigen.generate(model, ids, {"max_new_tokens": 4, "stop_token_ids": []}).tokens.shape == (1, 9)
    cfg.to_json(tmp_path / "g.json")
    assert minigen.generate(model, ids, tmp_path / "g.json").tokens.shape == (1, 10)
    with pytest.raises(minigen.ConfigError, match="max_new_tokens"):
        minigen.generate(model, ids, cfg, max_new_token=3)


def test_config_json_round_trip(tmp_path):
    cfg = GenerationConfig(max_new_tokens=7, do_sample=True, temperature=0.7, top_k=40, top_p=0.9,
                           seed=3, stop_token_ids=[2, 5], use_cache=False)
    cfg.to_json(tmp_path / "c.json")
    back = GenerationConfig.from_json(tmp_path / "c.json")
    assert back == cfg and back.stop_token_ids == (2, 5)
    assert GenerationConfig.from_json(tmp_path / "c.json").to_dict() == cfg.to_dict()
    GenerationConfig().to_json(tmp_path / "d.json")
    assert GenerationConfig.from_json(tmp_path / "d.json") == GenerationConfig()
