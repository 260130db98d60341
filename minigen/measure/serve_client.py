"""A load generator for any OpenAI-compatible server (`serve-bench --url`, scripts/serve_race.py): the
serving workload of chapter 14 (workload.py), sent over HTTP with the `openai` client, every request
streamed, each one timed from the client's side.

    build_workload(tokenizer, n, rate, seed=0)       -> Workload (the in-process serve-bench's workload)
    arrival_schedule(workload, "poisson"|"fixed")    -> send times in seconds (rate inf: all at t = 0)
    disconnect_plan(n, fraction, seed, max_tokens)   -> {request index: content chunks before it hangs up}
    run_client(url, workload, tokenizer, ...)        -> {"ttft_s", "tpot_s", "itl_s", ..., "counts", "requests"}
    summarize_client(records, duration_s, slo...)    -> the same dict from per-request records (pure)

What is measured, per request, on the client's clock (time.perf_counter), from the moment it is sent
(after a --concurrency slot is free; with no cap, its arrival time):
- TTFT: until the first chunk that carries text (a chat's first chunk, the role alone, is not text);
- ITL: the gap between consecutive text chunks. A chunk is not always one token (a server may merge
  tokens, or hold one back while a multi-byte character or a stop string is unfinished), so token
  counts come from the final chunk's usage.completion_tokens (stream_options include_usage), and
  ITL is per chunk, as vLLM's benchmark_serving reports it;
- TPOT = (e2e - TTFT) / (tokens - 1), requests of one token left out, the definition of metrics.py;
- e2e: until the stream ends.
Outcomes: completed, cancelled (by this client, --disconnect-fraction), rate_limited (HTTP 429),
http_error (any other status), timeout, connection (refused, reset), stream_error (an error event in
the stream). Every request ends in exactly one of them, so "lost" (sent minus all outcomes) is 0
unless the client itself is broken; a load test checks that, and that the server freed what the
hung-up streams held.

Prompts go to /v1/completions as token ids where the server takes them (llama-server, vLLM, minigen
serve): exact prompt lengths. Otherwise (transformers serve takes only a string) as the text decoded
from those ids, whose re-tokenized length is close but not always equal. `--chat` sends the shared
system message and the user's text to /v1/chat/completions. Every request asks for greedy decoding
and `ignore_eos` (the extra field of vLLM, llama-server and minigen serve), so it generates exactly
its max_tokens; a server that refuses the field is sent requests without it, said in the result
("ignore_eos": false), and its replies may end early: throughput counts the tokens it did send.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
import openai

from ..errors import BenchError
from ..serving.metrics import latency_stats
from ..serving.workload import LengthDist, Workload, make_workload, system_prompt_ids
from .bench import prompt_ids
from .machine import hardware_info
from ..loading import load_tokenizer, resolve_folder

# The shared system message (the default text of workload.system_prompt_ids, written out so that a
# chat request can send it as a message of its own)
SYSTEM_TEXT = ("You are a helpful assistant. Answer briefly and precisely, in plain English, and say so when you "
               "do not know.")
OUTCOMES = ("completed", "cancelled", "rate_limited", "http_error", "timeout", "connection", "stream_error")
# run_async's options that `serve-bench --url` passes on from its flags of the same names
CLIENT_OPTIONS = ("served_model", "api_key", "arrivals", "concurrency", "chat", "prompt_as", "disconnect_fraction",
                  "timeout_s", "slo_ttft_s", "slo_tpot_s")
PROBE_STATUSES = (400, 422)  # what a server answers a field or a prompt form it does not take


def build_workload(tokenizer, n_requests: int, rate_per_s: float, *, seed: int = 0, prompt_median: float = 32,
                   output_median: float = 24) -> Workload:
    """The workload of `serve-bench` in-process (serve_bench.serve_bench_cli's arguments): the system
    message in the chat template, then user prompts cut from the benchmark's English text. rate_per_s
    may be math.inf (every request at t = 0); the lengths depend only on the seed."""
    return make_workload(n_requests, rate_per_s, seed=seed, system_prompt=system_prompt_ids(tokenizer, SYSTEM_TEXT),
                         prompt_tokens=LengthDist(prompt_median, 0.6, 4, 256),
                         output_tokens=LengthDist(output_median, 0.5, 2, 128),
                         token_pool=prompt_ids(tokenizer, 1024)[0].tolist())


def arrival_schedule(workload: Workload, arrivals: str = "poisson") -> list[float]:
    """Send times (seconds after the run's start): "poisson", the workload's own draws (exponential
    gaps of mean 1/rate); "fixed", one every 1/rate seconds. Rate inf: every request at 0."""
    if arrivals == "poisson":
        return [r.arrival_s for r in workload.requests]
    if arrivals == "fixed":
        gap = 0.0 if math.isinf(workload.rate_per_s) else 1.0 / workload.rate_per_s
        return [i * gap for i in range(len(workload.requests))]
    raise BenchError(f"arrivals={arrivals!r}: use 'poisson' or 'fixed'")


def disconnect_plan(n: int, fraction: float, seed: int, max_tokens: list[int]) -> dict[int, int]:
    """Which requests hang up, and after how many text chunks: round(fraction * n) of the n, chosen
    by `seed` (its own stream, so the workload's draws do not move), each after a uniform 1 ..
    max_tokens - 1 chunks (at least 1: a request of one token hangs up after it)."""
    if not 0.0 <= fraction <= 1.0:
        raise BenchError(f"--disconnect-fraction {fraction}: use a number in [0, 1]")
    rng = np.random.default_rng([seed, 0xD15C])
    chosen = sorted(int(i) for i in rng.choice(n, size=round(fraction * n), replace=False))
    return {i: int(rng.integers(1, max(2, max_tokens[i]))) for i in chosen}


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the run's start."""
    index: int  # its place in the workload
    prompt_tokens: int  # the workload's prompt length (the server's count, when it says, in usage)
    max_tokens: int  # the reply length asked for
    arrival_s: float  # when the schedule wanted it sent
    sent_s: float = math.nan  # when it was sent (later than arrival_s while --concurrency is full)
    chunk_s: list[float] = field(default_factory=list)  # each text chunk's arrival
    finish_s: float = math.nan  # when the stream ended (or was closed by us, or failed)
    output_tokens: int = 0  # usage.completion_tokens, or the text chunks when the server sent no usage
    usage: bool = False  # whether the server reported usage
    outcome: str = ""  # one of OUTCOMES
    error: str = ""  # the error's first line, when it failed

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s if self.chunk_s else math.nan

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2 or not self.chunk_s:
            return math.nan
        return (self.finish_s - self.chunk_s[0]) / (self.output_tokens - 1)


def summarize_client(records: list[RequestRecord], duration_s: float, slo_ttft_s: float | None = None,
                     slo_tpot_s: float | None = None) -> dict:
    """The metrics of one run from its records: latencies of the completed requests (p50/p90/p99 by
    metrics.latency_stats), output tokens/s and requests/s over the run's wall time, and goodput:
    completed requests per second whose TTFT <= slo_ttft_s and TPOT <= slo_tpot_s (a one-token
    request has no TPOT and meets that half; an SLO not given is met by all)."""
    done = [r for r in records if r.outcome == "completed"]
    tpots = [r.tpot_s for r in done if not math.isnan(r.tpot_s)]
    itl = [b - a for r in done for a, b in zip(r.chunk_s, r.chunk_s[1:])]

    def good(r: RequestRecord) -> bool:
        return ((slo_ttft_s is None or r.ttft_s <= slo_ttft_s)
                and (slo_tpot_s is None or math.isnan(r.tpot_s) or r.tpot_s <= slo_tpot_s))

    counts = {k: sum(r.outcome == k for r in records) for k in OUTCOMES}
    counts["sent"] = len(records)
    counts["lost"] = len(records) - sum(counts[k] for k in OUTCOMES)
    counts["short"] = sum(r.output_tokens < r.max_tokens for r in done)  # ended early (EOS, stop)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return {"ttft_s": latency_stats([r.ttft_s for r in done]), "tpot_s": latency_stats(tpots),
            "itl_s": latency_stats(itl), "e2e_latency_s": latency_stats([r.finish_s - r.sent_s for r in done]),
            "output_tokens": sum(r.output_tokens for r in done),
            "output_tokens_per_s": per_s(sum(r.output_tokens for r in done)),
            "request_throughput": per_s(len(done)),
            "goodput": per_s(sum(good(r) for r in done)) if slo_ttft_s is not None or slo_tpot_s is not None else None,
            "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s}, "duration_s": duration_s, "counts": counts,
            "requests": [asdict(r) for r in records]}


# ---------------------------------------------------------------- talking to a server
@dataclass
class Form:
    """How requests are sent to this server (found by probe())."""
    model: str  # the model name the server lists
    chat: bool  # /v1/chat/completions instead of /v1/completions
    tokens: bool  # prompts as token ids (else as text)
    ignore_eos: bool  # send extra_body={"ignore_eos": True}


def request_kwargs(form: Form, prompt: list[int], system_tokens: int, tokenizer, max_tokens: int) -> dict:
    """The create() arguments of one streamed, greedy request of `prompt` (token ids)."""
    kw = {"model": form.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
          "stream_options": {"include_usage": True}}
    if form.ignore_eos:
        kw["extra_body"] = {"ignore_eos": True}
    if form.chat:  # the server applies its chat template to the system message and the user's text
        user = tokenizer.decode(prompt[system_tokens:], skip_special_tokens=True)
        kw["messages"] = [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": user}]
    else:
        kw["prompt"] = list(prompt) if form.tokens else tokenizer.decode(prompt, skip_special_tokens=False)
    return kw


def chunk_text(chunk, chat: bool) -> str:
    """The text one streamed chunk carries ("" for a role-only, finish-only or usage-only chunk)."""
    if not chunk.choices:
        return ""
    choice = chunk.choices[0]
    return (choice.delta.content or "") if chat else (choice.text or "")


async def create(client: openai.AsyncOpenAI, form: Form, kw: dict):
    return await (client.chat.completions.create(**kw) if form.chat else client.completions.create(**kw))


async def first_model(client: openai.AsyncOpenAI) -> str:
    """The first model the server lists at /v1/models."""
    try:
        models = [m.id async for m in client.models.list()]
    except openai.APIError as e:
        raise BenchError(f"{client.base_url}models: {type(e).__name__}: {str(e).splitlines()[0]}. Is the server "
                         "up, and the URL its /v1 base (e.g. http://127.0.0.1:8000/v1)? Or pass --served-model") from None
    if not models:
        raise BenchError(f"{client.base_url}models lists no model: pass --served-model NAME")
    return models[0]


async def probe(client: openai.AsyncOpenAI, model: str, chat: bool, prompt_as: str, workload: Workload,
                tokenizer) -> Form:
    """The first request form this server takes, asked with a one-token request of the workload's
    first prompt: token ids before text (unless prompt_as says which), ignore_eos before none. A
    400/422 answer moves to the next form; anything else, or no form left, raises BenchError."""
    first = workload.requests[0]
    tokens = [False] if chat or prompt_as == "text" else [True] if prompt_as == "tokens" else [True, False]
    last = ""
    for as_tokens in tokens:
        for ignore_eos in (True, False):
            form = Form(model, chat, as_tokens, ignore_eos)
            kw = request_kwargs(form, list(first.prompt_ids), workload.system_prompt_tokens, tokenizer, 1)
            try:
                stream = await create(client, form, kw)
                async for _ in stream:
                    pass
                return form
            except openai.APIStatusError as e:
                if e.status_code not in PROBE_STATUSES:
                    raise BenchError(f"{client.base_url}: a first request failed with HTTP {e.status_code}: "
                                     f"{str(e).splitlines()[0][:300]}") from None
                last = f"HTTP {e.status_code}: {str(e).splitlines()[0][:300]}"
            except openai.APIConnectionError as e:
                raise BenchError(f"{client.base_url}: cannot connect ({type(e).__name__}): is the server up?") from None
    raise BenchError(f"{client.base_url} refused every request form (prompt as {'/'.join(map(str, tokens))} ids, "
                     f"with and without ignore_eos); the last answer: {last}")


async def one_request(client, form: Form, kw: dict, rec: RequestRecord, t0: float, hang_up_after: int | None,
                      timeout_s: float) -> None:
    """Send one request and fill `rec` with its times and its outcome; never raises."""
    now = lambda: time.perf_counter() - t0  # noqa: E731
    rec.sent_s = now()
    try:
        async with asyncio.timeout(timeout_s):
            stream = await create(client, form, kw)
            async for chunk in stream:
                if chunk_text(chunk, form.chat):
                    rec.chunk_s.append(now())
                    if hang_up_after is not None and len(rec.chunk_s) >= hang_up_after:
                        await stream.close()  # the server sees the connection drop, and should cancel
                        rec.outcome, rec.output_tokens = "cancelled", len(rec.chunk_s)  # chunks it saw
                        break
                if chunk.usage is not None:
                    rec.output_tokens, rec.usage = chunk.usage.completion_tokens, True
        if not rec.outcome:
            rec.outcome = "completed"
            rec.output_tokens = rec.output_tokens if rec.usage else len(rec.chunk_s)
    except (TimeoutError, openai.APITimeoutError):
        rec.outcome, rec.error = "timeout", f"no end within {timeout_s:g} s"
    except openai.RateLimitError as e:
        rec.outcome, rec.error = "rate_limited", str(e).splitlines()[0][:300]
    except openai.APIStatusError as e:
        rec.outcome, rec.error = "http_error", f"HTTP {e.status_code}: {str(e).splitlines()[0][:300]}"
    except openai.APIConnectionError as e:
        rec.outcome, rec.error = "connection", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    except openai.APIError as e:  # an error event inside a stream that had begun
        rec.outcome, rec.error = "stream_error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    rec.finish_s = now()


async def run_async(url: str, workload: Workload, tokenizer, *, served_model: str | None = None, api_key: str | None = None,
                    arrivals: str = "poisson", concurrency: int | None = None, chat: bool = False,
                    prompt_as: str = "auto", disconnect_fraction: float = 0.0, seed: int = 0,
                    timeout_s: float = 600.0, slo_ttft_s: float | None = None,
                    slo_tpot_s: float | None = None) -> dict:
    """run_client's body, on the running event loop."""
    if prompt_as not in ("auto", "tokens", "text"):
        raise BenchError(f"--prompt-as {prompt_as!r}: use auto, tokens or text")
    if concurrency is not None and concurrency < 1:
        raise BenchError(f"--concurrency {concurrency}: use an integer >= 1 (or leave it out: no cap)")
    schedule = arrival_schedule(workload, arrivals)
    hang_ups = disconnect_plan(len(workload.requests), disconnect_fraction, seed,
                               [r.max_new_tokens for r in workload.requests])
    # max_retries=0: a 429 or a dropped connection is counted, never silently sent again. No keep-alive:
    # each request opens its own connection, since a server may close one after a stream (llama-server
    # did), and a request sent on that pooled connection would fail as a "connection" error of ours
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    client = openai.AsyncOpenAI(base_url=url, api_key=api_key or "none", max_retries=0, timeout=timeout_s,
                                http_client=http)
    async with client:
        form = await probe(client, served_model or await first_model(client), chat, prompt_as, workload, tokenizer)
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        records = [RequestRecord(i, len(r.prompt_ids), r.max_new_tokens, at)
                   for i, (r, at) in enumerate(zip(workload.requests, schedule))]
        t0 = time.perf_counter()

        async def launch(rec: RequestRecord) -> None:
            request = workload.requests[rec.index]
            kw = request_kwargs(form, list(request.prompt_ids), workload.system_prompt_tokens, tokenizer,
                                request.max_new_tokens)
            await asyncio.sleep(max(0.0, rec.arrival_s - (time.perf_counter() - t0)))
            if gate is None:
                await one_request(client, form, kw, rec, t0, hang_ups.get(rec.index), timeout_s)
                return
            async with gate:
                await one_request(client, form, kw, rec, t0, hang_ups.get(rec.index), timeout_s)

        await asyncio.gather(*(launch(rec) for rec in records))
        duration = time.perf_counter() - t0
    result = summarize_client(records, duration, slo_ttft_s, slo_tpot_s)
    result.update(url=url, model=form.model, endpoint="chat/completions" if form.chat else "completions",
                  prompt_as="tokens" if form.tokens else "text", ignore_eos=form.ignore_eos, arrivals=arrivals,
                  concurrency=concurrency, disconnect_fraction=disconnect_fraction, workload=workload.description)
    return result


def run_client(url: str, workload: Workload, tokenizer, **options) -> dict:
    """Send `workload` to the server at `url` (its /v1 base) and return the run's metrics
    (summarize_client's dict, and how the requests were sent). Options: run_async's."""
    return asyncio.run(run_async(url, workload, tokenizer, **options))


def format_client(runs: dict[str, dict]) -> str:
    """The side-by-side table of client runs ({name: run_client's result}), serve-bench's columns and
    more: ITL, request and goodput rates, and every outcome."""
    head = (f"{'engine':<24}{'out tok/s':>10}{'req/s':>7}{'goodput':>8}{'TTFT p50/p90/p99 s':>21}"
            f"{'TPOT p50/p90/p99 ms':>22}{'ITL p50/p99 ms':>16}  outcomes")
    lines = [head]
    for name, m in runs.items():
        c = m["counts"]
        outcomes = ", ".join(f"{k} {c[k]}" for k in (*OUTCOMES, "lost", "short") if c[k] or k in ("completed", "lost"))
        goodput = "-" if m["goodput"] is None else f"{m['goodput']:.2f}"
        t, p, i = m["ttft_s"], m["tpot_s"], m["itl_s"]
        lines.append(f"{name:<24}{m['output_tokens_per_s']:>10.1f}{m['request_throughput']:>7.2f}{goodput:>8}"
                     f"{t['p50']:>9.3f}/{t['p90']:.3f}/{t['p99']:.3f}"
                     f"{p['p50'] * 1e3:>10.1f}/{p['p90'] * 1e3:.1f}/{p['p99'] * 1e3:.1f}"
                     f"{i['p50'] * 1e3:>9.1f}/{i['p99'] * 1e3:.1f}  {outcomes}")
    return "\n".join(lines)


def serve_bench_url(model_name: str, url: str, n_requests: int, rate_per_s: float, *, seed: int = 0,
                    prompt_median: float = 32, output_median: float = 24, engines=None, **options) -> dict:
    """`serve-bench --url`: the in-process serve-bench's workload (on `model_name`'s tokenizer), sent to
    the server at `url` -> {"workload", "hardware", "runs": {url: run_client's result}}."""
    if engines:
        raise BenchError("--engine names in-process engines; with --url the server is the engine: drop --engine")
    tokenizer = load_tokenizer(resolve_folder(model_name))
    workload = build_workload(tokenizer, n_requests, rate_per_s, seed=seed, prompt_median=prompt_median,
                              output_median=output_median)
    run = run_client(url, workload, tokenizer, seed=seed, **options)
    return {"workload": workload.description, "hardware": f"{hardware_info()['cpu']} (the client's)", "runs": {url: run}}


def format_url_run(result: dict) -> str:
    """serve_bench_url's result as serve-bench prints it: the workload, how it was sent, the table."""
    (url, run), = result["runs"].items()
    how = (f"server: {url} (model {run['model']}; {run['arrivals']} arrivals; /v1/{run['endpoint']}, prompts as {run['prompt_as']}, ignore_eos "
           f"{'sent' if run['ignore_eos'] else 'refused by the server: replies may end early'})")
    return "\n".join([f"workload: {result['workload']}", how, format_client(result["runs"])])
