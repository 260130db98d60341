"""Attention from positions: the causal mask and the attention product.

Shapes: B batch, H query heads, Hkv key/value heads, G = H / Hkv query heads per key/value head,
T queries, S key slots, Dh head dim.
Every mask is built from positions (which token each query is, which token each cache slot holds),
so a cache can store its slots in any order (blocks, a ring buffer) and attention stays correct.
Key positions are [S] when every row holds the same positions, or [B, S] when rows differ (heavy
hitters evict per row, ragged batches); query positions are [T], or [B, T] in a ragged batch, where
each row has its own (-1: padding). Masks are [T, S] when both are shared, else [B, 1, T, S],
broadcast over the heads.

Chapters 7 and 8 add policies on top of causality, all still built from positions and scores:
a window with sinks (`in_window`, `window_mask`), dynamic sparse selection (`sparse_keep`), and
observers that see the attention probabilities (entropy, heavy hitters). `AttentionPolicy` carries
them through `Model.forward(..., policy=...)`; with policy=None nothing changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from .caches.contract import BlockView
from .numerics.quant import QuantizedTensor, dequantize


def _per_row(mask: Tensor) -> Tensor:
    """[T, S] stays (the same for every row); [B, T, S] -> [B, 1, T, S] (one mask per row, for every head)."""
    return mask if mask.dim() == 2 else mask[:, None]


def causal_mask(query_pos: Tensor, key_pos: Tensor) -> Tensor:
    """[T, S] (or [B, 1, T, S] for query_pos [B, T] or key_pos [B, S]) bool: query t may attend
    slot s when the slot holds a real token (position >= 0) at or before the query's position.
    A padding query (position -1, a ragged batch) sees nothing here; Model.forward lets it attend
    everything instead, so that its (discarded) output stays finite."""
    k = key_pos[..., None, :]  # [.., 1, S]
    return _per_row((k >= 0) & (k <= query_pos[..., :, None]))


class Causal:
    """The mask of a prompt that starts a sequence: key slot s holds position s, and query t (at
    position t) sees slots 0..t. `attend` hands it to SDPA as `is_causal` over the first T slots,
    so no [T, S] mask is built and torch's CPU flash kernel skips the tiles above the diagonal:
    an 8,192-token prompt's attention needs ~20 MB instead of ~600 MB, in a third of the time
    (measured on chapter 3's Xeon). `Model.forward` uses it where `prefix_causal` holds."""

    def __init__(self, T: int):
        self.T = T

    def __repr__(self) -> str:
        return f"Causal({self.T})"


def prefix_causal(query_pos: Tensor, key_pos: Tensor) -> bool:
    """True when query_pos [T] is 0..T-1 and key slot s holds position s for s < T, every other
    slot empty or later (-1 or >= T): then `causal_mask` is the lower triangle over the first T
    slots, `Causal(T)`. Under torch.compile it answers False: the test reads tensor values, which
    a graph cannot branch on, and the explicit mask gives the same result."""
    T = query_pos.shape[-1]
    if torch.compiler.is_compiling() or not (query_pos.dim() == 1 and key_pos.dim() == 1 and 1 < T <= key_pos.shape[0]):
        return False
    first = torch.arange(T, device=query_pos.device)
    rest = key_pos[T:]
    return bool(torch.equal(query_pos, first) and torch.equal(key_pos[:T], first) and ((rest < 0) | (rest >= T)).all())


def seen_slots(mask: Tensor) -> int:
    """1 + the last key slot that some query of mask [T, S] (bool) sees, at least 1: the slots after
    it hold nothing any query attends to (empty, or later positions). One host sync."""
    seen = mask.any(dim=0).nonzero()
    return int(seen[-1]) + 1 if seen.numel() else 1


def attend(q: Tensor, k: Tensor, v: Tensor, mask: "Tensor | Causal", fp32_softmax: bool = True,
           bf16: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(Dh) + mask) v with grouped-query heads.

    q [B, H, T, Dh], k and v [B, Hkv, S, Dh], mask [T, S] or [B, 1, T, S], bool (True: attend) or
    float (added to the scores: 0 or -inf) -> [B, H, T, Dh]. SDPA keeps its scores and
    probabilities in fp32 whatever q's dtype; fp32_softmax=False with 16-bit q instead runs each
    step in q's dtype, rounding scores and probabilities to 16 bits (what chapter 9 measures).
    mask may also be `Causal(T)`: the first T slots, lower triangle, without building the mask; or
    narrower than k (Model.forward trims the slots no query sees): the first mask.shape[-1] slots.
    bf16=True (a prompt under prefill_precision="bfloat16": PromptFormat.attention_dtype, chapter 3)
    gives SDPA fp32 q, k and v in bf16, its scores and softmax still fp32, and the result back in fp32:
    on the Xeon a 512-token layer (9 heads, 3 of keys) took 2.3-2.8 ms in place of 5.7-6.4 at 2 threads.
    """
    if bf16 and fp32_softmax and q.dtype == torch.float32:  # a bf16 prompt (chapter 3)
        mask = mask if isinstance(mask, Causal) or mask.dtype == torch.bool else mask.to(torch.bfloat16)
        return attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, fp32_softmax=True).float()
    if isinstance(mask, Causal):
        k, v = k[:, :, :mask.T], v[:, :, :mask.T]
        if fp32_softmax or q.dtype == torch.float32:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        pos = torch.arange(mask.T, device=q.device)
        mask = causal_mask(pos, pos)
    if mask.shape[-1] < k.shape[2]:  # the slots after the last one any query sees are left out
        k, v = k[:, :, :mask.shape[-1]], v[:, :, :mask.shape[-1]]
    if fp32_softmax or q.dtype == torch.float32:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    scores = attention_scores(q, k)  # [B, H, T, S] in q's dtype
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(q.dtype)
    probs = scores.softmax(dim=-1)  # rounded to 16 bits
    grouped = rearrange(probs, "b (hkv g) t s -> b hkv g t s", hkv=v.shape[1])
    return rearrange(grouped @ v[:, :, None], "b hkv g t d -> b (hkv g) t d")


# ---------------------------------------------------------------- window and sinks (chapter 7)
def in_window(key_pos: Tensor, query_pos: Tensor, window_size: int, sink_tokens: int) -> Tensor:
    """True where key position j is inside the window of query position p: j < sink_tokens or
    p - j < window_size (the query plus the window_size - 1 tokens before it, as in Mistral).

    Broadcasts key_pos against query_pos. Causality is separate (`causal_mask`). The rule is monotone:
    a key outside the window of query p is outside the window of every later query, so a cache may
    free it for good (the ring buffer in window.py, the paged cache's blocks).
    """
    return (key_pos < sink_tokens) | (query_pos - key_pos < window_size)


def window_mask(query_pos: Tensor, key_pos: Tensor, window_size: int, sink_tokens: int = 0) -> Tensor:
    """[T, S] (or [B, 1, T, S]) bool: causal, and the key is a sink or one of the window_size most
    recent positions."""
    inside = in_window(key_pos[..., None, :], query_pos[..., :, None], window_size, sink_tokens)  # [.., T, S]
    return causal_mask(query_pos, key_pos) & _per_row(inside)


def window_attention(q: Tensor, k: Tensor, v: Tensor, query_pos: Tensor, key_pos: Tensor,
                     window_size: int, sink_tokens: int = 0) -> Tensor:
    """The article's window snippet, corrected: scaled by 1/sqrt(Dh), causal inside the window, and
    the window chosen by position (not by storage order), plus optional sinks.

    q [B, H, T, Dh] at query_pos [T]; k, v [B, Hkv, S, Dh] holding key_pos [S] -> [B, H, T, Dh].
    """
    return attend(q, k, v, window_mask(query_pos, key_pos, window_size, sink_tokens))


# ---------------------------------------------------------------- dynamic sparse attention (chapter 8)
def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """q k^T / sqrt(Dh) with grouped-query heads: q [B, H, T, Dh], k [B, Hkv, S, Dh] -> [B, H, T, S]."""
    # Query head h reads key/value head h // G, the `repeat_kv` order of Llama checkpoints.
    qg = rearrange(q, "b (hkv g) t d -> b hkv g t d", hkv=k.shape[1])
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, k) / math.sqrt(q.shape[-1])  # [B, Hkv, G, T, S]
    return rearrange(scores, "b hkv g t s -> b (hkv g) t s")


def sparse_keep(scores: Tensor, mask: Tensor, top_k: int | None, threshold: float | None,
                signed: bool = False) -> Tensor:
    """[B, H, T, S] bool: the keys each head keeps for each query (dynamic sparse attention).

    The article's rule (signed=False): a key's importance is |q.k|/sqrt(Dh) (`scores` is
    q.k/sqrt(Dh)). Among the keys `mask` [T, S] (or [B, 1, T, S]) allows, a key is kept when it is one of the `top_k`
    most important of its head and query (ties broken by torch.topk) AND its importance is
    >= threshold x the largest importance of that head and query.
    signed=True ranks by q.k/sqrt(Dh) itself, i.e. by attention probability, and the threshold keeps
    keys whose probability is >= threshold x the largest (score >= max + log(threshold)).
    None disables either rule; top_k >= the allowed keys and threshold = 0 keep every allowed key,
    so attention is then exactly dense. The top key always stays.
    Note: choosing the keys reads every key, so this saves the softmax-times-values work, not the
    memory traffic of reading the cache.
    """
    importance = (scores if signed else scores.abs()).masked_fill(~mask, float("-inf"))  # [B, H, T, S]
    keep = mask.expand_as(scores)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = importance.topk(top_k, dim=-1).indices  # [B, H, T, k]
        keep = keep & torch.zeros_like(keep).scatter_(-1, kth, True)
    if threshold is not None and threshold > 0:
        top = importance.amax(dim=-1, keepdim=True)  # [B, H, T, 1]
        keep = keep & (importance >= (top + math.log(threshold) if signed else threshold * top))
    return keep


def attend_blocks(q: Tensor, view: BlockView, window_size: int | None = None, sink_tokens: int = 0) -> Tensor:
    """One query per row, q [B, H, Dh], over the positions a paged cache's `view` holds, read in
    place -> [B, H, Dh]: the plain torch reference of the fused kernel (kernels/triton_attention.py).

    Row b's query sits at position view.seq_lens[b] - 1: a prompt of one token (attend_prompt_blocks)."""
    return attend_prompt_blocks(q[:, :, None], view, (view.seq_lens - 1)[:, None], window_size, sink_tokens)[:, :, 0]


def attend_prompt_blocks(q: Tensor, view: BlockView, query_pos: Tensor, window_size: int | None = None,
                         sink_tokens: int = 0, bf16: bool = False) -> Tensor:
    """T queries per row, q [B, H, T, Dh] at query_pos [B, T] (-1: padding), over the positions a
    paged cache's `view` holds -> [B, H, T, Dh]: the torch reference of kernels/triton_prefill.py.

    Position p of row b lives in block view.block_table[b, p // bs] at slot p % bs (-1: freed, outside
    the window), or, from view.recent_start[b] on, in the full-precision recent buffers. Each query sees
    the held positions up to its own (with a window: the sinks and the window), as `window_mask` says;
    a padding query attends everything, so that its discarded output stays finite. bf16: each row's
    attention in bf16 (`attend`)."""
    keys_all = dequantize(view.k) if isinstance(view.k, QuantizedTensor) else view.k  # [N, bs, Hkv, Dh]
    values_all = dequantize(view.v) if isinstance(view.v, QuantizedTensor) else view.v
    query_pos = query_pos.expand(q.shape[0], q.shape[2])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        n, recent, bs = int(view.seq_lens[b]), int(view.recent_start[b]), view.block_size
        old = torch.arange(min(n, recent), device=q.device)
        old = old[view.block_table[b, old // bs] >= 0]  # positions in held blocks
        new = torch.arange(recent, n, device=q.device)
        blocks = view.block_table[b, old // bs]
        k = torch.cat([keys_all[blocks, old % bs], view.recent_k[b, new - recent] if len(new) else keys_all[:0, 0]])
        v = torch.cat([values_all[blocks, old % bs], view.recent_v[b, new - recent] if len(new) else values_all[:0, 0]])
        key_pos = torch.cat([old, new])  # [S] the position of each gathered key
        mask = (causal_mask(query_pos[b], key_pos) if window_size is None
                else window_mask(query_pos[b], key_pos, window_size, sink_tokens))  # [T, S]
        mask = mask | (query_pos[b] < 0)[:, None]
        k, v = rearrange(k, "s h d -> 1 h s d").to(q.dtype), rearrange(v, "s h d -> 1 h s d").to(q.dtype)
        out[b] = attend(q[b, None], k, v, mask, bf16=bf16)[0]
    return out


def sparse_on(top_k: int | None, threshold: float | None) -> bool:
    """Whether sparse key selection changes attention: a top-k, or a threshold above 0 (a threshold
    of 0 keeps every key). The one definition that the config, its table and attention share."""
    return top_k is not None or (threshold or 0) > 0


# An observer sees each layer's attention probabilities: (layer, probs [B, H, T, S]) -> None.
# The entropy monitor (entropy.py) and heavy-hitter eviction (h2o.py) are observers.
AttentionObserver = Callable[[int, Tensor], None]


@dataclass(frozen=True)
class AttentionPolicy:
    """How attention picks its keys beyond causality; passed to Model.forward(..., policy=...).

    None (the default everywhere) keeps the plain causal path and its speed.
    """
    window_size: int | None = None  # each query sees this many most recent tokens; None: all
    sink_tokens: int = 0  # the first tokens, always visible when a window is set
    sparse_top_k: int | None = None  # keep the k most important keys per head and query (sparse_keep)
    sparsity_threshold: float | None = None  # keep keys scoring >= this x the head's max, in [0, 1]
    sparse_signed: bool = False  # rank keys by q.k (attention probability) instead of the article's |q.k|
    observers: tuple[AttentionObserver, ...] = ()  # called with every layer's probabilities

    @classmethod
    def from_config(cls, config, observers: tuple[AttentionObserver, ...] = ()) -> "AttentionPolicy | None":
        """The policy a GenerationConfig selects, or None when it selects plain causal attention."""
        sparse = config.sparse  # a threshold of 0 keeps every key: no selection, the plain path
        policy = cls(config.window_size, config.sink_tokens if config.window_size is not None else 0,
                     config.sparse_top_k if sparse else None, config.sparsity_threshold if sparse else None,
                     sparse and config.sparse_score == "signed", tuple(observers))
        return None if policy == cls() else policy

    @property
    def sparse(self) -> bool:
        return sparse_on(self.sparse_top_k, self.sparsity_threshold)

    def mask(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """[T, S] (or [B, 1, T, S]) bool: causal, restricted to the window and sinks when a window is set."""
        if self.window_size is None:
            return causal_mask(query_pos, key_pos)
        return window_mask(query_pos, key_pos, self.window_size, self.sink_tokens)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, layer: int, bf16: bool = False) -> Tensor:
        """Like `attend`, plus sparse key selection and observers. q [B, H, T, Dh] -> [B, H, T, Dh].
        bf16: a bf16 prompt's attention (`attend`), where no key selection or observer needs the scores."""
        if not self.sparse and not self.observers:
            return attend(q, k, v, mask, bf16=bf16)  # a window alone is only a mask: keep the fused kernel
        scores = attention_scores(q, k)  # [B, H, T, S]
        keep = (sparse_keep(scores, mask, self.sparse_top_k, self.sparsity_threshold, self.sparse_signed)
                if self.sparse else mask)
        # The softmax runs in fp32 whatever the model's dtype, as fused attention kernels do.
        probs = scores.float().masked_fill(~keep, float("-inf")).softmax(dim=-1)  # [B, H, T, S]
        for observe in self.observers:
            observe(layer, probs)
        grouped = rearrange(probs.to(v.dtype), "b (hkv g) t s -> b hkv g t s", hkv=v.shape[1])
        out = grouped @ v[:, :, None]  # [B, Hkv, G, T, Dh]
        return rearrange(out, "b hkv g t d -> b (hkv g) t d")


# ---------------------------------------------------------------- one mask per kind of layer (Model.forward)
def imposes_window(policy: "AttentionPolicy | None") -> bool:
    """Whether a policy imposes its own window (window_size): then it masks every layer, the model's
    sliding layers too (the config allows at most their own window: run_rules.RUN_RULES)."""
    return policy is not None and policy.window_size is not None


def layer_mask(input_pos: Tensor, key_pos: Tensor, policy: "AttentionPolicy | None", window: int | None,
               dtype: torch.dtype, reads_blocks: bool = False) -> "Tensor | Causal | None":
    """The mask of the layers that attend `window` tokens (None: every earlier one) over the slots
    holding key_pos: `Causal` where SDPA's own causal tiles will do, else [T, S] or [B, 1, T, S].
    reads_blocks: attention reads a paged cache's blocks in place (the ops' reads_blocks, with a cache):
    None, no mask."""
    plain = policy is None or (policy.window_size is None and not policy.sparse and not policy.observers)
    if reads_blocks:
        return None  # the Triton kernels mask from positions as they read the blocks: no [T, S] mask
    if plain and prefix_causal(input_pos, key_pos) and (window is None or input_pos.shape[0] <= window):
        return Causal(input_pos.shape[0])  # a prompt from position 0 (that fits the window)
    # [T, S] or [B, 1, T, S] bool; a policy may narrow it to a window with sinks
    if policy is not None and (window is None or imposes_window(policy)):
        mask = policy.mask(input_pos, key_pos)
    elif window is None:
        mask = causal_mask(input_pos, key_pos)
    else:  # a sliding layer's own window (a policy without a window of its own masks causally)
        mask = window_mask(input_pos, key_pos, window)
    if policy is None and input_pos.dim() == 1 and input_pos.shape[0] > 1 and not torch.compiler.is_compiling():
        # a later piece of a prompt, or a verify chunk: the slots after the last one any query
        # sees add only masked scores, which SDPA would compute anyway; attend up to it
        mask = mask[:, :seen_slots(mask)]
    if input_pos.dim() == 2:  # a padding query attends everything: its output is discarded, but finite
        mask = mask | (input_pos < 0)[:, None, :, None]
    if policy is None:  # as 0 / -inf, added to the scores: SDPA would convert a bool mask in every layer
        mask = torch.zeros(mask.shape, dtype=dtype, device=input_pos.device).masked_fill(~mask, float("-inf"))
    return mask
