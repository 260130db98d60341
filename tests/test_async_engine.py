"""minigen.serving.async_engine: the Engine stepped by one thread for asyncio, and the Engine's
logprobs and forget.

Oracles: a streamed request's tokens equal Engine.run's and generating it alone (rows never see each
other, each samples from its own seeded generator); a logprob equals torch.log_softmax of the
transformers model's fp32 logits at the same prefix; a cancelled or finished request gives every
block back and leaves no record. Each test runs its coroutine under asyncio.run with a timeout, so a
stream that never ends fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import minigen
from minigen import ConfigError, Engine, PromptError, RequestError
from minigen.errors import QueueFullError
from minigen.serving.async_engine import AsyncEngine, RequestStream, TokenEvent

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {"cache_chunk_size": 4, "stop_token_ids": []}
TIMEOUT_S = 30.0  # every test's coroutine; each takes well under a second when it works


def drive(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def alone(model, prompt: list[int], **config) -> list[int]:
    """The new tokens of generating `prompt` by itself, cut after a stop token (generate pads past it)."""
    config = {"stop_token_ids": [], **config}  # as CONFIG: no eos unless a test names stop ids
    new = minigen.generate(model, torch.tensor([prompt]), **config).tokens[0, len(prompt):].tolist()
    stop = config.get("stop_token_ids") or []
    return new[:next((k + 1 for k, t in enumerate(new) if t in stop), len(new))]


async def collect(engine: AsyncEngine, prompt, **kw) -> tuple[RequestStream, list[TokenEvent]]:
    stream = await engine.submit(prompt, **kw)
    return stream, [event async for event in stream]


async def ends(streams: list[RequestStream]) -> list[tuple[str | None, int]]:
    """Read each stream to its end -> (finish_reason, events read) per stream."""
    counts = [len([event async for event in s]) for s in streams]
    return [(s.finish_reason, n) for s, n in zip(streams, counts)]


def slow_steps(engine: Engine, step_s: float) -> None:
    """Make every step take at least step_s, so that a request stays in flight while a test acts."""
    step = engine.step

    def slow():
        time.sleep(step_s)
        return step()
    engine.step = slow


def test_streams_equal_engine_run_and_generating_alone(tiny_llama):
    _, model = tiny_llama
    ps = prompts(6)
    stop = alone(model, ps[2], max_new_tokens=8, stop_token_ids=[])[2]  # request 2 stops at its third token
    settings = [dict(max_new_tokens=8), dict(max_new_tokens=3),
                dict(max_new_tokens=8, stop_token_ids=[stop]),
                dict(max_new_tokens=7, do_sample=True, temperature=0.8, seed=7),
                dict(max_new_tokens=7, do_sample=True, top_k=5, top_p=0.9, seed=8),
                dict(max_new_tokens=9, do_sample=True, temperature=1.3, seed=9)]
    engine = AsyncEngine(Engine(model, CONFIG, max_batch_size=4, num_blocks=24))
    began = time.perf_counter()

    async def main():  # all six at once: they share steps, four rows at a time
        return await asyncio.gather(*[collect(engine, p, **s) for p, s in zip(ps, settings)])
    try:
        got = drive(main())
    finally:
        engine.close()
    reference = Engine(model, CONFIG, max_batch_size=4, num_blocks=24)
    for p, s in zip(ps, settings):
        reference.add_request(p, **s)
    ran = reference.run()
    for i, ((stream, events), p, s) in enumerate(zip(got, ps, settings)):
        tokens = [e.token_id for e in events]
        assert tokens == ran[i][len(p):].tolist() == alone(model, p, **s), (i, s)
        assert stream.finish_reason == ("stop" if i == 2 else "length") and stream.prompt_tokens == len(p)
        assert all(e.logprob is None and e.top_logprobs is None for e in events)  # none asked for
        assert began < stream.first_token_s < time.perf_counter()
    assert sorted(s.request_id for s, _ in got) == list(range(6))
    assert engine.engine.requests == {} and engine.engine.steps == []  # forgotten, and no step record kept


def test_logprobs_equal_log_softmax_of_the_models_logits(tiny_llama):
    hf, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, max_batch_size=4, num_blocks=24))
    p = prompts(1, seed=3)[0]

    async def main():
        return await asyncio.gather(collect(engine, p, max_new_tokens=6, logprobs=5),
                                    # temperature reshapes what is sampled, not the logprobs reported
                                    collect(engine, p, max_new_tokens=6, logprobs=20, do_sample=True,
                                            temperature=0.5, seed=1),
                                    collect(engine, p, max_new_tokens=2, logprobs=0))
    try:
        (_, greedy), (_, sampled), (_, zero) = drive(main())
    finally:
        engine.close()
    for events, k in ((greedy, 5), (sampled, 20), (zero, 0)):
        tokens = [e.token_id for e in events]
        for i, event in enumerate(events):
            with torch.no_grad():
                logits = hf(torch.tensor([p + tokens[:i]])).logits[0, -1]  # [V], fp32
            want = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(want, k)
            assert event.logprob == pytest.approx(float(want[event.token_id]), abs=1e-4)
            assert [t for t, _ in event.top_logprobs] == top.indices.tolist()  # most likely first
            assert [v for _, v in event.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert greedy[0].top_logprobs[0][0] == greedy[0].token_id  # greedy picks the top one
    assert len(zero[0].top_logprobs) == 0 and zero[0].logprob < 0


def test_logprobs_out_of_range_are_refused_before_anything_is_queued(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, num_blocks=8))

    async def main():
        for bad in (21, -1, True, 2.0, "3"):
            with pytest.raises(ConfigError, match=r"logprobs=.* is invalid: use an integer in 0\.\.20"):
                await engine.submit([1, 2], logprobs=bad)
        with pytest.raises(PromptError, match="empty"):  # add_request's errors come through unchanged
            await engine.submit([])
        with pytest.raises(ConfigError, match="Did you mean 'max_new_tokens'"):
            await engine.submit([1, 2], max_new_token=3)
    try:
        drive(main())
        assert engine.engine.requests == {} and engine.snapshot()["requests_total"] == 0
    finally:
        engine.close()


def test_cancel_mid_stream_gives_its_blocks_back(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, max_batch_size=4, num_blocks=64))
    free = len(engine.engine.alloc.free)
    p, q = prompts(2, seed=5)
    slow_steps(engine.engine, 0.005)

    async def main():
        other = asyncio.create_task(collect(engine, q, max_new_tokens=20))  # runs beside it, undisturbed
        stream = await engine.submit(p, max_new_tokens=100)
        got = [await stream.__anext__() for _ in range(3)]
        stream.cancel()
        stream.cancel()  # idempotent
        got += [event async for event in stream]
        early = await engine.submit(p, max_new_tokens=100)
        early.cancel()  # before its first step
        return stream, got, early, [e async for e in early], await other
    try:
        stream, got, early, early_events, (other, other_events) = drive(main())
        assert stream.finish_reason == "cancelled" and 3 <= len(got) < 100
        assert [e.token_id for e in got] == alone(model, p, max_new_tokens=100)[:len(got)]
        assert early.finish_reason == "cancelled" and len(early_events) < 100
        assert other.finish_reason == "length"
        assert [e.token_id for e in other_events] == alone(model, q, max_new_tokens=20)
        assert len(engine.engine.alloc.free) == free and engine.engine.alloc.n_used == 0
        assert engine.engine.requests == {}
    finally:
        engine.close()


def test_a_full_queue_refuses_and_shutdown_cancels_what_is_left(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, max_batch_size=1, num_blocks=64), max_waiting=2)
    slow_steps(engine.engine, 0.02)  # the first request holds the one batch slot for ~2 s

    async def main():
        first = await engine.submit([1, 2, 3], max_new_tokens=100)
        await first.__anext__()  # running now
        waiting = [await engine.submit([4, 5], max_new_tokens=100) for _ in range(2)]
        with pytest.raises(QueueFullError, match=r"2 requests are waiting \(max_waiting=2\)"):
            await engine.submit([6], max_new_tokens=2)
        load = engine.snapshot()
        assert load["running"] == 1 and load["waiting"] == 2 and load["requests_total"] == 3, load
        assert 0 < load["kv_usage"] <= 1 and load["free_blocks"] < load["num_blocks"] == 64
        began = time.perf_counter()
        await engine.shutdown(grace_s=0.2)
        took = time.perf_counter() - began
        with pytest.raises(QueueFullError, match="shutting down"):
            await engine.submit([1], max_new_tokens=2)
        return took, await ends([first, *waiting])
    took, ended = drive(main())
    assert 0.2 <= took < 1.5, took  # the grace, then the cancels; not the ~2 s the first one needs
    assert ended[0][0] == "cancelled" and 1 <= ended[0][1] < 99 and ended[1:] == [("cancelled", 0)] * 2
    assert not engine._thread.is_alive() and engine.engine.requests == {} and engine.engine.alloc.n_used == 0


def test_shutdown_lets_requests_in_flight_finish_within_the_grace(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, num_blocks=16))

    async def main():
        stream = await engine.submit([1, 2, 3], max_new_tokens=5)
        began = time.perf_counter()
        await engine.shutdown(grace_s=30.0)  # returns as soon as the request is done, not after 30 s
        return stream, [e.token_id async for e in stream], time.perf_counter() - began
    stream, tokens, took = drive(main())
    assert stream.finish_reason == "length" and tokens == alone(model, [1, 2, 3], max_new_tokens=5)
    assert took < 10.0 and not engine._thread.is_alive()


def test_forget_keeps_a_long_running_engine_small(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, max_batch_size=4, num_blocks=32), max_waiting=8)
    sizes = []

    async def main():
        for wave in range(6):
            streams = [await engine.submit(p, max_new_tokens=3) for p in prompts(8, seed=wave)]
            sizes.append(len(engine.engine.requests))
            for s in streams:
                assert len([e async for e in s]) == 3 and s.finish_reason == "length"
        zero = await engine.submit([1], max_new_tokens=0)  # finishes as it is added: no step sees it
        return zero, [e async for e in zero]
    try:
        zero, events = drive(main())
    finally:
        engine.close()
    assert zero.finish_reason == "length" and events == [] and zero.request_id == 48
    assert max(sizes) <= 8 and engine.engine.requests == {} and engine.engine.steps == []
    assert engine.snapshot()["requests_total"] == 49 and engine.engine.alloc.n_used == 0


def test_engine_forget_and_logprobs(tiny_llama):
    """Engine.forget drops only finished records; ids keep increasing; run/metrics see the rest."""
    _, model = tiny_llama
    engine = Engine(model, CONFIG, num_blocks=16)
    a = engine.add_request([1, 2, 3], max_new_tokens=4, logprobs=3)
    b = engine.add_request([4, 5], max_new_tokens=4)
    with pytest.raises(RequestError, match="request 0 is still waiting: only a finished or cancelled"):
        engine.forget(a)
    engine.run()
    assert [len(lps) for _, lps in engine.requests[a].logprobs] == [3] * 4 and engine.requests[b].logprobs == []
    engine.forget(a)
    with pytest.raises(RequestError, match=r"unknown request id 0 \(int\) \(finished and forgotten\)"):
        engine.cancel(a)
    assert engine.add_request([6], max_new_tokens=1) == 2  # a forgotten id is never given again
    assert sorted(engine.run()) == [1, 2] and [r["request_id"] for r in engine.metrics()["requests"]] == [1, 2]
    with pytest.raises(ConfigError, match=r"logprobs=21 is invalid"):
        engine.add_request([1], logprobs=21)
    assert engine.add_request([1], max_new_tokens=1) == 3  # the refused one used no id


def test_a_failed_step_ends_every_stream_with_error(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, max_batch_size=2, num_blocks=32))
    step, calls = engine.engine.step, []

    def failing():  # the third step once all three requests are in fails, as a CUDA error or a kernel's bug would
        if len(engine.engine.requests) == 3:  # (counted from then: a loaded machine may step before the last submit)
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected step failure")
        return step()
    engine.engine.step = failing

    async def main():
        streams = [await engine.submit(p, max_new_tokens=20) for p in prompts(3, seed=7)]
        ended = await ends(streams)
        with pytest.raises(RuntimeError, match="engine thread stopped after a failed step.*injected"):
            await engine.submit([1], max_new_tokens=2)
        return ended
    ended = drive(main())
    assert [r for r, _ in ended] == ["error"] * 3 and all(n < 20 for _, n in ended)
    assert isinstance(engine.error, RuntimeError) and "injected" in str(engine.error)
    engine._thread.join(timeout=10)  # it ends the streams, then returns
    assert not engine._thread.is_alive() and engine.engine.alloc.n_used == 0  # the requests were cancelled
    engine.close()  # returns at once: the thread has stopped


def test_an_idle_engine_does_not_spin(tiny_llama):
    _, model = tiny_llama
    engine = AsyncEngine(Engine(model, CONFIG, num_blocks=16))
    engine.start()
    try:
        drive(collect(engine, [1, 2], max_new_tokens=2))
        cpu = time.process_time()
        time.sleep(0.5)  # the thread sleeps on its event: the process does next to nothing
        assert time.process_time() - cpu < 0.1
        stream, events = drive(collect(engine, [1, 2], max_new_tokens=2))  # and wakes for the next request
        assert stream.finish_reason == "length" and len(events) == 2
    finally:
        engine.close()
    assert not engine._thread.is_alive()
