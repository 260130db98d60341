"""The block allocator of the paged cache (chapter 5): pure bookkeeping, no tensors.

A pool of `n_blocks` blocks of `block_size` token slots; one block table per sequence maps its
logical block j (positions j*bs .. j*bs + bs - 1) to a physical block. Blocks are reference
counted, so sequences can share them (parallel sampling, prefix caching); a shared block about to
be written is copied first (copy-on-write). paged.py stores the keys and values; simulation.py and
the serving engine (engine.py) drive the same allocator.
"""

from __future__ import annotations

import math
import sys

from ..errors import PLAN_HINT, CacheFullError, ConfigError, PositionError


# ---------------------------------------------------------------- the allocator (no tensors)
class BlockAllocator:
    """Hands out blocks of `block_size` token slots from a pool of `n_blocks`; one block table per sequence.

    Pure bookkeeping, so a serving workload can be simulated without running a model.
    """

    def __init__(self, n_blocks: int, block_size: int):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(f"cache_chunk_size={block_size!r} is invalid: use an integer >= 1 "
                              "(tokens per block), or None for a contiguous cache")
        if not isinstance(n_blocks, int) or isinstance(n_blocks, bool) or n_blocks < 1:
            raise ConfigError(f"n_blocks={n_blocks!r} is invalid: the pool needs at least one block")
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free = list(range(n_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self.refs = [0] * n_blocks  # sequences whose table holds each block; 0: free
        self.fill = [0] * n_blocks  # token slots written in each block
        self.tables: dict[int, list[int]] = {}  # sequence id -> physical block of each logical block (-1: freed)
        self.lengths: dict[int, int] = {}  # sequence id -> tokens written (positions 0..length-1)
        self._next_id = 0

    def add_sequence(self) -> int:
        """Start an empty sequence -> its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self.tables[seq], self.lengths[seq] = [], 0
        return seq

    def share(self, seq: int, blocks: list[int]) -> None:
        """Give an empty sequence the full `blocks` as its first logical blocks, shared by reference
        count (a block no one holds leaves the free list)."""
        for b in blocks:
            if self.refs[b] == 0:
                self.free.remove(b)
                self.fill[b] = self.block_size
            self.refs[b] += 1
        self.tables[seq] = list(blocks)
        self.lengths[seq] = len(blocks) * self.block_size

    def fork(self, seq: int, n: int) -> list[int]:
        """n new sequences that share every block of `seq` (their tables are copies) -> their ids."""
        new = []
        for _ in range(n):
            child = self.add_sequence()
            self.tables[child], self.lengths[child] = list(self.tables[seq]), self.lengths[seq]
            for b in self.tables[child]:
                if b >= 0:
                    self.refs[b] += 1
            new.append(child)
        return new

    def blocks_needed(self, writes: list[tuple[int, int, int]], kept: dict[int, int] | None = None) -> int:
        """Blocks that `write(seq, start, end)` for each of `writes`, in order, would take from the
        pool (new blocks and copies on write), worked out without changing anything. `kept`: seq ->
        logical blocks left after a `truncate` that comes first."""
        bs, refs, need = self.block_size, {}, 0  # refs: the counts as the writes would leave them
        for seq, start, end in writes:
            table = self.tables[seq]
            n = min(len(table), (kept or {}).get(seq, len(table)))
            for j in range(start // bs, math.ceil(end / bs)):
                if j >= n:
                    need += 1
                elif table[j] >= 0 and refs.setdefault(table[j], self.refs[table[j]]) > 1:
                    refs[table[j]] -= 1  # the last holder left writes in place
                    need += 1
        return need

    def claim(self, seq: int, start: int, end: int) -> list[tuple[int, int]]:
        """Give `seq` the blocks that positions [start, end) will be written into, before they are
        -> the (src, dst) block copies to make first.

        Allocates the blocks that do not exist yet; a block shared with another sequence is replaced
        by a private copy (copy-on-write), which the caller must copy before anything writes into it.
        Records nothing as written (`write` does). Raises CacheFullError, changing nothing, when the
        pool cannot supply the blocks.
        """
        bs, table, copies = self.block_size, self.tables[seq], []
        for j in range(start // bs, math.ceil(end / bs)):
            if j < len(table) and table[j] < 0:
                raise PositionError(f"position {max(start, j * bs)} of sequence {seq} was freed (outside the "
                                    "window); it cannot be written again. Start a new sequence at position 0.")
        self.check_room(self.blocks_needed([(seq, start, end)]))
        for j in range(start // bs, math.ceil(end / bs)):
            if j >= len(table):
                table.append(self.take())
            elif self.refs[table[j]] > 1:  # shared: this sequence gets its own copy
                src, dst = table[j], self.take()
                self.refs[src] -= 1
                self.fill[dst] = self.fill[src]
                table[j] = dst
                copies.append((src, dst))
        return copies

    def claim_all(self, spans: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """`claim(seq, start, end)` for each of `spans`, all or none: CacheFullError, changing nothing,
        when the pool cannot supply them together -> the block copies to make first."""
        self.check_room(self.blocks_needed(spans))
        return [c for seq, start, end in spans for c in self.claim(seq, start, end)]

    def write(self, seq: int, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) of `seq` writable -> the (src, dst) block copies to make first.

        Allocates the blocks that do not exist yet; a block shared with another sequence is replaced
        by a private copy (copy-on-write), which the caller must copy before it writes; then records
        the slots written (fill) and the sequence's length. Raises
        CacheFullError, changing nothing, when the pool cannot supply the blocks.
        """
        copies = self.claim(seq, start, end)
        bs, table = self.block_size, self.tables[seq]
        for j in range(start // bs, math.ceil(end / bs)):
            self.fill[table[j]] = max(self.fill[table[j]], min(bs, end - j * bs))
        self.lengths[seq] = max(self.lengths[seq], end)
        return copies

    def check_room(self, need: int) -> None:
        """Raise CacheFullError, naming the numbers and the fixes, when `need` blocks are not free."""
        if need > len(self.free):
            raise CacheFullError(
                f"the paged KV cache's pool of {self.n_blocks} blocks of {self.block_size} tokens is full: this "
                f"step needs {need} more blocks and {len(self.free)} are free. Give the pool more blocks "
                f"(n_blocks), lower max_new_tokens or the batch, or set window_size so that blocks outside the "
                f"window are freed. {PLAN_HINT}")

    def truncate(self, seq: int, length: int) -> None:
        """Forget positions >= length of `seq`: whole blocks after it go back to the pool."""
        table, keep = self.tables[seq], math.ceil(length / self.block_size)
        while len(table) > keep:
            b = table.pop()
            if b >= 0:
                self._release(b)
        self.lengths[seq] = min(self.lengths[seq], length)

    def free_block(self, seq: int, j: int) -> None:
        """Give logical block j of `seq` back (its positions are never read again)."""
        self._release(self.tables[seq][j])
        self.tables[seq][j] = -1

    def free_sequence(self, seq: int) -> None:
        """The sequence finished: every block it held goes back to the pool (once no one shares it)."""
        for b in self.tables.pop(seq):
            if b >= 0:
                self._release(b)
        del self.lengths[seq]

    def take(self) -> int:
        """Hand out one free block (held once, nothing written) -> its id."""
        b = self.free.pop()
        self.refs[b], self.fill[b] = 1, 0
        return b

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.fill[b] = 0
            self.free.append(b)

    # --- accounting
    @property
    def host_nbytes(self) -> int:
        """Host bytes of the bookkeeping, measured on its structures: the lists free, refs and fill
        (their slots and the int objects they hold that Python does not share) and the block tables."""
        lists = (self.free, self.refs, self.fill, *self.tables.values())
        ints = {id(x): x for lst in lists for x in lst if not -5 <= x <= 256}  # small ints are Python's own
        return sum(sys.getsizeof(lst) for lst in lists) + sum(sys.getsizeof(x) for x in ints.values())

    @classmethod
    def host_bytes_per_block(cls, sample: int = 4096) -> float:
        """Host bytes of bookkeeping per block of a pool, measured on an empty pool of `sample` blocks
        (it grows linearly: one slot in each list, one int object per block id)."""
        return cls(sample, 1).host_nbytes / sample

    @property
    def n_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.n_blocks - len(self.free)

    @property
    def used_slots(self) -> int:
        """Token slots written, each physical slot counted once even when shared."""
        return sum(f for f, r in zip(self.fill, self.refs) if r > 0)

    @property
    def waste(self) -> float:
        """Allocated but unwritten slots / allocated slots (0 when nothing is allocated)."""
        allocated = self.n_used * self.block_size
        return 1 - self.used_slots / allocated if allocated else 0.0

    @property
    def shared_hit_rate(self) -> float:
        """Block-table entries served by a block that another sequence also holds / all entries."""
        entries = [b for t in self.tables.values() for b in t if b >= 0]
        return sum(self.refs[b] > 1 for b in entries) / len(entries) if entries else 0.0
