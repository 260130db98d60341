"""A serving workload simulated on the block allocator alone (chapter 5; the course's layer: the
core never imports this).

    simulate(requests, block_size, max_len) -> Simulation: the slots written, held by a paged cache,
                                               and reserved by a contiguous one, at every step

No model runs: each request prefills at step 0, appends one token per step, and frees its blocks
when done, so the memory a paged and a contiguous cache hold can be compared in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..caches.blocks import BlockAllocator


@dataclass
class Simulation:
    """Slots per decode step of a simulated batch: what was written, what paging and contiguous held."""
    used: list[int]  # token slots written by the active sequences
    paged: list[int]  # slots in the blocks they hold
    contiguous: list[int]  # slots a contiguous cache reserves: max_len per active sequence

    @property
    def paged_waste(self) -> float:
        """Fraction of the held slots (summed over steps) that hold no token."""
        return 1 - sum(self.used) / sum(self.paged)

    @property
    def contiguous_waste(self) -> float:
        return 1 - sum(self.used) / sum(self.contiguous)


def simulate(requests: list[tuple[int, int]], block_size: int, max_len: int) -> Simulation:
    """Run the allocator alone on a batch of (prompt tokens, new tokens) requests: all prefill at
    step 0, each then appends one token per step and frees its blocks when done. No model runs."""
    alloc = BlockAllocator(sum(math.ceil((p + n) / block_size) for p, n in requests), block_size)
    active = {alloc.add_sequence(): (p, p + n) for p, n in requests}  # seq -> (length, final length)
    sim = Simulation([], [], [])
    for seq, (p, _) in active.items():
        alloc.write(seq, 0, p)
    while active:
        sim.used.append(alloc.used_slots)
        sim.paged.append(alloc.n_used * block_size)
        sim.contiguous.append(len(active) * max_len)
        for seq, (length, final) in list(active.items()):
            if length == final:
                alloc.free_sequence(seq)
                del active[seq]
            else:
                alloc.write(seq, length, length + 1)
                active[seq] = (length + 1, final)
    return sim
