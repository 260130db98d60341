"""The paged cache's side of a CUDA graph (vLLM's way): block tables in fixed buffers the graph reads.

Shapes: B batch rows, n table entries this step, M = max_blocks entries the buffers hold, bs block size.

A captured step reads every tensor at the address it was captured with. The pool of a paged cache
stays put, but its block tables [B, n] and lengths [B] change between steps (a new block every bs
tokens, blocks freed outside a window), and the cache builds them on the host. Under a graph they
live in StaticBlockTables instead: a table [B, M] wide enough for the longest row the graph serves
(-1 past each row's entries: never read) and lengths [B], refreshed with copy_ before a replay,
or before a chunk of replays when the cache has allocated the blocks of the chunk's positions
ahead. Inside the graph the write slots come from the table and the position on the device
(`slots`), the lengths advance with the position (`advance`), and attention reads `view`. A table
padded with -1 attends as the unpadded one: the Triton kernel skips entries < 0, and its
DecodeMetadata, planned from the view's capacity (M * bs), reads no length.

What this needs from caches/paged.py, which graphs do not drive yet (combinations.py still refuses
cuda_graphs beside cache_chunk_size):
- blocks allocated before the forward, on the host, for every position the next replays write
  (one step, or a chunk of STOP_CHECK_EVERY), with the step's tables and lengths as tensors;
- a prepare that, given positions already on the device, only reads block tables (no Python list
  turned into a tensor, no allocation), and an update_blocks whose BlockView can read tables and
  lengths bound from outside (these buffers) and write at slots computed from them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..caches.contract import BlockView
from ..errors import ConfigError


class StaticBlockTables:
    """A graph's block tables [B, M] and lengths [B] at fixed addresses; `refresh` copies a step's
    tables in (entries past n: -1), never reallocating, so a captured step keeps reading them."""

    def __init__(self, batch: int, max_blocks: int, block_size: int, device: torch.device | str):
        self.block_size = block_size
        self.table = torch.full((batch, max_blocks), -1, dtype=torch.long, device=device)  # [B, M]
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # [B] positions each row holds

    def refresh(self, table: Tensor, lens: Tensor) -> None:
        """Copy the cache's tables [B, n] (n <= M) and lengths [B] in, before a replay: device copies only."""
        B, n = table.shape
        if B != self.table.shape[0] or n > self.table.shape[1]:
            raise ConfigError(f"a graph captured for {self.table.shape[0]} rows of at most {self.table.shape[1]} "
                              f"blocks cannot take tables {tuple(table.shape)}: capture it with max_blocks >= {n}")
        self.table[:, :n].copy_(table)
        self.table[:, n:].fill_(-1)
        self.lens.copy_(lens)

    def slots(self, pos: Tensor) -> Tensor:
        """The pool slot [B] each row writes at position pos [1] (rows in lockstep), on the device:
        table[b, pos // bs] * bs + pos % bs."""
        bs = self.block_size
        block = self.table.gather(1, (pos // bs).expand(self.table.shape[0], 1))[:, 0]  # [B]
        return block * bs + pos % bs

    def advance(self) -> None:
        """Each row holds one more position (inside the graph, after a decode step's write)."""
        self.lens.add_(1)

    def view(self, k: Any, v: Any) -> BlockView:
        """One layer's pool k, v read through these tables: every position in blocks (no recent buffer)."""
        return BlockView(k, v, self.table, self.block_size, self.lens, self.lens)
