"""`minigen serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

    app = make_app(AsyncEngine(engine), tokenizer, "smollm2-135m", max_context=2048)
    serve("smollm2-135m", GenerationConfig(), port=8000)   # loads, builds the engine, runs uvicorn

Routes: POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), GET
/v1/models, GET /health, GET /metrics (Prometheus text, vLLM's metric names).

One request of n choices is n engine requests (seeds seed, seed+1, ...). Each choice's tokens go
through its Detokenizer (text, multi-byte characters whole) and its StopStrings; a matched stop
string cancels its engine request, so its blocks go back at the next step. Streaming and not
streaming run the same code (`choice_deltas`): a stream sends the deltas as server-sent events,
a plain response joins them, so both give the same text for the same seed.

Errors are OpenAI's error object: 400 a bad field (named, with its range) or a prompt past the
context (both lengths), 401 a missing or wrong API key, 404 an unknown model or route, 429 a full
queue (with Retry-After), 503 while shutting down, 500 a generic message (the traceback is logged
here, never sent). A client that leaves mid-stream cancels its requests at the next token (a plain,
not streamed, request runs to its end: its handler learns of no disconnect).

Shutdown (SIGTERM or Ctrl-C): the server stops admitting at once (503 on new requests, /health
503 so a load balancer stops routing here), lets in-flight requests finish for up to `grace_s`
(uvicorn's timeout_graceful_shutdown), cancels the rest, stops the engine's thread, and exits 0.
503, not 429: the request was not refused for load, and a client should retry elsewhere.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import GenerationConfig
from ..errors import ConfigError, MinigenError, PromptError, QueueFullError, RequestError
from ..kernels.cpu import bound_onednn_caches
from ..loading import load
from .async_engine import AsyncEngine, RequestStream
from ..decoding.detokenize import Detokenizer, StopStrings
from .engine import Engine
from .openai_api import (FINISH, ApiError, ChatRequest, Choice, CompletionRequest, SamplingRequest, chat_prompt,
                         choice_body, completion_prompt, engine_overrides, envelope, error_body, logprobs_k, new_tokens,
                         now_s, request_id, unsupported, usage, validation_message)

log = logging.getLogger("minigen.serve")
ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
RETRY_AFTER_S = 1  # a full queue drains in about a step or two: ask the client to come back soon
# Latency buckets in seconds, from a fast GPU step to a long CPU request (vLLM's are similar)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


# ---------------------------------------------------------------- metrics
class ServerMetrics:
    """vLLM's metric names in an own CollectorRegistry: gauges read the engine when scraped,
    histograms and counters are observed as each engine request finishes."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = registry = CollectorRegistry()
        for name, doc, key in (("vllm:num_requests_running", "Requests in the running batch.", "running"),
                               ("vllm:num_requests_waiting", "Requests waiting to be admitted.", "waiting"),
                               ("vllm:kv_cache_usage_perc", "Share of the pool's KV blocks in use (0..1).",
                                "kv_usage")):
            gauge = Gauge(name, doc, ["model_name"], registry=registry)
            gauge.labels(model_name).set_function(lambda key=key: engine.snapshot()[key])

        def histogram(name: str, doc: str):
            return Histogram(name, doc, ["model_name"], buckets=LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to the first token, from submission.")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from submission to the last token.")
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens submitted.", ["model_name"],
                                     registry=registry).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=registry).labels(model_name)
        self.success = Counter("vllm:request_success", "Engine requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=registry)
        self.model_name = model_name

    def finished(self, submitted_s: float, first_token_s: float | None, tokens: int, reason: str) -> None:
        end = time.perf_counter()
        self.e2e.observe(end - submitted_s)
        if first_token_s is not None:
            self.ttft.observe(first_token_s - submitted_s)
            if tokens > 1:
                self.tpot.observe((end - first_token_s) / (tokens - 1))
        self.generation_tokens.inc(tokens)
        self.success.labels(self.model_name, reason).inc()


# ---------------------------------------------------------------- the state the routes share
class Served:
    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_context: int):
        self.engine, self.tokenizer, self.model_name, self.max_context = engine, tokenizer, model_name, max_context
        self.metrics = ServerMetrics(engine, model_name)
        self.draining = False  # set on SIGTERM: new requests get 503


class SSEResponse(StreamingResponse):
    """A stream whose generator is closed as soon as sending ends, a client's disconnect included,
    so its `finally` cancels the engine requests now rather than when the generator is collected."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# ---------------------------------------------------------------- one choice, and the n of a request
async def choice_deltas(s: Served, index: int, stream: RequestStream, prompt_ids: list[int], stops: list[str],
                        submitted_s: float, stop_ids: frozenset[int] = frozenset()) -> AsyncIterator[Choice]:
    """A choice's text as it grows: one Choice per token (its new text, maybe ""), and a last one with
    the finish reason. Streaming and plain responses both read this, so their texts are equal. A stop
    token (stop_ids: the eos that ends it) counts as a token and adds no text, as in OpenAI's replies."""
    detok, cut = Detokenizer(s.tokenizer, prompt_ids), StopStrings(stops)
    tokens, reason = 0, None
    try:
        async for ev in stream:
            tokens += 1
            text, matched = cut.push(detok.push(ev.token_id)) if ev.token_id not in stop_ids else ("", False)
            entries = [] if ev.logprob is None else [(ev.token_id, ev.logprob, ev.top_logprobs or [])]
            if matched:  # the stop string and what follows are cut; its engine request ends now
                stream.cancel()
                reason = "stop"
                yield Choice(index, text, 1, entries, reason)
                break
            yield Choice(index, text, 1, entries)
        else:
            if stream.finish_reason == "error":  # a step failed (AsyncEngine.error): a 500, logged, never sent
                raise RuntimeError(f"engine request {stream.request_id} ended with a failed step: "
                                   f"{s.engine.error!r}")
            text, matched = cut.push(detok.flush())
            text += "" if matched else cut.flush()
            reason = "stop" if matched else FINISH.get(stream.finish_reason, "abort")
            yield Choice(index, text, 0, [], reason)
        s.metrics.finished(submitted_s, stream.first_token_s, tokens, reason)
    finally:
        if stream.finish_reason is None:  # left early (a disconnect, an error): free its blocks
            stream.cancel()


async def merge(gens: list[AsyncIterator[Choice]]) -> AsyncIterator[Choice]:
    """The n choices' deltas in the order they come (one task per choice)."""
    if len(gens) == 1:
        async for c in gens[0]:
            yield c
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(gen):
        try:
            async for c in gen:
                queue.put_nowait(c)
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait(e)
            return
        queue.put_nowait(None)
    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for t in tasks:  # each choice's generator then cancels its engine request
            t.cancel()


async def submit(s: Served, req: SamplingRequest, prompt_ids: list[int]) -> list[tuple[RequestStream, float]]:
    """The request's n engine requests, all or none: (stream, perf_counter at submission) each."""
    if s.draining:
        raise ApiError(503, "the server is shutting down and takes no new requests: retry on another replica")
    if req.model != s.model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist: this server serves '{s.model_name}' "
                       "(GET /v1/models)", "model", "model_not_found")
    k = logprobs_k(req)
    overrides = engine_overrides(req, new_tokens(req, len(prompt_ids), s.max_context))
    streams: list[tuple[RequestStream, float]] = []
    try:
        for o in overrides:
            t0 = time.perf_counter()
            streams.append((await s.engine.submit(prompt_ids, logprobs=k, **o), t0))
    except BaseException:
        for stream, _ in streams:
            stream.cancel()
        raise
    s.metrics.prompt_tokens.inc(len(prompt_ids) * len(streams))
    return streams


async def respond(s: Served, kind: str, req: SamplingRequest, prompt_ids: list[int]) -> Response:
    """Run a request: a JSON response, or server-sent events when req.stream."""
    streams = await submit(s, req, prompt_ids)
    stop_ids = frozenset(() if req.ignore_eos else s.engine.engine.model.config.eos_token_ids)
    deltas = merge([choice_deltas(s, i, st, prompt_ids, req.stop_strings(), t0, stop_ids)
                    for i, (st, t0) in enumerate(streams)])
    rid, created, wants = request_id(kind), now_s(), logprobs_k(req) is not None
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return SSEResponse(events(s, kind, rid, created, deltas, [st for st, _ in streams], len(prompt_ids),
                                  wants, include_usage), media_type="text/event-stream")
    choices = [Choice(i) for i in range(len(streams))]
    try:
        async for c in deltas:
            whole = choices[c.index]
            whole.text += c.text
            whole.tokens += c.tokens
            whole.logprobs += c.logprobs
            whole.finish_reason = c.finish_reason or whole.finish_reason
    finally:
        await deltas.aclose()
    body = envelope(kind, rid, s.model_name, created, [choice_body(kind, s.tokenizer, c, wants) for c in choices])
    body["usage"] = usage(len(prompt_ids), sum(c.tokens for c in choices))
    return JSONResponse(body)


async def events(s: Served, kind: str, rid: str, created: int, deltas: AsyncIterator[Choice],
                 streams: list[RequestStream], prompt_len: int, wants: bool, include_usage: bool):
    """Server-sent events: a chunk per delta that carries text, logprobs or a finish reason; with
    include_usage, a last chunk of `choices: []` and the usage; then `data: [DONE]`."""
    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    offsets, started, completion = [0] * len(streams), [False] * len(streams), 0
    try:
        async for c in deltas:
            completion += c.tokens
            first = not started[c.index]
            if not (c.text or c.logprobs or c.finish_reason or (first and kind == "chat")):
                continue  # a token that completed no character yet
            chunk = envelope(kind, rid, s.model_name, created, [choice_body(
                kind, s.tokenizer, c, wants, chunk=True, first=first, offset=offsets[c.index])], chunk=True)
            if include_usage:
                chunk["usage"] = None
            started[c.index] = True
            offsets[c.index] += len(c.text)
            yield data(chunk)
        if include_usage:
            yield data({**envelope(kind, rid, s.model_name, created, [], chunk=True),
                        "usage": usage(prompt_len, completion)})
    except Exception:  # the status line is sent already: the error goes in the stream, the trace in the log
        log.exception("request %s failed mid-stream", rid)
        yield data(error_body(500, "the server failed while generating this response; it has been logged"))
    finally:
        await deltas.aclose()
        for st in streams:
            if st.finish_reason is None:
                st.cancel()
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- the app
class BearerAuth:
    """ASGI middleware: every route but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                response = error_response(401, "a missing or wrong API key: send the header "
                                          "'Authorization: Bearer KEY' with the server's --api-key",
                                          code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error object, never a traceback."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        retry = {"Retry-After": str(RETRY_AFTER_S)} if e.status in (429, 503) else None
        return error_response(e.status, str(e), e.param, e.code, retry)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):  # FastAPI's 422 is OpenAI's 400
        message, param = validation_message(list(e.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = (f"no route {request.method} {request.url.path}: this server has {ROUTES}"
                   if e.status_code in (404, 405) else str(e.detail))
        return error_response(e.status_code, message, headers=e.headers)

    @app.exception_handler(QueueFullError)
    async def full(request: Request, e: QueueFullError):
        return error_response(429, f"the server is busy: {e}; retry in {RETRY_AFTER_S} s",
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(MinigenError)
    async def refused(request: Request, e: MinigenError):  # ConfigError, PromptError, RequestError
        if isinstance(e, (ConfigError, PromptError, RequestError)):
            return error_response(400, str(e), "prompt" if isinstance(e, PromptError) else None)
        log.error("request refused by %s: %s", type(e).__name__, e)
        return error_response(500, "the server failed on this request; it has been logged")

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception):
        log.error("request %s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(500, "the server failed on this request; it has been logged")


def make_app(async_engine: AsyncEngine, tokenizer, model_name: str, *, api_key: str | None = None,
             max_context: int, grace_s: float = 30.0) -> FastAPI:
    """The FastAPI app over a (not yet started) AsyncEngine: its lifespan starts the engine's thread,
    and at shutdown lets in-flight requests finish for up to grace_s before cancelling the rest."""
    s = Served(async_engine, tokenizer, model_name, max_context)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        s.draining = True
        await async_engine.shutdown(grace_s)

    app = FastAPI(title="minigen", summary="An OpenAI-compatible server over minigen's engine", lifespan=lifespan)
    app.state.served = s
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        unsupported(body)
        return await respond(s, "completion", body, completion_prompt(tokenizer, body.prompt))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Response:
        unsupported(body)
        return await respond(s, "chat", body, chat_prompt(tokenizer, body))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": now_s(),
                                            "owned_by": "minigen", "max_model_len": max_context}]}

    @app.get("/health")
    async def health() -> Response:
        if s.draining:
            return error_response(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(s.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGTERM/SIGINT first marks the app as draining (503 on new requests)."""

    def __init__(self, config: uvicorn.Config, served: Served):
        super().__init__(config)
        self.served = served

    def handle_exit(self, sig, frame) -> None:
        self.served.draining = True
        super().handle_exit(sig, frame)


def serve(model_name: str, config: GenerationConfig, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_batch_size: int = 8, num_blocks: int | None = None,
          max_num_batched_tokens: int | None = None, max_waiting: int = 256, weight_bits: int | None = None,
          grace_s: float = 30.0, dtype: str = "float32", compute_dtype: str | None = None) -> None:
    """Load the model, build the Engine and its AsyncEngine, and serve until SIGTERM or Ctrl-C."""
    if config is not None and config.logprobs is not None:  # before the load: each request asks for its own
        raise ConfigError(f"logprobs={config.logprobs} in minigen serve's config: a request asks for its own "
                          "(logprobs / top_logprobs in its body). Fix: logprobs=None")
    bound_onednn_caches()  # before any oneDNN call: a prompt's new row count must not grow RSS for good
    model, tokenizer = load(model_name, dtype=dtype, weight_bits=weight_bits)
    if compute_dtype is not None:
        model.precision = model.precision.replace(compute=compute_dtype)
    engine = Engine(model, config, max_batch_size=max_batch_size, num_blocks=num_blocks,
                    max_num_batched_tokens=max_num_batched_tokens, tokenizer=tokenizer)
    # the longest request the engine can hold: the model's context, or the whole pool if smaller
    max_context = min(model.config.max_seq_len, engine.num_blocks * engine.block_size)
    app = make_app(AsyncEngine(engine, max_waiting=max_waiting), tokenizer, model_name, api_key=api_key,
                   max_context=max_context, grace_s=grace_s)
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=grace_s,
                                           log_level="info"), app.state.served)
    # uvicorn re-raises the signal it caught, once shut down, to the handler it found: for SIGTERM a
    # no-op, because a graceful stop is a success (exit 0); SIGINT still ends as Ctrl-C (130)
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    server.run()
