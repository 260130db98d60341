"""Chapter 14's replays: static batches on minigen's own generate, and the Engine's scheduling choices.

    StaticGenerate(model, max_batch_size)  static batches of `minigen.generate` (ragged rows), with the
                                           Engine's API (add_request, step, run, metrics), so that
                                           workload.replay drives both and only the scheduling differs
    with_burst(workload, n)                the same workload, its first n requests arriving together at t = 0
    record_choices(engine, arrivals)       -> [Choice]: at every step, what the scheduler saw (the queue,
                                           the running sequences, the free blocks) and whom it preempted
                                           and admitted, read from a real Engine around each step()

The course's layer: the core never imports this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..generate import generate
from ..measure.serve_bench import StaticBatches
from ..serving.engine import Engine
from ..serving.scheduler import blocks_for
from ..serving.workload import Workload


# ---------------------------------------------------------------- static batches, same model code as the Engine
class StaticGenerate(StaticBatches):
    """Static batching on `minigen.generate`: StaticBatches' queue and records, each batch run as one
    ragged batch until its longest reply is done (no stop token: each row makes exactly its
    max_new_tokens, the rest of the batch's tokens are dropped). Each row's k-th token is handed out
    when the batch's k-th token is made, the kindest reading for static batching."""

    def __init__(self, model, max_batch_size: int = 8):
        super().__init__(None, max_batch_size)
        self.model = model

    def default_new_tokens(self) -> int:
        return 16

    def run_batch(self, batch: list[tuple], longest: int) -> tuple[list[float], list[torch.Tensor], int]:
        out = generate(self.model, [torch.tensor(p) for _, p, _, _ in batch], max_new_tokens=longest,
                       stop_token_ids=[])
        end, lat = self.now(), out.stats.token_latencies_s
        # anchored at the end, so the plan's set-up before the first token counts as the prefill's time
        times = [end - sum(lat) + t for t in accumulate(lat)]
        rows = [out.tokens[row][:len(prompt) + n].clone() for row, (_, prompt, n, _) in enumerate(batch)]
        return times, rows, sum(len(p) for _, p, _, _ in batch)


def with_burst(workload: Workload, n: int) -> Workload:
    """The workload with its first n requests arriving together at t = 0 (a burst, as when a service
    opens or a client retries), the later ones at their own times."""
    requests = [dataclasses.replace(r, arrival_s=0.0) if i < n else r for i, r in enumerate(workload.requests)]
    return dataclasses.replace(workload, requests=requests,
                               description=workload.description + f"; the first {n} arrive together at t = 0")


# ---------------------------------------------------------------- the scheduler's choices, step by step
@dataclass(frozen=True)
class Waiting:
    """A request in the queue (arrived): the blocks its tokens need to be admitted."""
    id: int
    blocks: int  # its prompt's blocks (and its earlier output's, after a preemption)


@dataclass(frozen=True)
class Running:
    """A running sequence: the blocks it holds and the blocks its next token needs (0 or 1)."""
    id: int
    blocks: int  # blocks it holds: all go back to the pool if it is preempted
    next_blocks: int  # 1 when its next token opens a new block, else 0


@dataclass(frozen=True)
class Choice:
    """One step: what the scheduler saw at its start, and whom it preempted and admitted (in order)."""
    step: int
    waiting: tuple[Waiting, ...]  # queue order: preempted requests first, then arrival order
    running: tuple[Running, ...]  # admission order: the newest last
    free_blocks: int
    max_batch_size: int
    preempted: tuple[int, ...]  # in the order the Engine preempted them
    admitted: tuple[int, ...]  # in the order it admitted them


def engine_view(engine: Engine) -> tuple[tuple[Waiting, ...], tuple[Running, ...], int]:
    """The queue, the running sequences and the free blocks as the Engine's step will see them. A waiting
    request's blocks count as the Engine's admission counts them: its cached prefix blocks that another
    sequence holds cost nothing, the rest one block each."""
    alloc, bs = engine.alloc, engine.block_size
    waiting = []
    for r in engine.waiting:
        hits = alloc.lookup(r.block_keys((len(r.tokens) - 1) // bs, bs))
        held = sum(alloc.refs[b] > 0 for b in hits)
        waiting.append(Waiting(r.id, blocks_for(len(r.tokens), bs) - held))
    running = [Running(r.id, sum(b >= 0 and alloc.refs[b] == 1 for b in alloc.tables[r.seq]),
                       alloc.blocks_needed([(r.seq, r.computed, r.computed + 1 if r.prefilled else len(r.tokens))]))
               for r in engine.running]
    return tuple(waiting), tuple(running), len(alloc.free)


def record_choices(engine: Engine, arrivals: dict[int, list[tuple[list[int], int]]]) -> list[Choice]:
    """Drive `engine` step by step: before step k add arrivals[k] ((prompt, max_new_tokens) pairs, arriving
    now), read what it sees, step it, and read whom it preempted (their preemption count grew) and
    admitted (they left the queue) -> one Choice per step that ran, until every request has finished."""
    choices: list[Choice] = []
    k = 0
    while k <= max(arrivals, default=0) or engine.unfinished():
        for prompt, n in arrivals.get(k, []):
            engine.add_request(prompt, max_new_tokens=n)
        waiting, running, free = engine_view(engine)
        before = {r.id: r.preemptions for r in engine.running}
        queued = list(engine.waiting)
        engine.step()
        preempted = [rid for rid in reversed(list(before)) if engine.requests[rid].preemptions > before[rid]]
        admitted = [r.id for r in queued if r.status != "waiting"]
        if waiting or running:
            choices.append(Choice(k, waiting, running, free, engine.max_batch_size, tuple(preempted), tuple(admitted)))
        k += 1
    return choices
