"""Beam search (minigen/beam.py): the same tokens as `transformers`' generate(num_beams=k, do_sample=False,
length_penalty=...), and refused, with the reason, wherever it does not run.

Oracle: transformers' own beam search on the same tiny random fp32 model. Its default rules are the
ones beam.py follows (early_stopping=False, one returned sequence, padded with the eos after a
shorter best hypothesis). The stop token of each model is a token its greedy path produces, so that
finished hypotheses (and so length_penalty) decide some outputs; test_the_oracle_cases_exercise_
finished_hypotheses checks that they do. The numbers differ from transformers' by fp32 rounding
(~1e-6 on log-probs of a few units); on random models the sums the ranking compares are never that
close, so the tokens are equal, not close.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import skip_where_aside, tiny_hf
from minigen import ConfigError, GenerationConfig
from minigen.caches.contiguous import KVCache
from minigen.caches.window import WindowKVCache

pytestmark = pytest.mark.usefixtures("one_thread")

T, NEW = 6, 10
SEEDS = (0, 1, 2)


def prompts(seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 97, (batch, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models():
    """seed -> (transformers model, minigen model, prompts [2, T], a stop id the greedy path produces)."""
    out = {}
    for seed in SEEDS:
        hf = tiny_hf("llama", seed=seed)
        model = minigen.from_hf(hf)
        ids = prompts(seed)
        greedy = minigen.generate(model, ids, max_new_tokens=NEW, stop_token_ids=[]).tokens
        out[seed] = hf, model, ids, int(greedy[0, T + 3])
    return out


def transformers_beams(hf, ids, eos: int | None, **kw) -> torch.Tensor:
    """transformers' beam search, its eos `eos` (None: none), padding with it after a shorter hypothesis."""
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = eos if eos is not None else 0
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)


def minigen_beams(model, ids, eos: int | None, **kw) -> torch.Tensor:
    return minigen.generate(model, ids, stop_token_ids=[] if eos is None else [eos], **kw).tokens


# ---------------------------------------------------------------- against transformers
@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("num_beams", [2, 3, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_beam_search_equals_transformers(models, seed, num_beams, length_penalty, with_eos):
    hf, model, ids, eos = models[seed]
    eos = eos if with_eos else None
    kw = dict(max_new_tokens=NEW, num_beams=num_beams, length_penalty=length_penalty)
    want = transformers_beams(hf, ids, eos, **kw)
    got = minigen_beams(model, ids, eos, **kw)
    assert got.tolist() == want.tolist()


def test_the_oracle_cases_exercise_finished_hypotheses(models):
    """Not vacuous: with the stop id, some best hypotheses end early (padded), and the length
    penalty changes some outputs; beam search differs from greedy somewhere."""
    shorter, penalty_matters, differs_from_greedy = 0, 0, 0
    for seed, (hf, model, ids, eos) in models.items():
        greedy = minigen_beams(model, ids, None, max_new_tokens=NEW)
        for k in (2, 3, 4):
            outs = [minigen_beams(model, ids, eos, max_new_tokens=NEW, num_beams=k, length_penalty=lp).tolist()
                    for lp in (0.5, 2.0)]
            shorter += len(outs[0][0]) < T + NEW or any(eos in row[T:-1] for row in outs[0])
            penalty_matters += outs[0] != outs[1]
            differs_from_greedy += minigen_beams(model, ids, None, max_new_tokens=NEW, num_beams=k).tolist() \
                != greedy.tolist()
    assert shorter >= 2 and penalty_matters >= 2 and differs_from_greedy >= 2, \
        (shorter, penalty_matters, differs_from_greedy)


def test_one_beam_is_greedy(models):
    hf, model, ids, eos = models[0]
    want = transformers_beams(hf, ids, eos, max_new_tokens=NEW, num_beams=1)
    assert minigen_beams(model, ids, eos, max_new_tokens=NEW, num_beams=1).tolist() == want.tolist()
    assert minigen_beams(model, ids, eos, max_new_tokens=NEW).tolist() == want.tolist()


def test_several_stop_ids_and_a_long_generation(models):
    """Two stop ids (transformers then ranks 3k candidates), 30 new tokens, a batch of 3."""
    hf, model, _, eos = models[1]
    ids = prompts(5, batch=3)
    other = (eos + 1) % 97
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = [eos, other], eos
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30, num_beams=3)
    got = minigen.generate(model, ids, max_new_tokens=30, num_beams=3, stop_token_ids=[eos, other]).tokens
    assert got.tolist() == want.tolist()


def test_a_prompt_batched_equals_it_alone(models):
    _, model, ids, eos = models[2]
    both = minigen_beams(model, ids, eos, max_new_tokens=NEW, num_beams=3, length_penalty=0.5)
    for row in range(2):
        alone = minigen_beams(model, ids[row:row + 1], eos, max_new_tokens=NEW, num_beams=3, length_penalty=0.5)[0]
        assert both[row, :len(alone)].tolist() == alone.tolist()
        assert set(both[row, len(alone):].tolist()) <= {eos}  # then only the padding


@pytest.mark.parametrize("setting", [dict(prefill_chunk_size=4), dict(sparse_top_k=100), dict(kv_dtype="float32"),
                                     dict(window_size=64), dict(fused_decode=True)])
def test_beam_search_runs_beside(models, setting):
    """What the table applies beside beam search changes how a step runs, never these tokens: a prompt
    in pieces, sparse selection that keeps every key, a window longer than the text (the ring's
    reorder_rows), the fused C step (the contiguous cache reordered in place, under its addresses)."""
    hf, model, ids, eos = models[0]
    if "fused_decode" in setting:
        skip_where_aside("fused_step", model)
    kw = dict(max_new_tokens=NEW, num_beams=3, length_penalty=2.0)
    try:
        got = minigen_beams(model, ids, eos, **kw, **setting)
    except ConfigError as e:  # the fused step needs minigen's C kernel
        pytest.skip(f"this machine does not run {setting}: {e}")
    assert got.tolist() == transformers_beams(hf, ids, eos, **kw).tolist()


def test_a_model_s_own_sliding_window():
    """Mistral slides every layer over 8 tokens: the hybrid cache's rings are reordered with its rows, and a
    window_size=8 ring without sinks (the same attention) gives the same beams, past the window."""
    hf = tiny_hf("mistral", sliding_window=8, num_hidden_layers=3)
    model = minigen.from_hf(hf)
    ids = prompts(3)
    kw = dict(max_new_tokens=14, num_beams=3)
    want = transformers_beams(hf, ids, None, **kw).tolist()
    assert minigen_beams(model, ids, None, **kw).tolist() == want
    assert minigen_beams(model, ids, None, window_size=8, sink_tokens=0, **kw).tolist() == want


def test_reorder_rows_moves_every_layer_in_place():
    for cache in (KVCache(2, 3, 1, 4, 2), WindowKVCache(2, 3, 1, 2, 4, 0)):
        cache.k.copy_(torch.arange(3.0).view(1, 3, 1, 1, 1).expand_as(cache.k))
        cache.v.copy_(10 + cache.k)
        ptr = cache.k.data_ptr()
        cache.reorder_rows(torch.tensor([2, 2, 0]))
        assert cache.k[:, :, 0, 0, 0].tolist() == [[2, 2, 0]] * 2 and cache.v[1, :, 0, 0, 0].tolist() == [12, 12, 10]
        assert cache.k.data_ptr() == ptr and cache.k_layers[1].data_ptr() == cache.k[1].data_ptr()


def test_stats_and_the_plan_say_what_ran(models):
    _, model, ids, eos = models[1]
    out = minigen.generate(model, ids, max_new_tokens=NEW, num_beams=4, stop_token_ids=[eos])
    assert out.stats.new_tokens == out.tokens.shape[1] - T and len(out.stats.token_latencies_s) >= 1
    assert "beam search (beam.py): 4 beams a prompt, 8 rows" in out.stats.plan
    assert out.stats.kv_cache_bytes > 0 and out.stats.ttft_s >= out.stats.prefill_s > 0
    plan = minigen.make_plan(model, GenerationConfig(max_new_tokens=NEW, num_beams=4, stop_token_ids=[eos]), 8,
                             max_len=T + NEW)
    assert minigen.generate(model, ids, plan=plan).tokens.tolist() == out.tokens.tolist()
    assert minigen.generate(model, ids, max_new_tokens=0, num_beams=4).tokens.tolist() == ids.tolist()


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize("settings, fragment", [
    (dict(num_beams=0), "num_beams=0 is invalid: use an integer >= 1"),
    (dict(num_beams=2.0), "num_beams=2.0 is invalid"),
    (dict(num_beams=True), "num_beams=True is invalid"),
    (dict(num_beams=2, length_penalty=float("inf")), "length_penalty=inf is invalid: use a finite number"),
    (dict(num_beams=2, length_penalty="1"), "length_penalty='1' is invalid"),
    (dict(length_penalty=2.0), "length_penalty=2.0 has no effect without num_beams > 1"),
    (dict(num_beams=2, do_sample=True), "beam sampling .* is not implemented"),
    (dict(num_beams=2, speculative_method="ngram"), "speculative_method='ngram' and num_beams=2 do not combine"),
    (dict(num_beams=2, cache_chunk_size=16), "cache_chunk_size=16 and num_beams=2 do not combine.*num_beams=1"),
    (dict(num_beams=2, quant_bits=4), "quant_bits=4 and num_beams=2 do not combine"),
    (dict(num_beams=2, kv_budget=8), "kv_budget=8 and num_beams=2 do not combine"),
    (dict(num_beams=2, use_cache=False), "use_cache=False and num_beams=2 do not combine"),
    (dict(num_beams=2, compile=True), "compile=True and num_beams=2 do not combine"),
    (dict(num_beams=2, cuda_graphs=True), "cuda_graphs=True and num_beams=2 do not combine"),
])
def test_bad_settings_are_refused(settings, fragment):
    with pytest.raises(ConfigError, match=fragment):
        GenerationConfig(**settings)


def test_the_places_that_do_not_run_it_refuse_it(models):
    _, model, ids, _ = models[0]
    with pytest.raises(ConfigError, match=r"num_beams=2 does not combine with a ragged batch.*\[B, T\] tensor"):
        minigen.generate(model, [ids[0], ids[1, :3]], num_beams=2)
    with pytest.raises(ConfigError, match="the serving engine: the engine schedules one sequence per request"):
        minigen.Engine(model, {"num_beams": 2})
    with pytest.raises(ConfigError, match="num_beams=2 does not combine with parallel_sample"):
        minigen.parallel_sample(model, ids[:1], 3, num_beams=2)
    with pytest.raises(ConfigError, match="stream with num_beams=2: a beam search knows its tokens only when it ends"):
        minigen.stream(model, ids, num_beams=2)
    with pytest.raises(ConfigError, match="observers with num_beams=2"):
        minigen.generate(model, ids, num_beams=2, observers=(lambda layer, probs: None,))
