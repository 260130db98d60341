"""A soak test of an OpenAI-compatible server under load (issue 43; scripts/serve_soak.py runs it on
`minigen serve`): rounds of a closed loop of streaming clients, and after each round, once the server
is idle, the checks that a long-running server needs.

    run_soak(url, pid, workload, tokenizer, rounds=3, duration_s=120, clients=64) -> {"rounds", "checks", "pass"}
    closed_loop(client, form, workload, tokenizer, ...)   -> (RequestRecords, seconds): one round
    scrape(base_url)                                      -> {"running", "waiting", "kv_usage", "finished", ...}
    process_memory(pid)                                   -> {"rss_bytes", "rss_anon_bytes", "hwm_bytes", ...}

The load: `clients` tasks, each sending one streamed request after another (serve_client's one_request,
prompts and lengths from build_workload's workload, taken in turn) until `duration_s` has passed; then
the requests in flight run to their end (the round drains). A closed loop keeps exactly `clients`
requests in flight for the whole round, which is what "64 concurrent clients for 2 minutes" means;
run_client(concurrency=64) would instead need a request count guessed ahead to fill the time, and
its tail would run with fewer than 64 in flight. A quarter of the workload's requests (serve_client's
disconnect_plan, seeded) hang up after a random number of text chunks. A client refused with 429
waits the server's Retry-After (1 s) before its next request, as a polite client does.

The checks of each round:
- outcomes: every request sent ended completed, cancelled by the client, or 429; none timed out,
  failed or was lost; and the server's count of finished requests (vllm:request_success) grew by at
  least the completed ones and at most completed + cancelled (a hung-up stream may have been
  finished by the server before it saw the hang-up: its last tokens were in flight);
- idle: once the round has drained, /metrics reads vllm:num_requests_running == 0 and
  vllm:num_requests_waiting == 0 (polled for up to IDLE_TIMEOUT_S: a hung-up stream is cancelled at
  the engine's next step);
- kv: vllm:kv_cache_usage_perc is back at its value just before the round. It is the allocator's
  n_used / num_blocks, n_used counting blocks held by at least one sequence; a prefix-cached block
  that no request holds sits in the free list (reclaimable, found again by its hash), so an idle
  engine reads 0.0 whatever its prefix cache keeps, and "where it began" is that idle value;
- memory (across rounds): the server's VmRSS after each round, once idle, stays within
  max(RSS_TOLERANCE_FRAC of round 1's, RSS_TOLERANCE_MIB) of round 1's: round 1 warms the allocators
  up (its growth is not a leak), and a leak grows with the requests served, round after round.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sys
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from ..serving.workload import Workload
from .serve_client import (OUTCOMES, Form, RequestRecord, disconnect_plan, first_model, one_request, probe,
                           request_kwargs, summarize_client)

ALLOWED = ("completed", "cancelled", "rate_limited")  # the outcomes a healthy server under load gives
IDLE_TIMEOUT_S = 30.0  # a drained round's server must read running 0, waiting 0 within this
RSS_TOLERANCE_FRAC = 0.02  # a later round's RSS may exceed round 1's by 2% of it ...
RSS_TOLERANCE_MIB = 8.0  # ... or by 8 MiB, whichever is larger (allocator noise on a small process)
RETRY_AFTER_S = 1.0  # a 429's Retry-After (server.RETRY_AFTER_S): a refused client waits this long
MIB = 2**20


# ---------------------------------------------------------------- what the server says about itself
def parse_metrics(text: str) -> dict:
    """The gauges and counters the checks read, from Prometheus text with vLLM's metric names."""
    out = {"running": math.nan, "waiting": math.nan, "kv_usage": math.nan, "finished": 0.0,
           "generation_tokens": 0.0}
    keys = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
            "vllm:kv_cache_usage_perc": "kv_usage", "vllm:request_success_total": "finished",
            "vllm:generation_tokens_total": "generation_tokens"}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = keys.get(sample.name)
            if key in ("finished", "generation_tokens"):  # counters: summed over their labels
                out[key] += sample.value
            elif key is not None:
                out[key] = sample.value
    return out


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict:
    """GET {base_url}/metrics -> parse_metrics's dict (base_url without /v1)."""
    response = await http.get(f"{base_url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


async def wait_idle(http: httpx.AsyncClient, base_url: str, timeout_s: float = IDLE_TIMEOUT_S) -> dict:
    """Scrape until nothing runs or waits, or timeout_s passes -> the last scrape, and the wait."""
    t0 = time.perf_counter()
    while True:
        m = await scrape(http, base_url)
        if (m["running"] == 0 and m["waiting"] == 0) or time.perf_counter() - t0 > timeout_s:
            return m | {"idle_wait_s": time.perf_counter() - t0}
        await asyncio.sleep(0.1)


def process_memory(pid: int) -> dict:
    """A process's memory from /proc/<pid>/status: VmRSS, RssAnon (its heaps: Python's, malloc's,
    torch's) and VmHWM (the peak RSS), in bytes; and, for this very process, Python's allocated
    blocks (sys.getallocatedblocks: objects alive; another process's heap is not readable cheaply)."""
    fields = {"VmRSS": "rss_bytes", "RssAnon": "rss_anon_bytes", "VmHWM": "hwm_bytes"}
    out: dict = {v: None for v in fields.values()}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) * 1024  # the kernel writes kB
    out["python_blocks"] = sys.getallocatedblocks() if pid == os.getpid() else None
    return out


def cpu_info() -> dict:
    """The first CPU's "model name", "cpu family", "model" and "stepping" from /proc/cpuinfo."""
    wanted = {"model name": "model_name", "cpu family": "family", "model": "model", "stepping": "stepping"}
    out: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block ends
                if key.strip() in wanted:
                    out[wanted[key.strip()]] = value.strip()
    except OSError:
        pass
    return out


# ---------------------------------------------------------------- the load
async def closed_loop(client: openai.AsyncOpenAI, form: Form, workload: Workload, tokenizer, *, clients: int,
                      duration_s: float, hang_ups: dict[int, int], start: int = 0,
                      timeout_s: float = 300.0) -> tuple[list[RequestRecord], float]:
    """One round: `clients` tasks each send a streamed request after another until duration_s has
    passed, then finish the one in flight -> (a record per request sent, the round's seconds).
    Request k of the round is the workload's (start + k) mod n; it hangs up as hang_ups says."""
    n, taken = len(workload.requests), itertools.count(start)
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def client_task() -> None:
        while time.perf_counter() - t0 < duration_s:
            i = next(taken) % n
            request = workload.requests[i]
            rec = RequestRecord(i, len(request.prompt_ids), request.max_new_tokens, time.perf_counter() - t0)
            records.append(rec)
            kw = request_kwargs(form, list(request.prompt_ids), workload.system_prompt_tokens, tokenizer,
                                request.max_new_tokens)
            await one_request(client, form, kw, rec, t0, hang_ups.get(i), timeout_s)
            if rec.outcome == "rate_limited":
                await asyncio.sleep(RETRY_AFTER_S)

    await asyncio.gather(*(client_task() for _ in range(clients)))
    return records, time.perf_counter() - t0


# ---------------------------------------------------------------- the checks
def check(ok: bool, detail: str) -> dict:
    return {"pass": bool(ok), "detail": detail}


def round_checks(counts: dict, before: dict, after: dict) -> dict:
    """The outcome, server-count, idle and kv checks of one round (counts: summarize_client's)."""
    others = {k: counts[k] for k in OUTCOMES if k not in ALLOWED and counts[k]}
    ended = sum(counts[k] for k in ALLOWED)
    finished = after["finished"] - before["finished"]
    return {
        "outcomes": check(not others and counts["lost"] == 0 and ended == counts["sent"],
                          f"sent {counts['sent']} = completed {counts['completed']} + cancelled {counts['cancelled']}"
                          f" + 429 {counts['rate_limited']}; other {others or 0}, lost {counts['lost']}"),
        "server_counted": check(counts["completed"] <= finished <= counts["completed"] + counts["cancelled"],
                                f"server finished {finished:g}, client completed {counts['completed']} "
                                f"(+ cancelled {counts['cancelled']})"),
        "idle": check(after["running"] == 0 and after["waiting"] == 0,
                      f"running {after['running']:g}, waiting {after['waiting']:g} after {after['idle_wait_s']:.1f} s"),
        "kv": check(abs(after["kv_usage"] - before["kv_usage"]) < 1e-9,
                    f"kv_cache_usage_perc {before['kv_usage']:g} before, {after['kv_usage']:g} after"),
    }


def memory_check(rss: list[int]) -> dict:
    """Every round's RSS after round 1 within max(RSS_TOLERANCE_FRAC, RSS_TOLERANCE_MIB) of round 1's."""
    allowed = max(RSS_TOLERANCE_FRAC * rss[0], RSS_TOLERANCE_MIB * MIB)
    growth = [r - rss[0] for r in rss[1:]]
    return check(all(g <= allowed for g in growth),
                 f"RSS after each round {', '.join(f'{r / MIB:.1f}' for r in rss)} MiB; growth over round 1 "
                 f"{', '.join(f'{g / MIB:+.1f}' for g in growth) or '-'} MiB, allowed {allowed / MIB:.1f} MiB")


# ---------------------------------------------------------------- the run
async def soak_async(url: str, pid: int, workload: Workload, tokenizer, *, rounds: int = 3, duration_s: float = 120.0,
                     clients: int = 64, disconnect_fraction: float = 0.25, seed: int = 0,
                     timeout_s: float = 300.0, log=print) -> dict:
    """run_soak's body, on the running event loop."""
    base = url.removesuffix("/").removesuffix("/v1")
    hang_ups = disconnect_plan(len(workload.requests), disconnect_fraction, seed,
                               [r.max_new_tokens for r in workload.requests])
    # no retries (a 429 is counted, never sent again) and no keep-alive, as serve_client.run_async
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=timeout_s, http_client=http)
    results, sent = [], 0
    async with client, httpx.AsyncClient(timeout=10.0) as scraper:
        form = await probe(client, await first_model(client), False, "tokens", workload, tokenizer)
        for r in range(1, rounds + 1):
            before = await wait_idle(scraper, base)
            records, seconds = await closed_loop(client, form, workload, tokenizer, clients=clients,
                                                 duration_s=duration_s, hang_ups=hang_ups, start=sent,
                                                 timeout_s=timeout_s)
            sent += len(records)
            after = await wait_idle(scraper, base)
            memory = process_memory(pid)
            m = summarize_client(records, seconds)
            m.pop("requests")
            results.append({"round": r, "seconds": seconds, "counts": m["counts"], "output_tokens": m["output_tokens"],
                            "output_tokens_per_s": m["output_tokens_per_s"], "ttft_s": m["ttft_s"],
                            "tpot_s": m["tpot_s"], "itl_s": m["itl_s"], "e2e_latency_s": m["e2e_latency_s"],
                            "metrics_before": before, "metrics_after": after, "memory": memory,
                            "checks": round_checks(m["counts"], before, after)})
            log(format_round(results[-1]))
    checks = {f"round {x['round']} {k}": c for x in results for k, c in x["checks"].items()}
    checks["memory"] = memory_check([x["memory"]["rss_bytes"] for x in results])
    return {"url": url, "pid": pid, "workload": workload.description, "rounds_asked": rounds, "duration_s": duration_s,
            "clients": clients, "disconnect_fraction": disconnect_fraction, "seed": seed, "rounds": results,
            "checks": checks, "pass": all(c["pass"] for c in checks.values())}


def run_soak(url: str, pid: int, workload: Workload, tokenizer, **options) -> dict:
    """Soak the server at `url` (its /v1 base), whose process is `pid` -> the rounds, the checks and
    "pass". Options: soak_async's (rounds, duration_s, clients, disconnect_fraction, seed, timeout_s, log)."""
    return asyncio.run(soak_async(url, pid, workload, tokenizer, **options))


# ---------------------------------------------------------------- the table
HEAD = (f"{'round':>5}{'sent':>6}{'done':>6}{'cancel':>7}{'429':>5}{'other':>6}{'lost':>5}{'out tok/s':>10}"
        f"{'TTFT p50/p99 s':>17}{'TPOT p50/p99 ms':>17}{'run/wait':>9}{'kv before/after':>16}{'RSS MiB':>9}"
        f"{'anon MiB':>9}  checks")


def format_round(x: dict) -> str:
    c, t, p = x["counts"], x["ttft_s"], x["tpot_s"]
    b, a = x["metrics_before"], x["metrics_after"]
    other = sum(c[k] for k in OUTCOMES if k not in ALLOWED)
    failed = [k for k, v in x["checks"].items() if not v["pass"]]
    anon = x["memory"]["rss_anon_bytes"]
    return (f"{x['round']:>5}{c['sent']:>6}{c['completed']:>6}{c['cancelled']:>7}{c['rate_limited']:>5}{other:>6}"
            f"{c['lost']:>5}{x['output_tokens_per_s']:>10.1f}{t['p50']:>9.3f}/{t['p99']:<7.3f}"
            f"{p['p50'] * 1e3:>9.1f}/{p['p99'] * 1e3:<7.1f}{a['running']:>5g}/{a['waiting']:<3g}"
            f"{b['kv_usage']:>9.3f}/{a['kv_usage']:<6.3f}{x['memory']['rss_bytes'] / MIB:>9.1f}"
            f"{(anon or 0) / MIB:>9.1f}  {'FAIL ' + ', '.join(failed) if failed else 'ok'}")


def format_soak(result: dict) -> str:
    """The rounds' table, then every check that failed (or that all passed) and the memory check."""
    lines = [f"{result['clients']} streaming clients, {result['duration_s']:g} s a round, "
             f"{result['disconnect_fraction']:g} of requests hang up; workload: {result['workload']}", HEAD]
    lines += [format_round(x) for x in result["rounds"]]
    lines += [f"{'PASS' if c['pass'] else 'FAIL'}  {name}: {c['detail']}" for name, c in result["checks"].items()
              if not c["pass"] or name == "memory"]
    lines.append(f"soak: {'every check passed' if result['pass'] else 'FAILED'}")
    return "\n".join(lines)
