"""Chapter 5 exercises: the allocator's write with copy-on-write, reading through a block table, and
what prefix sharing saves.

1. `write(alloc, seq, start, end)`: make positions [start, end) of sequence `seq` writable in the
   BlockAllocator `alloc`, as `BlockAllocator.write` does, and return the (src, dst) block copies
   to make first. For each logical block j the positions touch, in order (j from start // bs to the
   block holding end - 1): a block the table does not reach yet is taken from the pool and appended;
   a block shared with another sequence (`alloc.refs[b] > 1`) is replaced in this sequence's table
   by a fresh block, which inherits the source's `fill`, while the source loses one holder; the last
   holder of a block writes in place. Then record the slots written in `alloc.fill` of the block
   (the most of what it held and `end - j * bs`, at most bs) and the sequence's length in
   `alloc.lengths`. Take every block with `alloc.take()` (it pops the free stack and sets the
   block's count to 1 and its fill to 0). The checker's pool never runs out and never holds a freed
   position, so leave out the room check and the window.
2. `slot_of(block_table, position, block_size)`: the index, in the pool flattened to
   [n_blocks * block_size] slots, of the slot that holds `position` of a sequence whose logical
   block j lives in physical block block_table[j].
3. `blocks_held(prompt_len, new_tokens, n, block_size)`: the physical blocks held after one prompt
   of prompt_len tokens is forked into n sequences that each write new_tokens more tokens
   (blocks are shared while unchanged and copied when a shared block is written).
"""

from __future__ import annotations

import math
import random

import torch

from ...caches.paged import PagedKVCache
from ...caches.blocks import BlockAllocator
from . import ExerciseFailed, compare, forbidding, known_mistake


def answers(fn, cases, solution, *package):
    """fn(*args) for each case, with the package's own `package` functions and the worked solution
    (unless fn is it) patched to raise; the checker compares them, hints included, outside the patch."""
    with forbidding(*package, *(() if fn is solution else (solution,))):
        got = [fn(*args) for _, args, _ in cases]
    return iter(got)


# ---------------------------------------------------------------- 1. the allocator's write (copy-on-write)
def solution_write(alloc: BlockAllocator, seq: int, start: int, end: int) -> list[tuple[int, int]]:
    """New blocks where the table ends; a private copy of a shared block; the last holder in place."""
    bs, table, copies = alloc.block_size, alloc.tables[seq], []
    for j in range(start // bs, math.ceil(end / bs)):  # every block the positions touch, the last partial one too
        if j >= len(table):
            table.append(alloc.take())
        elif alloc.refs[table[j]] > 1:  # another sequence reads this block: write into a copy
            src, dst = table[j], alloc.take()
            alloc.refs[src] -= 1
            alloc.fill[dst] = alloc.fill[src]  # the copy holds what the source held
            table[j] = dst
            copies.append((src, dst))
        alloc.fill[table[j]] = max(alloc.fill[table[j]], min(bs, end - j * bs))
    alloc.lengths[seq] = max(alloc.lengths[seq], end)
    return copies


# The scripted history of a pool (block size 4): ("write", seq, start, end), ("fork", seq, n) or
# ("truncate", seq, length). Sequence ids are handed out in order: 0 is the first added.
WRITE_SCRIPT = [
    ("add",), ("write", 0, 0, 10),  # a prompt of 10 tokens: two full blocks and a partial one
    ("add",), ("write", 1, 0, 5),  # another request
    ("fork", 0, 2),  # two parallel samples share the prompt's three blocks: sequences 2 and 3
    ("write", 2, 10, 11),  # the first writer of the shared partial block copies it
    ("write", 3, 10, 13),  # so does the second (the block is still shared with sequence 0)
    ("write", 0, 10, 11),  # sequence 0 is now the last holder: it writes in place
    ("write", 3, 13, 17),  # past the end of the table: new blocks, no copy
    ("write", 1, 5, 6),  # a private block: in place
    ("fork", 3, 1), ("truncate", 4, 9),  # a draft rolled back to 9 tokens, its block still shared
    ("write", 4, 9, 10),  # copies a block that its source had filled further than this write
    ("fork", 0, 1), ("write", 5, 0, 12),  # rewriting a whole shared prefix copies every block
]


def _replay(write) -> list[tuple]:
    """Run WRITE_SCRIPT on a fresh pool with `write` -> the allocator's state after each write."""
    alloc, states = BlockAllocator(n_blocks=32, block_size=4), []
    for op, *args in WRITE_SCRIPT:
        if op == "add":
            alloc.add_sequence()
        elif op == "fork":
            alloc.fork(*args)
        elif op == "truncate":
            alloc.truncate(*args)
        else:
            copies = write(alloc, *args)
            states.append((op, args, copies, {s: list(t) for s, t in alloc.tables.items()}, list(alloc.refs),
                           list(alloc.fill), dict(alloc.lengths), list(alloc.free)))
    return states


def _write_hint(want: tuple, got: tuple) -> str:
    _, (seq, start, end), w_copies, w_tables, w_refs, w_fill, w_lengths, _ = want
    _, _, g_copies, g_tables, g_refs, g_fill, g_lengths, _ = got
    if g_copies == [(d, s) for s, d in w_copies] and w_copies:
        return "return (src, dst) pairs: the block to copy from, then the new one"
    if len(g_tables[seq]) < len(w_tables[seq]):
        return ("the blocks touched run from start // block_size to the block of end - 1: a partly written "
                "last block counts (round end / block_size up)")
    if not g_copies and w_copies:
        return "a block shared with another sequence (refs > 1) must be copied before it is written"
    if len(g_copies) > len(w_copies):
        return "the last holder of a block (refs == 1) writes in place: a copy would waste a block"
    if g_tables == w_tables and g_refs != w_refs:
        return "the source block loses this sequence as a holder: decrement its reference count"
    if g_tables == w_tables and g_fill != w_fill:
        return "a copy holds everything its source held: its fill starts at the source's"
    if g_lengths != w_lengths:
        return "record the sequence's new length (the most of its old length and end)"
    return ""


def check_write(fn) -> bool:
    """fn(alloc, seq, start, end) -> copies, leaving `alloc` as BlockAllocator.write does, step by step."""
    want = _replay(lambda alloc, *args: alloc.write(*args))
    with forbidding(BlockAllocator.write, BlockAllocator.claim, *(() if fn is solution_write else (solution_write,))):
        got = _replay(fn)
    for w, g in zip(want, got):
        if w != g:
            (_, (seq, start, end), w_copies, w_tables, w_refs, *_), (_, _, g_copies, g_tables, g_refs, *_) = w, g
            hint = _write_hint(w, g)
            raise ExerciseFailed(f"write: after write(seq {seq}, {start}, {end}) the allocator differs: "
                                 f"expected copies {w_copies} and tables {w_tables}, got copies {g_copies} "
                                 f"and tables {g_tables} (refs {g_refs[:16]}, expected {w_refs[:16]})"
                                 + (f". Hint: {hint}" if hint else ""))
    print(f"✓ write: all {len(want)} writes of the script leave the allocator as BlockAllocator.write does")
    return True


# ---------------------------------------------------------------- 2. the block-table lookup
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

    got = answers(fn, cases, solution_slot_of, PagedKVCache.prepare)
    return compare("slot_of", cases, lambda *args: next(got), hints)


def _slot_by_package(table: list[int], position: int, block_size: int) -> int:
    """The slot PagedKVCache writes `position` to, when its sequence's block table is `table`."""
    alloc = BlockAllocator(max(table) + 1, block_size)
    seq = alloc.add_sequence()
    alloc.share(seq, table)  # the sequence holds exactly these blocks, in this order
    cache = PagedKVCache(1, 0, 1, 1, block_size, alloc.n_blocks, allocator=alloc)
    cache.select_rows([seq])
    cache.prepare(torch.tensor([position]))
    return int(cache.write_slots()[0])


# ---------------------------------------------------------------- 3. prefix sharing
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

    got = answers(fn, cases, solution_blocks_held)
    return compare("blocks_held", cases, lambda *args: next(got), hints)
