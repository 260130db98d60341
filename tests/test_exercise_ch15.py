"""Chapter 15's exercise (issue 46): the replica count an HPA asks for, from the pods' /metrics. The checker
draws random cases at every call, computes them with minigen's reference (course/autoscale.py), names
the usual mistakes, and refuses an answer that calls the reference or the worked solution. The
reference itself is checked here against Kubernetes' algorithm on cases worked by hand."""

from __future__ import annotations

import math

import pytest

from minigen.course import autoscale
from minigen.course.exercises import ExerciseFailed, ch15

W, KV = ch15.WAITING, ch15.KV


def test_the_deployed_hpa_reads_back_to_vllms_series():
    targets, lo, hi = ch15.deployed_targets()
    assert targets == {W: 4.0, KV: 0.75} and (lo, hi) == (1, 8)


@pytest.mark.parametrize("pods, want", [
    ([{W: 0, KV: 0.0}], 1),  # idle: ceil(0) = 0, clamped up to minReplicas
    ([{W: 4.2, KV: 0.1}], 1),  # 5% over the queue target: within the tolerance
    ([{W: 12, KV: 0.1}, {W: 6, KV: 0.1}], 5),  # average 9 / 4 = 2.25 -> ceil(4.5) = 5
    ([{W: 0, KV: 0.99}, {W: 0, KV: 0.97}], 3),  # cache 0.98 / 0.75 = 1.31 -> ceil(2.61) = 3
    ([{W: 0, KV: 0.1}] * 4, 1),  # quiet: ceil(0.53) = 1
    ([{W: 100, KV: 1.0}] * 6, 8),  # swamped: ceil(150) clamped to maxReplicas
])
def test_the_reference_follows_kubernetes_algorithm(pods, want):
    assert autoscale.desired_replicas(pods, {W: 4.0, KV: 0.75}, 1, 8) == want


def test_the_worked_solution_passes_on_fresh_random_cases():
    assert ch15.check_desired_replicas(ch15.solution_desired_replicas)
    assert ch15.check_desired_replicas(ch15.solution_desired_replicas, seed=3)
    assert ch15.cases(1) != ch15.cases(2)  # each call draws its own cases: a pasted table of answers fails


def summed(pods, targets, lo, hi):
    n = len(pods)
    props = [n if abs(sum(p[s] for p in pods) / t - 1) <= 0.1 else math.ceil(sum(p[s] for p in pods) / t * n)
             for s, t in targets.items()]
    return max(lo, min(hi, max(props)))


def no_tolerance(pods, targets, lo, hi):
    n = len(pods)
    return max(lo, min(hi, max(math.ceil(sum(p[s] for p in pods) / n / t * n) for s, t in targets.items())))


def rounded(pods, targets, lo, hi):
    n = len(pods)
    props = [n if abs(sum(p[s] for p in pods) / n / t - 1) <= 0.1 else round(sum(p[s] for p in pods) / n / t * n)
             for s, t in targets.items()]
    return max(lo, min(hi, max(props)))


def smallest(pods, targets, lo, hi):
    n = len(pods)
    props = [n if abs(sum(p[s] for p in pods) / n / t - 1) <= 0.1 else math.ceil(sum(p[s] for p in pods) / t)
             for s, t in targets.items()]
    return max(lo, min(hi, min(props)))


def unclamped(pods, targets, lo, hi):
    n = len(pods)
    return max(n if abs(sum(p[s] for p in pods) / n / t - 1) <= 0.1 else math.ceil(sum(p[s] for p in pods) / t)
               for s, t in targets.items())


@pytest.mark.parametrize("answer, hint", [
    (summed, "average, not their sum"), (no_tolerance, "within 10%"), (rounded, "rounds the proposal up"),
    (smallest, "largest proposal"), (unclamped, "clamp"),
])
def test_the_usual_mistakes_fail_with_their_hint(answer, hint):
    with pytest.raises(ExerciseFailed, match=f"the HPA asks for .*Hint:.*{hint}"):
        ch15.check_desired_replicas(answer, seed=0)


def test_an_answer_that_calls_minigens_reference_fails():
    for cheat, name in ((autoscale.desired_replicas, "desired_replicas"),
                        (lambda *a: autoscale.desired_replicas(*a), "desired_replicas"),
                        (lambda *a: ch15.solution_desired_replicas(*a), "solution_desired_replicas"),
                        (lambda *a: ch15._mistake(*a), "_mistake")):
        with pytest.raises(ExerciseFailed, match=f"calls minigen's own {name}"):
            ch15.check_desired_replicas(cheat)
    assert autoscale.desired_replicas([{W: 0, KV: 0}], {W: 4.0}, 1, 8) == 1  # restored after


def test_a_wrong_type_is_named():
    with pytest.raises(ExerciseFailed, match="yours None"):
        ch15.check_desired_replicas(lambda *a: None)
    with pytest.raises(ExerciseFailed, match="yours True"):
        ch15.check_desired_replicas(lambda *a: True)
