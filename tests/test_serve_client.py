"""The load generator of `serve-bench --url` (minigen/measure/serve_client.py): its arrival schedules,
the seeded choice of streams that hang up, the latency, throughput and goodput arithmetic on timings
written by hand, the request forms, and the command line's checks."""

from __future__ import annotations

import math
import time

import pytest

import minigen
from conftest import Running, tiny_hf
from minigen.__main__ import main
from minigen.errors import BenchError, MinigenError
from minigen.loading import DEFAULT_MODEL, load_tokenizer, resolve_folder
from minigen.measure.serve_client import (SYSTEM_TEXT, Form, RequestRecord, arrival_schedule, disconnect_plan,
                                          request_kwargs, run_client, summarize_client)
from minigen.serving.async_engine import AsyncEngine
from minigen.serving.engine import Engine
from minigen.serving.server import make_app
from minigen.serving.workload import LengthDist, make_workload, system_prompt_ids


# ---------------------------------------------------------------- arrival schedules
def test_poisson_arrivals_are_the_workloads_own():
    w = make_workload(20, 4.0, seed=3)
    assert arrival_schedule(w, "poisson") == [r.arrival_s for r in w.requests]
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(w.requests, w.requests[1:])]
    assert len(set(gaps)) > 1  # exponential gaps, not a fixed beat


def test_fixed_arrivals_are_one_every_one_over_rate():
    w = make_workload(5, 4.0, seed=3)
    assert arrival_schedule(w, "fixed") == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_an_infinite_rate_sends_everything_at_once():
    w = make_workload(6, math.inf, seed=3)
    assert arrival_schedule(w, "poisson") == [0.0] * 6
    assert arrival_schedule(w, "fixed") == [0.0] * 6
    # the lengths depend on the seed only, not on the rate: a burst and a trickle replay one workload
    assert [r.prompt_ids for r in w.requests] == [r.prompt_ids for r in make_workload(6, 2.0, seed=3).requests]


def test_an_unknown_arrival_process_is_refused():
    with pytest.raises(BenchError, match="poisson"):
        arrival_schedule(make_workload(2, 1.0), "bursty")


# ---------------------------------------------------------------- hanging up
def test_the_disconnect_choice_is_the_seeds():
    lengths = [10 + i for i in range(40)]
    plan = disconnect_plan(40, 0.25, 7, lengths)
    assert plan == disconnect_plan(40, 0.25, 7, lengths)  # same seed, same streams, same chunk counts
    assert len(plan) == 10
    assert all(1 <= k <= lengths[i] - 1 for i, k in plan.items())  # hangs up before its last token
    assert plan != disconnect_plan(40, 0.25, 8, lengths)


def test_disconnect_fractions_at_the_ends():
    assert disconnect_plan(8, 0.0, 0, [5] * 8) == {}
    assert sorted(disconnect_plan(8, 1.0, 0, [5] * 8)) == list(range(8))
    assert disconnect_plan(3, 1.0, 0, [1, 2, 1]) == {0: 1, 1: 1, 2: 1}  # a 1-token reply hangs up after it
    with pytest.raises(BenchError, match=r"\[0, 1\]"):
        disconnect_plan(8, 1.5, 0, [5] * 8)


# ---------------------------------------------------------------- the arithmetic
def record(i, sent, chunks, finish, tokens, outcome="completed", max_tokens=None):
    return RequestRecord(i, 10, max_tokens or tokens, sent, sent_s=sent, chunk_s=list(chunks), finish_s=finish,
                         output_tokens=tokens, usage=True, outcome=outcome)


def test_latencies_throughput_and_goodput_of_hand_made_timings():
    records = [
        record(0, 0.0, [0.5, 0.6, 0.7, 0.8, 0.9], 0.9, 5),   # TTFT 0.5, TPOT 0.4/4 = 0.1
        record(1, 1.0, [1.2, 1.5], 1.5, 4),                 # TTFT 0.2, TPOT 0.3/3 = 0.1 (2 chunks of 4 tokens)
        record(2, 2.0, [3.0, 3.1, 3.2], 3.2, 3),            # TTFT 1.0: misses a 0.6 s TTFT SLO
        record(3, 2.0, [2.1], 2.1, 1),                      # one token: no TPOT
        record(4, 2.5, [2.6, 2.7], 2.7, 2, outcome="cancelled", max_tokens=9),
        record(5, 3.0, [], 3.0, 0, outcome="rate_limited"),
        record(6, 3.0, [], 4.0, 0, outcome="timeout"),
    ]
    m = summarize_client(records, duration_s=4.0, slo_ttft_s=0.6, slo_tpot_s=0.15)
    assert m["ttft_s"]["n"] == 4 and m["ttft_s"]["p50"] == pytest.approx(0.5)  # sorted .1 .2 .5 1.0, rank 2
    assert m["ttft_s"]["p99"] == pytest.approx(1.0) and m["ttft_s"]["mean"] == pytest.approx(0.45)
    assert m["tpot_s"]["n"] == 3 and m["tpot_s"]["p50"] == pytest.approx(0.1)
    # ITL per chunk: .1 .1 .1 .1 | .3 | .1 .1 (the cancelled stream's gap is left out)
    assert m["itl_s"]["n"] == 7 and m["itl_s"]["p50"] == pytest.approx(0.1) and m["itl_s"]["p99"] == pytest.approx(0.3)
    assert m["e2e_latency_s"]["p50"] == pytest.approx(0.9)  # .1 .5 .9 1.2
    assert m["output_tokens"] == 13 and m["output_tokens_per_s"] == pytest.approx(13 / 4)  # usage, not chunks
    assert m["request_throughput"] == pytest.approx(4 / 4)
    assert m["goodput"] == pytest.approx(3 / 4)  # requests 0, 1 and 3 (no TPOT) meet both
    c = m["counts"]
    assert (c["sent"], c["completed"], c["cancelled"], c["rate_limited"], c["timeout"], c["lost"]) == (7, 4, 1, 1, 1, 0)


def test_goodput_needs_an_slo_and_each_half_counts():
    records = [record(0, 0.0, [0.1, 0.6], 0.6, 2), record(1, 0.0, [0.9, 1.0], 1.0, 2)]  # TPOT .5 and .1
    assert summarize_client(records, 2.0)["goodput"] is None
    assert summarize_client(records, 2.0, slo_ttft_s=0.5)["goodput"] == pytest.approx(0.5)
    assert summarize_client(records, 2.0, slo_tpot_s=0.2)["goodput"] == pytest.approx(0.5)
    assert summarize_client(records, 2.0, slo_ttft_s=0.5, slo_tpot_s=0.2)["goodput"] == 0.0


def test_a_record_without_an_outcome_is_counted_lost_and_a_short_reply_short():
    m = summarize_client([record(0, 0.0, [0.1], 0.2, 1, outcome=""), record(1, 0.0, [0.1], 0.2, 3, max_tokens=8)], 1.0)
    assert m["counts"]["lost"] == 1 and m["counts"]["short"] == 1
    empty = summarize_client([], 0.0)
    assert math.isnan(empty["ttft_s"]["p50"]) and math.isnan(empty["output_tokens_per_s"])


# ---------------------------------------------------------------- request forms
class Letters:
    """A tokenizer stand-in: id i decodes to chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_the_request_forms():
    prompt = [0, 1, 2, 3, 4]
    kw = request_kwargs(Form("m", chat=False, tokens=True, ignore_eos=True), prompt, 2, Letters(), 7)
    assert kw["prompt"] == prompt and kw["max_tokens"] == 7 and kw["extra_body"] == {"ignore_eos": True}
    assert kw["stream"] and kw["stream_options"] == {"include_usage": True} and kw["temperature"] == 0.0
    kw = request_kwargs(Form("m", chat=False, tokens=False, ignore_eos=False), prompt, 2, Letters(), 7)
    assert kw["prompt"] == "abcde" and "extra_body" not in kw
    kw = request_kwargs(Form("m", chat=True, tokens=False, ignore_eos=True), prompt, 2, Letters(), 7)
    assert kw["messages"][0]["role"] == "system" and kw["messages"][1] == {"role": "user", "content": "cde"}


# ---------------------------------------------------------------- the command line
def test_rate_inf_is_for_a_server_only(capsys):
    assert main(["serve-bench", "--rate", "inf", "--engine", "minigen", "--engine", "transformers-static"]) == 2
    assert "--url" in capsys.readouterr().err
    assert main(["serve-bench", "--rate", "-1"]) == 2  # argparse: out of range
    assert main(["serve-bench", "--url", "http://127.0.0.1:9/v1", "--engine", "minigen"]) == 2
    assert "drop --engine" in capsys.readouterr().err


# ---------------------------------------------------------------- against minigen serve
@pytest.fixture(scope="module")
def served():
    """minigen serve's app (make_app) over a tiny Llama with SmolLM2's vocabulary, behind uvicorn in a
    thread on 127.0.0.1 at a free port -> (its /v1 URL, the AsyncEngine, the tokenizer)."""
    try:
        tokenizer = load_tokenizer(resolve_folder(DEFAULT_MODEL))
    except MinigenError as e:
        pytest.skip(f"SmolLM2's tokenizer is not available: {e}")
    model = minigen.from_hf(tiny_hf("llama", vocab_size=len(tokenizer), max_position_embeddings=256))
    async_engine = AsyncEngine(Engine(model, max_batch_size=4, num_blocks=64), max_waiting=64)
    app = make_app(async_engine, tokenizer, "tiny", max_context=256)
    running = Running(app)
    yield f"{running.url}/v1", async_engine, tokenizer
    running.stop()


def in_flight_at_most(records: list[dict]) -> int:
    """The most requests that were in flight at once, from their send and finish times."""
    events = sorted([(r["sent_s"], 1) for r in records] + [(r["finish_s"], -1) for r in records])
    level = most = 0
    for _, step in events:
        level += step
        most = max(most, level)
    return most


def test_a_workload_against_minigen_serve(served):
    """12 streamed requests, a quarter of them hanging up mid-stream, at most 3 in flight: every
    request is accounted for, each completed one has exactly its max_tokens (ignore_eos taken, the
    prompt sent as ids), and once the run ends the engine runs and queues nothing."""
    url, async_engine, tokenizer = served
    workload = make_workload(12, 40.0, seed=1, system_prompt=system_prompt_ids(tokenizer, SYSTEM_TEXT),
                             prompt_tokens=LengthDist(8, 0.5, 2, 16), output_tokens=LengthDist(8, 0.5, 3, 16))
    run = run_client(url, workload, tokenizer, seed=1, disconnect_fraction=0.25, concurrency=3,
                     slo_ttft_s=30.0, slo_tpot_s=30.0, timeout_s=60.0)
    assert (run["prompt_as"], run["ignore_eos"], run["model"]) == ("tokens", True, "tiny")
    c = run["counts"]
    assert (c["sent"], c["completed"], c["cancelled"], c["lost"]) == (12, 9, 3, 0), c
    plan = disconnect_plan(12, 0.25, 1, [r.max_new_tokens for r in workload.requests])
    for r in run["requests"]:
        if r["index"] in plan:
            assert r["outcome"] == "cancelled" and len(r["chunk_s"]) == plan[r["index"]]
        else:
            assert r["outcome"] == "completed" and r["usage"] and r["output_tokens"] == r["max_tokens"]
    assert in_flight_at_most(run["requests"]) <= 3
    assert run["goodput"] == pytest.approx(run["request_throughput"])  # an SLO of 30 s: every completed one
    assert run["output_tokens"] == sum(r.max_new_tokens for i, r in enumerate(workload.requests) if i not in plan)
    deadline = time.monotonic() + 10  # the hung-up streams' requests are cancelled at the engine's next step
    while (snap := async_engine.snapshot())["running"] + snap["waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snap["running"] == 0 and snap["waiting"] == 0, snap
