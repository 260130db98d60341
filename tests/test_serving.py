"""Serving (chapter 14): the synthetic workload is seeded and as stated, the replayer adds every
request once in arrival order on the engine's clock, the metrics dict is what a plain count says,
the static transformers baseline is token-identical to generating each prompt alone, and the
dashboard plots draw a hand-made metrics dict."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from conftest import tiny_hf  # noqa: E402
from minigen import ConfigError  # noqa: E402
from minigen.course import plots  # noqa: E402
import minigen  # noqa: E402
from minigen import Engine, GenerationConfig  # noqa: E402
from minigen.__main__ import main  # noqa: E402
from minigen.measure.serve_bench import (StaticBatches, TransformersContinuous, format_serve_bench, pool_blocks,  # noqa: E402
                                 run_serve_bench)
from minigen.serving.metrics import batch_efficiency, latency_stats, summarize  # noqa: E402
from minigen.serving.workload import LengthDist, make_workload, replay  # noqa: E402


# ---------------------------------------------------------------- the workload
def test_same_seed_same_workload_and_the_stated_distributions():
    a = make_workload(400, 5.0, seed=3, system_prompt=[1, 2, 3], prompt_tokens=LengthDist(20, 0.5, 4, 64))
    b = make_workload(400, 5.0, seed=3, system_prompt=[1, 2, 3], prompt_tokens=LengthDist(20, 0.5, 4, 64))
    assert a.requests == b.requests
    assert a.requests != make_workload(400, 5.0, seed=4, system_prompt=[1, 2, 3]).requests
    arrivals = np.array([r.arrival_s for r in a.requests])
    assert arrivals[0] == 0 and (np.diff(arrivals) >= 0).all()
    assert np.diff(arrivals).mean() == pytest.approx(1 / 5.0, rel=0.15)  # 399 exponential gaps of mean 0.2 s
    user = np.array([len(r.prompt_ids) - 3 for r in a.requests])
    assert all(r.prompt_ids[:3] == (1, 2, 3) for r in a.requests)  # the shared system prompt
    assert user.min() >= 4 and user.max() <= 64
    assert np.median(user) == pytest.approx(20, rel=0.15)  # lognormal's median, little clipped
    assert all(2 <= r.max_new_tokens <= 128 for r in a.requests)


def test_workload_cuts_prompts_from_a_token_pool():
    pool = list(range(1000, 1300))
    w = make_workload(20, 1.0, seed=0, token_pool=pool, prompt_tokens=LengthDist(10, 0.3, 2, 40))
    for r in w.requests:  # each prompt a contiguous slice of the pool
        assert list(r.prompt_ids) == list(range(r.prompt_ids[0], r.prompt_ids[0] + len(r.prompt_ids)))


@pytest.mark.parametrize("call, fragment", [
    (lambda: make_workload(0, 1.0), "integer >= 1"),
    (lambda: make_workload(3, 0.0), "number > 0"),
    (lambda: LengthDist(10, 0.5, 5, 4), "1 <= low <= high"),
    (lambda: make_workload(3, 1.0, token_pool=[1, 2]), "fewer than the longest prompt"),
    (lambda: batch_efficiency(10.0, 0.0, 4), "max_throughput > 0"),
])
def test_bad_workload_settings(call, fragment):
    with pytest.raises(ConfigError, match=fragment):
        call()


# ---------------------------------------------------------------- the replayer
class Recorder:
    """An object with the Engine's API that records what the replayer does; a step with work
    takes `step_s` of the fake clock."""

    def __init__(self, step_s: float = 0.05):
        self.t, self.step_s = 0.0, step_s
        self.added, self.running, self.steps = [], 0, 0

    def now(self):
        return self.t

    def add_request(self, prompt_ids, *, arrival_s=None, max_new_tokens=None):
        self.added.append((tuple(prompt_ids), arrival_s, max_new_tokens, self.t))
        self.running += 1
        return len(self.added) - 1

    def step(self):
        if self.running:  # one request finishes per step
            self.t += self.step_s
            self.running -= 1
            self.steps += 1

    def run(self):
        while self.running:
            self.step()

    def metrics(self):
        return {"added": self.added}


def test_replay_adds_each_request_once_in_order_at_its_time():
    w = make_workload(30, 4.0, seed=1)
    engine = Recorder(step_s=0.2)  # slower than arrivals: requests queue up while a step runs
    got = replay(engine, w, clock=engine.now, skip_idle=True)["added"]
    assert [g[0] for g in got] == [r.prompt_ids for r in w.requests]
    assert [g[2] for g in got] == [r.max_new_tokens for r in w.requests]
    shift = 0.0
    for (prompt, arrival, _, added_at), r in zip(got, w.requests):
        assert added_at >= arrival - 1e-9  # never added before it arrived
        shift = max(shift, r.arrival_s - arrival)  # idle gaps skipped: arrivals only move earlier
        assert arrival <= r.arrival_s + 1e-9
    gaps = np.diff([g[1] for g in got])  # while the engine is busy, gaps between arrivals are kept
    assert (gaps >= -1e-9).all() and engine.steps == 30


def test_replay_without_skipping_waits_for_each_arrival():
    w = make_workload(5, 50.0, seed=2)
    engine = Recorder(step_s=0.0)  # every step looks idle
    slept = []

    def fake_sleep(s):
        slept.append(s)
        engine.t += s

    got = replay(engine, w, clock=engine.now, skip_idle=False, sleep=fake_sleep)["added"]
    assert [g[1] for g in got] == pytest.approx([r.arrival_s for r in w.requests])
    assert sum(slept) == pytest.approx(w.requests[-1].arrival_s, abs=1e-6)


# ---------------------------------------------------------------- the metrics dict
def record(rid, arrival, scheduled, first, finish, n, prompt=10, cached=0):
    return {"request_id": rid, "prompt_tokens": prompt, "output_tokens": n, "cached_tokens": cached,
            "preemptions": rid % 2, "arrival_s": arrival, "first_scheduled_s": scheduled, "first_token_s": first,
            "finish_s": finish, "finish_reason": "length",
            "phases": [["queued", arrival, scheduled], ["prefill", scheduled, first], ["decode", first, finish]]}


HAND = [record(0, 0.0, 0.0, 0.5, 1.5, 11, cached=0), record(1, 0.2, 0.6, 1.0, 3.0, 5, cached=8),
        record(2, 1.0, 1.5, 2.0, 2.0, 1, prompt=20, cached=16)]
STEPS = [{"t_s": 0.1 * i, "step_s": 0.1, "batch_size": 1 + i % 3, "kv_usage": i / 40, "prefill_tokens": 0,
          "decode_tokens": 1 + i % 3} for i in range(30)]


def test_summarize_against_a_hand_count():
    m = summarize(HAND, STEPS, num_blocks=40, block_size=4, max_batch_size=8)
    assert m["ttft_s"]["n"] == 3 and m["ttft_s"]["p50"] == pytest.approx(0.8)  # TTFTs 0.5, 0.8, 1.0
    assert m["tpot_s"]["n"] == 2 and m["tpot_s"]["mean"] == pytest.approx((0.1 + 0.5) / 2)  # 1 s / 10, 2 s / 4
    assert m["queue_time_s"]["p99"] == 0.5 and m["queue_time_s"]["p50"] == pytest.approx(0.4)  # nearest rank of 0, 0.4, 0.5
    assert m["e2e_latency_s"]["mean"] == pytest.approx((1.5 + 2.8 + 1.0) / 3)
    assert m["output_tokens_per_s"] == pytest.approx(17 / 3.0)  # 17 tokens from t = 0 to the last finish
    assert m["prefix_cache_hit_rate"] == pytest.approx(24 / 40) and m["preemptions"] == 1
    assert m["kv_usage"] == [s["kv_usage"] for s in STEPS] and m["num_blocks"] == 40
    assert math.isnan(latency_stats([])["p50"])


def test_batch_efficiency_is_one_for_linear_scaling():
    assert batch_efficiency(400.0, 100.0, 4) == 1.0  # 4 sequences, each as fast as one alone
    assert batch_efficiency(210.0, 100.0, 8) == pytest.approx(0.2625)  # the 2.1x at batch 8


def test_dashboard_draws_a_hand_made_metrics_dict(tmp_path, monkeypatch):
    m = summarize(HAND, STEPS, num_blocks=40, block_size=4, max_batch_size=8)
    ax = plots.plot_timeline(m)
    bars = [c for c in ax.collections]
    assert len(bars) == 7  # 3 requests x 3 phases; the two of zero length (request 0 queued, request 2 decode) left out
    span = ax.get_xlim()
    plt.close(ax.figure)
    ax = plots.plot_kv_usage(m)
    usage = [100 * s["kv_usage"] for s in STEPS]
    assert list(ax.lines[0].get_ydata()) == pytest.approx(usage + usage[-1:])  # the last value held to the end
    # issue 46: the usage panel spans the timeline's whole span, each value from the end of its step
    end = max(b for r in HAND for _, _, b in r["phases"])
    assert ax.get_xlim() == pytest.approx(span) and ax.lines[0].get_xdata()[-1] == pytest.approx(max(
        end, max(s["t_s"] + s["step_s"] for s in STEPS)))
    assert list(ax.lines[0].get_xdata()[:-1]) == pytest.approx([s["t_s"] + s["step_s"] for s in STEPS])
    plt.close(ax.figure)
    fig = plots.plot_dashboard(m, title="hand-made")
    monkeypatch.setenv("MINIGEN_FIGURES", str(tmp_path))
    assert plots.save_figure(fig, "10_test_dashboard").exists()
    plt.close(fig)


# ---------------------------------------------------------------- the static transformers baseline
def test_static_batches_are_token_identical_to_one_prompt_alone():
    hf = tiny_hf("llama")
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    w = make_workload(5, 100.0, seed=0, system_prompt=[5, 6, 7], prompt_tokens=LengthDist(6, 0.6, 1, 12),
                      output_tokens=LengthDist(4, 0.5, 2, 6), vocab=(1, 97))
    engine = StaticBatches(hf, max_batch_size=3)
    m = replay(engine, w, clock=engine.now)
    outputs = engine.run()
    for rid, r in enumerate(w.requests):
        alone = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=r.max_new_tokens, do_sample=False)[0]
        assert torch.equal(outputs[rid], alone), f"request {rid}"
    assert sorted(x["request_id"] for x in m["requests"]) == list(range(5))
    for x in m["requests"]:
        assert x["arrival_s"] <= x["first_scheduled_s"] <= x["first_token_s"] <= x["finish_s"]
    two = make_workload(2, 100.0, seed=0, prompt_tokens=LengthDist(4, 0.1, 2, 6), output_tokens=LengthDist(2, 0.1, 2, 3),
                        vocab=(1, 97))
    result = run_serve_bench(two, {"b3": lambda: StaticBatches(hf, 3), "b1": lambda: StaticBatches(hf, 1)})
    assert set(result["ratios"]) == {"b3 / b1"} and "output tok/s" in format_serve_bench(result)


def test_the_engine_and_the_static_baseline_serve_the_same_tokens():
    """minigen.Engine and transformers' static batches replay one workload: each request's tokens
    are the same on both (greedy fp32, no stop token), and both metrics dicts have the schema."""
    hf = tiny_hf("llama")
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    w = make_workload(6, 200.0, seed=3, system_prompt=[5, 6, 7, 8, 9], prompt_tokens=LengthDist(6, 0.6, 1, 12),
                      output_tokens=LengthDist(4, 0.5, 2, 6), vocab=(1, 97))
    engines = {"engine": Engine(minigen.from_hf(hf), GenerationConfig(stop_token_ids=[], cache_chunk_size=4),
                                max_batch_size=4, num_blocks=pool_blocks(w, 4, block_size=4)),
               "static": StaticBatches(hf, max_batch_size=4)}
    result = run_serve_bench(w, {name: (lambda e=e: e) for name, e in engines.items()})
    outputs = {name: e.run() for name, e in engines.items()}
    assert all(torch.equal(outputs["engine"][i], outputs["static"][i]) for i in range(6))
    for m in result["runs"].values():
        assert {"ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s", "output_tokens_per_s", "requests"} <= set(m)
        assert [r["output_tokens"] for r in sorted(m["requests"], key=lambda r: r["request_id"])] == \
            [r.max_new_tokens for r in w.requests]
    assert result["runs"]["engine"]["prefix_cache_hit_rate"] > 0  # the 5-token system prompt fills a block of 4


@pytest.mark.parametrize("argv, fragment", [
    (["serve-bench", "--engine", "minigen"], "at least two different engines"),
    (["serve-bench", "--engine", "minigen", "--engine", "vllm"], "at least two different engines"),
    (["serve-bench", "--requests", "0"], "argument --requests: 0 is out of range: use an integer >= 1"),
])
def test_serve_bench_refuses_bad_flags_before_loading(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_transformers_continuous_batching_adapter_is_exact():
    """The ContinuousBatchingManager adapter replays a workload to the tokens of generating each alone."""
    hf = tiny_hf("llama")
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    w = make_workload(4, 200.0, seed=3, system_prompt=[5, 6, 7, 8, 9], prompt_tokens=LengthDist(6, 0.6, 1, 12),
                      output_tokens=LengthDist(4, 0.5, 2, 6), vocab=(1, 97))
    engine = TransformersContinuous(hf, 4, num_blocks=32, block_size=4, max_batch_tokens=64)
    m = replay(engine, w, clock=engine.now)
    for rid, r in enumerate(w.requests):
        alone = hf.generate(torch.tensor([r.prompt_ids]), max_new_tokens=r.max_new_tokens, do_sample=False)[0]
        assert torch.equal(engine.outputs[rid], alone), f"request {rid}"
    assert m["ttft_s"]["n"] == 4 and math.isnan(m["queue_time_s"]["p50"])  # its scheduling times are not exposed


def test_mixed_prefill_keeps_each_requests_tokens_and_the_budget(tiny_llama):
    """Chapter 3's workload on a tiny model: a budget changes when prompt tokens run, never which
    tokens come out, and no step runs more tokens than the budget."""
    from minigen.measure.serve_bench import mixed_prefill
    _, model = tiny_llama
    ids = torch.randint(1, model.config.vocab_size, (1200,), generator=torch.Generator().manual_seed(0))
    whole = mixed_prefill(model, ids, None, short=2, new=6, n_long=1, long=40, gap_s=0.0)
    chunked = mixed_prefill(model, ids, 8, short=2, new=6, n_long=1, long=40, gap_s=0.0)
    assert whole["max_step_tokens"] >= 40 and chunked["max_step_tokens"] <= 8
    assert whole["tokens"].keys() == chunked["tokens"].keys()
    assert all(torch.equal(whole["tokens"][i], chunked["tokens"][i]) for i in whole["tokens"])
    assert len(chunked["long_ttft_s"]) == 1 and chunked["decode_step_p99_s"] >= chunked["decode_step_p50_s"] > 0
