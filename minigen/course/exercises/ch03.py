"""Chapter 3 exercises: reading through a block table, and what prefix sharing saves.

1. `slot_of(block_table, position, block_size)`: the index, in the pool flattened to
   [n_blocks * block_size] slots, of the slot that holds `position` of a sequence whose logical
   block j lives in physical block block_table[j].
2. `blocks_held(prompt_len, new_tokens, n, block_size)`: the physical blocks held after one prompt
   of prompt_len tokens is forked into n sequences that each write new_tokens more tokens
   (blocks are shared while unchanged and copied when a shared block is written).
"""

from __future__ import annotations

import math
import random

from ...caches.paged import PagedKVCache
from ...caches.blocks import BlockAllocator
from . import compare, known_mistake


# ---------------------------------------------------------------- 1. the block-table lookup
def solution_slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Logical block position // block_size, found in the table; the offset inside it is the rest."""
    return block_table[position // block_size] * block_size + position % block_size


def check_slot_of(fn) -> bool:
    """fn(block_table, position, block_size) -> int, the slot that a PagedKVCache writes the position to."""
    rng = random.Random(3)
    cases = []
    for block_size in (1, 4, 16, 256):
        pool = list(range(64))
        rng.shuffle(pool)  # blocks handed out in any order, as after other sequences come and go
        table = pool[:8]
        for position in rng.sample(range(8 * block_size), min(4, 8 * block_size)):
            cases.append((f"table {table}, position {position}, block size {block_size}",
                          (table, position, block_size), _slot_by_package(table, position, block_size)))

    def hints(args, got):
        table, position, bs = args
        return known_mistake(got, [
            (position, "the slot is not the position: look the block up in the table"),
            (table[position // bs] + position % bs, "multiply the physical block by block_size"),
            (table[position % bs] * bs + position // bs if position % bs < len(table) else None,
             "the logical block is position // block_size and the offset position % block_size"),
        ])

    return compare("slot_of", cases, fn, hints)


def _slot_by_package(table: list[int], position: int, block_size: int) -> int:
    """The slot PagedKVCache writes `position` to, when its sequence's block table is `table`."""
    cache = PagedKVCache(1, 1, 1, 1, block_size, n_blocks=max(table) + 1)
    cache.allocator.lengths[cache.rows[0]] = position + 1
    cache._plan(position, position + 1, [table])
    return int(cache._write_slots[0])


# ---------------------------------------------------------------- 2. prefix sharing
def solution_blocks_held(prompt_len: int, new_tokens: int, n: int, block_size: int) -> int:
    """The prompt's full blocks are stored once; its partly filled block is copied by each sequence
    that writes into it, and every block after it is private."""
    shared = prompt_len // block_size
    per_sequence = math.ceil((prompt_len + new_tokens) / block_size)
    if new_tokens == 0:  # nobody wrote: even the partial block is still shared
        return per_sequence
    return shared + n * (per_sequence - shared)


def _blocks_by_allocator(prompt_len: int, new_tokens: int, n: int, block_size: int) -> int:
    """Run the package's allocator: prefill, fork, then each sequence writes its tokens one by one."""
    alloc = BlockAllocator(n * math.ceil((prompt_len + new_tokens) / block_size) + 1, block_size)
    first = alloc.add_sequence()
    alloc.write(first, 0, prompt_len)
    rows = [first] + alloc.fork(first, n - 1)
    for p in range(prompt_len, prompt_len + new_tokens):
        for row in rows:
            alloc.write(row, p, p + 1)
    return alloc.n_used


def check_blocks_held(fn) -> bool:
    """fn(prompt_len, new_tokens, n, block_size) -> int, the blocks BlockAllocator holds."""
    cases = [(f"prompt {T}, {w} new tokens, n = {n}, block size {bs}", (T, w, n, bs), _blocks_by_allocator(T, w, n, bs))
             for T, w, n, bs in ((100, 20, 4, 16), (96, 20, 4, 16), (100, 0, 4, 16), (37, 9, 3, 3),
                                 (500, 100, 8, 256), (10, 50, 2, 1))]

    def hints(args, got):
        T, w, n, bs = args
        per = math.ceil((T + w) / bs)
        return known_mistake(got, [
            (n * per, "the prompt's full blocks are shared, not copied per sequence"),
            (math.ceil(T / bs) + n * (per - math.ceil(T / bs)),
             "the prompt's partly filled block is copied on write by every sequence that writes into it"),
            (per, "each sequence's new tokens need their own blocks"),
        ])

    return compare("blocks_held", cases, fn, hints)
