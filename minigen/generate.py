"""The generation loop as small free functions: prefill, decode_step, sample; generate and stream.

Shapes: B batch, T prompt tokens, n new tokens, V vocabulary.

    generate ─> make_cache ─> prefill(prompt) ─> sample ─> decode_step(token) ─> sample ─> ...

With `use_cache=False` the loop is the naive one: every step runs the model over the whole
sequence so far (chapter 1). With the cache, the prompt is processed once and every later step
feeds only the newest token at its explicit position (chapter 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from .attention import AttentionObserver, AttentionPolicy
from .config import GenerationConfig, resolve_config
from .errors import ConfigError, PromptError
from .kv_cache import KVCache
from .model import Model
from .offload import OffloadedKVCache
from .paged import paged_cache_for
from .quant import QuantizedKVCache
from .window import HeavyHitterCache, WindowKVCache


@dataclass
class GenerationStats:
    prefill_s: float = 0.0  # seconds to run the prompt through the model
    ttft_s: float = 0.0  # seconds from the call to the first new token (prefill + sampling)
    decode_s: float = 0.0  # seconds for every token after the first
    new_tokens: int = 0  # tokens generated per sequence (the longest one, when some stop early)
    decode_tokens_per_s: float = 0.0  # (new_tokens - 1) / decode_s, per sequence
    kv_cache_bytes: int = 0  # bytes the cache holds at the end (a preallocated cache: all of it)
    peak_kv_cache_bytes: int = 0  # the most bytes the cache held at any point
    token_latencies_s: list[float] = field(default_factory=list)  # wall time of each new token


@dataclass
class GenerationOutput:
    tokens: Tensor  # [B, T + n]: the prompt followed by the new tokens, as transformers returns them
    stats: GenerationStats


def check_prompt(model: Model, input_ids: Tensor, max_new_tokens: int) -> None:
    """Raise PromptError for prompts the model cannot take, naming the fix."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise PromptError(f"input_ids must be an integer tensor [batch, tokens], got {shape}; "
                          "use tokenizer(text, return_tensors='pt').input_ids")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise PromptError("the prompt is empty: give at least one token to condition on")
    V, ctx = model.config.vocab_size, model.config.max_seq_len
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
        raise PromptError(f"token ids must lie in [0, {V - 1}] for this model; got ids from "
                          f"{int(input_ids.min())} to {int(input_ids.max())}. Use the model's own tokenizer.")
    T = input_ids.shape[1]
    if T > ctx:
        raise PromptError(f"the prompt has {T} tokens but the model's context is {ctx}: "
                          f"truncate it to at most {ctx} tokens")
    if T + max_new_tokens > ctx:
        raise PromptError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                          f"{ctx} tokens: lower max_new_tokens to {ctx - T} or shorten the prompt")


def make_cache(model: Model, config: GenerationConfig, batch: int, max_len: int) -> KVCache | None:
    """The cache that `config` selects, sized to `max_len` tokens; None for the naive loop."""
    if not config.use_cache:
        return None
    if config.cache_chunk_size is not None or config.prefetch_depth is not None:  # chapter 3
        return _paged_or_offloaded(model, config, batch, max_len)
    if config.quant_bits is not None:  # group-wise quantized codes (a window still applies through the mask)
        return QuantizedKVCache.for_model(model, batch, max_len, config)
    if config.kv_budget is not None:  # heavy hitters: kv_budget slots, evicting the least attended
        return HeavyHitterCache.for_model(model, batch, config.kv_budget)
    if config.window_size is not None:  # a rolling buffer: sinks + window slots, whatever max_len
        return WindowKVCache.for_model(model, batch, config.window_size, config.sink_tokens)
    return KVCache.for_model(model, batch, max_len)


def _paged_or_offloaded(model: Model, config: GenerationConfig, batch: int, max_len: int):
    """A paged cache (blocks; quantized with quant_bits; freed outside window_size), and/or an
    offload tier around it (or around a contiguous cache) when prefetch_depth is set."""
    c = model.config
    # With an offload tier, the device holds only the layers in flight: prefetch_depth + 1.
    n_layers = c.n_layers if config.prefetch_depth is None else min(c.n_layers, config.prefetch_depth + 1)
    if config.cache_chunk_size is not None:
        cache = paged_cache_for(model, config, batch, max_len, n_layers)
    elif config.quant_bits is None and config.window_size is None:
        cache = KVCache(n_layers, batch, c.n_kv_heads, max_len, c.head_dim, model.dtype, model.device)
    else:
        raise ConfigError(f"prefetch_depth={config.prefetch_depth} with quant_bits or window_size needs the "
                          "paged cache: set cache_chunk_size (e.g. 256), or prefetch_depth=None")
    return cache if config.prefetch_depth is None else OffloadedKVCache(cache, c.n_layers, config.prefetch_depth)


def make_policy(config: GenerationConfig, cache,
                observers: tuple[AttentionObserver, ...] = ()) -> AttentionPolicy | None:
    """The attention policy (window, sinks, sparse, observers) that `config` selects; None: plain causal."""
    if isinstance(cache, HeavyHitterCache):  # it learns which tokens are heavy hitters by watching
        observers = (*observers, cache.observe)
    return AttentionPolicy.from_config(config, tuple(observers))


def prefill(model: Model, input_ids: Tensor, cache: KVCache | None,
            policy: AttentionPolicy | None = None) -> Tensor:
    """Run the prompt [B, T] at positions 0..T-1 -> logits of the last position [B, V]."""
    input_pos = torch.arange(input_ids.shape[1], device=input_ids.device)
    return model(input_ids, input_pos, cache, last_only=True, policy=policy)[:, -1]


def decode_step(model: Model, tokens: Tensor, input_pos: Tensor, cache: KVCache,
                policy: AttentionPolicy | None = None) -> Tensor:
    """Feed the newest tokens [B, 1] at position input_pos [1] -> next-token logits [B, V]."""
    return model(tokens, input_pos, cache, policy=policy)[:, -1]


def sample(logits: Tensor, config: GenerationConfig, generator: torch.Generator | None = None) -> Tensor:
    """Pick the next token [B] from logits [B, V]: greedy, or temperature / top-k / top-p sampling.

    Stays on the device (no .item()), so it adds no host sync to a decode step.
    """
    if not config.do_sample:
        return logits.argmax(dim=-1)
    logits = logits / config.temperature
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None and config.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= config.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _stream(model: Model, input_ids: Tensor, config: GenerationConfig,
            stats: GenerationStats, observers: tuple[AttentionObserver, ...] = ()) -> Iterator[Tensor]:
    """The loop itself: yields the next tokens [B] and fills `stats` as it goes."""
    check_prompt(model, input_ids, config.max_new_tokens)
    B, T = input_ids.shape
    n = config.max_new_tokens
    if n == 0:
        return
    stop = config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids
    stop_ids = torch.tensor(stop, dtype=torch.long, device=input_ids.device)
    generator = None
    if config.do_sample:
        generator = torch.Generator(device=input_ids.device)
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:  # fresh entropy for this generator only; torch.seed() would reseed the caller's global RNG
            generator.seed()
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    pad = stop[0] if stop else 0  # finished sequences are padded with their stop token
    start = last = time.perf_counter()
    with torch.inference_mode():
        cache = make_cache(model, config, B, T + n)
        policy = make_policy(config, cache, observers)
        seq = input_ids
        logits = prefill(model, input_ids, cache, policy)
        stats.prefill_s = time.perf_counter() - start
        for i in range(n):
            token = sample(logits, config, generator)  # [B]
            token = torch.where(finished, torch.full_like(token, pad), token)
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - start
            stats.token_latencies_s.append(now - last)
            last = now
            stats.new_tokens = i + 1
            if cache is not None:
                stats.kv_cache_bytes = cache.nbytes  # a growing or evicting cache changes size
                stats.peak_kv_cache_bytes = max(stats.peak_kv_cache_bytes, cache.nbytes)
            yield token
            finished |= torch.isin(token, stop_ids)
            if i == n - 1 or bool(finished.all()):
                break
            if cache is None:  # naive: recompute the whole sequence
                seq = torch.cat([seq, token[:, None]], dim=1)
                pos = torch.arange(seq.shape[1], device=seq.device)
                logits = model(seq, pos, None, last_only=True, policy=policy)[:, -1]
            else:
                pos = torch.tensor([T + i], device=input_ids.device)
                logits = decode_step(model, token[:, None], pos, cache, policy)
    stats.decode_s = time.perf_counter() - start - stats.ttft_s
    if stats.new_tokens > 1 and stats.decode_s > 0:
        stats.decode_tokens_per_s = (stats.new_tokens - 1) / stats.decode_s


def generate(model: Model, input_ids: Tensor, config: GenerationConfig | None = None, *,
             observers: tuple[AttentionObserver, ...] = (), **overrides) -> GenerationOutput:
    """Generate up to max_new_tokens after input_ids [B, T] -> GenerationOutput(tokens [B, T+n], stats).

    `observers` see every layer's attention probabilities (e.g. entropy.EntropyMonitor).
    """
    config = resolve_config(config, overrides)
    stats = GenerationStats()
    new = list(_stream(model, input_ids, config, stats, tuple(observers)))
    tokens = torch.cat([input_ids, torch.stack(new, dim=1)], dim=1) if new else input_ids.clone()
    return GenerationOutput(tokens=tokens, stats=stats)


def stream(model: Model, input_ids: Tensor, config: GenerationConfig | None = None, *,
           observers: tuple[AttentionObserver, ...] = (), **overrides) -> Iterator[Tensor]:
    """Yield each new token [B] as soon as it is sampled."""
    config = resolve_config(config, overrides)
    # Check here: a generator function would only raise at the first next(), far from the call.
    check_prompt(model, input_ids, config.max_new_tokens)
    return _stream(model, input_ids, config, GenerationStats(), tuple(observers))
