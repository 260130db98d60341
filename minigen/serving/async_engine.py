"""`AsyncEngine`: the Engine driven by one background thread, for asyncio handlers (`minigen serve`).

The Engine (engine.py) is synchronous and single-threaded: `step()` runs a forward and samples. A
server's handlers are coroutines on one event loop, which must never wait for a forward. So one
daemon thread owns the stepping, as vLLM's engine core loop does:

    engine = AsyncEngine(Engine(model, max_batch_size=8), max_waiting=256)
    engine.start()
    stream = await engine.submit(prompt_ids, max_new_tokens=32, logprobs=2)   # in a handler
    async for event in stream: ...                                            # TokenEvent per token
    stream.finish_reason                                                      # "stop", "length", ...

Every Engine call happens under one lock: the thread holds it while it steps, and `submit` runs
`add_request` in a worker thread (`asyncio.to_thread`) under the same lock, so the loop never blocks.
After each step the thread hands each stream its new tokens with `loop.call_soon_threadsafe` (an
asyncio.Queue is not thread-safe), ends the streams of finished requests, `forget`s them and clears
`engine.steps`, so a server that runs for weeks keeps a bounded record. With nothing to run the
thread sleeps on a threading.Event that `submit`, `cancel` and `shutdown` set: no polling.
If a step raises, the thread ends every stream with finish_reason "error", keeps the exception in
`AsyncEngine.error` and refuses later submits: a server must never hang on a dead engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

from ..errors import ConfigError, QueueFullError
from .engine import Engine

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """One sampled token of a request, with its logprobs when the request asked for them."""
    token_id: int
    logprob: float | None  # None unless the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None  # the top k (id, logprob), most likely first


class _End:
    """The item that closes a stream's queue."""


class RequestStream:
    """One request's tokens, as an async iterator of TokenEvent; ends when the request finishes.

    Made on the event loop by `AsyncEngine.submit` and fed by the engine thread through `send`
    (`loop.call_soon_threadsafe`), so its queue, finish_reason and first_token_s change on the loop only.
    """

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self.request_id: int = -1  # set under the engine lock as the request is added
        self.prompt_tokens = 0
        self.finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" once ended
        self.first_token_s: float | None = None  # time.perf_counter() when its first token was sampled
        self.cancel_requested = False
        self._owner, self._loop = owner, loop
        self._queue: asyncio.Queue = asyncio.Queue()  # TokenEvent items, then one _End
        self._ended = False
        self.sent = 0  # output tokens handed to the loop so far (read and written by the engine thread only)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _End:
            self._ended = True
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Stop the request (thread-safe, idempotent): before its next step the engine thread cancels it,
        its blocks go back to the pool, and the stream ends with finish_reason "cancelled"."""
        if not self.cancel_requested:
            self.cancel_requested = True  # set before queuing: submit's worker re-queues a stream it sees set
            self._owner.request_cancel(self)

    def send(self, events: list[TokenEvent], first_token_s: float | None, reason: str | None) -> None:
        """From the engine thread: hand `events` to the stream's loop, and end the stream when `reason` is
        set. RuntimeError when that loop is closed (no one can read the stream any more)."""
        self._loop.call_soon_threadsafe(self._receive, events, first_token_s, reason)

    def _receive(self, events: list[TokenEvent], first_token_s: float | None, reason: str | None) -> None:
        """On the loop: queue the events the engine thread sampled, and end the stream when `reason` is set."""
        if self.first_token_s is None:
            self.first_token_s = first_token_s
        for event in events:
            self._queue.put_nowait(event)
        if reason is not None and self.finish_reason is None:
            self.finish_reason = reason
            self._queue.put_nowait(_End)


class AsyncEngine:
    """An Engine stepped by one daemon thread; coroutines submit requests and read their streams.

    max_waiting bounds the requests queued and not yet admitted: past it `submit` raises QueueFullError
    (a server answers 429) instead of letting the queue, and every client's wait, grow without bound.
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256):
        if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 1:
            raise ConfigError(f"max_waiting={max_waiting!r} is invalid: use an integer >= 1 (requests queued "
                              "before the engine admits them; past it a request is refused)")
        self.engine, self.max_waiting = engine, max_waiting
        self.error: BaseException | None = None  # what a failed step raised; the thread has stopped
        self.requests_total = 0  # requests accepted since the start
        self._lock = threading.Lock()  # every Engine call holds it
        self._wake = threading.Event()  # set when there may be work: a submit, a cancel, a shutdown
        self._streams: dict[int, RequestStream] = {}  # request id -> its stream, until it ends
        self._cancels: collections.deque[RequestStream] = collections.deque()  # appended from any thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline = float("inf")  # time.perf_counter() past which shutdown cancels what is left

    # ---------------------------------------------------------------- the event loop's side
    def start(self) -> None:
        """Start the engine thread (a daemon: it never keeps the process alive); submit starts it too."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minigen-engine", daemon=True)
            self._thread.start()

    async def submit(self, prompt_ids, *, logprobs: int | None = None, **overrides) -> RequestStream:
        """Queue a request -> its stream. `overrides` are the Engine's request keys (max_new_tokens,
        do_sample, temperature, top_k, top_p, seed, stop_token_ids); add_request's ConfigError and
        PromptError come through unchanged; QueueFullError when max_waiting requests are waiting or
        shutdown has begun, and nothing is queued."""
        self._check_open()
        self.start()
        stream = RequestStream(self, asyncio.get_running_loop())
        try:
            await asyncio.to_thread(self._add, stream, prompt_ids, logprobs, overrides)
        except asyncio.CancelledError:  # the caller went away; the worker may still add it: cancel it then
            stream.cancel()
            raise
        self._wake.set()
        return stream

    def snapshot(self) -> dict:
        """The engine's load now, for /metrics: read without the lock (single reads of lists and counters),
        so a scrape never waits for a step."""
        e = self.engine
        used = e.alloc.n_used
        return {"running": len(e.running), "waiting": len(e.waiting), "num_blocks": e.num_blocks,
                "free_blocks": e.num_blocks - used, "kv_usage": used / e.num_blocks,
                "requests_total": self.requests_total}

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting (submit raises QueueFullError), let the requests in flight run for up to
        grace_s seconds, cancel the rest (their streams end "cancelled") and stop the thread."""
        self._begin_stop(grace_s)
        await asyncio.to_thread(self._join)

    def close(self) -> None:
        """Stop now, synchronously: cancel every request in flight and stop the thread."""
        self._begin_stop(0.0)
        self._join()

    # ---------------------------------------------------------------- called from any thread
    def request_cancel(self, stream: RequestStream) -> None:
        """Queue a stream's cancel for the engine thread (RequestStream.cancel calls it)."""
        self._cancels.append(stream)
        self._wake.set()

    def _check_open(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine thread stopped after a failed step ({type(self.error).__name__}: "
                               f"{self.error}); no request can run: restart the server") from None
        if self._stopping:
            raise QueueFullError("the server is shutting down: no new requests are accepted; retry on another "
                                 "replica or after the restart") from None

    def _add(self, stream: RequestStream, prompt_ids, logprobs, overrides: dict) -> None:
        """In a worker thread: add the request under the lock and register its stream."""
        with self._lock:
            self._check_open()  # shutdown or a failure may have begun while this waited for the lock
            waiting = len(self.engine.waiting)
            if waiting >= self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting (max_waiting={self.max_waiting}): the "
                                     "server is at capacity; retry later, or raise max_waiting") from None
            rid = self.engine.add_request(prompt_ids, logprobs=logprobs, **overrides)
            req = self.engine.requests[rid]
            stream.request_id, stream.prompt_tokens = rid, len(req.prompt)
            self._streams[rid] = stream
            self.requests_total += 1
            if req.status == "finished":  # max_new_tokens=0 finishes as it is added: no step will see it
                self._send(stream, req, time.perf_counter(), req.finish_reason)
        if stream.cancel_requested:  # cancelled while it was being added: the thread may have skipped it
            self.request_cancel(stream)

    def _begin_stop(self, grace_s: float) -> None:
        self._stopping = True
        self._deadline = min(self._deadline, time.perf_counter() + max(0.0, grace_s))
        self._wake.set()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        else:  # never started: end what was submitted here
            with self._lock:
                self._cancel_all("cancelled")

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        """Step while there is work; sleep on the event while there is none; never die silently."""
        try:
            while True:
                with self._lock:
                    self._wake.clear()  # under the lock: a submit or cancel after this sets it again
                    self._apply_cancels()
                    e, now = self.engine, time.perf_counter()
                    if self._stopping and (not e.unfinished() or now >= self._deadline):
                        self._cancel_all("cancelled")
                        return
                    if e.running or (e.waiting and e.waiting[0].arrival_s <= e.now()):
                        e.step()
                        e.steps.clear()  # the server keeps no per-step record: memory stays bounded
                        self._deliver()
                        nap = 0.0
                    else:  # nothing to run: sleep until a submit, a cancel, the next arrival or the deadline
                        waits = ([self._deadline - now] if self._stopping else []) + (
                            [e.waiting[0].arrival_s - e.now()] if e.waiting else [])
                        nap = max(0.0, min(waits)) if waits else None
                if nap is None or nap > 0:
                    self._wake.wait(nap)
                else:  # let a submit waiting for the lock take it before the next step (Lock is not fair)
                    time.sleep(0)
        except BaseException as exc:  # a failed step (or a bug here): end every stream, keep the error
            log.exception("minigen engine thread stopped: every request in flight ends with 'error'")
            with self._lock:  # set under the lock: a submit that holds it next sees the error
                self.error = exc
                self._cancel_all("error")

    def _apply_cancels(self) -> None:
        """Cancel in the engine the streams cancelled since the last step (their blocks go back)."""
        while self._cancels:
            stream = self._cancels.popleft()
            if self._streams.get(stream.request_id) is not stream:  # ended already, or not added yet
                continue
            if self.engine.requests[stream.request_id].status != "finished":
                self.engine.cancel(stream.request_id)
            self._end(stream, self.engine.requests[stream.request_id].finish_reason)

    def _deliver(self) -> None:
        """Hand each stream its new tokens; end and forget the finished requests."""
        now = time.perf_counter()
        for rid, stream in list(self._streams.items()):
            req = self.engine.requests[rid]
            done = req.status == "finished"
            if len(req.output) > stream.sent or done:
                self._send(stream, req, now, req.finish_reason if done else None)

    def _send(self, stream: RequestStream, req, now: float, reason: str | None) -> None:
        new = range(stream.sent, len(req.output))
        lps = req.logprobs if req.num_logprobs is not None else None
        events = [TokenEvent(req.output[i], lps[i][0] if lps else None, lps[i][1] if lps else None) for i in new]
        stream.sent = len(req.output)
        if reason is not None:
            del self._streams[req.id]
            self.engine.forget(req.id)
        try:
            stream.send(events, now if events else None, reason)
        except RuntimeError:  # its event loop is closed: no one reads it any more, so stop computing it
            if reason is None:
                self.engine.cancel(req.id)
                self._streams.pop(req.id)
                self.engine.forget(req.id)

    def _end(self, stream: RequestStream, reason: str) -> None:
        """End a stream whose request has finished in the engine, with its tokens not yet sent."""
        req = self.engine.requests[stream.request_id]
        self._send(stream, req, time.perf_counter(), reason)

    def _cancel_all(self, reason: str) -> None:
        """Cancel every request in flight and end its stream with `reason` (shutdown, or a failed step)."""
        for rid, stream in list(self._streams.items()):
            try:
                if self.engine.requests[rid].status != "finished":
                    self.engine.cancel(rid)
                self._end(stream, reason)
            except Exception:  # the engine may be broken (a failed step): the stream must end all the same
                self._streams.pop(rid, None)
                try:
                    stream.send([], None, reason)
                except RuntimeError:
                    pass
