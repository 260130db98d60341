"""The cache contract: what every KV cache promises (the Protocol), and the pieces every cache
shares (the block view a kernel reads, position checks). `make.py` builds the cache a config selects.

Shapes: L layers, B batch rows, Hkv key/value heads, T new tokens, S key slots, Dh head dim.

A forward pass uses a cache in three moves:

    cache.reserve(input_pos)                  before the forward, by whoever owns the step
    key_pos = cache.prepare(input_pos)        once per forward, before the first layer
    k, v = cache.update(layer, k_new, v_new)  once per layer

`reserve(input_pos)` is the only place where a cache's blocks move: a paged cache forgets the
positions at or after the write, frees the blocks outside its window, allocates and decides the
copies on write there, and raises CacheFullError, changing nothing, when its pool cannot hold the
step; a preallocated cache has nothing to do. The owner calls it: generate's steps before each
forward (steps/eager.py), the serving engine's scheduler before each of its forwards.
`prepare(input_pos)` never allocates or frees a block: it reads the block tables (and evicts,
rotates a ring buffer or compacts, in the caches that keep no blocks) and returns the position each
key slot holds after this step's write, always as {layer type: positions}: `{ANY_LAYER: p}` when
every layer holds the same slots, with p `[S]` (the same for every row) or `[B, S]` (rows that
hold different positions), -1 for an empty slot (`positions_of` reads a layer's entry). Attention
masks are built from these positions (attention.py), so a cache may store its slots in any order.

input_pos is [T], one position vector for every row, or [B, T], each row at its own positions
with -1 for padding (a ragged batch, the serving engine): padding is never written and never attended. The contiguous, paged and ring-buffer caches take
[B, T] themselves; the quantized caches (a per-batch full-precision window) refuse it
(PositionError), and `make_cache(..., ragged=True)` runs one of them per row (rowwise.py); the
features that cannot take per-row positions are refused up front (places.RAGGED_REFUSED).
A write that starts at position p forgets every position >= p that the cache held (a paged cache
at `reserve`): a cache reused for a new sequence (p = 0) never shows the old one's keys.
A cache whose layers hold different slots (hybrid.py: a model's sliding and full layers) returns one
entry per layer type, {"full_attention": ..., "sliding_attention": ...}.

`update(layer, k, v)` writes the new keys and values [B, Hkv, T, Dh] where `prepare` decided (a
paged cache: into the blocks `reserve` gave, after the layer's copies on write) and returns what
attention reads, [B, Hkv, S, Dh]. It touches only that layer's state.

`nbytes` is every byte the cache holds between steps (on all tiers, metadata included; a
preallocated cache counts its whole allocation); `peak_nbytes` the most it has held at any moment,
the short-lived tensors of a step included. `device_nbytes` is the part on the model's device.
`blocks` is (blocks in use, blocks in the pool) for a paged cache, None otherwise. `observers`
are the attention observers the cache needs to see (heavy hitters learn from attention); none for
most. `layer_tensors()` lists the per-layer state, layer first, which an offload tier moves and the
fused C step reads through its addresses. The contiguous cache, the ring and the hybrid cache also
`reorder_rows(index)`: row b takes what row index[b] held, in place (beam search, beam.py); the
others keep per-row state (block tables, codes, evictions) that beam search would have to move too.

A paged cache (BlockCache) also names its sequences and blocks: `select_rows`, `add_sequence`,
`free_sequence`, `fork(n)` (one row into n that share its blocks), `free()` (every row's blocks back),
`copy_blocks` (the data of copies on write that an owner's own allocator decided), `write_slots()`
(the pool slot of each token `prepare` placed) and `shared_hit_rate`.

The contiguous cache and the ring buffer keep positions on the device and run a decode step
(T = 1) without a host sync or a Python list: what torch.compile(fullgraph=True) and CUDA graphs
need. The others sync once per step (block tables, eviction), which is their bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..errors import PLAN_HINT, CacheFullError, PositionError


@dataclass
class BlockView:
    """One layer's keys and values as a kernel reads them in place: blocks through the block table,
    then the newest positions from a full-precision buffer (triton_attention.py draws the layout)."""
    k: Any  # the pool [N, bs, Hkv, Dh], or a quant.QuantizedTensor of that shape (codes, scales, zeros)
    v: Any  # like k
    block_table: Tensor  # [B, n] the physical block of each row's logical block j; -1: freed (outside the window)
    block_size: int  # bs, token slots per block
    seq_lens: Tensor  # [B] positions each row holds (0 .. seq_len - 1); its query sits at seq_len - 1
    recent_start: Tensor  # [B] positions from here on are read from recent_k / recent_v, not from blocks
    recent_k: Tensor | None = None  # [B, R, Hkv, Dh] full precision: positions recent_start .. seq_len - 1
    recent_v: Tensor | None = None  # like recent_k; None when every position sits in the blocks


@runtime_checkable
class Cache(Protocol):
    """What every KV cache implements (the module docstring says what each member promises)."""

    observers: tuple[Callable[[int, Tensor], None], ...]  # attention.AttentionObserver: (layer, probs)

    def reserve(self, input_pos: Tensor) -> None: ...

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]: ...

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def reset(self) -> None: ...

    def layer_tensors(self) -> list[Tensor]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def peak_nbytes(self) -> int: ...

    @property
    def device_nbytes(self) -> int: ...

    @property
    def blocks(self) -> tuple[int, int] | None: ...


@runtime_checkable
class BlockCache(Cache, Protocol):
    """A cache of paged blocks, which a kernel may read in place (attention_backend='triton').

    `update_blocks(layer, k, v)` writes as `update` does and returns the layer's storage as it
    lies, a BlockView (the pool, the block tables, the full-precision recent positions), instead of
    gathering it. `select_rows(sequences)` says which of the pool's sequences the next forward runs,
    one per batch row: a caller that owns the pool (the serving engine) changes its rows between
    steps this way, never by setting attributes. The module docstring says what the rest promise."""

    def update_blocks(self, layer: int, k: Tensor, v: Tensor) -> BlockView: ...

    def select_rows(self, sequences: list[int]) -> None: ...

    def add_sequence(self) -> int: ...

    def free_sequence(self, seq: int) -> None: ...

    def fork(self, n: int) -> None: ...

    def free(self) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None: ...

    def write_slots(self) -> Tensor: ...

    @property
    def shared_hit_rate(self) -> float: ...


# ---------------------------------------------------------------- what the caches share
ANY_LAYER = "any_layer"  # prepare's key when every layer holds the same slots


def key_positions(positions: Tensor) -> dict[str, Tensor]:
    """prepare's answer of a cache whose every layer holds the same slots: {ANY_LAYER: positions}."""
    return {ANY_LAYER: positions}


def positions_of(key_pos: dict[str, Tensor], kind: str) -> Tensor:
    """The key positions a layer of type `kind` reads in prepare's answer (its own entry, else ANY_LAYER's)."""
    return key_pos[kind] if kind in key_pos else key_pos[ANY_LAYER]



def long_tensor(rows: list, device: torch.device | str = "cpu") -> Tensor:
    """Block ids or positions from Python lists -> an int64 tensor (empty lists stay integer)."""
    return torch.tensor(rows, dtype=torch.long, device=device)


def check_fits(input_pos: Tensor, capacity: int) -> None:
    """Raise CacheFullError when positions reach past `capacity` slots.

    Only for positions in host memory and outside torch.compile: reading a CPU tensor is no device
    sync, while on a GPU the check would stall every step (generate sizes its caches up front).
    """
    if input_pos.device.type != "cpu" or torch.compiler.is_compiling():
        return
    if input_pos.numel() == 1:  # a decode step: one read, not two reductions (each costs a cold dispatch)
        first = last = int(input_pos)
    else:
        first, last = int(input_pos.min()), int(input_pos.max())
    if first < 0:
        raise CacheFullError(f"positions must be >= 0, got {first}")
    if last >= capacity:
        raise CacheFullError(f"the KV cache holds {capacity} tokens but position {last} was written. "
                             f"Allocate a cache of at least {last + 1} tokens (prompt + max_new_tokens). "
                             + PLAN_HINT.replace("--context N", f"--context {last + 1}"))


def one_vector(input_pos: Tensor, cache) -> None:
    """Refuse per-row positions [B, T] in a cache that takes one position vector [T] for all rows."""
    if input_pos.dim() != 1:
        raise PositionError(f"{type(cache).__name__} takes one position vector [T] for all rows, got "
                            f"{tuple(input_pos.shape)}: for per-row positions build the cache with "
                            "make_cache(..., ragged=True), which runs one such cache per row (rowwise.py)")
