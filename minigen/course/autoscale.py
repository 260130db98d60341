"""The replica count a HorizontalPodAutoscaler asks for, from the pods' /metrics (chapter 15).

    hpa_targets(hpa, adapter_rules)  -> {/metrics series: per-pod target}: an autoscaling/v2 HPA's Pods
                                        metrics (AverageValue targets), each named back to the series
                                        prometheus-adapter serves it from (deploy/k8s/prometheus-adapter.yaml)
    desired_replicas(pods, targets, min_replicas, max_replicas) -> the count one evaluation proposes

Kubernetes' algorithm (the HPA documentation's "Algorithm details"; pkg/controller/podautoscaler):
for each metric, ratio = the pods' average / the target; within the tolerance (|ratio - 1| <= 0.1)
that metric keeps the current count, else it proposes ceil(ratio x current replicas). The largest
proposal wins, clamped to [minReplicas, maxReplicas]. The HPA's `behavior` (stabilization windows,
rate policies: chapter 15 section 4) then limits how fast the count may move; that is not done here.
The course's layer: the core never imports this.
"""

from __future__ import annotations

import math

from kubernetes.utils import parse_quantity

TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance default


def hpa_targets(hpa, adapter_rules: list[dict]) -> dict[str, float]:
    """{the /metrics series a Pods metric comes from: its AverageValue target} of a V2HorizontalPodAutoscaler.
    adapter_rules: prometheus-adapter's `rules` (each renames a seriesQuery's series to name.as)."""
    series_of = {r["name"]["as"]: r["seriesQuery"].split("{")[0].strip("'") for r in adapter_rules}
    targets = {}
    for m in hpa.spec.metrics:
        if m.type != "Pods" or m.pods.target.type != "AverageValue":
            raise ValueError(f"hpa_targets reads Pods metrics with AverageValue targets; this HPA has a {m.type} "
                             f"metric ({m.pods.target.type if m.type == 'Pods' else ''})")
        targets[series_of[m.pods.metric.name]] = float(parse_quantity(m.pods.target.average_value))
    return targets


def desired_replicas(pods: list[dict[str, float]], targets: dict[str, float], min_replicas: int, max_replicas: int,
                     tolerance: float = TOLERANCE) -> int:
    """pods: one /metrics snapshot per running pod ({series: value}); targets: {series: per-pod target}
    -> the replica count one HPA evaluation proposes (before its behavior's limits)."""
    current = len(pods)
    proposals = []
    for series, target in targets.items():
        ratio = sum(p[series] for p in pods) / current / target  # the pods' average against the target
        proposals.append(current if abs(ratio - 1) <= tolerance else math.ceil(ratio * current))
    return min(max(max(proposals), min_replicas), max_replicas)
