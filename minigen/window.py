"""Caches that hold a bounded set of tokens (chapters 5-6): a rolling buffer for window attention
with sinks, and heavy-hitter (H2O) eviction under a token budget.

Shapes: L layers, B batch, Hkv key/value heads, S slots, T new tokens, Dh head dim.

Both implement the interface of kv_cache.py: `key_positions(input_pos)` says which position each
slot holds after this step (-1: empty or evicted), `update` writes and returns every slot, `nbytes`
counts every byte held. Attention masks come from those positions (attention.py), so the order in
which slots are filled never matters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import CacheFullError


class WindowKVCache:
    """A rolling buffer of sink_tokens + window_size slots: memory stays flat however long the text.

    Slot rule: position p goes to slot p when p < sink_tokens (the sinks are never overwritten),
    else to slot sink_tokens + (p - sink_tokens) % window_size, overwriting position p - window_size,
    which just left the window of query p (attention.in_window). Positions are the original ones:
    RoPE is applied before keys are cached (model.py), so this cache does not re-index positions as
    StreamingLLM does; generation past the model's trained context is not supported.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, window_size: int,
                 sink_tokens: int = 4, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if window_size < 1 or not 0 <= sink_tokens <= window_size:
            raise ValueError(f"need window_size >= 1 and 0 <= sink_tokens <= window_size, "
                             f"got {window_size} and {sink_tokens}")
        self.window_size, self.sink_tokens = window_size, sink_tokens
        S = sink_tokens + window_size
        self.k = torch.zeros(n_layers, batch, n_kv_heads, S, head_dim, dtype=dtype, device=device)  # [L, B, Hkv, S, Dh]
        self.v = torch.zeros_like(self.k)
        self.slot_pos = torch.full((S,), -1, dtype=torch.long, device=device)  # [S]; -1: empty
        self._keep = self._slots = None  # this step's surviving new tokens and their slots
        self._concat = False  # True for a multi-token step: attend over old slots + new tokens

    @classmethod
    def for_model(cls, model, batch: int, window_size: int, sink_tokens: int,
                  dtype: torch.dtype | None = None) -> "WindowKVCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, window_size, sink_tokens,
                   dtype or model.dtype, model.device)

    def slot_of(self, pos: Tensor) -> Tensor:
        """The slot of each position [T] -> [T] (the rule in the class docstring)."""
        sinks = self.sink_tokens
        return torch.where(pos < sinks, pos, sinks + (pos - sinks) % self.window_size)

    def key_positions(self, input_pos: Tensor) -> Tensor:
        """Positions seen by this step's queries: [S] for one new token, [S + T] for T > 1."""
        if int(input_pos[0]) < 0:
            raise CacheFullError(f"positions must be >= 0, got {int(input_pos[0])}")
        # Of the new tokens, only the sinks and the last window_size stay in the buffer; writing
        # just those keeps each slot written once (index_copy_ with repeated slots is undefined).
        last = input_pos[-1]
        self._keep = (input_pos < self.sink_tokens) | (input_pos > last - self.window_size)  # [T]
        self._slots = self.slot_of(input_pos[self._keep])
        self._concat = input_pos.numel() > 1
        before = self.slot_pos.clone() if self._concat else None
        self.slot_pos[self._slots] = input_pos[self._keep]
        if not self._concat:
            # One token overwrites a slot that just left its window: read after writing, [S] fixed.
            return self.slot_pos
        # Several tokens: an early query still needs keys that a later token of this step evicts,
        # so this step attends over the buffer as it was plus the new tokens, then keeps the survivors.
        return torch.cat([before, input_pos])  # [S + T]

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh]; return the keys/values that match key_positions."""
        k_all = v_all = None
        if self._concat:  # copy the old buffer before overwriting it: [B, Hkv, S + T, Dh]
            k_all = torch.cat([self.k[layer], k], dim=2)
            v_all = torch.cat([self.v[layer], v], dim=2)
        self.k[layer].index_copy_(2, self._slots, k[:, :, self._keep])
        self.v[layer].index_copy_(2, self._slots, v[:, :, self._keep])
        if self._concat:
            return k_all, v_all
        return self.k[layer], self.v[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held: sinks + window slots, independent of the sequence length."""
        return self.k.nbytes + self.v.nbytes + self.slot_pos.nbytes


class HeavyHitterCache:
    """H2O heavy-hitter eviction (Zhang et al. 2023): at most `kv_budget` tokens are held, the
    `recent` newest always, the rest chosen by the largest attention they have received so far.

    The cache is an attention observer (`observe`): after each layer it adds the attention
    probabilities each slot received, summed over layers, heads and queries. H2O proper evicts per
    layer and head; here one eviction decision is shared by all of them, so that the positions
    stay one vector [S] (the cache interface) and the evicted slot is reused for the new token.
    A full cache evicts before the new token attends, so a query sees at most kv_budget tokens.
    """

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, kv_budget: int,
                 recent: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.budget = kv_budget
        self.recent = kv_budget // 2 if recent is None else recent  # H2O's even split
        if not 1 <= self.recent < kv_budget:
            raise ValueError(f"need 1 <= recent < kv_budget, got recent={self.recent}, kv_budget={kv_budget}")
        self.k = torch.zeros(n_layers, batch, n_kv_heads, kv_budget, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)  # [L, B, Hkv, S, Dh]
        self.slot_pos = torch.full((kv_budget,), -1, dtype=torch.long, device=device)  # [S]
        self.score = torch.zeros(kv_budget, device=device)  # [S] attention received so far
        self._slots: Tensor | None = None  # where this step's tokens are written (direct mode)
        self._pending: dict | None = None  # a multi-token step that overflowed: compact next time
        self.peak_nbytes = self.nbytes

    @classmethod
    def for_model(cls, model, batch: int, kv_budget: int, dtype: torch.dtype | None = None) -> "HeavyHitterCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, kv_budget,
                   dtype=dtype or model.dtype, device=model.device)

    def _victims(self, n: int, pos: Tensor, score: Tensor, empty: float) -> Tensor:
        """Indices of n entries to replace: never the `recent` newest, else the least attended.

        empty: the rank of empty entries (-inf: fill them first; +inf: never pick them).
        """
        protected = pos.topk(min(self.recent, pos.numel())).indices  # the newest positions
        rank = score.masked_fill(pos < 0, empty)
        rank[protected] = float("inf")
        return rank.topk(n, largest=False).indices

    def key_positions(self, input_pos: Tensor) -> Tensor:
        """[S] when this step's tokens fit (evicting if needed), else [S + T] for this step only."""
        if self._pending is not None:
            self._compact()
        T = input_pos.numel()
        free = int((self.slot_pos < 0).sum())
        if T <= max(free, self.budget - self.recent):  # free slots first, then the least attended
            slots = self._victims(T, self.slot_pos, self.score, float("-inf")) if T > free else \
                (self.slot_pos < 0).nonzero().flatten()[:T]
            self._slots = slots
            self.slot_pos[slots] = input_pos
            self.score[slots] = 0.0
            return self.slot_pos
        # Too many new tokens to place now (a long prompt): attend over old + new, compact next step.
        self._slots = None
        self._pending = {"pos": input_pos.clone(), "score": torch.zeros(T, device=self.score.device),
                         "k": [None] * self.k.shape[0], "v": [None] * self.k.shape[0]}
        return torch.cat([self.slot_pos, input_pos])

    def update(self, layer: int, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh]; return the keys/values that match key_positions."""
        if self._pending is None:
            self.k[layer].index_copy_(2, self._slots, k)
            self.v[layer].index_copy_(2, self._slots, v)
            return self.k[layer], self.v[layer]
        self._pending["k"][layer], self._pending["v"][layer] = k, v
        k_all, v_all = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes + 2 * k_all.nbytes)
        return k_all, v_all  # [B, Hkv, S + T, Dh]

    def observe(self, layer: int, probs: Tensor) -> None:
        """Add the attention each slot received, probs [B, H, T, S] summed over B, H, T."""
        received = probs.sum(dim=(0, 1, 2)).float()  # [S] or [S + T]
        S = self.budget
        self.score += received[:S]
        if self._pending is not None:
            self._pending["score"] += received[S:]

    def _compact(self) -> None:
        """Keep kv_budget of the old slots and the pending tokens: the recent ones, then the most attended."""
        p = self._pending
        pos = torch.cat([self.slot_pos, p["pos"]])  # [S + T]
        score = torch.cat([self.score, p["score"]])
        n_drop = int((pos >= 0).sum()) - self.budget
        keep = torch.ones_like(pos, dtype=torch.bool)
        if n_drop > 0:
            keep[self._victims(n_drop, pos, score, float("inf"))] = False
        keep[pos < 0] = False
        new_keep = keep[self.budget:].nonzero().flatten()  # pending tokens that stay
        # They go to the old slots that were dropped or empty.
        slots = (~keep[:self.budget]).nonzero().flatten()[:new_keep.numel()]
        for layer in range(self.k.shape[0]):
            self.k[layer].index_copy_(2, slots, p["k"][layer][:, :, new_keep])
            self.v[layer].index_copy_(2, slots, p["v"][layer][:, :, new_keep])
        self.slot_pos[~keep[:self.budget]] = -1
        self.score[~keep[:self.budget]] = 0.0
        self.slot_pos[slots] = p["pos"][new_keep]
        self.score[slots] = p["score"][new_keep]
        self._pending = None

    @property
    def nbytes(self) -> int:
        """Bytes held: kv_budget slots plus their positions and scores."""
        return self.k.nbytes + self.v.nbytes + self.slot_pos.nbytes + self.score.nbytes
