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
import time

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
