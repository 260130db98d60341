"""Group-wise 8/4/2-bit quantization of the KV cache (chapter 4).

Shapes: L layers, B batch, Hkv key/value heads, S token slots, T new tokens, Dh head dim,
G group size (`group_size`), n codes per byte (8 // bits).

A group of G consecutive elements along one axis shares a scale and a zero (asymmetric min-max):

    code = round((x - zero) / scale)  in [0, 2^bits - 1],      x_hat = zero + code * scale

so every element comes back within scale / 2. 4- and 2-bit codes are packed two or four to a
byte. Scales and zeros are stored in a dtype that holds every value they describe: the values' own
dtype when it is fp16 or bf16, fp32 otherwise (an fp32 key may exceed fp16's 65,504, and an fp16
scale would then be inf and the key NaN). Per element that costs bits + 2 x 16 / G bits with
16-bit metadata: 5 bits for 4-bit codes in groups of 32, which is why a 4-bit cache is at best
3.2x (not 4x) smaller than fp16; with an fp32 cache's fp32 metadata, 6 bits.

Which axis a group runs along matters (KIVI, Liu et al. 2024): keys have outlier *channels* (a few
of the Dh dimensions are large for every token), so keys are grouped per channel over G tokens
(axis -2 of [.., S, Dh]) and each outlier channel gets its own scale; values have no such
structure and are grouped per token over G channels (axis -1). A per-channel group can only be
quantized once its G tokens exist, so the newest tokens wait in a small full-precision window and
leave it one whole group at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import PLAN_HINT, CacheFullError, ConfigError, PositionError
from .kv_cache import one_vector
from .paged import BlockView, PagedKVCache, _long

# The axis of a [.., S, Dh] key/value tensor along which a group of G elements runs.
GROUP_AXIS = {"channel": -2, "token": -1}  # per channel: G tokens of one channel; per token: G channels
VALUE_AXIS = GROUP_AXIS["token"]  # KIVI: values per token


@dataclass
class QuantizedTensor:
    data: Tensor  # uint8, the input's shape with `axis` divided by 8 // bits: the packed codes
    scales: Tensor  # meta_dtype(dtype), the input's shape with `axis` divided by group_size: each group's step
    zeros: Tensor  # like scales: the value of code 0 (the group's minimum, rounded down)
    bits: int  # 8, 4 or 2
    group_size: int  # G, elements along `axis` that share one scale and zero
    axis: int  # the dimension (negative) along which groups run and codes are packed
    dtype: torch.dtype  # the dtype `dequantize` returns

    @property
    def nbytes(self) -> int:
        """Every byte held: codes, scales and zeros."""
        return self.data.nbytes + self.scales.nbytes + self.zeros.nbytes


# ---------------------------------------------------------------- packing
def pack(codes: Tensor, bits: int, axis: int = -1) -> Tensor:
    """uint8 codes < 2**bits -> bytes holding n = 8 // bits consecutive codes along `axis`
    (the first code in the lowest bits). The size of `axis` must be a multiple of n."""
    n = 8 // bits
    if n == 1:
        return codes
    ax = axis % codes.dim()
    c = codes.unflatten(ax, (-1, n))  # [.., N/n, n, ..]
    packed = c.select(ax + 1, 0).clone()
    for i in range(1, n):
        packed |= c.select(ax + 1, i) << (i * bits)
    return packed


def unpack(data: Tensor, bits: int, axis: int = -1) -> Tensor:
    """Inverse of `pack`: bytes -> uint8 codes, `axis` n = 8 // bits times longer."""
    n = 8 // bits
    if n == 1:
        return data
    ax = axis % data.dim()
    codes = [(data >> shift) & (2**bits - 1) for shift in range(0, 8, bits)]  # & 0xF for 4 bits
    return torch.stack(codes, dim=ax + 1).flatten(ax, ax + 1)  # [.., N/n, n, ..] -> [.., N, ..]


# ---------------------------------------------------------------- quantize / dequantize
def meta_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of scales and zeros for values of `dtype`: one that holds every such value."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def round_to(x: Tensor, dtype: torch.dtype, down: bool) -> Tensor:
    """The closest value of `dtype` <= x (down) or >= x (up); a plain cast rounds to nearest, either way."""
    h = x.to(dtype)
    if dtype == x.dtype:
        return h
    wrong = h.to(x.dtype) > x if down else h.to(x.dtype) < x
    return torch.where(wrong, torch.nextafter(h, torch.full_like(h, -math.inf if down else math.inf)), h)


def quantize(x: Tensor, bits: int, group_size: int, axis: int = -1,
             scale_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Asymmetric min-max quantization of x in groups of `group_size` elements along `axis`.

    Every element of dequantize(quantize(x)) is within scales / 2 of x. Scales and zeros are
    stored in `scale_dtype` (default: meta_dtype(x.dtype), which holds every finite x).
    """
    if bits not in (8, 4, 2):
        raise ConfigError(f"bits={bits!r} is invalid: use 8, 4 or 2")
    ax = axis % x.dim()
    N, G, n = x.shape[ax], group_size, 8 // bits
    if G < 1 or N % G or G % n:
        raise ConfigError(f"group_size={G} must divide the {N} elements along axis {axis} and be a "
                          f"multiple of {n} (the codes per byte at {bits} bits)")
    scale_dtype = scale_dtype or meta_dtype(x.dtype)
    g = x.float().unflatten(ax, (N // G, G))  # [.., N/G, G, ..]: a group runs along dim ax + 1
    lo, hi = g.amin(ax + 1), g.amax(ax + 1)  # [.., N/G, ..]
    # The zero is rounded down and the scale up, so that the grid zero + [0, 2^bits-1] * scale
    # still covers [lo, hi] after rounding: this is what keeps every error within scale / 2. The
    # range is taken in fp64, where hi - lo cannot overflow.
    zeros = round_to(lo, scale_dtype, down=True)
    scales = round_to((hi.double() - zeros.double()) / (2**bits - 1), scale_dtype, down=False)
    step = torch.where(scales > 0, scales.float(), 1.0)  # a constant group has scale 0: every code 0
    codes = ((g - zeros.float().unsqueeze(ax + 1)) / step.unsqueeze(ax + 1)).round_()
    codes = codes.clamp_(0, 2**bits - 1).to(torch.uint8).flatten(ax, ax + 1)  # x's shape
    return QuantizedTensor(pack(codes, bits, ax), scales, zeros, bits, G, ax - x.dim(), x.dtype)


def dequantize(q: QuantizedTensor) -> Tensor:
    """zeros + codes * scales, in q.dtype, with the shape that was quantized."""
    ax = q.axis % q.data.dim()
    codes = unpack(q.data, q.bits, ax).unflatten(ax, (-1, q.group_size))  # [.., N/G, G, ..]
    x = torch.addcmul(q.zeros.float().unsqueeze(ax + 1), codes.float(), q.scales.float().unsqueeze(ax + 1))
    return x.flatten(ax, ax + 1).to(q.dtype)


def round_trip(x: Tensor, bits: int, group_size: int, axis: int = -1) -> Tensor:
    """dequantize(quantize(x)): what a reader of the quantized cache sees instead of x."""
    return dequantize(quantize(x, bits, group_size, axis))


# ---------------------------------------------------------------- the quantized caches
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
                          f"are grouped over channels (cache.check_for_model suggests a valid size)")


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

    def prepare(self, input_pos: Tensor) -> Tensor:
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

    def prepare(self, input_pos: Tensor) -> Tensor:
        one_vector(input_pos, self)  # each row's open block lives in a per-batch tail
        start = int(input_pos[0])
        if start not in (0, self._length):  # checked before the allocator changes anything
            raise PositionError(f"the quantized paged cache appends: it holds positions 0..{self._length - 1}, "
                                f"so write position {self._length} next (or 0 for a new sequence), not {start}")
        return super().prepare(input_pos)

    def _plan(self, start: int, end: int, tables: list[list[int]]) -> Tensor:
        bs = self.block_size
        j0 = start // bs
        self._start, self._length = start, end
        # Read: the quantized blocks before the open one, then positions [j0 * bs, end) in full precision.
        kept = [j for j, b in enumerate(tables[0][:j0]) if b >= 0]
        self._table = _long([[t[j] for j in kept] for t in tables], self.device)  # [B, n]
        # What a kernel reads in place: the logical blocks before the open one (-1: freed), then `recent`.
        self._blocks = _long([t[:j0] for t in tables], self.device)  # [B, j0]
        self._lens = torch.full((len(tables),), end, device=self.device)
        # Write: the blocks that fill up in this step get quantized into their physical blocks.
        n_full = end // bs - j0
        self._full = _long([t[j0:j0 + n_full] for t in tables], self.device)  # [B, n_full]
        old = (_long(kept)[:, None] * bs + torch.arange(bs)).flatten()
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
