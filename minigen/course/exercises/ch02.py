"""Chapter 2 exercise: build the KV cache.

Write the two methods of a contiguous cache, on a class that derives from `ContiguousShell` (which
allocates `self.k` and `self.v`, [L, B, Hkv, S, Dh] zeros, `self.max_len` = S, and keeps the rest of
the cache contract, minigen/caches/contract.py):

    prepare(input_pos [T]) -> {ANY_LAYER: positions [S]}   once per forward, before the first layer:
        remember where this step writes, and say which position every slot holds after the write.
        In a contiguous cache slot s holds position s (unwritten slots are masked: their position
        lies after every query).
    update(layer, k, v) -> (keys, values)                  in every layer: write k, v [B, Hkv, T, Dh]
        at this step's positions in this layer's storage, and return the layer's whole storage
        [B, Hkv, S, Dh].

The checker first probes your class with keys that encode their layer and position, then runs
greedy generation of SmolLM2 (prefill, then one decode step per token, twice with one cache: the
second prompt starts again at position 0) and demands the very tokens of minigen's `KVCache`. While
your class runs, `KVCache.update` and `KVCache.prepare` raise, so a cache that hands its work to
minigen's fails, naming it. The usual mistakes are named: positions off by one, a missing layer index
(every layer writing one buffer), and writing in storage order (a counter of tokens written) instead
of at `input_pos`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...caches.contiguous import KVCache
from ...caches.contract import ANY_LAYER, key_positions
from ...config import GenerationConfig
from ...model import Model
from ...sampling import sample
from ...steps.eager import decode_step, prefill
from . import ExerciseFailed, forbidding

# The probe's cache: small, with distinct sizes so that a transposed axis shows.
PROBE = dict(n_layers=3, batch=1, n_kv_heads=2, max_len=10, head_dim=4)
LAYER_CODE = 100.0  # a probe key holds LAYER_CODE * layer + position + 1 in every element


class ContiguousShell:
    """The allocation and the parts of the cache contract that are not the exercise (given)."""
    observers = ()  # plain attention: nothing to watch
    blocks = None  # not a paged cache

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)  # [L, B, Hkv, S, Dh]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def reserve(self, input_pos: Tensor) -> None:
        """Nothing to hand out: the slots are preallocated."""

    def reset(self) -> None:
        """Nothing to forget: a new sequence rewrites its slots before it reads them."""

    def layer_tensors(self) -> list[Tensor]:
        return [self.k, self.v]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def peak_nbytes(self) -> int:
        return self.nbytes

    @property
    def device_nbytes(self) -> int:
        return self.nbytes


# ---------------------------------------------------------------- worked solution
class SolutionKVCache(ContiguousShell):
    """Slot s holds position s: prepare remembers input_pos, update writes there."""

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        if int(input_pos.max()) >= self.max_len:
            raise IndexError(f"position {int(input_pos.max())} does not fit {self.max_len} slots")
        self.input_pos = input_pos  # [T]: where this step writes, in every layer
        return key_positions(torch.arange(self.max_len, device=input_pos.device))  # slot s: position s

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k[layer].index_copy_(2, self.input_pos, k.to(self.k.dtype))  # [B, Hkv, T, Dh] into [B, Hkv, S, Dh]
        self.v[layer].index_copy_(2, self.input_pos, v.to(self.v.dtype))
        return self.k[layer], self.v[layer]


# ---------------------------------------------------------------- the probe
def _probe_kv(layer: int, positions: list[int], sign: float = 1.0) -> Tensor:
    """Keys [1, Hkv, T, Dh] whose every element says its layer and position (values: the negatives)."""
    codes = torch.tensor([LAYER_CODE * layer + p + 1 for p in positions]) * sign  # [T]
    return codes.view(1, 1, -1, 1).expand(1, PROBE["n_kv_heads"], -1, PROBE["head_dim"]).clone()


def _step(cache, positions: list[int], name: str, rewrite: float = 1.0) -> list[tuple[Tensor, Tensor]]:
    """One forward's moves on the cache: prepare, then update in every layer (keys scaled by `rewrite`,
    so that a rewritten position holds a new key); returns what each layer's update returned."""
    key_pos = cache.prepare(torch.tensor(positions))
    if not isinstance(key_pos, dict) or ANY_LAYER not in key_pos or not isinstance(key_pos[ANY_LAYER], Tensor):
        raise ExerciseFailed(f"prepare returned {type(key_pos).__name__}: return {{ANY_LAYER: positions}}, a dict "
                             "(minigen.caches.contract.key_positions(positions) builds it), positions [S]")
    if tuple(key_pos[ANY_LAYER].shape) != (PROBE["max_len"],):
        raise ExerciseFailed(f"prepare's positions have shape {tuple(key_pos[ANY_LAYER].shape)} in a cache of "
                             f"{PROBE['max_len']} slots: one position per slot, [S]")
    out = []
    for layer in range(PROBE["n_layers"]):
        got = cache.update(layer, rewrite * _probe_kv(layer, positions), -rewrite * _probe_kv(layer, positions))
        if not isinstance(got, tuple) or len(got) != 2 or not all(isinstance(t, Tensor) for t in got):
            raise ExerciseFailed(f"update returned {type(got).__name__}: return (keys, values), two tensors")
        want = (1, PROBE["n_kv_heads"], PROBE["max_len"], PROBE["head_dim"])
        if tuple(got[0].shape) != want or tuple(got[1].shape) != want:
            raise ExerciseFailed(f"update returned keys {tuple(got[0].shape)}, values {tuple(got[1].shape)} in the "
                                 f"{name}: return the layer's whole storage, [B, Hkv, S, Dh] = {want}")
        out.append((got[0].clone(), got[1].clone()))  # as attention would read it, before the next layer
    out.append(key_pos[ANY_LAYER].clone())
    return out


def _held(keys: Tensor, key_pos: Tensor, position: int) -> float | None:
    """The code in the slot that prepare says holds `position` (None: no slot says so)."""
    slots = (key_pos == position).nonzero()
    return float(keys[0, 0, int(slots[0]), 0]) if len(slots) else None


def _diagnose(cls) -> None:
    """Run the three probe steps and name the first mistake they show; silent when none."""
    cache = cls(**PROBE)
    first = _step(cache, [0, 1, 2, 3], "prefill at positions 0..3")
    keys, key_pos = first[0][0], first[-1]
    slots = torch.arange(PROBE["max_len"])
    if torch.equal(key_pos, slots + 1) or torch.equal(key_pos, slots - 1):
        raise ExerciseFailed("KV cache: positions off by one. prepare says slot s holds position "
                             f"{'s + 1' if torch.equal(key_pos, slots + 1) else 's - 1'}; in a contiguous cache slot s "
                             "holds position s")
    for p in range(4):  # the slot said to hold p must hold the key written at p, in layer 0
        got, want = _held(keys, key_pos, p), LAYER_CODE * 0 + p + 1
        if got != want:
            if got in (want - 1, want + 1) or (got == 0.0 and p in (0, 3)):
                what = "no key" if got == 0.0 else f"the key of position {int(got) - 1}"
                raise ExerciseFailed(
                    "KV cache: positions off by one. After a prefill at positions 0..3, the slot that prepare says "
                    f"holds position {p} holds {what}. Write token t at slot input_pos[t], without a shift")
            raise ExerciseFailed(f"KV cache: after a prefill at positions 0..3 the slot that prepare says holds "
                                 f"position {p} holds {got}, not the key written there ({want}): write k at "
                                 "input_pos in the layer's own storage, and let prepare say slot s holds position s")
    second = _step(cache, [4], "decode step at position 4")
    keys, key_pos = second[0][0], second[-1]
    last = LAYER_CODE * (PROBE["n_layers"] - 1)
    if _held(keys, key_pos, 0) == last + 1:
        raise ExerciseFailed(
            "KV cache: a missing layer index. At the decode step, layer 0 reads the keys of the last layer "
            f"(layer {PROBE['n_layers'] - 1}) at the prompt's positions: every layer writes one buffer. "
            "Write into self.k[layer] and self.v[layer], and return that layer's storage")
    for p in range(5):
        if _held(keys, key_pos, p) != p + 1 or _held(second[0][1], key_pos, p) != -(p + 1):
            raise ExerciseFailed(f"KV cache: at the decode step, layer 0's slot for position {p} holds "
                                 f"{_held(keys, key_pos, p)}, not the key written there ({p + 1}); values must hold "
                                 "the negatives (the probe writes v = -k)")
    # Rewind: a step at an earlier position, as after a rejected guess (chapter 13) or a new prompt.
    third = _step(cache, [2], "step back at position 2", rewrite=2.0)
    keys, key_pos = third[0][0], third[-1]
    if _held(keys, key_pos, 2) != 2.0 * 3:
        moved = (keys[0, 0, :, 0] == 2.0 * 3).nonzero()
        where = f"slot {int(moved[0])}" if len(moved) else "no slot"
        raise ExerciseFailed(
            "KV cache: writing in storage order instead of at input_pos. After positions 0..4, a step at position 2 "
            f"(a rewind, as speculative decoding does after a rejected guess, or a cache reused for a new prompt) "
            f"put its key in {where}, and the slot for position 2 still holds the old one. Write at input_pos, "
            "not after the last slot written")


# ---------------------------------------------------------------- greedy generation with a cache
def greedy_tokens(model: Model, prompts: list[Tensor], n: int, cache) -> list[Tensor]:
    """Each prompt [1, T] then n greedy tokens, every prompt in the same cache from position 0."""
    config = GenerationConfig(max_new_tokens=n)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            T, tokens = ids.shape[1], [ids]
            logits = prefill(model, ids, cache)  # [1, V]
            for i in range(n):
                token = sample(logits, config)  # [1]
                tokens.append(token[:, None])
                if i < n - 1:
                    logits = decode_step(model, token[:, None], torch.tensor([T + i]), cache)
            out.append(torch.cat(tokens, dim=1))
    return out


def _build(cls, model: Model, max_len: int):
    c = model.config
    return cls(c.n_layers, 1, c.n_kv_heads, max_len, c.head_dim, model.dtype, model.device)


def check_kv_cache(cls, model: Model, input_ids: Tensor, n: int = 8) -> bool:
    """cls(n_layers, batch, n_kv_heads, max_len, head_dim, dtype, device), a cache with prepare and update:
    the probe names the usual mistakes, then greedy generation must give KVCache's tokens exactly."""
    if not isinstance(cls, type):
        raise ExerciseFailed(f"check_kv_cache takes your class, not {type(cls).__name__}")
    prompts = [input_ids, input_ids[:, : max(1, input_ids.shape[1] // 2)].flip(1)]  # the second: shorter, new
    max_len = max(p.shape[1] for p in prompts) + n
    want = greedy_tokens(model, prompts, n, KVCache.for_model(model, 1, max_len))
    own = [KVCache.update, KVCache.prepare] + ([] if cls is SolutionKVCache else
                                               [SolutionKVCache.update, SolutionKVCache.prepare])
    with forbidding(*own):
        try:
            _diagnose(cls)
            got = greedy_tokens(model, prompts, n, _build(cls, model, max_len))
        except (ExerciseFailed, NotImplementedError):
            raise
        except Exception as error:  # the answer's own crash, said in the checker's words
            raise ExerciseFailed(f"KV cache: your class raised {type(error).__name__}: {error}") from error
    for i, (g, w) in enumerate(zip(got, want)):
        if not torch.equal(g, w):
            k = int((g[0] != w[0]).nonzero()[0]) - prompts[i].shape[1]
            raise ExerciseFailed(f"KV cache: prompt {i}'s new token {k} is {int(g[0, prompts[i].shape[1] + k])}, "
                                 f"KVCache gives {int(w[0, prompts[i].shape[1] + k])}" +
                                 (" (the second prompt reuses the cache from position 0)" if i else ""))
    print(f"✓ KV cache: the probe passes, and greedy generation of {len(prompts)} prompts in one cache gives "
          f"KVCache's {n} tokens each")
    return True
