"""Issue 25's hardening, one case per reproducer: what hostile input found, and what it gets now.

Each `@case` here is a row of docs/bad_inputs.md, run by `test_row` in tests/test_bad_inputs.py
(which imports this module), exactly as that module's own cases are: an error row must raise its
named `MinigenError` with the quoted text, a behaviour row asserts the behaviour itself. Case
functions take pytest fixtures by name (tiny_model, tmp_path, monkeypatch, ...). The tests below
the cases (the Engine's property tests) run here.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from test_bad_inputs import case
# engine (issue 25, item 3 and the property tests)
import collections
import functools
import itertools
import time

from conftest import tiny_hf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes
# 3 (engine): add_request's prompts and arrival_s, cancel's ids. Each refused call is made on an engine
# that is already serving; the case checks that the call left it as it was, then lets the error out.
_ENGINE_SERVING = (([5, 6, 7], 3), ([8, 9], 2))  # (prompt, max_new_tokens) of requests 0 and 1


def _engine_serving(model) -> minigen.Engine:
    """An engine in mid-work: requests 0 and 1 added, one step run (both hold blocks)."""
    engine = minigen.Engine(model, {"cache_chunk_size": 4, "stop_token_ids": []}, num_blocks=8)
    for prompt, n in _ENGINE_SERVING:
        engine.add_request(prompt, max_new_tokens=n)
    engine.step()
    return engine


def _engine_state(engine) -> tuple:
    return ([(r.id, r.status, list(r.tokens)) for r in engine.requests], [r.id for r in engine.waiting],
            [r.id for r in engine.running], list(engine.alloc.free), len(engine.steps))


def _engine_refuses(model, call) -> None:
    """Make the refused `call` on a serving engine, check that nothing changed (no id used, no block
    taken or freed), that the next request gets id 2 and every request equals generating it alone;
    then raise the call's error for the row to check."""
    engine = _engine_serving(model)
    before = _engine_state(engine)
    try:
        call(engine)
    except minigen.errors.MinigenError:
        assert _engine_state(engine) == before, "the refused call changed the engine"
        requests = (*_ENGINE_SERVING, ([10, 11, 12, 13], 2))
        assert engine.add_request(requests[2][0], max_new_tokens=requests[2][1]) == 2
        out = engine.run()
        assert sorted(out) == [0, 1, 2] and engine.alloc.n_used == 0
        for rid, (prompt, n) in enumerate(requests):
            alone = minigen.generate(model, torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=[]).tokens[0]
            assert out[rid].tolist() == alone.tolist(), f"request {rid}"
        raise
    pytest.fail("the call was not refused")


@case("engine-prompt-floats")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([1.5, 2.7], max_new_tokens=2))


@case("engine-prompt-bools")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([True, False], max_new_tokens=2))


@case("engine-prompt-float-tensor")
def _(tiny_model):
    for bad in (torch.tensor([True, False]), torch.tensor([[1, 2], [3, 4]]), torch.tensor(3)):  # refused too
        with pytest.raises(minigen.errors.PromptError, match="tensor of shape"):
            _engine_refuses(tiny_model, lambda e: e.add_request(bad, max_new_tokens=2))
    _engine_refuses(tiny_model, lambda e: e.add_request(torch.tensor([1.5, 2.7]), max_new_tokens=2))


@case("engine-prompt-text")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request("hello", max_new_tokens=2))


@case("engine-prompt-none")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request(None, max_new_tokens=2))


@case("engine-prompt-ragged")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([[1, 2], [3]], max_new_tokens=2))


@case("engine-prompt-dict")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request({1: 2}, max_new_tokens=2))


@case("engine-prompt-past-int64")
def _(tiny_model):
    with pytest.raises(minigen.errors.PromptError, match=r"token id -1 \(item 1\)"):  # below 0, refused too
        _engine_refuses(tiny_model, lambda e: e.add_request([3, -1], max_new_tokens=2))
    _engine_refuses(tiny_model, lambda e: e.add_request([3, 2**70], max_new_tokens=2))


@case("engine-prompt-accepted")
def _(tiny_model):
    import numpy as np
    engine = minigen.Engine(tiny_model, {"cache_chunk_size": 4, "stop_token_ids": []}, num_blocks=16)
    forms = ([4, 5, 6], (4, 5, 6), [np.int64(4), np.int32(5), 6], torch.tensor([4, 5, 6]),
             torch.tensor([[4, 5, 6]], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.uint8))
    assert [engine.add_request(f, max_new_tokens=2) for f in forms] == list(range(len(forms)))
    out = engine.run()
    alone = minigen.generate(tiny_model, torch.tensor([[4, 5, 6]]), max_new_tokens=2, stop_token_ids=[]).tokens[0]
    assert all(out[i].tolist() == alone.tolist() for i in range(len(forms)))


@case("engine-arrival-text")
def _(tiny_model):
    with pytest.raises(minigen.errors.ConfigError, match=r"arrival_s=\[1\] is invalid"):  # the row's other value
        _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=[1]))
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s="soon"))


@case("engine-arrival-nan")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=float("nan")))


@case("engine-arrival-inf")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=float("inf")))


@case("engine-arrival-negative")
def _(tiny_model):
    with pytest.raises(minigen.errors.ConfigError, match="arrival_s=True is invalid"):  # the row's other value
        _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=True))
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=-1))


@case("engine-arrival-far")
def _(tiny_model, monkeypatch):
    engine = minigen.Engine(tiny_model, {"cache_chunk_size": 4}, num_blocks=8)
    engine.add_request([1, 2], max_new_tokens=2, arrival_s=1e12)  # past what time.sleep takes at once
    naps = []

    class Woke(Exception):
        pass

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise Woke
    monkeypatch.setattr(time, "sleep", nap)
    with pytest.raises(Woke):
        engine.run()
    assert all(0 < s <= 3600 for s in naps) and engine.steps == [], naps  # waiting, in naps of at most an hour
    engine.cancel(0)


@case("engine-cancel-not-an-id")
def _(tiny_model):
    for bad in (1.0, "1", None):  # the row's other values, refused as well
        with pytest.raises(minigen.errors.RequestError, match=f"unknown request id {bad!r}"):
            _engine_refuses(tiny_model, lambda e: e.cancel(bad))
    _engine_refuses(tiny_model, lambda e: e.cancel(True))  # True was taken for request 1



# ---------------------------------------------------------------- 4-9: config, CLI integers, sizes, argument types


# ---------------------------------------------------------------- 10-12: output files and what is cached


# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum


# ---------------------------------------------------------------- 14: the 4-bit cache's scales


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
# Random sequences of add_request, step, cancel and stream, valid and invalid, on the tiny Llama with a
# pool of 6..8 blocks of 4 tokens: requests of up to 23 positions, 1..3 at a time, so the pool runs out
# and sequences are preempted (and recomputed) often. Invariants, after every call: each request sits in
# exactly one of waiting / running / finished, finished exactly once, and what step/stream yielded is
# its output; a refused call raises a MinigenError and changes nothing. At the end (every request run
# out): each finished request equals generating it alone, greedy or sampled with its own seed (a lone
# prompt is row 0, whose generator is seeded by `seed`), and a cancelled one holds a prefix of that.
_ENGINE_BAD_ADDS = [  # (prompt, keyword arguments) that add_request refuses whatever the engine holds
    ([1.5, 2.7], {}), ([True, False], {}), ("hello", {}), (None, {}), ([[1, 2], [3]], {}), ({1: 2}, {}),
    ([3, 2**70], {}), ([], {}), ([3, 97], {}), ([-1], {}), (torch.tensor([1.5]), {}),
    (torch.tensor([[1, 2], [3, 4]]), {}), (torch.tensor([], dtype=torch.long), {}),
    ([1, 2], {"arrival_s": "soon"}), ([1, 2], {"arrival_s": [1]}), ([1, 2], {"arrival_s": float("nan")}),
    ([1, 2], {"arrival_s": float("inf")}), ([1, 2], {"arrival_s": -1}), ([1, 2], {"arrival_s": True}),
    ([1, 2], {"max_new_token": 3}), ([1, 2], {"window_size": 4}), ([1, 2], {"temperature": -1.0}),
    ([1, 2], {"max_new_tokens": -1}), ([1, 2], {"max_new_tokens": 2.5}), ([1, 2], {"seed": "x"}),
    ([1, 2], {"top_k": 0}), ([1, 2], {"top_p": 1.5}), ([1, 2], {"stop_token_ids": [500]}),
    ([1, 2], {"max_new_tokens": 200}),  # past the context of 128
    (list(range(40)), {"max_new_tokens": 8}),  # 47 positions: 12 blocks, more than the pool holds
]
_ENGINE_BAD_IDS = [1.0, "0", None, -1, 10**6]
_ENGINE_SAMPLING = st.one_of(st.just({}), st.fixed_dictionaries({
    "do_sample": st.just(True), "seed": st.integers(0, 2**32), "temperature": st.sampled_from([0.8, 1.3]),
    "top_k": st.sampled_from([None, 8]), "top_p": st.sampled_from([None, 0.9])}))
_engine_seen = collections.Counter()  # what the examples exercised, checked after the run


@functools.cache
def _engine_tiny():
    return minigen.from_hf(tiny_hf("llama"))


@functools.cache
def _engine_alone(prompt: tuple[int, ...], overrides: tuple) -> list[int]:
    """The new tokens of generating `prompt` alone with add_request's `overrides` (sorted key, value pairs)."""
    config = {**dict(overrides), "stop_token_ids": list(dict(overrides)["stop_token_ids"])}
    out = minigen.generate(_engine_tiny(), [torch.tensor(prompt)], **config)
    return out.tokens[0][len(prompt):].tolist()


class _EngineCounting(minigen.Engine):
    """An Engine that counts how often each request finishes (it must be once), and fails where it
    would step forever (a stalled engine: stream() and run() would never return)."""
    finishes: collections.Counter
    steps_taken = 0

    def _finish(self, req, reason: str) -> None:
        self.finishes[req.id] += 1
        super()._finish(req, reason)

    def step(self) -> dict[int, list[int]]:
        self.steps_taken += 1  # an example adds at most 90 requests of at most 24 tokens: far fewer steps
        assert self.steps_taken <= 5000, f"the engine stalled: {len(self.waiting)} waiting, {len(self.running)} running"
        return super().step()


class _EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 8), max_batch_size=st.integers(1, 3),
                budget=st.sampled_from([None, 3, 8]))
    def make(self, num_blocks: int, max_batch_size: int, budget: int | None) -> None:
        self.engine = _EngineCounting(_engine_tiny(), {"cache_chunk_size": 4}, num_blocks=num_blocks,
                                      max_batch_size=max_batch_size, max_num_batched_tokens=budget)
        self.engine.finishes = collections.Counter()
        self.added: list[tuple[tuple[int, ...], tuple]] = []  # per id: prompt, settings
        self.cancelled: set[int] = set()
        self.yielded: dict[int, list[int]] = {}  # per id: the tokens step/stream gave, in order

    def _unfinished(self) -> list[int]:
        return [r.id for r in self.engine.requests if r.status != "finished"]

    def _refused(self, call) -> None:
        before = _engine_state(self.engine)
        with pytest.raises(minigen.errors.MinigenError):
            call()
        assert _engine_state(self.engine) == before, "a refused call changed the engine"
        _engine_seen["refused"] += 1

    @rule(requests=st.lists(st.tuples(
        st.lists(st.integers(0, 96), min_size=1, max_size=12),  # the prompt
        st.sampled_from("ltTr"),  # as a list, tuple, [T] tensor or [1, T] tensor
        st.integers(0, 12),  # max_new_tokens: a request takes up to 23 positions, 6 blocks
        _ENGINE_SAMPLING,
        st.one_of(st.just([]), st.lists(st.integers(0, 96), min_size=2, max_size=8)),  # stop ids: some stop early
        st.sampled_from([None, 0.0])), min_size=1, max_size=3))  # arrival_s
    def add(self, requests) -> None:
        for prompt, form, n, sampling, stop, arrival in requests:
            given = {"l": prompt, "t": tuple(prompt), "T": torch.tensor(prompt), "r": torch.tensor([prompt])}[form]
            overrides = {"max_new_tokens": n, "stop_token_ids": stop, **sampling}
            assert self.engine.add_request(given, arrival_s=arrival, **overrides) == len(self.added)
            self.added.append((tuple(prompt), tuple(sorted({**overrides, "stop_token_ids": tuple(stop)}.items()))))
            self.yielded[len(self.added) - 1] = []

    @rule(bad=st.sampled_from(_ENGINE_BAD_ADDS))
    def add_invalid(self, bad) -> None:
        self._refused(lambda: self.engine.add_request(bad[0], **bad[1]))

    @rule()
    def step(self) -> None:
        for rid, tokens in self.engine.step().items():
            self.yielded[rid] += tokens
        assert all(self.yielded[r.id] == r.output for r in self.engine.requests)  # a step yields every new token

    @rule(k=st.integers(1, 10))
    def stream_some(self, k: int) -> None:
        """Take k tokens from stream(), then drop it: the rest of its last step's tokens are never yielded."""
        tokens = self.engine.stream()
        for rid, token in itertools.islice(tokens, k):
            self.yielded[rid].append(token)
        tokens.close()
        for r in self.engine.requests:
            assert r.output[:len(self.yielded[r.id])] == self.yielded[r.id], "stream yielded a token out of order"
            self.yielded[r.id] = list(r.output)

    @precondition(lambda self: self._unfinished())
    @rule(data=st.data())
    def cancel(self, data) -> None:
        rid = data.draw(st.sampled_from(self._unfinished()))
        self.engine.cancel(rid)
        self.cancelled.add(rid)

    @rule(data=st.data())
    def cancel_invalid(self, data) -> None:
        finished = [r.id for r in self.engine.requests if r.status == "finished"]
        bad = data.draw(st.one_of(st.sampled_from([True, False]),  # Python's 1 and 0: often live ids
                                  st.sampled_from(_ENGINE_BAD_IDS + finished + [len(self.added)])))
        self._refused(lambda: self.engine.cancel(bad))

    @invariant()
    def each_request_once(self) -> None:
        e = self.engine
        queued = [r.id for r in e.waiting] + [r.id for r in e.running]
        assert len(set(queued)) == len(queued), f"a request is queued twice: {queued}"
        assert [r.id for r in e.requests] == list(range(len(self.added)))
        for r in e.requests:
            assert (r.status == "finished") == (r.id not in queued), f"request {r.id}: {r.status}, queued {queued}"
            assert e.finishes[r.id] == (r.status == "finished"), f"request {r.id} finished {e.finishes[r.id]} times"
            assert (r.finish_reason == "cancelled") == (r.id in self.cancelled)
        assert e.alloc.n_used <= e.num_blocks

    def teardown(self) -> None:
        e = self.engine
        out = e.run()  # every request to its end
        self.each_request_once()
        assert sorted(out) == list(range(len(self.added))) and e.alloc.n_used == 0
        for rid, (prompt, overrides) in enumerate(self.added):
            alone, new = _engine_alone(prompt, overrides), out[rid][len(prompt):].tolist()
            assert out[rid][:len(prompt)].tolist() == list(prompt)
            if rid in self.cancelled:
                assert new == alone[:len(new)], f"cancelled request {rid}: {new} is not a prefix of {alone}"
            else:
                assert new == alone, f"request {rid} {overrides}: {new}, alone {alone}"
                _engine_seen["sampled" if dict(overrides).get("do_sample") else "greedy"] += 1
            _engine_seen["stopped"] += e.requests[rid].finish_reason == "stop"
        _engine_seen["cancelled"] += len(self.cancelled)
        _engine_seen["preemptions"] += e.preemptions
        _engine_seen["chunked"] += e.max_num_batched_tokens is not None


def test_engine_api_properties():
    """Random sequences of the Engine's calls keep every invariant (see _EngineMachine)."""
    _engine_seen.clear()
    run_state_machine_as_test(_EngineMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    # the examples reached what the invariants are about (a derandomized run: the same every time)
    for what in ("refused", "sampled", "greedy", "stopped", "cancelled", "preemptions", "chunked"):
        assert _engine_seen[what] > 0, f"no example had {what}: {dict(_engine_seen)}"
