"""Heavy-hitter (H2O) eviction under a token budget (chapter 8).

Shapes: L layers, B batch rows, H query heads, Hkv key/value heads, S = kv_budget slots,
T new tokens, Dh head dim.

H2O (Zhang et al. 2023) keeps a fixed budget of cached tokens: the `recent` newest always, the rest
chosen by the attention they have received so far ("heavy hitters"); the others are evicted and
their slots reused. The cache is an attention observer: after each layer it adds up the
probability each slot received.

Every row keeps its own scores and its own positions ([B, S]), so a row's tokens never depend on
what it is batched with. One decision per row is shared by all layers and heads, where the paper
decides per layer and head: the key positions then stay one [B, S] tensor per forward, as the
cache contract (cache.py) has them, and eviction runs once per step instead of L x Hkv times.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import ConfigError
from .contract import key_positions, one_vector


class HeavyHitterCache:
    """At most `kv_budget` tokens per row: the `recent` newest, then the most attended.

    A full cache evicts before the new token attends, so a query sees at most kv_budget tokens.
    A prompt too long to place at once is attended whole (old slots + new tokens) and compacted to
    the budget at the next step's `prepare`, with the attention it received in its own forward.
    """
    blocks = None

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, kv_budget: int,
                 recent: int | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.budget = kv_budget
        self.recent = kv_budget // 2 if recent is None else recent  # H2O's even split
        if not 1 <= self.recent < kv_budget:
            raise ConfigError(f"kv_budget={kv_budget}, recent={self.recent} are invalid: need 1 <= recent < "
                              "kv_budget (kv_budget >= 2 keeps at least one recent and one heavy-hitter slot)")
        self.k = torch.zeros(n_layers, batch, n_kv_heads, kv_budget, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)  # [L, B, Hkv, S, Dh]
        self.slot_pos = torch.full((batch, kv_budget), -1, dtype=torch.long, device=device)  # [B, S]; -1: empty
        self.score = torch.zeros(batch, kv_budget, device=device)  # [B, S]: attention received so far
        self.observers = (self.observe,)
        self._slots: Tensor | None = None  # [B, T]: where this step's tokens go (direct mode)
        self._pending: dict | None = None  # a step of too many tokens: compact at the next prepare
        self._peak = self.nbytes

    @classmethod
    def for_model(cls, model, batch: int, kv_budget: int, dtype: torch.dtype | None = None) -> "HeavyHitterCache":
        cfg = model.config
        return cls(cfg.n_layers, batch, cfg.n_kv_heads, cfg.head_dim, kv_budget,
                   dtype=dtype or model.dtype, device=model.device)

    def rank(self, pos: Tensor, score: Tensor, empty: float) -> Tensor:
        """[B, N]: the order in which entries are evicted (lowest first). The `recent` newest
        positions of each row are never evicted (+inf); empty entries rank as `empty`."""
        rank = score.clone()
        newest = pos.topk(min(self.recent, pos.shape[1]), dim=1).indices  # [B, recent]
        rank.scatter_(1, newest, float("inf"))
        return rank.masked_fill(pos < 0, empty)

    def reserve(self, input_pos: Tensor) -> None:
        """Nothing to hand out before the forward: the slots are preallocated (the contract)."""

    def prepare(self, input_pos: Tensor) -> dict[str, Tensor]:
        """{ANY_LAYER: the position each slot holds after this step} (contract.py; `_positions`)."""
        return key_positions(self._positions(input_pos))

    def _positions(self, input_pos: Tensor) -> Tensor:
        """[B, S] when this step's tokens fit (evicting if needed), else [B, S + T] for this step only."""
        one_vector(input_pos, self)
        if self._pending is not None:
            self._compact()
        # Positions at or after this write belong to an older sequence (or were rolled back).
        stale = self.slot_pos >= input_pos[0]
        self.slot_pos.masked_fill_(stale, -1)
        self.score.masked_fill_(stale, 0.0)
        B, T = self.slot_pos.shape[0], input_pos.shape[0]
        free = int((self.slot_pos[0] < 0).sum())  # rows advance together: the same count in every row
        new_pos = input_pos.expand(B, T)
        if T <= max(free, self.budget - self.recent):  # empty slots first, then the least attended
            self._slots = self.rank(self.slot_pos, self.score, float("-inf")).topk(T, dim=1, largest=False).indices
            self.slot_pos.scatter_(1, self._slots, new_pos)
            self.score.scatter_(1, self._slots, 0.0)
            return self.slot_pos
        # Too many new tokens to place now (a long prompt): attend over old + new, compact next step.
        self._slots = None
        L, _, Hkv, S, Dh = self.k.shape
        self._pending = {"pos": new_pos.clone(), "score": torch.zeros(B, T, device=self.score.device),
                         "k": [None] * L, "v": [None] * L}
        step_bytes = 2 * B * Hkv * T * Dh * self.k.element_size()  # one layer's new keys and values
        self._peak = max(self._peak, self.nbytes + L * step_bytes + 2 * B * Hkv * (S + T) * Dh * self.k.element_size())
        return torch.cat([self.slot_pos, new_pos], dim=1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, T, Dh]; return the keys/values that match the positions of prepare."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)  # stored in the cache's dtype (kv_dtype)
        if self._pending is None:
            index = self._slots[:, None, :, None].expand_as(k)  # [B, Hkv, T, Dh]: each row its own slots
            self.k[layer].scatter_(2, index, k)
            self.v[layer].scatter_(2, index, v)
            return self.k[layer], self.v[layer]
        self._pending["k"][layer], self._pending["v"][layer] = k, v
        return torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)  # [B, Hkv, S + T, Dh]

    def observe(self, layer: int, probs: Tensor) -> None:
        """Add the attention each slot received, probs [B, H, T, S] summed over heads and queries."""
        received = probs.sum(dim=(1, 2)).float()  # [B, S] or [B, S + T]
        self.score += received[:, :self.budget]
        if self._pending is not None:
            self._pending["score"] += received[:, self.budget:]

    def _compact(self) -> None:
        """Keep kv_budget of each row's old slots and pending tokens: the recent ones, then the most attended."""
        p = self._pending
        pos = torch.cat([self.slot_pos, p["pos"]], dim=1)  # [B, S + T]
        score = torch.cat([self.score, p["score"]], dim=1)
        # More than kv_budget positions are held (that is why the step was pending), so the top
        # kv_budget of each row are real tokens.
        keep = self.rank(pos, score, float("-inf")).topk(self.budget, dim=1).indices  # [B, S]
        for layer in range(self.k.shape[0]):
            index = keep[:, None, :, None].expand_as(self.k[layer])  # [B, Hkv, S, Dh]
            self.k[layer] = torch.cat([self.k[layer], p["k"][layer]], dim=2).gather(2, index)
            self.v[layer] = torch.cat([self.v[layer], p["v"][layer]], dim=2).gather(2, index)
        self.slot_pos = pos.gather(1, keep)
        self.score = score.gather(1, keep)
        self._pending = None

    def reset(self) -> None:
        """Forget every position and score (prepare does it too when a write starts at position 0)."""
        self.slot_pos.fill_(-1)
        self.score.zero_()
        self._pending = None

    def layer_tensors(self) -> list[Tensor]:
        return [self.k, self.v]

    @property
    def nbytes(self) -> int:
        """Bytes held: kv_budget slots of keys and values per row, plus their positions and scores."""
        return self.k.nbytes + self.v.nbytes + self.slot_pos.nbytes + self.score.nbytes

    @property
    def peak_nbytes(self) -> int:
        """nbytes, plus a long prompt's keys and values of every layer held until the next step
        compacts them, and one layer's old + new keys and values while it attends."""
        return self._peak

    device_nbytes = nbytes
