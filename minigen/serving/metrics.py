"""Serving metrics (chapter 14): latency percentiles, the metrics dict that serving runs share, and
the article's "batch efficiency", examined.

    latency_stats(values)          -> {"p50", "p90", "p99", "mean", "n"}
    summarize(requests, steps)     -> the metrics dict (the Engine's schema) from per-request records
    batch_efficiency(tput, max, B) -> the article's actual / (max x B)

A request record is a dict with "request_id", "prompt_tokens", "output_tokens", "arrival_s",
"first_scheduled_s", "first_token_s", "finish_s" (seconds on one clock), and optionally
"cached_tokens", "preemptions", "finish_reason", "phases". The names follow vLLM's where it has
one: TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1), requests
of one token left out; e2e latency = finish - arrival; queue time = first scheduled - arrival.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..errors import ConfigError

LATENCIES = ("ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s")


def latency_stats(values: Sequence[float]) -> dict:
    """Percentiles by nearest rank (the q-th is sorted[min(n - 1, floor(q n))]; the Engine's metrics
    use this too, so that runs compare on one definition) and the mean; NaN when empty."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan, "n": 0}
    at = {f"p{round(q * 100)}": v[min(len(v) - 1, int(q * len(v)))] for q in (0.5, 0.9, 0.99)}
    return {**at, "mean": sum(v) / len(v), "n": len(v)}


def request_latencies(requests: Sequence[dict]) -> dict[str, list[float]]:
    """Each latency of LATENCIES, one value per request that has it."""
    out = {name: [] for name in LATENCIES}
    for r in requests:
        out["ttft_s"].append(r["first_token_s"] - r["arrival_s"])
        out["e2e_latency_s"].append(r["finish_s"] - r["arrival_s"])
        out["queue_time_s"].append(r["first_scheduled_s"] - r["arrival_s"])
        if r["output_tokens"] > 1:
            out["tpot_s"].append((r["finish_s"] - r["first_token_s"]) / (r["output_tokens"] - 1))
    return out


def summarize(requests: Sequence[dict], steps: Sequence[dict] = (), **extra) -> dict:
    """The metrics dict of a finished run, from its request records and per-step records
    ({"t_s", "step_s", "batch_size", "kv_usage", "prefill_tokens", "decode_tokens"}).
    output_tokens_per_s = all output tokens / (last finish - first arrival). `extra` adds keys
    (e.g. "num_blocks", "max_batch_size")."""
    requests = sorted(requests, key=lambda r: r["request_id"])
    metrics = {name: latency_stats(v) for name, v in request_latencies(requests).items()}
    span = max((r["finish_s"] for r in requests), default=0.0) - min((r["arrival_s"] for r in requests), default=0.0)
    output = sum(r["output_tokens"] for r in requests)
    prompt = sum(r["prompt_tokens"] for r in requests)
    metrics.update(
        output_tokens_per_s=output / span if span > 0 else 0.0,
        preemptions=sum(r.get("preemptions", 0) for r in requests),
        prefix_cache_hit_rate=sum(r.get("cached_tokens", 0) for r in requests) / prompt if prompt else 0.0,
        steps=list(steps), kv_usage=[s["kv_usage"] for s in steps], batch_size=[s["batch_size"] for s in steps],
        requests=list(requests))
    metrics.update(extra)
    return metrics


def batch_efficiency(throughput: float, max_throughput: float, batch_size: int) -> float:
    """The article's batch efficiency: actual throughput / (max throughput x batch size).

    Units. Read with both throughputs in tokens/s, the denominator is tokens/s x sequences, so the
    ratio is not a pure number unless "max throughput" means *one sequence's* tokens/s: then
    max x B is what B sequences would deliver if batching were free (B batch-1 runs side by side),
    and the ratio is dimensionless, 1.0 for perfectly linear scaling. That is the reading this
    function takes: pass `max_throughput` = the batch-1 rate (tokens/s of one sequence) and
    `throughput` = the batch's total output tokens/s. If instead "max" is the engine's peak total
    throughput, the formula divides a total by a total times B, and falls as 1/B for an engine
    that is perfect.

    What it measures: how much of the per-sequence speed survives batching. At batch 1 a decode
    step reads every weight for one token (memory-bound); a batch reads them once for B tokens,
    so while the step stays memory-bound the efficiency stays near 1, and it falls once the
    batch reaches the machine's ridge point (compute-bound): falling there is the roofline, not
    a defect. What it does not measure: latency (TTFT and TPOT can worsen while it rises), padding
    (padded slots counted as tokens inflate it: count useful output tokens only), memory (the KV
    cache grows with B), and whether the batch was full: an engine that runs half-empty batches
    can score well per batch and still serve little.
    """
    if batch_size < 1 or max_throughput <= 0:
        raise ConfigError(f"batch_efficiency needs batch_size >= 1 and max_throughput > 0, got {batch_size} and "
                         f"{max_throughput}")
    return throughput / (max_throughput * batch_size)
