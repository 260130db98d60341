"""Offloading the KV cache to a second memory tier, fetching layers ahead (chapter 5).

Shapes: L layers, P = prefetch_depth, P + 1 device slots (each holds one layer's cache state).

When the KV cache outgrows GPU memory, FlexGen (Sheng et al. 2023) and DeepSpeed-Inference keep it
in CPU memory and bring each layer's keys and values in just before that layer runs. Layer l needs
its cache only while it runs, so the device holds P + 1 layers: before layer l runs, layers
l .. l+P are made resident, and the copy of layer l+P overlaps the compute of layers l .. l+P-1.
Layer l+P takes the slot of layer l-1, whose updated state is first written back.

On a GPU the copies run on a side `torch.cuda.Stream` from pinned host memory with events ordering
them against the compute; on a CPU the second tier is another host buffer and the copies are
synchronous, so the schedule (which layer moves when) runs and is tested anywhere.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..errors import ConfigError
from .contract import one_vector
from .hybrid import HybridKVCache, HybridPagedKVCache


class OffloadedKVCache:
    """Wraps a cache built with P + 1 layers (`inner`): its per-layer state becomes device slots, and
    every layer's state lives in the second tier. Any cache of the contract (cache.py) whose
    `prepare` leaves per-layer state alone can be wrapped: contiguous, ring buffer, quantized,
    paged (build and fork it before wrapping: the wrapper holds its tensors). Heavy hitters
    cannot: they compact every layer at once (config.py refuses the pair). Nor can the hybrid
    caches: their tensors are per part (full layers, sliding rings), not per model layer, so
    make_cache offloads a KVCache on a model with sliding layers and the model masks them."""

    def __init__(self, inner, n_layers: int, prefetch_depth: int):
        if isinstance(inner, (HybridKVCache, HybridPagedKVCache)):
            # its tensors are per part (full layers, sliding rings), not per model layer: the tier
            # would move a sliding layer's ring into a full layer's slot
            raise ConfigError(f"OffloadedKVCache cannot wrap a {type(inner).__name__}: it keeps full and sliding "
                              "layers in separate parts, and the tier moves one model layer per slot. Fix: wrap a "
                              "KVCache of min(n_layers, prefetch_depth + 1) layers (the model masks each sliding "
                              "layer), as make_cache does with prefetch_depth")
        self.inner, self.n_layers, self.depth = inner, n_layers, prefetch_depth
        self.slots = inner.layer_tensors()  # each [P + 1, ...] on the device
        self.n_slots = self.slots[0].shape[0]
        if self.n_slots != min(n_layers, prefetch_depth + 1):
            raise ConfigError(f"the inner cache has {self.n_slots} layers; build it with "
                             f"min(n_layers, prefetch_depth + 1) = {min(n_layers, prefetch_depth + 1)}")
        self.cuda = self.slots[0].device.type == "cuda"
        # The second tier: every layer's state [L, ...], pinned so that copies can be asynchronous.
        self.tier = [torch.zeros((n_layers, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda)
                     for t in self.slots]
        self.resident: list[int | None] = [None] * self.n_slots  # the layer each slot holds
        self.dirty = [False] * self.n_slots  # the slot was written since it was fetched
        self.log: list[tuple[str, int]] = []  # ("fetch" | "write_back", layer), in the order issued
        self.stream = torch.cuda.Stream(self.slots[0].device) if self.cuda else None
        self.ready: list[torch.cuda.Event | None] = [None] * self.n_slots  # a slot's fetch is done

    @property
    def observers(self):
        return self.inner.observers

    def reserve(self, input_pos: Tensor) -> None:
        one_vector(input_pos, self)
        self.inner.reserve(input_pos)  # blocks are layer independent

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        one_vector(input_pos, self)  # the tier moves one batch's layers in lockstep
        return self.inner.prepare(input_pos)  # block tables and positions are layer independent

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Make layers layer .. layer+P resident, wait for this one, then update it in its slot."""
        for ahead in range(layer, min(layer + self.depth, self.n_layers - 1) + 1):
            self._fetch(ahead)
        slot = layer % self.n_slots
        if self.ready[slot] is not None:  # the compute stream waits for this slot's copy only
            torch.cuda.current_stream().wait_event(self.ready[slot])
        self.dirty[slot] = True
        return self.inner.update(slot, k, v)

    def _fetch(self, layer: int) -> None:
        """Bring `layer` into its slot (l mod P+1), writing back the layer the slot held."""
        slot = layer % self.n_slots
        if self.resident[slot] == layer:
            return
        old, side = self.resident[slot], contextlib.nullcontext()
        if self.cuda:
            # The side stream may overwrite the slot only after the compute queued so far (the old
            # layer's attention reads it) has run.
            compute_done = torch.cuda.Event()
            compute_done.record()
            self.stream.wait_event(compute_done)
            side = torch.cuda.stream(self.stream)
        with side:
            if old is not None and self.dirty[slot]:
                for dev, host in zip(self.slots, self.tier):
                    host[old].copy_(dev[slot], non_blocking=True)
                self.log.append(("write_back", old))
            for dev, host in zip(self.slots, self.tier):
                dev[slot].copy_(host[layer], non_blocking=True)
            self.log.append(("fetch", layer))
        if self.cuda:
            self.ready[slot] = torch.cuda.Event()
            self.ready[slot].record(self.stream)
        self.resident[slot], self.dirty[slot] = layer, False

    def reset(self) -> None:
        self.inner.reset()  # positions forgotten; the stale state left in the tier is masked by them

    def layer_tensors(self) -> list[Tensor]:
        return self.tier

    # --- accounting
    @property
    def layer_nbytes(self) -> int:
        """Bytes one transfer moves: one layer's whole cache state."""
        return sum(t[0].nbytes for t in self.slots)

    @property
    def transfers(self) -> int:
        return len(self.log)

    @property
    def device_nbytes(self) -> int:
        """Bytes on the device: the P + 1 slots (plus what the inner cache keeps besides)."""
        return self.inner.nbytes

    @property
    def nbytes(self) -> int:
        """Every byte held, in both tiers."""
        return self.inner.nbytes + sum(t.nbytes for t in self.tier)

    @property
    def peak_nbytes(self) -> int:
        return self.inner.peak_nbytes + sum(t.nbytes for t in self.tier)

    @property
    def blocks(self) -> tuple[int, int] | None:
        return self.inner.blocks
