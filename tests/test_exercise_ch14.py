"""Chapter 14's admission-with-preemption exercise (issue 46): the checker replays a seeded workload through
a real Engine and compares an answer's choices with the Engine's, step by step. The worked solution passes;
the usual mistakes fail naming the step and the mistake; an answer that calls the Engine's own step or
scheduler.can_admit (or the worked solution) fails."""

from __future__ import annotations

import re

import pytest
import torch

from minigen.course.exercises import ExerciseFailed, ch14
from minigen.course.replay import Waiting
from minigen.serving import scheduler
from minigen.serving.engine import Engine


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_worked_solution_makes_the_engines_choices_at_every_step():
    assert ch14.check_schedule(ch14.solution_schedule)
    choices = ch14.recorded()
    assert sum(len(c.preempted) for c in choices) >= 3 and any(len(c.preempted) > 1 for c in choices)
    assert any(len(c.running) + len(c.admitted) == c.max_batch_size and c.waiting for c in choices)


def test_the_replay_reads_the_engine_not_the_solution():
    """Another seed, recorded from a real Engine: the solution still agrees (the recording is the Engine's)."""
    for c in ch14.recorded(1):
        assert ch14.solution_schedule(list(c.waiting), list(c.running), c.free_blocks, c.max_batch_size) == \
            (list(c.preempted), list(c.admitted)), c


def preempt_oldest(waiting, running, free, b):
    running, preempted = list(running), []
    while running and sum(r.next_blocks for r in running) > free:
        v = running.pop(0)  # the usual mistake: the oldest
        free += v.blocks
        preempted.append(v.id)
    if preempted:
        return preempted, []
    free -= sum(r.next_blocks for r in running)
    admitted = []
    for w in waiting:
        if len(running) + len(admitted) >= b or w.blocks > free:
            break
        admitted.append(w.id)
        free -= w.blocks
    return preempted, admitted


def no_room_for_next_token(waiting, running, free, b):
    running, preempted = list(running), []
    while running and sum(r.next_blocks for r in running) > free:
        v = running.pop()
        free += v.blocks
        preempted.append(v.id)
    if preempted:
        return preempted, []
    admitted = []  # the usual mistake: the running sequences' next blocks are not taken out of `free`
    for w in waiting:
        if len(running) + len(admitted) >= b or w.blocks > free:
            break
        admitted.append(w.id)
        free -= w.blocks
    return preempted, admitted


@pytest.mark.parametrize("answer, hint", [
    (preempt_oldest, "preempt the newest running sequence"),
    (no_room_for_next_token, "next tokens take their blocks first"),
])
def test_the_usual_mistakes_fail_naming_the_step_and_the_mistake(answer, hint):
    with pytest.raises(ExerciseFailed, match=rf"at step \d+ the Engine saw .*Hint:.*{hint}"):
        ch14.check_schedule(answer)


@pytest.mark.parametrize("switches, hint", ch14.MISTAKES)
def test_every_listed_mistake_is_caught_with_its_hint(switches, hint):
    def answer(waiting, running, free, b):
        # the solution's logic, written out again (the checker forbids _rule itself)
        running, queue, preempted = list(running), [(w.id, w.blocks) for w in waiting], []
        while running and sum(r.next_blocks for r in running) > free and (switches.get("repeat", True) or not preempted):
            v = running.pop(-1 if switches.get("victim", "newest") == "newest" else 0)
            free += v.blocks if switches.get("give_back", True) else 0
            preempted.append(v.id)
            if switches.get("requeue", True):
                queue.insert(0, (v.id, v.blocks + v.next_blocks))
        free -= sum(r.next_blocks for r in running) if switches.get("reserve", True) else 0
        admitted, slots = [], switches.get("slots", "<")
        for rid, blocks in queue:
            n = len(running) + len(admitted)
            full = n >= b if slots == "<" else n > b if slots == "<=" else False
            if full or (blocks > free if switches.get("fits", "<=") == "<=" else blocks >= free):
                if switches.get("fifo", True) or full:
                    break
                continue
            admitted.append(rid)
            free -= blocks
        return preempted, admitted
    with pytest.raises(ExerciseFailed, match="Hint:.*" + re.escape(hint.split(":")[0][:40])):
        ch14.check_schedule(answer)


def test_an_answer_that_calls_minigens_scheduler_fails():
    def uses_can_admit(waiting, running, free, b):
        preempted, admitted = [], []
        for w in waiting:
            if not scheduler.can_admit(w.blocks, free, sum(r.next_blocks for r in running), len(running) + len(admitted), b):
                break
            admitted.append(w.id)
            free -= w.blocks
        return preempted, admitted

    def uses_the_engine(waiting, running, free, b):
        Engine.step(None)

    for cheat, name in ((uses_can_admit, "can_admit"), (uses_the_engine, "step"),
                        (lambda *a: ch14.solution_schedule(*a), "solution_schedule"), (lambda *a: ch14._rule(*a), "_rule")):
        with pytest.raises(ExerciseFailed, match=f"calls minigen's own .*{name}"):
            ch14.check_schedule(cheat)
    assert scheduler.can_admit(1, 2, 0, 0, 1)  # restored after


def test_a_malformed_answer_is_named():
    with pytest.raises(ExerciseFailed, match="return two lists"):
        ch14.check_schedule(lambda *a: None)
    with pytest.raises(ExerciseFailed, match="preempted .* admitted"):
        ch14.check_schedule(lambda *a: ([], []))
    assert Waiting(0, 1).blocks == 1


def test_static_batches_on_minigen_generate_match_the_engine_and_wait_for_the_longest():
    """course/replay.py's static baseline: same tokens as the Engine (same model code), every row of a
    batch decoded until the batch's longest reply, a burst at t = 0 filling the batch."""
    import minigen
    from minigen.course.distributions import tiny_llama
    from minigen.course.replay import StaticGenerate, with_burst
    from minigen.serving.workload import LengthDist, make_workload, replay

    model = tiny_llama(vocab_size=64, seed=0)
    work = with_burst(make_workload(6, 50.0, seed=0, prompt_tokens=LengthDist(6, 0.5, 2, 12),
                                    output_tokens=LengthDist(5, 0.5, 2, 9), vocab=(1, 64)), 4)
    assert [r.arrival_s for r in work.requests[:4]] == [0.0] * 4 and work.requests[4].arrival_s > 0
    static = StaticGenerate(model, max_batch_size=4)
    m = replay(static, work, clock=static.now)
    engine = minigen.Engine(model, minigen.GenerationConfig(stop_token_ids=[], cache_chunk_size=4), max_batch_size=4,
                            num_blocks=64)
    replay(engine, work, clock=engine.now)
    got, want = static.run(), engine.run()
    assert all(torch.equal(got[i], want[i]) for i in range(6))
    assert m["batch_size"][0] == 4 and [r["output_tokens"] for r in m["requests"]] == [r.max_new_tokens for r in work.requests]
    first = max(r.max_new_tokens for r in work.requests[:4])
    assert sum(s["decode_tokens"] for s in m["steps"][:first]) == 4 * (first - 1)
