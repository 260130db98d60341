"""The paged (chunked) KV cache (chapter 5): a pool of fixed-size blocks and one block table per sequence.

Shapes: L layers, N blocks in the pool, bs = block_size token slots per block, B batch rows (one
sequence each), Hkv key/value heads, Dh head dim, T new tokens, n blocks read, S = n * bs key slots.

A contiguous cache reserves prompt + max_new_tokens slots per sequence up front; when sequences end
early or lengths vary, most of that reservation is never written. vLLM's PagedAttention (Kwon et al.
2023) instead hands out blocks of `block_size` tokens on demand from one preallocated pool, so a
sequence wastes at most one partly filled block. A block table maps each sequence's logical block j
(positions j*bs .. j*bs + bs - 1) to a physical block of the pool; attention reads the blocks in
table order: `update` gathers them for torch's attention, `update_blocks` hands the pool and the
tables to a kernel that reads through them without the copy (vLLM's; minigen's triton_attention.py).

Blocks are reference counted, so sequences forked from one prompt (parallel sampling) share the
prompt's blocks; a shared block that is about to be written is copied first (copy-on-write).
With a window, blocks wholly outside it (and holding no sink token) go back to the pool.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import Tensor

from ..attention import in_window
from ..errors import PositionError
from .blocks import BlockAllocator
from .contract import BlockView, key_positions, long_tensor


# ---------------------------------------------------------------- the cache (full precision)
class PagedKVCache:
    """KV cache in a pool of blocks [L, N, bs, Hkv, Dh] read through block tables.

    With input_pos [T] the rows advance in lockstep, each with its own block table, so the rows'
    tables have the same shape; with input_pos [B, T] each row writes its own positions (a ragged
    batch, or the serving engine's sequences, chosen with `select_rows` before each step). It follows
    the cache contract (contract.py, BlockCache):
    `reserve`, called before the forward by whoever owns the step, allocates, copies on write, frees
    blocks outside the window and forgets positions at or after a write that starts early (a new
    sequence or a rollback); a step the pool cannot hold raises CacheFullError before anything
    changes. `prepare` only reads the block tables, and `update` only writes into the blocks the
    rows were given and gathers.
    """
    observers = ()

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, block_size: int,
                 n_blocks: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 window_size: int | None = None, sink_tokens: int = 0, allocator: BlockAllocator | None = None):
        # the pool's bookkeeping: a caller may own it (the serving engine's prefix-caching allocator)
        self.allocator = allocator if allocator is not None else BlockAllocator(n_blocks, block_size)
        if self.allocator.n_blocks != n_blocks or self.allocator.block_size != block_size:
            raise ValueError(f"the allocator holds {self.allocator.n_blocks} blocks of {self.allocator.block_size} "
                             f"tokens; the cache was asked for {n_blocks} of {block_size}")
        self.rows = [self.allocator.add_sequence() for _ in range(batch)]  # the sequence of each row
        self.block_size, self.window_size, self.sink_tokens = block_size, window_size, sink_tokens
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._make_storage()
        self._table = self._write_slots = None  # this step's plan, set by prepare
        self._copies: Tensor | None = None  # [2, n]: the (src, dst) blocks reserve gave this step to copy on write
        self._write_index: Tensor | None = None  # per-row positions: which of the B * T tokens are written
        self._blocks = self._lens = None  # this step's logical tables [B, n] (-1: freed) and lengths [B]
        self._read: dict[str, Tensor] = {}  # "k"/"v" -> the buffer attention reads gathered blocks from
        self._peak = self.nbytes

    def _make_storage(self) -> None:
        # [L, N, bs, Hkv, Dh]: a block's slots and heads are contiguous, the layout of FlashAttention's
        # paged kernels; one gather of a block table then views as [B, S, Hkv, Dh].
        shape = (self.n_layers, self.allocator.n_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # --- blocks, before the forward: the caller that owns the step (generate's steps, the engine's scheduler)
    def reserve(self, input_pos: Tensor) -> None:
        """Give the rows the blocks that writing input_pos ([T], or [B, T] per row, -1: padding) takes,
        before the forward: forget positions at or after a write that starts early (a new sequence
        or a rollback), free blocks outside the window, allocate, copy shared blocks (copy-on-write).
        A step the pool cannot hold raises CacheFullError before anything changes."""
        self._allocate(self._spans(input_pos))
        self._peak = max(self._peak, self.nbytes)

    def _spans(self, input_pos: Tensor) -> dict[int, tuple[int, int]]:
        """Each row's sequence -> the (start, end) of the consecutive positions it writes (rows of
        padding only write nothing). One host sync per forward call."""
        if input_pos.dim() == 1:
            start, end = int(input_pos[0]), int(input_pos[-1]) + 1
            if start < 0 or end - start != input_pos.shape[0]:
                raise PositionError(f"the paged cache takes consecutive positions >= 0, got {start}..{end - 1} "
                                    f"for {input_pos.shape[0]} tokens")
            return {row: (start, end) for row in self.rows}
        pos, spans = input_pos.cpu(), {}
        for b, row in enumerate(self.rows):
            real = pos[b][pos[b] >= 0]
            if real.numel():
                start, end = int(real[0]), int(real[-1]) + 1
                if not torch.equal(real, torch.arange(start, end)):
                    raise PositionError(f"the paged cache takes consecutive positions >= 0 in each row; row {b} "
                                        f"has {real.tolist()}")
                spans[row] = (start, end)
        return spans

    def _check_reserved(self, spans: dict[int, tuple[int, int]]) -> None:
        """PositionError unless every row already holds the blocks of the positions it writes."""
        bs, alloc = self.block_size, self.allocator
        for row, (start, end) in spans.items():
            table = alloc.tables[row]
            if alloc.lengths[row] < end or any(table[j] < 0 for j in range(start // bs, math.ceil(end / bs))):
                raise PositionError(f"sequence {row} holds no blocks for positions {start}..{end - 1}: call "
                                    "cache.reserve(input_pos) before the forward (prepare only reads the block tables)")

    # --- reading the tables, once per forward call (layer independent)
    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """{ANY_LAYER: the position of each read slot}, from the block tables that `reserve` set;
        changes no block (contract.py)."""
        return key_positions(self._positions(input_pos))

    def _positions(self, input_pos: Tensor) -> Tensor:
        """The position of each read slot [S], -1 where a slot holds nothing. Per-row positions
        [B, T]: `_prepare_rows`."""
        if input_pos.dim() == 2:
            return self._prepare_rows(input_pos)
        self._write_index = None
        spans = self._spans(input_pos)
        self._check_reserved(spans)
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1
        key_pos = self._plan(start, end, [self.allocator.tables[row] for row in self.rows])
        self._peak = max(self._peak, self.nbytes)
        return key_pos

    def _prepare_rows(self, input_pos: Tensor) -> Tensor:
        """Per-row positions [B, T], -1 for padding: each row writes its own run of consecutive
        positions (or nothing) -> key positions [B, S], each row's blocks in table order, -1 where
        a slot holds nothing (rows with fewer blocks are padded)."""
        pos, alloc, bs = input_pos.cpu(), self.allocator, self.block_size  # one host sync per forward call
        self._check_reserved(self._spans(input_pos))
        # Read: each row's kept blocks, padded with block 0 (its slots marked -1, never attended).
        kept = [[j for j, b in enumerate(alloc.tables[row]) if b >= 0] for row in self.rows]
        n = max(1, max(len(k) for k in kept))
        self._table = long_tensor([[alloc.tables[row][j] for j in k] + [0] * (n - len(k))
                             for row, k in zip(self.rows, kept)], self.device)  # [B, n]
        key_pos = torch.full((len(self.rows), n * bs), -1, dtype=torch.long)
        for b, (row, k) in enumerate(zip(self.rows, kept)):
            held = (long_tensor(k)[:, None] * bs + torch.arange(bs)).flatten()
            key_pos[b, :held.numel()] = held.masked_fill(held >= alloc.lengths[row], -1)
        # Write: the pool slot of every real token, and where it sits in the flattened [B * T] batch.
        rows, cols = (pos >= 0).nonzero(as_tuple=True)
        p = pos[rows, cols]
        block = long_tensor([alloc.tables[self.rows[r]][q // bs] for r, q in zip(rows.tolist(), p.tolist())])
        self._write_slots = (block * bs + p % bs).to(self.device)
        self._write_index = (rows * pos.shape[1] + cols).to(self.device)
        self._blocks, self._lens = None, long_tensor([alloc.lengths[row] for row in self.rows], self.device)
        self._peak = max(self._peak, self.nbytes)
        return key_pos.to(self.device)

    def _allocate(self, spans: dict[int, tuple[int, int]]) -> None:
        """Give each sequence the blocks for writing positions [start, end) of `spans`: forget its
        positions >= start, free blocks outside the window, allocate -> self._copies (copy-on-write).
        Every change is worked out first, so that a step the pool cannot hold changes nothing."""
        alloc = self.allocator
        rewind = {row: a for row, (a, _) in spans.items() if alloc.lengths[row] > a}
        outside = ([(row, j) for row, (a, _) in spans.items() for j in self._outside_window(row, a)]
                   if self.window_size is not None else [])  # blocks no query from `start` on can see
        writes = [(row, a, e) for row, (a, e) in spans.items()]
        alloc.check_room(self._blocks_needed(writes, rewind, outside))  # before anything changes
        for row, a in rewind.items():
            alloc.truncate(row, a)
        for row, j in outside:
            if j < len(alloc.tables[row]) and alloc.tables[row][j] >= 0:
                alloc.free_block(row, j)
        copies = [c for row, a, e in writes for c in alloc.write(row, a, e)]
        # copied layer by layer as each layer writes (an offload tier holds only some layers at a time)
        self._copies = long_tensor(copies, self.device).T if copies else None  # [2, n_copies]: src, dst

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write's data: block src -> block dst of every layer, for each (src, dst), before the
        forward writes into dst, for copies a caller's own allocator made (contract.BlockCache)."""
        if copies:
            self._copy_layers(long_tensor(copies, self.device).T)

    def _copy_layers(self, copies: Tensor) -> None:
        """Block src -> block dst of every layer, for copies [2, n] (src, dst)."""
        src, dst = copies
        for pool in (self.k, self.v):
            pool[:, dst] = pool[:, src]

    def _outside_window(self, row: int, start: int) -> list[int]:
        """Logical blocks of `row` that no query from `start` on can see (attention.in_window is monotone)."""
        bs, out = self.block_size, []
        for j, b in enumerate(self.allocator.tables[row]):
            first, last = j * bs, j * bs + bs - 1
            # Sinks are a prefix and the window a suffix of the positions, so a block is visible
            # when its first or its last position is.
            if b >= 0 and last < start and not (in_window(first, start, self.window_size, self.sink_tokens)
                                                or in_window(last, start, self.window_size, self.sink_tokens)):
                out.append(j)
        return out

    def _blocks_needed(self, writes, rewind: dict[int, int], outside: list[tuple[int, int]]) -> int:
        """Blocks this step takes from the pool, minus the ones rewinding (row -> the position it
        rewinds to) and the window give back."""
        alloc = self.allocator
        kept = {row: math.ceil(start / self.block_size) for row, start in rewind.items()}  # blocks a rewind keeps
        need = alloc.blocks_needed(writes, kept)
        # Given back first: whole blocks after the rewind point, and blocks outside the window, each
        # once its last holder lets go (a block shared with a sequence outside this batch stays).
        holders: dict[int, int] = {}
        for row in rewind:
            for b in alloc.tables[row][kept[row]:]:
                if b >= 0:
                    holders[b] = holders.get(b, 0) + 1
        for row, j in outside:
            b = alloc.tables[row][j]
            holders[b] = holders.get(b, 0) + 1
        returned = sum(1 for b, n in holders.items() if alloc.refs[b] == n)
        return max(0, need - returned)

    def _plan(self, start: int, end: int, tables: list[list[int]]) -> Tensor:
        """Set this step's write slots and read table from the rows' block tables -> key positions [S]."""
        bs = self.block_size
        kept = [j for j, b in enumerate(tables[0]) if b >= 0]  # logical blocks still held (same in every row)
        self._table = long_tensor([[t[j] for j in kept] for t in tables], self.device)  # [B, n]
        self._blocks, self._lens = long_tensor(tables, self.device), torch.full((len(tables),), end, device=self.device)
        pos = torch.arange(start, end)
        write_blocks = long_tensor([[t[p // bs] for p in range(start, end)] for t in tables])  # [B, T]
        self._write_slots = (write_blocks * bs + pos % bs).flatten().to(self.device)  # [B*T] slots of the pool
        key_pos = (long_tensor(kept)[:, None] * bs + torch.arange(bs)).flatten()  # [S]
        return key_pos.masked_fill(key_pos >= end, -1).to(self.device)  # unwritten slots: -1

    def read_tables(self, input_pos: Tensor) -> tuple[Tensor, Tensor]:
        """For a step that reads the blocks in place (the fused C step, steps/fused.py), after `reserve`: one
        token per row at input_pos ([1] shared, or [B, 1] per row) -> (the rows' block tables [B, n], each
        row's first n logical blocks, the physical block of each; the rows' positions [B]). Every block up
        to a row's position must be held (no window has freed one): PositionError otherwise. The copies on
        write that reserve decided are made here, in every layer, before the step writes."""
        pos = (input_pos.reshape(-1) if input_pos.dim() == 2 else input_pos[:1].expand(len(self.rows))).tolist()
        alloc, bs = self.allocator, self.block_size
        if len(pos) != len(self.rows) or min(pos) < 0:
            raise PositionError(f"a step that reads the blocks in place takes one position >= 0 per row, got {pos} "
                                f"for {len(self.rows)} rows")
        n = max(pos) // bs + 1
        tables = []
        for row, p in zip(self.rows, pos):
            held = alloc.tables[row][:p // bs + 1]
            if alloc.lengths[row] <= p or len(held) <= p // bs or min(held) < 0:
                raise PositionError(f"sequence {row} holds no block for some position up to {p}: call "
                                    "cache.reserve(input_pos) before the forward (and no window may free a block "
                                    "a step reads in place)")
            tables.append(held + [0] * (n - len(held)))
        if self._copies is not None:  # copy-on-write, every layer at once: the step writes them all
            self._copy_layers(self._copies)
            self._copies = None
        return long_tensor(tables, self.device), long_tensor(pos, self.device)

    # --- storage, once per layer
    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] into their blocks; return the rows' blocks [B, Hkv, S, Dh]
        (views of a buffer that the next layer's update overwrites)."""
        return self._update_one(self.k[layer], k, "k"), self._update_one(self.v[layer], v, "v")

    def update_blocks(self, layer: int, k: Tensor, v: Tensor) -> BlockView:
        """Write k, v [B, Hkv, T, Dh] as `update` does; return the pool and the tables in place of a gather."""
        self._write(self.k[layer], k)
        self._write(self.v[layer], v)
        return BlockView(self.k[layer], self.v[layer], self._blocks, self.block_size, self._lens, self._lens)

    def _write(self, pool: Tensor, x: Tensor) -> None:
        B, Hkv, T, Dh = x.shape
        x = x.to(pool.dtype)  # stored in the cache's dtype (kv_dtype)
        if self._copies is not None:  # copy-on-write that reserve decided: each writer's own copy of a shared block
            pool[self._copies[1]] = pool[self._copies[0]]
        slots = pool.view(-1, Hkv, Dh)  # [N*bs, Hkv, Dh]
        x = rearrange(x, "b h t d -> (b t) h d")
        if self._write_index is not None:  # per-row positions: only the real tokens, not the padding
            x = x[self._write_index]
        slots.index_copy_(0, self._write_slots, x)

    def _update_one(self, pool: Tensor, x: Tensor, name: str) -> Tensor:
        B = x.shape[0]
        self._write(pool, x)
        n = self._table.shape[1]
        blocks = torch.index_select(pool, 0, self._table.flatten(), out=self._buffer(name, B * n))  # [B*n, bs, Hkv, Dh]
        return rearrange(blocks, "(b n) s h d -> b h (n s) d", b=B)  # [B, Hkv, S, Dh], S = n * bs

    def _buffer(self, name: str, n_blocks: int) -> Tensor:
        """A reused [n_blocks, bs, Hkv, Dh] buffer to gather into (grown by doubling): a fresh tensor
        per layer and step cost more than the copy itself on the machine this course is measured on
        (page faults of large allocations), and a fixed buffer is what a CUDA graph needs anyway."""
        buf = self._read.get(name)
        if buf is None or buf.shape[0] < n_blocks:
            size = max(n_blocks, 2 * buf.shape[0] if buf is not None else 1)
            shape = (size, self.block_size, self.n_kv_heads, self.head_dim)
            buf = self._read[name] = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._peak = max(self._peak, self.nbytes)
        return buf[:n_blocks]

    def layer_tensors(self) -> list[Tensor]:
        """Every tensor that holds per-layer state, layer first (what an offload tier moves)."""
        return [self.k, self.v]

    # --- sequences
    def select_rows(self, sequences: list[int]) -> None:
        """The allocator's sequences the next forward runs, one per batch row (contract.BlockCache)."""
        unknown = [s for s in sequences if s not in self.allocator.tables]
        if unknown:
            raise PositionError(f"sequences {unknown} are not in this cache's pool: add them with "
                                "allocator.add_sequence() first")
        self.rows = list(sequences)

    def add_sequence(self) -> int:
        """Start an empty sequence in this cache's pool -> its id (for `select_rows`)."""
        return self.allocator.add_sequence()

    def free_sequence(self, seq: int) -> None:
        """Give back every block of sequence `seq` and drop it from the rows."""
        self.allocator.free_sequence(seq)
        self.rows = [r for r in self.rows if r != seq]

    def write_slots(self) -> Tensor:
        """The pool slot (physical block * block_size + offset) of each token this step writes, [B * T]
        in row order (per-row positions: the real tokens only), as `prepare` set it."""
        return self._write_slots

    def fork(self, n: int) -> None:
        """Turn a batch of one sequence into n rows that share its blocks (parallel sampling)."""
        if len(self.rows) != 1:
            raise PositionError(f"fork a batch of one sequence, not {len(self.rows)}: prefill one prompt, then fork")
        self.rows += self.allocator.fork(self.rows[0], n - 1)

    def free(self) -> None:
        """Every row finished: give all blocks back to the pool."""
        for row in self.rows:
            self.allocator.free_sequence(row)
        self.rows = []

    def reset(self) -> None:
        """Forget every position: each row's blocks go back to the pool (reserve at position 0 does it too)."""
        for row in self.rows:
            self.allocator.truncate(row, 0)

    # --- accounting
    @property
    def nbytes(self) -> int:
        """Every byte held: the whole preallocated pool, the block tables (int32 entries) and the
        buffers attention reads gathered blocks from."""
        # a row's sequence may have finished since (the serving engine frees it in the allocator)
        entries = sum(len(self.allocator.tables.get(row, ())) for row in self.rows)
        return (sum(t.nbytes for t in self.layer_tensors()) + 4 * entries
                + sum(b.nbytes for b in self._read.values()))

    @property
    def peak_nbytes(self) -> int:
        return self._peak

    device_nbytes = nbytes

    @property
    def blocks(self) -> tuple[int, int]:
        """(blocks in use, blocks in the pool)."""
        return self.allocator.n_used, self.allocator.n_blocks

    @property
    def shared_hit_rate(self) -> float:
        """Block-table entries served by a block that another sequence also holds / all entries."""
        return self.allocator.shared_hit_rate
