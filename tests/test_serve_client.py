"""The load generator of `serve-bench --url` (minigen/measure/serve_client.py): its arrival schedules,
the seeded choice of streams that hang up, the latency, throughput and goodput arithmetic on timings
written by hand, the request forms, and the command line's checks."""

from __future__ import annotations

import math

import pytest

from minigen.__main__ import main
from minigen.errors import BenchError
from minigen.measure.serve_client import (Form, RequestRecord, arrival_schedule, disconnect_plan, request_kwargs,
                                          summarize_client)
from minigen.serving.workload import make_workload


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
