"""The article's batching (chapter 14): group requests by length, pad each batch to its longest
prompt with a cap of 256, queue requests in a bounded ring buffer, and count what padding wastes.

Shapes: B rows in a batch, L the padded length (the batch's longest prompt).

    RequestQueue(capacity)        a ring buffer: put() refuses or blocks when full, never drops
    group_by_length(lengths, B)   -> batches of indices, sorted by length, padding capped at 256
    pad_batch(prompts)            -> PaddedBatch: tokens [B, L] left-padded, mask [B, L], lengths
    padding_waste(batches, ...)   -> PaddingWaste: padded slots / all slots, and the KV bytes they hold

A static batch runs every row through the same forward: a row shorter than the longest is padded,
and each pad is a token slot that is computed, and whose keys and values are cached, for nothing.
Sorting by length before cutting batches puts similar lengths together, so there is usually less
padding (not always: tests/test_batching.py has a counterexample).

Prompts longer than the cap. The article caps padding at 256 tokens; it does not say what happens
to a longer prompt, and truncating it would silently change the request. Here the cap bounds the
*padding*, never the prompt: `group_by_length` gives every prompt longer than `pad_cap` a batch of
its own (padded length = its own length, zero padding), and `pad_batch` refuses, with a
PromptError naming the lengths, to pad other prompts up to one. No prompt is ever cut or dropped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

import torch
from torch import Tensor

from ..errors import ConfigError, PromptError, QueueFullError

PAD_CAP = 256  # the article's cap on a batch's padded length, in tokens

T = TypeVar("T")


# ---------------------------------------------------------------- the request queue
class RequestQueue(Generic[T]):
    """A bounded FIFO ring buffer of requests, safe to share between threads.

    `capacity` slots are allocated once; `head` is the oldest request and `count` how many wait.
    A full queue applies backpressure instead of dropping: `put(item)` raises QueueFullError (the
    caller retries or sheds load, knowingly), and `put(item, block=True, timeout=s)` waits for a
    slot, raising QueueFullError only when `timeout` seconds pass without one.
    """

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigError(f"RequestQueue capacity {capacity!r} is invalid: use an integer >= 1 "
                              "(the requests that may wait at once)")
        self.capacity = capacity
        self._slots: list[T | None] = [None] * capacity
        self._head = 0  # index of the oldest waiting request
        self._count = 0
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return self._count

    def full(self) -> bool:
        return self._count == self.capacity

    def put(self, item: T, *, block: bool = False, timeout: float | None = None) -> None:
        """Append `item` at the tail. Full queue: raise QueueFullError (block=False), or wait for a
        slot, at most `timeout` seconds (None: as long as it takes)."""
        if timeout is not None and (not block or timeout < 0):
            raise ConfigError(f"put(timeout={timeout!r}) needs block=True and a timeout >= 0 (seconds)")
        with self._changed:
            if self._count == self.capacity:
                if not block:
                    raise QueueFullError(
                        f"the request queue is full: {self._count} of {self.capacity} slots wait; nothing was "
                        "dropped and this request was not added. Retry after the server takes some "
                        "(get), pass block=True (optionally with a timeout), or make the queue larger")
                deadline = None if timeout is None else time.monotonic() + timeout
                while self._count == self.capacity:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise QueueFullError(
                            f"the request queue stayed full for {timeout} s: {self._count} of {self.capacity} "
                            "slots wait and none was freed; this request was not added (nothing was dropped). "
                            "Wait longer, take requests faster, or make the queue larger")
                    self._changed.wait(left)
            self._slots[(self._head + self._count) % self.capacity] = item
            self._count += 1
            self._changed.notify_all()

    def get(self, n: int = 1) -> list[T]:
        """Remove and return up to `n` of the oldest requests, oldest first ([] when empty)."""
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"get({n!r}): take an integer >= 1 requests")
        with self._changed:
            taken = []
            for _ in range(min(n, self._count)):
                taken.append(self._slots[self._head])
                self._slots[self._head] = None  # the queue no longer holds it
                self._head = (self._head + 1) % self.capacity
                self._count -= 1
            if taken:
                self._changed.notify_all()  # wake a blocked put
            return taken

    def peek(self) -> list[T]:
        """The waiting requests, oldest first, without removing them."""
        with self._changed:
            return [self._slots[(self._head + i) % self.capacity] for i in range(self._count)]


# ---------------------------------------------------------------- grouping and padding
def _check_lengths(lengths: Sequence[int]) -> None:
    if len(lengths) == 0:
        raise PromptError("no prompts to batch: pass at least one")
    bad = [(i, n) for i, n in enumerate(lengths) if n < 1]
    if bad:
        raise PromptError(f"prompt {bad[0][0]} is empty (length {bad[0][1]}): every prompt needs at least one token")


def group_by_length(lengths: Sequence[int], max_batch_size: int, pad_cap: int = PAD_CAP) -> list[list[int]]:
    """Indices of `lengths` cut into batches of at most `max_batch_size`, after a stable sort by
    length: each batch holds neighbouring lengths, so it pads little. A prompt longer than
    `pad_cap` gets a batch of its own (nothing is padded up to it; see the module's docstring).
    Every index appears in exactly one batch; equal lengths keep their order."""
    _check_lengths(lengths)
    if max_batch_size < 1 or pad_cap < 1:
        raise ConfigError(f"max_batch_size {max_batch_size} and pad_cap {pad_cap} must both be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    short = [i for i in order if lengths[i] <= pad_cap]
    batches = [short[i:i + max_batch_size] for i in range(0, len(short), max_batch_size)]
    return batches + [[i] for i in order if lengths[i] > pad_cap]


@dataclass
class PaddedBatch:
    tokens: Tensor  # [B, L] int64: each prompt right-aligned, pad_id before it (left padding)
    attention_mask: Tensor  # [B, L] int64: 1 on a prompt's tokens, 0 on its padding
    lengths: list[int]  # each row's prompt length, without padding

    @property
    def pad_tokens(self) -> int:
        """Slots in `tokens` that hold padding."""
        return self.tokens.numel() - sum(self.lengths)


def pad_batch(prompts: Sequence[Sequence[int] | Tensor], pad_id: int = 0, pad_cap: int = PAD_CAP) -> PaddedBatch:
    """Left-pad `prompts` (token ids, 1-D) to the longest one: dynamic padding, as the article's
    batcher does. Refuses to pad any prompt up past `pad_cap` (a longer prompt runs alone)."""
    rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    lengths = [len(r) for r in rows]
    _check_lengths(lengths)
    longest = max(lengths)
    if longest > pad_cap and len(rows) > 1:
        raise PromptError(f"a prompt of {longest} tokens is longer than the padding cap of {pad_cap}, so the other "
                          f"{len(rows) - 1} prompt(s) (lengths {sorted(lengths)}) would be padded past the cap: run "
                          "it in a batch of its own (group_by_length does), or raise pad_cap")
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(rows), longest), dtype=torch.long)  # [B, L]
    for b, row in enumerate(rows):
        tokens[b, longest - len(row):] = row
        mask[b, longest - len(row):] = 1
    return PaddedBatch(tokens, mask, lengths)


# ---------------------------------------------------------------- padding waste
@dataclass
class PaddingWaste:
    pad_slots: int  # token slots that hold padding, summed over batches
    total_slots: int  # every token slot: sum over batches of rows x padded length
    kv_bytes: int  # the keys and values that the pad slots would hold in a cache (0 without a model)

    @property
    def fraction(self) -> float:
        """pad_slots / total_slots: the share of prefill compute and of cache spent on padding."""
        return self.pad_slots / self.total_slots if self.total_slots else 0.0


def padding_waste(lengths: Sequence[int], batches: Sequence[Sequence[int]] | None = None,
                  kv_bytes_per_token: int = 0) -> PaddingWaste:
    """The padding of `batches` (lists of indices into `lengths`; None: one batch of all of them),
    each padded to its longest prompt. kv_bytes_per_token: ModelConfig.kv_bytes_per_token(bytes per
    element), the cache cost of one slot in every layer (2 x layers x KV heads x head dim x bytes)."""
    _check_lengths(lengths)
    batches = [list(range(len(lengths)))] if batches is None else batches
    pad = total = 0
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        total += len(batch) * longest
        pad += sum(longest - lengths[i] for i in batch)
    return PaddingWaste(pad, total, pad * kv_bytes_per_token)
