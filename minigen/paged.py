"""The paged (chunked) KV cache (chapter 3): a pool of fixed-size blocks and one block table per sequence.

Shapes: L layers, N blocks in the pool, bs = block_size token slots per block, B batch rows (one
sequence each), Hkv key/value heads, Dh head dim, T new tokens, n blocks read, S = n * bs key slots.

A contiguous cache reserves prompt + max_new_tokens slots per sequence up front; when sequences end
early or lengths vary, most of that reservation is never written. vLLM's PagedAttention (Kwon et al.
2023) instead hands out blocks of `block_size` tokens on demand from one preallocated pool, so a
sequence wastes at most one partly filled block. A block table maps each sequence's logical block j
(positions j*bs .. j*bs + bs - 1) to a physical block of the pool; attention reads the blocks in
table order (here a gather in torch; vLLM's kernel reads through the table without the copy).

Blocks are reference counted, so sequences forked from one prompt (parallel sampling) share the
prompt's blocks; a shared block that is about to be written is copied first (copy-on-write).
With a window, blocks wholly outside it (and holding no sink token) go back to the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import in_window
from .errors import CacheFullError, ConfigError
from .quant import QuantizedTensor, dequantize, quantize


# ---------------------------------------------------------------- the allocator (no tensors)
class BlockAllocator:
    """Hands out blocks of `block_size` token slots from a pool of `n_blocks`; one block table per sequence.

    Pure bookkeeping, so a serving workload can be simulated without running a model.
    """

    def __init__(self, n_blocks: int, block_size: int):
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(f"cache_chunk_size={block_size!r} is invalid: use an integer >= 1 "
                              "(tokens per block), or None for a contiguous cache")
        if not isinstance(n_blocks, int) or n_blocks < 1:
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

    def write(self, seq: int, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) of `seq` writable -> the (src, dst) block copies to make first.

        Allocates the blocks that do not exist yet; a block shared with another sequence is replaced
        by a private copy (copy-on-write), which the caller must copy before it writes.
        """
        bs, table, copies = self.block_size, self.tables[seq], []
        for j in range(start // bs, math.ceil(end / bs)):
            if j >= len(table):
                table.append(self._take())
            elif table[j] < 0:
                raise ValueError(f"position {j * bs} of sequence {seq} was freed (outside the window); "
                                 "it cannot be written again")
            elif self.refs[table[j]] > 1:  # shared: this sequence gets its own copy
                src, dst = table[j], self._take()
                self.refs[src] -= 1
                self.fill[dst] = self.fill[src]
                table[j] = dst
                copies.append((src, dst))
            self.fill[table[j]] = max(self.fill[table[j]], min(bs, end - j * bs))
        self.lengths[seq] = max(self.lengths[seq], end)
        return copies

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

    def _take(self) -> int:
        if not self.free:
            raise CacheFullError(
                f"the paged KV cache's pool of {self.n_blocks} blocks of {self.block_size} tokens is "
                f"full. Give the pool more blocks (n_blocks), lower max_new_tokens or the batch, or "
                f"set window_size so that blocks outside the window are freed.")
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


# ---------------------------------------------------------------- the cache (full precision)
def _long(rows: list, device: torch.device | str = "cpu") -> Tensor:
    """Block ids or positions from Python lists -> an int64 tensor (empty lists stay integer)."""
    return torch.tensor(rows, dtype=torch.long, device=device)



class PagedKVCache:
    """KV cache in a pool of blocks [L, N, bs, Hkv, Dh] read through block tables.

    The rows of a batch advance in lockstep (the same input_pos), each with its own block table.
    Writes must append or rewrite earlier positions; the rows' tables always have the same shape.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, block_size: int,
                 n_blocks: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 window_size: int | None = None, sink_tokens: int = 0):
        self.allocator = BlockAllocator(n_blocks, block_size)
        self.rows = [self.allocator.add_sequence() for _ in range(batch)]  # the sequence of each row
        self.block_size, self.window_size, self.sink_tokens = block_size, window_size, sink_tokens
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._make_storage()
        self._table = self._copies = None  # this step's plan, set by key_positions
        self._read = {}  # "k"/"v" -> the buffer attention reads gathered blocks from, reused by every layer

    def _make_storage(self) -> None:
        # [L, N, bs, Hkv, Dh]: a block's slots and heads are contiguous, the layout of FlashAttention's
        # paged kernels; one gather of a block table then views as [B, S, Hkv, Dh].
        shape = (self.n_layers, self.allocator.n_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    # --- bookkeeping, once per forward call (layer independent)
    def key_positions(self, input_pos: Tensor) -> Tensor:
        """Allocate (and copy-on-write) the blocks this step writes -> position of each read slot [S]."""
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1  # one host sync per forward call
        if start < 0 or end - start != input_pos.shape[0]:
            raise ValueError(f"the paged cache takes consecutive positions, got {start}..{end - 1} "
                             f"for {input_pos.shape[0]} tokens")
        if self.window_size is not None:
            self._free_outside_window(start)
        copies = [c for row in self.rows for c in self.allocator.write(row, start, end)]
        self._copies = _long(copies, self.device).T if copies else None  # [2, n_copies]: src, dst
        return self._plan(start, end, [self.allocator.tables[row] for row in self.rows])

    def _free_outside_window(self, start: int) -> None:
        """Free the blocks that no query from `start` on can see (attention.in_window is monotone)."""
        bs = self.block_size
        for row in self.rows:
            for j, b in enumerate(self.allocator.tables[row]):
                first, last = j * bs, j * bs + bs - 1
                # Sinks are a prefix and the window a suffix of the positions, so a block is visible
                # when its first or its last position is.
                if b >= 0 and not (in_window(first, start, self.window_size, self.sink_tokens)
                                   or in_window(last, start, self.window_size, self.sink_tokens)):
                    self.allocator.free_block(row, j)

    def _plan(self, start: int, end: int, tables: list[list[int]]) -> Tensor:
        """Set this step's write slots and read table from the rows' block tables -> key positions [S]."""
        bs = self.block_size
        kept = [j for j, b in enumerate(tables[0]) if b >= 0]  # logical blocks still held (same in every row)
        self._table = _long([[t[j] for j in kept] for t in tables], self.device)  # [B, n]
        pos = torch.arange(start, end)
        write_blocks = _long([[t[p // bs] for p in range(start, end)] for t in tables])  # [B, T]
        self._write_slots = (write_blocks * bs + pos % bs).flatten().to(self.device)  # [B*T] slots of the pool
        key_pos = (_long(kept)[:, None] * bs + torch.arange(bs)).flatten()  # [S]
        length = self.allocator.lengths[self.rows[0]]
        return key_pos.masked_fill(key_pos >= length, -1).to(self.device)  # unwritten slots: -1

    # --- storage, once per layer
    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh] into their blocks; return the rows' blocks [B, Hkv, S, Dh]
        (views of a buffer that the next layer's update overwrites)."""
        return self._update_one(self.k[layer], k, "k"), self._update_one(self.v[layer], v, "v")

    def _update_one(self, pool: Tensor, x: Tensor, name: str) -> Tensor:
        B, Hkv, T, Dh = x.shape
        if self._copies is not None:  # copy-on-write: give each writer its own copy of a shared block
            pool[self._copies[1]] = pool[self._copies[0]]
        slots = pool.view(-1, Hkv, Dh)  # [N*bs, Hkv, Dh]
        slots.index_copy_(0, self._write_slots, x.transpose(1, 2).reshape(B * T, Hkv, Dh))
        n = self._table.shape[1]
        blocks = torch.index_select(pool, 0, self._table.flatten(), out=self._buffer(name, B * n))  # [B*n, bs, Hkv, Dh]
        return blocks.view(B, n * self.block_size, Hkv, Dh).transpose(1, 2)  # [B, Hkv, S, Dh]

    def _buffer(self, name: str, n_blocks: int) -> Tensor:
        """A reused [n_blocks, bs, Hkv, Dh] buffer to gather into (grown by doubling): a fresh tensor
        per layer and step cost more than the copy itself on the machine this course is measured on
        (page faults of large allocations), and a fixed buffer is what a CUDA graph needs anyway."""
        buf = self._read.get(name)
        if buf is None or buf.shape[0] < n_blocks:
            size = max(n_blocks, 2 * buf.shape[0] if buf is not None else 1)
            shape = (size, self.block_size, self.n_kv_heads, self.head_dim)
            buf = self._read[name] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return buf[:n_blocks]

    def layer_tensors(self) -> list[Tensor]:
        """Every tensor that holds per-layer state, layer first (what an offload tier moves)."""
        return [self.k, self.v]

    # --- sequences
    def fork(self, n: int) -> None:
        """Turn a batch of one sequence into n rows that share its blocks (parallel sampling)."""
        if len(self.rows) != 1:
            raise ValueError(f"fork a batch of one sequence, not {len(self.rows)}")
        self.rows += self.allocator.fork(self.rows[0], n - 1)

    def free(self) -> None:
        """Every row finished: give all blocks back to the pool."""
        for row in self.rows:
            self.allocator.free_sequence(row)
        self.rows = []

    # --- accounting
    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: keys and values of block_size tokens in every layer."""
        return sum(t[:, 0].nbytes for t in self.layer_tensors())

    @property
    def nbytes(self) -> int:
        """Every byte held: the whole preallocated pool plus the block tables (int32 entries)."""
        entries = sum(len(self.allocator.tables[row]) for row in self.rows)
        return sum(t.nbytes for t in self.layer_tensors()) + 4 * entries

    @property
    def used_nbytes(self) -> int:
        """Bytes of the blocks that sequences hold now (the rest of the pool is free for others)."""
        return self.allocator.n_used * self.block_nbytes


# ---------------------------------------------------------------- quantized blocks (with chapter 4)
class QuantizedPagedKVCache(PagedKVCache):
    """A paged cache whose full blocks are stored group-wise quantized (minigen.quant).

    A block is quantized once, when its last slot is written; each row's open (partly filled) block
    waits in a full-precision tail [B, bs, Hkv, Dh], so this cache only appends. Keys are grouped per
    channel over group_size tokens (KIVI), so block_size must be a multiple of group_size; values
    per token over group_size channels. The open block plays the role of `quant_residual`.
    As in QuantizedKVCache, the tokens of the current call are attended in full precision.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, block_size: int,
                 n_blocks: int, bits: int = 4, group_size: int = 32, key_axis: str = "channel",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 window_size: int | None = None, sink_tokens: int = 0):
        if key_axis == "channel" and block_size % group_size:
            raise ConfigError(f"cache_chunk_size={block_size} is not a multiple of quant_group_size="
                              f"{group_size}: keys are quantized per channel over group_size tokens of "
                              f"one block, so use a block size of {group_size * math.ceil(block_size / group_size)}")
        if head_dim % group_size:
            raise ConfigError(f"quant_group_size={group_size} does not divide the head dim {head_dim}: "
                              f"values are grouped over channels, so use a divisor of {head_dim}")
        self.bits, self.group_size = bits, group_size
        self._start = self._length = 0  # this step writes positions [_start, _length)
        # The axis of a block [.., bs, Hkv, Dh] along which groups run: tokens (-3) or channels (-1).
        self.k_axis, self.v_axis = (-3 if key_axis == "channel" else -1), -1
        super().__init__(n_layers, batch, n_kv_heads, head_dim, block_size, n_blocks, dtype, device,
                         window_size, sink_tokens)

    def _make_storage(self) -> None:
        block = (self.n_layers, self.allocator.n_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        self.k = self._empty_store(block, self.k_axis)
        self.v = self._empty_store(block, self.v_axis)
        tail = (self.n_layers, len(self.rows), self.block_size, self.n_kv_heads, self.head_dim)  # [L, B, bs, Hkv, Dh]
        self.k_tail = torch.zeros(tail, dtype=self.dtype, device=self.device)
        self.v_tail = torch.zeros(tail, dtype=self.dtype, device=self.device)

    def _empty_store(self, shape: tuple[int, ...], axis: int) -> QuantizedTensor:
        data, meta = list(shape), list(shape)
        data[axis] //= 8 // self.bits  # codes packed along the group axis
        meta[axis] //= self.group_size  # one scale and zero per group
        return QuantizedTensor(torch.zeros(data, dtype=torch.uint8, device=self.device),
                               torch.zeros(meta, dtype=torch.float16, device=self.device),
                               torch.zeros(meta, dtype=torch.float16, device=self.device),
                               self.bits, self.group_size, axis, self.dtype)

    def _plan(self, start: int, end: int, tables: list[list[int]]) -> Tensor:
        bs = self.block_size
        j0 = start // bs
        if start != self._length:
            raise ValueError(f"the quantized paged cache only appends: it holds positions "
                             f"0..{self._length - 1} but was given {start}..{end - 1}")
        self._start, self._length = start, end
        # Read: the quantized blocks before the open one, then positions [j0 * bs, end) in full precision.
        kept = [j for j, b in enumerate(tables[0][:j0]) if b >= 0]
        self._table = _long([[t[j] for j in kept] for t in tables], self.device)  # [B, n]
        # Write: the blocks that fill up in this step get quantized into their physical blocks.
        n_full = end // bs - j0
        self._full = _long([t[j0:j0 + n_full] for t in tables], self.device)  # [B, n_full]
        old = (_long(kept)[:, None] * bs + torch.arange(bs)).flatten()
        return torch.cat([old, torch.arange(j0 * bs, end)]).to(self.device)  # [S]

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # Copy-on-write of a shared open block needs no data copy here: open blocks live in the
        # rows' private tails (copied at fork), and a full block is never written again.
        return (self._update_one_q(self.k, self.k_tail[layer], layer, k),
                self._update_one_q(self.v, self.v_tail[layer], layer, v))

    def _update_one_q(self, store: QuantizedTensor, tail: Tensor, layer: int, x: Tensor) -> Tensor:
        B, Hkv, T, Dh = x.shape
        bs = self.block_size
        j0 = self._start // bs
        recent = torch.cat([tail[:, :self._start - j0 * bs], x.transpose(1, 2)], dim=1)  # [B, end - j0*bs, Hkv, Dh]
        n_full = self._full.shape[1]
        if n_full:  # whole blocks leave the tail: quantize each once
            q = quantize(recent[:, :n_full * bs].reshape(B * n_full, bs, Hkv, Dh), self.bits, self.group_size,
                         store.axis)
            ids = self._full.flatten()
            store.data[layer, ids], store.scales[layer, ids], store.zeros[layer, ids] = q.data, q.scales, q.zeros
        rest = recent.shape[1] - n_full * bs
        tail[:, :rest] = recent[:, n_full * bs:]
        n = self._table.shape[1]
        ids = self._table.flatten()
        data, scales, zeros = (t[layer].index_select(0, ids) for t in (store.data, store.scales, store.zeros))
        old = dequantize(QuantizedTensor(data, scales, zeros, self.bits, self.group_size, store.axis,
                                         self.dtype))  # [B*n, bs, Hkv, Dh]
        out = torch.cat([old.view(B, n * bs, Hkv, Dh), recent], dim=1)  # [B, S, Hkv, Dh]
        return out.transpose(1, 2)  # [B, Hkv, S, Dh]

    def layer_tensors(self) -> list[Tensor]:
        return [self.k.data, self.k.scales, self.k.zeros, self.v.data, self.v.scales, self.v.zeros,
                self.k_tail, self.v_tail]

    def fork(self, n: int) -> None:
        super().fork(n)
        # Each row gets a private copy of the open block now (it is the next one written anyway).
        self.k_tail = self.k_tail[:, [0] * n].clone()
        self.v_tail = self.v_tail[:, [0] * n].clone()


# ---------------------------------------------------------------- from a GenerationConfig
def paged_cache_for(model, config, batch: int, max_len: int, n_layers: int | None = None,
                    n_blocks: int | None = None) -> PagedKVCache:
    """The paged cache `config` asks for (cache_chunk_size set; quant_bits, window_size optional).

    The pool defaults to what `batch` sequences of max_len tokens can need; `n_layers` below the
    model's is for an offload tier that keeps only the layers in flight on the device.
    """
    c, bs = model.config, config.cache_chunk_size
    n_blocks = n_blocks or batch * math.ceil(max_len / bs)
    window = config.window_size
    sinks = config.sink_tokens if window is not None else 0
    common = dict(dtype=model.dtype, device=model.device, window_size=window, sink_tokens=sinks)
    if config.quant_bits is not None:
        return QuantizedPagedKVCache(n_layers or c.n_layers, batch, c.n_kv_heads, c.head_dim, bs, n_blocks,
                                     config.quant_bits, config.quant_group_size, config.quant_key_axis,
                                     **common)
    return PagedKVCache(n_layers or c.n_layers, batch, c.n_kv_heads, c.head_dim, bs, n_blocks, **common)


# ---------------------------------------------------------------- prefix sharing: parallel sampling
@dataclass
class ParallelSample:
    tokens: Tensor  # [n, T + new]: the prompt followed by each sample's new tokens
    blocks_after_fork: int  # physical blocks held right after the fork (the prompt's, shared)
    blocks_used: int  # physical blocks held at the end
    blocks_unshared: int  # blocks n separate caches would hold at the end
    shared_hit_rate: float  # block-table entries served by a shared block, at the end


def parallel_sample(model, input_ids: Tensor, n: int, config=None, **overrides) -> ParallelSample:
    """Prefill one prompt [1, T] once, fork it into n rows that share its blocks, sample each row.

    Every row runs max_new_tokens (stop tokens are ignored). cache_chunk_size defaults to 16.
    """
    # generate.py builds paged caches, so the loop's functions are imported here to avoid a cycle.
    from .config import resolve_config
    from .generate import decode_step, make_policy, prefill, sample

    config = resolve_config(config, overrides)
    if config.cache_chunk_size is None:
        config = config.replace(cache_chunk_size=16)
    T, new, bs = input_ids.shape[1], config.max_new_tokens, config.cache_chunk_size
    unshared = n * math.ceil((T + new) / bs)
    cache = paged_cache_for(model, config, 1, T + new, n_blocks=unshared)
    policy = make_policy(config, cache)
    generator = torch.Generator(device=input_ids.device).manual_seed(config.seed or 0)
    with torch.inference_mode():
        logits = prefill(model, input_ids, cache, policy).expand(n, -1)  # [n, V]: one prompt, n rows
        cache.fork(n)
        after_fork = cache.allocator.n_used
        out = [input_ids.expand(n, -1)]
        for i in range(new):
            token = sample(logits, config, generator)  # [n]
            out.append(token[:, None])
            if i < new - 1:
                logits = decode_step(model, token[:, None], torch.tensor([T + i], device=input_ids.device),
                                     cache, policy)
    result = ParallelSample(torch.cat(out, dim=1), after_fork, cache.allocator.n_used, unshared,
                            cache.allocator.shared_hit_rate)
    cache.free()
    return result
