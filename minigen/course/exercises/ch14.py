"""Chapter 14 exercises: batching and serving.

1. `group(lengths, max_batch_size)`: cut requests into static batches of at most max_batch_size
   that waste no more padding than the article's grouping by length (batching.group_by_length),
   losing and repeating no request. Prompts longer than the cap of 256 run alone.
2. `schedule(waiting, running, free_blocks, max_batch_size) -> (preempted, admitted)`: the start of
   the Engine's step, admission with preemption. The running sequences' next tokens take their
   blocks first; while they do not fit, the newest running sequence is preempted (its blocks go
   back, it returns to the front of the queue). Then waiting requests join, first come first served,
   while a batch slot and their blocks are free. The checker replays a seeded workload through a
   real Engine (replay.record_choices), hands your function what the Engine saw at each step, and
   compares your choices with the Engine's, naming the first step where they differ.

Each checker fails an answer that calls minigen's own piece (batching.group_by_length, the Engine's
step or scheduler.can_admit, or this module's worked solution): the exercise is to build it.
"""

from __future__ import annotations

import functools
import random

from ...serving import batching, scheduler
from ...serving.engine import Engine
from ...config import GenerationConfig
from ..distributions import tiny_llama
from ..replay import Choice, Running, Waiting, record_choices
from ...serving.batching import PAD_CAP, group_by_length, padding_waste
from . import ExerciseFailed, forbidding, known_mistake


# ---------------------------------------------------------------- 1. grouping by length
def solution_group(lengths: list[int], max_batch_size: int) -> list[list[int]]:
    """Sort the indices by length, then cut consecutive runs; a prompt past the cap alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    short = [i for i in order if lengths[i] <= PAD_CAP]
    return [short[i:i + max_batch_size] for i in range(0, len(short), max_batch_size)] + \
        [[i] for i in order if lengths[i] > PAD_CAP]


def _cases() -> list[tuple[str, list[int], int]]:
    rng = random.Random(10)
    cases = [("one request", [7], 4), ("equal lengths", [5] * 9, 4)]
    for n, b in ((12, 4), (30, 8), (17, 3)):
        cases.append((f"{n} random lengths, batches of {b}", [rng.randint(1, 200) for _ in range(n)], b))
    return cases + [("one past the cap", [300, 12, 40, 3], 8)]


def check_group(fn) -> bool:
    """fn(lengths, max_batch_size) -> list of batches (lists of indices into lengths)."""
    # grouping by length's padding first: the answer then runs with minigen's grouping forbidden
    cases = [(label, lengths, b, padding_waste(lengths, group_by_length(lengths, b)).pad_slots)
             for label, lengths, b in _cases()]
    forbidden = [batching.group_by_length] + ([solution_group] if fn is not solution_group else [])
    for label, lengths, b, ref in cases:
        with forbidding(*forbidden):
            got = fn(list(lengths), b)
        if got is None:
            raise ExerciseFailed(f"group: for {label} your function returned None: return a list of batches")
        flat = sorted(i for batch in got for i in batch)
        if flat != list(range(len(lengths))):
            missing = sorted(set(range(len(lengths))) - set(flat))
            raise ExerciseFailed(f"group: for {label} (lengths {lengths}) every request must be in exactly one "
                                 f"batch; missing {missing}, or some twice. A batcher never drops a request")
        too_big = [batch for batch in got if len(batch) > b or not batch]
        if too_big:
            raise ExerciseFailed(f"group: for {label} batch {too_big[0]} has {len(too_big[0])} requests: use 1 to {b}")
        long_mixed = [batch for batch in got if len(batch) > 1 and max(lengths[i] for i in batch) > PAD_CAP]
        if long_mixed:
            raise ExerciseFailed(f"group: for {label} batch {long_mixed[0]} pads other prompts up to one longer "
                                 f"than the cap of {PAD_CAP}: a prompt past the cap runs alone")
        yours = padding_waste(lengths, got).pad_slots
        if yours > ref:
            raise ExerciseFailed(f"group: for {label} your batches pad {yours} slots, grouping by length pads {ref}. "
                                 "Hint: sort the requests by length before cutting the batches")
    print(f"✓ group: all {len(cases)} cases lose nothing and pad no more than grouping by length")
    return True


# ---------------------------------------------------------------- 2. admission with preemption
def solution_schedule(waiting: list[Waiting], running: list[Running], free_blocks: int,
                      max_batch_size: int) -> tuple[list[int], list[int]]:
    """The start of Engine.step -> (ids preempted, in order; ids admitted, in order).

    1. The running sequences' next tokens take their blocks, all together. While they do not fit,
       preempt the newest (the last admitted): its blocks go back to the pool, and it goes to the
       front of the queue, needing its blocks and its next token's to come back.
    2. Admit from the front of the queue while a batch slot is free and the request's blocks fit in
       what the running sequences left; stop at the first that does not (first come, first served)."""
    running, queue, preempted = list(running), [(w.id, w.blocks) for w in waiting], []
    while running and sum(r.next_blocks for r in running) > free_blocks:
        victim = running.pop()
        free_blocks += victim.blocks
        preempted.append(victim.id)
        queue.insert(0, (victim.id, victim.blocks + victim.next_blocks))
    free_blocks -= sum(r.next_blocks for r in running)
    admitted = []
    for rid, blocks in queue:
        if len(running) + len(admitted) >= max_batch_size or blocks > free_blocks:
            break
        admitted.append(rid)
        free_blocks -= blocks
    return preempted, admitted


def _rule(waiting, running, free, max_batch_size, victim="newest", reserve=True, fifo=True, slots="<",
          fits="<=", give_back=True, requeue=True, repeat=True) -> tuple[list[int], list[int]]:
    """The worked solution with one usual mistake switched on (the defaults: no mistake)."""
    running, queue, preempted = list(running), [(w.id, w.blocks) for w in waiting], []
    while running and sum(r.next_blocks for r in running) > free and (repeat or not preempted):
        v = running.pop(-1 if victim == "newest" else 0)
        free += v.blocks if give_back else 0
        preempted.append(v.id)
        if requeue:
            queue.insert(0, (v.id, v.blocks + v.next_blocks))
    free -= sum(r.next_blocks for r in running) if reserve else 0
    admitted = []
    for rid, blocks in queue:
        full = len(running) + len(admitted) >= max_batch_size if slots == "<" else \
            len(running) + len(admitted) > max_batch_size if slots == "<=" else False
        if full or (blocks > free if fits == "<=" else blocks >= free):
            if fifo or full:
                break
            continue
        admitted.append(rid)
        free -= blocks
    return preempted, admitted


MISTAKES = [  # (the mistake, as _rule's switch; the hint the checker gives)
    ({"victim": "oldest"}, "preempt the newest running sequence (the last in `running`), not the oldest: the "
                           "oldest has done the most work, and it keeps its place"),
    ({"reserve": False}, "the running sequences' next tokens take their blocks first: admit only into the free "
                         "blocks left after them (else the next step must preempt what this one admitted)"),
    ({"fifo": False}, "first come, first served: stop at the first waiting request that does not fit; a smaller "
                      "one behind it does not jump the queue"),
    ({"slots": None}, "a request also needs a batch slot: running + admitted must stay below max_batch_size"),
    ({"slots": "<="}, "a batch of max_batch_size sequences is full: admit while running + admitted < max_batch_size"),
    ({"fits": "<"}, "a request whose blocks exactly fill what is left is admitted (blocks <= free)"),
    ({"give_back": False}, "a preempted sequence gives its blocks back: add them to the free blocks before "
                           "deciding whether another must go"),
    ({"requeue": False}, "a preempted sequence goes back to the front of the queue, and admission is first come "
                         "first served: in the step that preempts it, nobody behind it is admitted"),
    ({"repeat": False}, "preempt again, newest first, while the other running sequences' next tokens still do "
                        "not fit"),
]

# The replayed workload: SEED's requests arrive over ARRIVAL_STEPS steps at a tiny random Llama's Engine
# of BATCH rows and a pool of POOL blocks of BLOCK tokens, small enough that every usual mistake above
# differs from the Engine at some step (check_schedule verifies it before it checks an answer).
SEED, N_REQUESTS, ARRIVAL_STEPS, BATCH, POOL, BLOCK = 3, 20, 30, 4, 12, 4


def workload(seed: int = SEED) -> dict[int, list[tuple[list[int], int]]]:
    """Step -> the (prompt, max_new_tokens) pairs arriving before it. Each prompt opens with its own
    token, so no two share a prefix block: a waiting request's blocks are its tokens' blocks."""
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple[list[int], int]]] = {}
    for i in range(N_REQUESTS):
        step = rng.randrange(ARRIVAL_STEPS)
        prompt = [i + 1] + [rng.randrange(64) for _ in range(rng.randint(1, 12))]
        arrivals.setdefault(step, []).append((prompt, rng.randint(2, 16)))
    return arrivals


@functools.lru_cache(maxsize=4)
def recorded(seed: int = SEED) -> tuple[Choice, ...]:
    """The Engine's real choices on the seeded workload (a tiny random model: greedy, no stop token, so
    the schedule depends on the lengths alone)."""
    engine = Engine(tiny_llama(vocab_size=64, seed=0), GenerationConfig(stop_token_ids=[], cache_chunk_size=BLOCK),
                    max_batch_size=BATCH, num_blocks=POOL)
    return tuple(record_choices(engine, workload(seed)))


def _call(fn, c: Choice):
    return fn(list(c.waiting), list(c.running), c.free_blocks, c.max_batch_size)


def _seen(c: Choice) -> str:
    return (f"waiting {[(w.id, w.blocks) for w in c.waiting]} (id, blocks), running "
            f"{[(r.id, r.blocks, r.next_blocks) for r in c.running]} (id, blocks, next_blocks), "
            f"{c.free_blocks} free blocks, batches of {c.max_batch_size}")


def check_schedule(fn) -> bool:
    """fn(waiting, running, free_blocks, max_batch_size) -> (preempted ids, admitted ids), as the Engine's
    step decides, at every step of a replayed workload."""
    choices = recorded()
    for switches, hint in MISTAKES:  # the replay must be able to tell each usual mistake from the rule
        if all(_call(lambda *a: _rule(*a, **switches), c) == (list(c.preempted), list(c.admitted)) for c in choices):
            raise RuntimeError(f"check_schedule: the replayed workload cannot catch the mistake {switches}")
    forbidden = [Engine.step, scheduler.can_admit, _rule] + ([solution_schedule] if fn is not solution_schedule else [])
    for c in choices:
        with forbidding(*forbidden):
            got = _call(fn, c)
        try:
            preempted, admitted = (list(map(int, ids)) for ids in got)
        except (TypeError, ValueError):
            raise ExerciseFailed(f"schedule: at step {c.step} your function returned {got!r}: return two lists of "
                                 "request ids, (preempted, admitted)") from None
        want = (list(c.preempted), list(c.admitted))
        if (preempted, admitted) != want:
            hint = known_mistake((preempted, admitted), [(_call(lambda *a, s=s: _rule(*a, **s), c), h)
                                                         for s, h in MISTAKES])
            if not hint and sorted(preempted) == sorted(want[0]) and preempted != want[0]:
                hint = "list the preempted in the order the Engine preempts them: the newest first"
            raise ExerciseFailed(f"schedule: at step {c.step} the Engine saw {_seen(c)}; it preempted {want[0]} and "
                                 f"admitted {want[1]}, yours preempted {preempted} and admitted {admitted}"
                                 + (f". Hint: {hint}" if hint else ""))
    print(f"✓ schedule: your choices equal the Engine's at all {len(choices)} steps of the replayed workload "
          f"({sum(map(len, (c.preempted for c in choices)))} preemptions, "
          f"{sum(map(len, (c.admitted for c in choices)))} admissions)")
    return True
