"""The run plan (minigen/run_plan.py): built once per generation, applied from the rule table's three
axes (places.py holds where it runs), said in words, and the one thing every entry point runs."""

from __future__ import annotations

import importlib

import pytest
import torch

import minigen
from minigen import run_plan
from minigen.errors import ConfigError
from minigen.measure import profiling
from minigen.places import WHERE_REFUSED, WHERES, check_where
from minigen.run_plan import Plan, make_plan
from minigen.steps import choose

PARTS = ["decode", "prompt", "attention", "KV", "kernels"]


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return tiny_llama[1]


def ids_of(model, T=6, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


def count_plans(monkeypatch) -> list[str]:
    """Every make_plan call, by where, through every module that builds a plan."""
    calls: list[str] = []
    real = run_plan.make_plan

    def counted(model, config=None, batch=1, where="generate", **kw):
        calls.append(where)
        return real(model, config, batch, where, **kw)
    for module in (importlib.import_module("minigen.generate"), importlib.import_module("minigen.evaluate"), minigen.serving.engine, profiling):
        monkeypatch.setattr(module, "make_plan", counted)
    return calls


def test_a_plan_says_what_runs_in_five_parts(llama):
    plan = make_plan(llama, minigen.GenerationConfig(), 1, max_len=32)
    assert isinstance(plan, Plan) and [line.split(":")[0] for line in plan.lines()] == PARTS
    c = llama.config
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4  # fp32 keys and values, every layer
    assert f"{per_token:,} bytes a token" in str(plan) and f"{per_token * 32:,} bytes for 32 positions" in str(plan)
    naive = make_plan(llama, minigen.GenerationConfig(use_cache=False), 1, max_len=32)
    assert "naive loop" in str(naive) and "KV:" in str(naive) and naive.step.name == "naive"
    paged = make_plan(llama, minigen.GenerationConfig(cache_chunk_size=4), 1, max_len=32)
    assert "paged blocks of 4" in str(paged) and paged.step.name == "eager"  # the table keeps the fused step off
    quant = make_plan(llama, minigen.GenerationConfig(quant_bits=4, quant_group_size=8), 1, max_len=32)
    assert "4-bit codes" in str(quant) and quant.step.name == "eager"


def test_generate_builds_one_plan_and_reports_it(llama, monkeypatch):
    calls = count_plans(monkeypatch)
    ids = ids_of(llama)
    out = minigen.generate(llama, ids, max_new_tokens=5, stop_token_ids=[])
    assert calls == ["generate"], calls
    plan = make_plan(llama, minigen.GenerationConfig(max_new_tokens=5, stop_token_ids=[]), 1, max_len=ids.shape[1] + 5)
    assert out.stats.plan == str(plan) and out.stats.step == plan.step.name
    # a ragged batch, parallel_sample and score each build one too, for their own place
    calls.clear()
    minigen.generate(llama, [ids[0], ids[0, :3]], max_new_tokens=3)
    minigen.parallel_sample(llama, ids, 2, max_new_tokens=3, do_sample=True, seed=0)
    minigen.score(llama, ids[0])
    assert calls == ["ragged", "parallel_sample", "score"], calls


def test_a_given_plan_runs_and_gives_the_same_tokens(llama):
    ids = ids_of(llama)
    config = minigen.GenerationConfig(max_new_tokens=6, stop_token_ids=[])
    plan = make_plan(llama, config, 1, max_len=ids.shape[1] + 6)
    planned = minigen.generate(llama, ids, plan=plan)
    assert torch.equal(planned.tokens, minigen.generate(llama, ids, config).tokens)
    assert torch.equal(torch.stack(list(minigen.stream(llama, ids, plan=plan)), 1), planned.tokens[:, ids.shape[1]:])
    naive = make_plan(llama, config.replace(use_cache=False), 1, max_len=ids.shape[1] + 6)
    assert torch.equal(minigen.generate(llama, ids, plan=naive).tokens, planned.tokens)  # the oracle: same tokens
    scored = make_plan(llama, minigen.GenerationConfig(), 1, "score", max_len=ids.shape[1])
    assert torch.allclose(minigen.score(llama, ids[0], plan=scored).nll, minigen.score(llama, ids[0]).nll)


@pytest.mark.parametrize("call, fragment", [
    (lambda m, ids, p: minigen.generate(m, ids, minigen.GenerationConfig(), plan=p), "a plan or a config, not both"),
    (lambda m, ids, p: minigen.generate(m, ids, plan=p, max_new_tokens=3), "a plan or a config, not both"),
    (lambda m, ids, p: minigen.generate(m, ids.expand(2, -1), plan=p), "this plan runs 1 rows"),
    (lambda m, ids, p: minigen.generate(m, [ids[0], ids[0]], plan=p), "built for where='generate', not 'ragged'"),
    (lambda m, ids, p: minigen.generate(m, ids, plan="fused"), "is not a Plan"),
    (lambda m, ids, p: minigen.generate(m, ids, plan=p, observers=(object(),)), "observers given beside plan="),
    (lambda m, ids, p: minigen.score(m, ids[0], minigen.GenerationConfig(), plan=p), "a plan or a config, not both"),
    (lambda m, ids, p: minigen.score(m, ids[0], plan=p), "built for where='generate', not 'score'"),
    (lambda m, ids, p: minigen.parallel_sample(m, ids, 3, plan=p), "built for where='generate', not 'parallel_sample'"),
])
def test_a_plan_that_does_not_fit_the_call_is_refused(llama, call, fragment):
    ids = ids_of(llama)
    plan = make_plan(llama, minigen.GenerationConfig(max_new_tokens=4), 1, max_len=ids.shape[1] + 4)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        call(llama, ids, plan)


def test_where_is_an_axis_of_the_rule_table():
    assert set(WHERE_REFUSED) <= set(WHERES)
    for where, (what, table) in WHERE_REFUSED.items():
        for feature, (why, fix) in table.items():
            assert why and fix and what, (where, feature)
    c = minigen.GenerationConfig
    check_where(c(quant_bits=4), "generate")  # generate runs it
    with pytest.raises(ConfigError, match="quant_bits=4 does not combine with the serving engine.*Fix"):
        check_where(c(quant_bits=4), "engine")
    with pytest.raises(ConfigError, match="does not combine with the profiler.*Fix: use_cache=True"):
        check_where(c(use_cache=False), "profile")
    with pytest.raises(ConfigError, match="prefetch_depth=1 does not combine with parallel_sample"):
        check_where(c(prefetch_depth=1), "parallel_sample")
    with pytest.raises(ConfigError, match="sparse_top_k=8 does not combine with a ragged batch"):
        check_where(c(sparse_top_k=8), "ragged")
    with pytest.raises(ConfigError, match="prefill_chunk_size=8 does not combine with the serving engine"):
        check_where(c(prefill_chunk_size=8), "engine")
    with pytest.raises(ConfigError, match="where='server' is not a place"):
        check_where(c(), "server")


def test_the_engine_and_the_profiler_take_their_plan(llama, monkeypatch):
    calls = count_plans(monkeypatch)
    engine = minigen.Engine(llama, minigen.GenerationConfig(max_new_tokens=3), max_batch_size=2, num_blocks=16)
    assert calls == ["engine"] and engine.plan.where == "engine" and engine.plan.batch == 2
    # the fused step over the engine's paged pool where it measured faster here (fastpaths: fused_paged)
    want = "fused" if choose.measured_fast(llama, "fused_paged") else "eager"
    assert engine.plan.step.name == want and "rows at their own positions" in str(engine.plan)
    with pytest.raises(ConfigError, match="does not combine with the serving engine"):
        minigen.Engine(llama, minigen.GenerationConfig(speculative_method="ngram"))
    calls.clear()
    profiling.profile(llama, ids_of(llama), minigen.GenerationConfig(), steps=1, warmup=1)
    assert calls == ["profile", "generate"], calls  # the profiled steps, then the memory timeline's generation


def test_a_draft_gets_its_own_plan(llama):
    config = minigen.GenerationConfig(speculative_method="draft", num_speculative_tokens=2, max_new_tokens=4)
    plan = make_plan(llama, config, 1, max_len=16, draft_model=llama)
    assert plan.step.name.startswith("speculative") and "a draft model's" in str(plan)
    with pytest.raises(ConfigError, match="draft"):
        make_plan(llama, config, 1, max_len=16)  # no draft model given


def test_a_plan_for_other_rows_is_refused_everywhere_it_is_taken(llama):
    ids = ids_of(llama)
    config = minigen.GenerationConfig(max_new_tokens=3, do_sample=True, seed=0)
    two = make_plan(llama, config, 2, "parallel_sample", max_len=ids.shape[1] + 3)
    with pytest.raises(ConfigError, match="this plan runs 2 rows"):
        minigen.parallel_sample(llama, ids, 3, plan=two)
    short = make_plan(llama, minigen.GenerationConfig(), 1, "score", max_len=ids.shape[1] - 1)
    with pytest.raises(ConfigError, match="the call needs 1 of 6"):
        minigen.score(llama, ids[0], plan=short)


def test_a_parallel_sample_plan_pages_its_cache_as_parallel_sample_does(llama):
    """parallel_sample's default blocks of 16 come from its plan, so a plan made for it by hand forks too."""
    ids = ids_of(llama)
    config = minigen.GenerationConfig(max_new_tokens=3, do_sample=True, seed=0)
    plan = make_plan(llama, config, 2, "parallel_sample", max_len=ids.shape[1] + 3)
    assert plan.config.cache_chunk_size == 16 and "paged blocks of 16" in str(plan)
    given = minigen.parallel_sample(llama, ids, 2, plan=plan)
    assert torch.equal(given.tokens, minigen.parallel_sample(llama, ids, 2, config).tokens)
