"""Chapter 15 exercise: the replica count the autoscaler asks for.

`check_desired_replicas(fn)`: fn(pods, targets, min_replicas, max_replicas) -> int. `pods` holds one
/metrics snapshot per running pod of minigen serve ({series under vLLM's names: value}); `targets`
maps each series the HPA scales on to its per-pod target (deploy/minigen/hpa.yaml's AverageValue).
Return the replica count one evaluation of Kubernetes' HPA proposes: for each metric, the ratio of
the pods' average to the target; within 10% of 1 that metric keeps the current count, else it
proposes ceil(ratio x current); the largest proposal, clamped to [min_replicas, max_replicas].

The checker draws fresh random cases at every call (and the cases of deploy/minigen/hpa.yaml), computes
each with minigen's reference (course/autoscale.py), names the usual mistake, and fails an answer
that calls the reference or the worked solution.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import yaml

from ...production.deploy import load_manifests
from ..autoscale import TOLERANCE, desired_replicas, hpa_targets
from . import ExerciseFailed, forbidding, known_mistake

WAITING, KV = "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"  # the repository's deploy/ (chapter 15 reads it too)


def solution_desired_replicas(pods: list[dict[str, float]], targets: dict[str, float], min_replicas: int,
                              max_replicas: int) -> int:
    """Per metric: the pods' average over the target; keep the count within 10%, else ceil(ratio x count).
    The largest proposal, clamped to the HPA's bounds."""
    current, proposals = len(pods), []
    for series, target in targets.items():
        ratio = sum(pod[series] for pod in pods) / len(pods) / target
        proposals.append(current if abs(ratio - 1) <= 0.1 else math.ceil(ratio * current))
    return max(min_replicas, min(max_replicas, max(proposals)))


def _mistake(pods, targets, lo, hi, total=False, tolerance=True, rounding=math.ceil, combine=max, clamp=True,
             times_current=True) -> int:
    """The reference with one usual mistake switched on."""
    current, proposals = len(pods), []
    for series, target in targets.items():
        ratio = sum(p[series] for p in pods) / (1 if total else current) / target
        keep = tolerance and abs(ratio - 1) <= TOLERANCE
        proposals.append(current if keep else rounding(ratio * (current if times_current else 1)))
    out = combine(proposals)
    return min(max(out, lo), hi) if clamp else out


MISTAKES = [
    ({"total": True}, "an AverageValue target is per pod: compare the pods' average, not their sum, with it"),
    ({"tolerance": False}, "within 10% of the target (|ratio - 1| <= 0.1) the HPA keeps the current count"),
    ({"rounding": round}, "the HPA rounds the proposal up: ceil(ratio x current)"),
    ({"rounding": math.floor}, "the HPA rounds the proposal up: ceil(ratio x current)"),
    ({"combine": min}, "with several metrics the HPA takes the largest proposal, so the metric most behind wins"),
    ({"clamp": False}, "clamp the count to [minReplicas, maxReplicas]"),
    ({"times_current": False}, "the proposal is ceil(ratio x the current replica count), not the ratio alone"),
]


def deployed_targets() -> tuple[dict[str, float], int, int]:
    """deploy/minigen/hpa.yaml's targets (named back to /metrics by the Prometheus adapter) and bounds."""
    hpa, = load_manifests(DEPLOY / "minigen" / "hpa.yaml")
    adapter = yaml.safe_load(load_manifests(DEPLOY / "k8s" / "prometheus-adapter.yaml")[0].data["config.yaml"])
    return hpa_targets(hpa, adapter["rules"]), hpa.spec.min_replicas, hpa.spec.max_replicas


def _clear(x: float) -> bool:
    """Far from a rounding edge, so that float order of operations cannot flip a ceil or the tolerance."""
    return abs(x - round(x)) > 1e-6


def cases(seed: int | None = None) -> list[tuple[str, tuple]]:
    """(label, (pods, targets, min, max)): a few fixed cases on the deployed HPA, then random ones."""
    rng = random.Random(seed)
    targets, lo, hi = deployed_targets()
    fixed = [("one idle pod", [{WAITING: 0, KV: 0.02}]),
             ("two pods, queues a little over target (within 10%)", [{WAITING: 4, KV: 0.3}, {WAITING: 4.6, KV: 0.2}]),
             ("three pods, long queues", [{WAITING: 9, KV: 0.5}, {WAITING: 14, KV: 0.6}, {WAITING: 3, KV: 0.4}]),
             ("two pods, caches full, queues short", [{WAITING: 1, KV: 0.97}, {WAITING: 0, KV: 0.99}]),
             ("four pods, quiet", [{WAITING: 0, KV: 0.1}, {WAITING: 1, KV: 0.2}, {WAITING: 0, KV: 0.05}, {WAITING: 0, KV: 0.1}]),
             ("six pods, swamped", [{WAITING: 40, KV: 0.95}] * 6)]
    out = [(f"{label} (deploy/minigen/hpa.yaml)", (pods, targets, lo, hi)) for label, pods in fixed]
    while len(out) < 40:
        n = rng.randint(1, 10)
        pods = [{WAITING: float(rng.randint(0, 30)), KV: round(rng.uniform(0, 1), 3)} for _ in range(n)]
        t = {WAITING: float(rng.choice([2, 4, 5, 8])), KV: rng.choice([0.5, 0.75, 0.8])}
        lo_r, hi_r = rng.randint(1, 3), rng.randint(4, 12)
        ratios = [sum(p[s] for p in pods) / n / t[s] for s in t]
        if all(_clear(r * n) and abs(abs(r - 1) - TOLERANCE) > 1e-6 for r in ratios):
            out.append((f"random case {len(out) - len(fixed) + 1}: {n} pod(s), targets {t}, bounds [{lo_r}, {hi_r}]",
                        (pods, t, lo_r, hi_r)))
    return out


def check_desired_replicas(fn, seed: int | None = None) -> bool:
    """fn(pods, targets, min_replicas, max_replicas) -> int, on the deployed HPA's cases and fresh random ones."""
    expected = [(label, args, desired_replicas(*args)) for label, args in cases(seed)]
    forbidden = [desired_replicas, _mistake] + ([solution_desired_replicas] if fn is not solution_desired_replicas else [])
    for label, (pods, targets, lo, hi), want in expected:
        with forbidding(*forbidden):
            got = fn([dict(p) for p in pods], dict(targets), lo, hi)
        if got != want or isinstance(got, bool):
            hint = known_mistake(got, [(_mistake(pods, targets, lo, hi, **s), h) for s, h in MISTAKES])
            shown = pods if len(pods) <= 4 else f"{pods[:3]} ... ({len(pods)} pods)"
            raise ExerciseFailed(f"desired_replicas: for {label}, pods {shown}, the HPA asks for {want} replicas, "
                                 f"yours {got!r}" + (f". Hint: {hint}" if hint else ""))
    print(f"✓ desired_replicas: all {len(expected)} cases agree with Kubernetes' algorithm (minigen.course.autoscale)")
    return True
