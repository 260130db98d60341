"""The quantized KV caches (chapter 6): contiguous, and paged blocks stored as codes.

Shapes: L layers, B batch, Hkv key/value heads, S token slots, T new tokens, Dh head dim,
G group size (`group_size`).

The codes, scales and zeros and how a group runs along one axis (KIVI: keys per channel, values
per token) are numerics/quant.py. A per-channel group can only be quantized once its G tokens
exist, so the newest tokens wait in a small full-precision window and leave it one whole group at
a time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import PLAN_HINT, CacheFullError, ConfigError, PositionError
from ..numerics.quant import GROUP_AXIS, VALUE_AXIS, QuantizedTensor, dequantize, meta_dtype, quantize
from .contract import BlockView, key_positions, long_tensor, one_vector
from .paged import PagedKVCache


def _empty_store(shape: tuple[int, ...], bits: int, group_size: int, axis: int, dtype: torch.dtype,
                 device) -> QuantizedTensor:
    """An all-zero QuantizedTensor able to hold a tensor of `shape` and `dtype`, grouped along `axis`."""
    data_shape, meta_shape = list(shape), list(shape)
    data_shape[axis] //= 8 // bits  # codes packed along the group axis
    meta_shape[axis] //= group_size  # one scale and zero per group
    return QuantizedTensor(torch.zeros(data_shape, dtype=torch.uint8, device=device),
                           torch.zeros(meta_shape, dtype=meta_dtype(dtype), device=device),
                           torch.zeros(meta_shape, dtype=meta_dtype(dtype), device=device),
                           bits, group_size, axis, dtype)


def _check_settings(bits: int, group_size: int, key_axis: str, head_dim: int) -> None:
    if bits not in (8, 4, 2) or group_size < 1 or group_size % (8 // bits):
        raise ConfigError(f"quant_bits={bits}, quant_group_size={group_size} are invalid: use 8, 4 or 2 "
                          f"bits and a group size that fills whole bytes (e.g. 32)")
    if key_axis not in GROUP_AXIS:
        raise ConfigError(f"quant_key_axis={key_axis!r} is invalid: use 'channel' or 'token'")
    if head_dim % group_size:  # values are always grouped per token, over channels
        raise ConfigError(f"quant_group_size={group_size} does not divide the head dim {head_dim}: values "
                          f"are grouped over channels (run_rules.RUN_RULES suggests a valid size)")


class QuantizedKVCache:
    """A preallocated KV cache that stores keys and values as group-wise quantized codes.

    Positions [0, n_quantized) live in the quantized store; the newest positions wait in a
    full-precision window of `residual` tokens. A write that would overflow the window first
    quantizes its oldest tokens, a whole group of G tokens at a time, so the window holds between
    residual - G + 1 and residual tokens once the text is longer than it. Writes append
    (positions 0, 1, 2, ... in order), as generation and teacher-forced scoring do; a write at
    position 0 starts a new sequence.
    """
    observers = ()
    blocks = None

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 bits: int = 4, group_size: int = 32, key_axis: str = "channel",
                 residual: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        residual = group_size if residual is None else residual
        _check_settings(bits, group_size, key_axis, head_dim)
        if residual < group_size:
            raise ConfigError(f"quant_residual={residual} is invalid: use >= quant_group_size={group_size}")
        self.bits, self.group_size, self.key_axis, self.residual = bits, group_size, key_axis, residual
        self.max_len, self.dtype = max_len, dtype
        # The store holds every position that can ever leave the window: whole groups up to max_len.
        store = (n_layers, batch, n_kv_heads, self.n_quantized(max_len), head_dim)  # [L, B, Hkv, S_q, Dh]
        self.k = _empty_store(store, bits, group_size, GROUP_AXIS[key_axis], dtype, device)
        self.v = _empty_store(store, bits, group_size, VALUE_AXIS, dtype, device)
        window = (n_layers, batch, n_kv_heads, min(residual, max_len), head_dim)  # [L, B, Hkv, R, Dh]
        self.k_window = torch.zeros(window, dtype=dtype, device=device)
        self.v_window = torch.zeros(window, dtype=dtype, device=device)
        self.slot_pos = torch.arange(max_len, device=device)  # the view returned by update: slot s = position s
        self.start = self.length = 0  # this step writes positions [start, length)
        self._peak = self.nbytes

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, config) -> "QuantizedKVCache":
        """The cache `config` (a GenerationConfig with quant_bits set) asks for, sized for `model`."""
        c = model.config
        return cls(c.n_layers, batch, c.n_kv_heads, max_len, c.head_dim, config.quant_bits,
                   config.quant_group_size, config.quant_key_axis, config.quant_residual,
                   model.dtype, model.device)

    def n_quantized(self, n: int) -> int:
        """Tokens in the quantized store once n tokens are written: whole groups beyond the window."""
        G = self.group_size
        return G * math.ceil(max(0, n - self.residual) / G)

    def _token_slices(self, store: QuantizedTensor, a: int, b: int) -> tuple[slice, slice]:
        """Slices along the token dim of store.data and of store.scales/zeros for tokens [a, b)."""
        if store.axis == -2:  # groups (and packed bytes) run along tokens
            n = 8 // self.bits
            return slice(a // n, b // n), slice(a // self.group_size, b // self.group_size)
        return slice(a, b), slice(a, b)

    def _write(self, store: QuantizedTensor, layer: int, a: int, x: Tensor) -> None:
        """Quantize x [B, Hkv, T, Dh] (T a multiple of G) into store slots [a, a + T)."""
        q = quantize(x, self.bits, self.group_size, store.axis, store.scales.dtype)
        data, meta = self._token_slices(store, a, a + x.shape[2])
        store.data[layer, :, :, data] = q.data
        store.scales[layer, :, :, meta] = q.scales
        store.zeros[layer, :, :, meta] = q.zeros

    def _read(self, store: QuantizedTensor, layer: int, n: int) -> Tensor:
        """Dequantize tokens [0, n) of the store -> [B, Hkv, n, Dh]."""
        whole = self.group_size * math.ceil(n / self.group_size)  # read whole groups, then cut
        data, meta = self._token_slices(store, 0, whole)
        part = QuantizedTensor(store.data[layer, :, :, data], store.scales[layer, :, :, meta],
                               store.zeros[layer, :, :, meta], self.bits, self.group_size, store.axis,
                               self.dtype)
        return dequantize(part)[:, :, :n]

    def reserve(self, input_pos: Tensor) -> None:
        """Nothing to hand out before the forward: the slots are preallocated (the contract)."""

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """{ANY_LAYER: the position each slot holds after this step} (contract.py; `_positions`)."""
        return key_positions(self._positions(input_pos))

    def _positions(self, input_pos: Tensor) -> Tensor:
        """The position held by each slot of the view `update` returns: [S] = 0..last written."""
        one_vector(input_pos, self)
        start, end = int(input_pos[0]), int(input_pos[-1]) + 1  # one host sync per forward call
        if start not in (0, self.length) or end - start != input_pos.shape[0]:
            raise PositionError(f"the quantized cache appends: it holds positions 0..{self.length - 1}, so "
                                f"write position {self.length} next (or 0 for a new sequence), not "
                                f"{start}..{end - 1}")
        if end > self.max_len:
            raise CacheFullError(
                f"the KV cache holds {self.max_len} tokens but position {end - 1} was written. "
                f"Allocate a cache of at least {end} tokens (prompt + max_new_tokens). "
                + PLAN_HINT.replace("--context N", f"--context {end}"))
        self.start, self.length = start, end  # start 0: a new sequence, the old positions are gone
        B, Hkv, _, Dh = self.k_window.shape[1:]
        # this step's short-lived tensors: one layer's keys and values, dequantized and concatenated
        self._peak = max(self._peak, self.nbytes + 2 * 2 * B * Hkv * end * Dh * self.k_window.element_size())
        return self.slot_pos[:end]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [B, Hkv, T, Dh]; return every position so far [B, Hkv, S, Dh] in full dtype.

        Tokens of earlier calls come back as stored (dequantized once they left the window); the
        T tokens of this call are attended in full precision, as a prefill computes them.
        """
        k, v = k.to(self.dtype), v.to(self.dtype)  # the window and the codes' source in the cache's dtype
        return (self._update_one(self.k, self.k_window, layer, k),
                self._update_one(self.v, self.v_window, layer, v))

    def _update_one(self, store: QuantizedTensor, window: Tensor, layer: int, x: Tensor) -> Tensor:
        start, end = self.start, self.length
        q0, q1 = self.n_quantized(start), self.n_quantized(end)  # quantized tokens before, after
        recent = torch.cat([window[layer, :, :, :start - q0], x], dim=2)  # positions [q0, end)
        if q1 > q0:  # the oldest whole groups leave the window
            self._write(store, layer, q0, recent[:, :, :q1 - q0])
        read = min(q1, start)  # earlier tokens as stored; this call's tokens in full precision
        out = torch.cat([self._read(store, layer, read), recent[:, :, read - q0:]], dim=2)  # [B, Hkv, end, Dh]
        window[layer, :, :, :end - q1] = recent[:, :, q1 - q0:]
        return out

    def reset(self) -> None:
        """Forget every position (a write at position 0 does it too)."""
        self.start = self.length = 0

    def layer_tensors(self) -> list[Tensor]:
        """Every tensor that holds per-layer state, layer first (what an offload tier moves)."""
        return [self.k.data, self.k.scales, self.k.zeros, self.v.data, self.v.scales, self.v.zeros,
                self.k_window, self.v_window]

    @property
    def nbytes(self) -> int:
        """Every byte held: packed codes, scales and zeros, and the full-precision window."""
        return sum(t.nbytes for t in self.layer_tensors())

    @property
    def peak_nbytes(self) -> int:
        """nbytes, plus one layer's keys and values read back in full precision while it attends."""
        return self._peak

    device_nbytes = nbytes


class QuantizedPagedKVCache(PagedKVCache):
    """A paged cache whose full blocks are stored group-wise quantized.

    A block is quantized once, when its last slot is written; each row's open (partly filled) block
    waits in a full-precision tail [B, bs, Hkv, Dh], so this cache appends (a write at position 0
    starts a new sequence). Keys are grouped per channel over group_size tokens (KIVI), so
    block_size must be a multiple of group_size; values per token over group_size channels. The
    open block plays the role of `quant_residual`. As in QuantizedKVCache, the tokens of the
    current call are attended in full precision.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, block_size: int,
                 n_blocks: int, bits: int = 4, group_size: int = 32, key_axis: str = "channel",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 window_size: int | None = None, sink_tokens: int = 0):
        _check_settings(bits, group_size, key_axis, head_dim)
        if key_axis == "channel" and block_size % group_size:
            raise ConfigError(f"cache_chunk_size={block_size} is not a multiple of quant_group_size="
                              f"{group_size}: keys are quantized per channel over group_size tokens of "
                              f"one block, so use a block size of {group_size * math.ceil(block_size / group_size)}")
        self.bits, self.group_size = bits, group_size
        self._start = self._length = 0  # this step writes positions [_start, _length)
        # The axis of a block [.., bs, Hkv, Dh] along which groups run: tokens (-3) or channels (-1).
        self.k_axis, self.v_axis = (-3 if key_axis == "channel" else -1), -1
        super().__init__(n_layers, batch, n_kv_heads, head_dim, block_size, n_blocks, dtype, device,
                         window_size, sink_tokens)

    def _make_storage(self) -> None:
        block = (self.n_layers, self.allocator.n_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        self.k = _empty_store(block, self.bits, self.group_size, self.k_axis, self.dtype, self.device)
        self.v = _empty_store(block, self.bits, self.group_size, self.v_axis, self.dtype, self.device)
        tail = (self.n_layers, len(self.rows), self.block_size, self.n_kv_heads, self.head_dim)  # [L, B, bs, Hkv, Dh]
        self.k_tail = torch.zeros(tail, dtype=self.dtype, device=self.device)
        self.v_tail = torch.zeros(tail, dtype=self.dtype, device=self.device)

    def reserve(self, input_pos: Tensor) -> None:
        self._check_appends(input_pos)  # before the allocator changes anything
        super().reserve(input_pos)

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        self._check_appends(input_pos)
        return super().prepare(input_pos)

    def _check_appends(self, input_pos: Tensor) -> None:
        one_vector(input_pos, self)  # each row's open block lives in a per-batch tail
        start = int(input_pos[0])
        if start not in (0, self._length):
            raise PositionError(f"the quantized paged cache appends: it holds positions 0..{self._length - 1}, "
                                f"so write position {self._length} next (or 0 for a new sequence), not {start}")

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """No data to copy: open blocks live in the rows' private tails (copied at fork), and a full
        block is never written again."""

    def _plan(self, start: int, end: int, tables: list[list[int]]) -> Tensor:
        bs = self.block_size
        j0 = start // bs
        self._start, self._length = start, end
        # Read: the quantized blocks before the open one, then positions [j0 * bs, end) in full precision.
        kept = [j for j, b in enumerate(tables[0][:j0]) if b >= 0]
        self._table = long_tensor([[t[j] for j in kept] for t in tables], self.device)  # [B, n]
        # What a kernel reads in place: the logical blocks before the open one (-1: freed), then `recent`.
        self._blocks = long_tensor([t[:j0] for t in tables], self.device)  # [B, j0]
        self._lens = torch.full((len(tables),), end, device=self.device)
        # Write: the blocks that fill up in this step get quantized into their physical blocks.
        n_full = end // bs - j0
        self._full = long_tensor([t[j0:j0 + n_full] for t in tables], self.device)  # [B, n_full]
        old = (long_tensor(kept)[:, None] * bs + torch.arange(bs)).flatten()
        B, Hkv, Dh = len(tables), self.n_kv_heads, self.head_dim
        # this step's short-lived tensors: one layer's keys and values, dequantized and concatenated
        S = len(kept) * bs + end - j0 * bs
        self._peak = max(self._peak, self.nbytes + 2 * 2 * B * Hkv * S * Dh * self.k_tail.element_size())
        return torch.cat([old, torch.arange(j0 * bs, end)]).to(self.device)  # [S]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # Copy-on-write of a shared open block needs no data copy here: open blocks live in the
        # rows' private tails (copied at fork), and a full block is never written again.
        k, v = k.to(self.dtype), v.to(self.dtype)  # the tail and the codes' source in the cache's dtype
        return (self._update_one_q(self.k, self.k_tail[layer], layer, k),
                self._update_one_q(self.v, self.v_tail[layer], layer, v))

    def update_blocks(self, layer: int, k: Tensor, v: Tensor) -> BlockView:
        """Write k, v [B, Hkv, T, Dh] as `update` does; return the stores and tables in place of a
        dequantizing gather, and positions [j0 * bs, end) (the open block, this call's tokens) in full precision."""
        k, v = k.to(self.dtype), v.to(self.dtype)
        recent_k = self._write_q(self.k, self.k_tail[layer], layer, k)  # [B, R, Hkv, Dh]
        recent_v = self._write_q(self.v, self.v_tail[layer], layer, v)
        k_store, v_store = (QuantizedTensor(s.data[layer], s.scales[layer], s.zeros[layer], s.bits, s.group_size,
                                            s.axis, s.dtype) for s in (self.k, self.v))  # this layer's
        start = self._lens - recent_k.shape[1]  # [B]: j0 * bs in every row
        return BlockView(k_store, v_store, self._blocks, self.block_size, self._lens, start, recent_k, recent_v)

    def _write_q(self, store: QuantizedTensor, tail: Tensor, layer: int, x: Tensor) -> Tensor:
        """Quantize the blocks that fill up, keep the open one in the tail -> positions [j0 * bs, end) [B, R, Hkv, Dh]."""
        B, Hkv, T, Dh = x.shape
        bs = self.block_size
        j0 = self._start // bs
        recent = torch.cat([tail[:, :self._start - j0 * bs], x.transpose(1, 2)], dim=1)  # [B, end - j0*bs, Hkv, Dh]
        n_full = self._full.shape[1]
        if n_full:  # whole blocks leave the tail: quantize each once
            q = quantize(recent[:, :n_full * bs].reshape(B * n_full, bs, Hkv, Dh), self.bits, self.group_size,
                         store.axis, store.scales.dtype)
            ids = self._full.flatten()
            store.data[layer, ids], store.scales[layer, ids], store.zeros[layer, ids] = q.data, q.scales, q.zeros
        rest = recent.shape[1] - n_full * bs
        tail[:, :rest] = recent[:, n_full * bs:]
        return recent

    def _update_one_q(self, store: QuantizedTensor, tail: Tensor, layer: int, x: Tensor) -> Tensor:
        recent = self._write_q(store, tail, layer, x)  # [B, end - j0 * bs, Hkv, Dh]
        B, _, Hkv, Dh = recent.shape
        bs = self.block_size
        n = self._table.shape[1]
        ids = self._table.flatten()
        data, scales, zeros = (t[layer].index_select(0, ids) for t in (store.data, store.scales, store.zeros))
        old = dequantize(QuantizedTensor(data, scales, zeros, self.bits, self.group_size, store.axis,
                                         self.dtype))  # [B*n, bs, Hkv, Dh]
        out = torch.cat([old.view(B, n * bs, Hkv, Dh), recent], dim=1)  # [B, S, Hkv, Dh]
        return out.transpose(1, 2)  # [B, Hkv, S, Dh]

    def reset(self) -> None:
        super().reset()
        self._start = self._length = 0

    def layer_tensors(self) -> list[Tensor]:
        return [self.k.data, self.k.scales, self.k.zeros, self.v.data, self.v.scales, self.v.zeros,
                self.k_tail, self.v_tail]

    def fork(self, n: int) -> None:
        super().fork(n)
        # Each row gets a private copy of the open block now (it is the next one written anyway).
        self.k_tail = self.k_tail[:, [0] * n].clone()
        self.v_tail = self.v_tail[:, [0] * n].clone()
