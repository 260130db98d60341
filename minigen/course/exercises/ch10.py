"""Chapter 10 exercises: batching and serving.

1. `group(lengths, max_batch_size)`: cut requests into static batches of at most max_batch_size
   that waste no more padding than the article's grouping by length (batching.group_by_length),
   losing and repeating no request. Prompts longer than the cap of 256 run alone.
2. `can_admit(blocks_needed, free_blocks, reserved_blocks, running, max_batch_size)`: the Engine's
   admission rule. Does a waiting request join this step's batch? It needs a batch slot, and the
   blocks its prompt takes must fit in the free blocks that the running sequences' next tokens
   have not already reserved. Checked against the Engine's own rule, scheduler.can_admit.

Each checker fails an answer that calls minigen's own piece (batching.group_by_length,
scheduler.can_admit, or this module's worked solution): the exercise is to build it.
"""

from __future__ import annotations

import random

from ...serving import batching, scheduler
from ...serving.batching import PAD_CAP, group_by_length, padding_waste
from ...serving.scheduler import can_admit as engine_can_admit
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


# ---------------------------------------------------------------- 2. the admission rule
def solution_can_admit(blocks_needed: int, free_blocks: int, reserved_blocks: int, running: int,
                       max_batch_size: int) -> bool:
    """A free batch slot, and the prompt's blocks within what the running sequences left free."""
    return running < max_batch_size and blocks_needed <= free_blocks - reserved_blocks


def check_can_admit(fn) -> bool:
    """fn(blocks_needed, free_blocks, reserved_blocks, running, max_batch_size) -> bool, as the Engine decides."""
    cases = []
    for need, free, reserved, running, b in ((1, 10, 0, 0, 8), (4, 4, 0, 3, 8), (4, 4, 1, 3, 8), (3, 4, 1, 3, 8),
                                             (2, 10, 0, 8, 8), (2, 10, 0, 7, 8), (0, 0, 0, 0, 1), (5, 9, 5, 1, 4),
                                             (4, 9, 5, 1, 4), (1, 1, 1, 0, 1), (6, 6, 0, 0, 1), (1, 50, 3, 1, 1)):
        cases.append((f"need {need} blocks, {free} free, {reserved} reserved, {running} running, batch of {b}",
                      (need, free, reserved, running, b), engine_can_admit(need, free, reserved, running, b)))

    def hints(args, got, expected):
        need, free, reserved, running, b = args
        return known_mistake(bool(got), [
            (running < b and need <= free,
             "the running sequences' next tokens have reserved some free blocks: count only free - reserved"),
            (need <= free - reserved, "a request also needs a batch slot: running < max_batch_size"),
            (running <= b and need <= free - reserved, "running == max_batch_size means the batch is full"),
            (running < b and need < free - reserved, "a prompt that exactly fits the blocks left is admitted (<=)"),
        ]) if bool(got) != expected else ""

    forbidden = [scheduler.can_admit] + ([solution_can_admit] if fn is not solution_can_admit else [])
    for label, args, expected in cases:
        with forbidding(*forbidden):
            got = fn(*args)
        if got is None or bool(got) != expected:
            hint = hints(args, got, expected) if got is not None else "return True or False"
            raise ExerciseFailed(f"can_admit: for {label} the Engine says {expected}, yours {got}"
                                 + (f". Hint: {hint}" if hint else ""))
    print(f"✓ can_admit: all {len(cases)} cases agree with the Engine's rule (scheduler.can_admit)")
    return True
