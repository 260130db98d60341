"""The generation loop: generate, stream, ragged batches and parallel sampling, all through one loop.

Shapes: B batch, T prompt tokens, n new tokens, V vocabulary.

    generate ─> make_cache ─> step.prefill(prompt) ─> sample ─> step.decode(token) ─> sample ─> ...

`run_steps` is the loop, the one place where prefill and decode steps run; a generation chooses its
step object once (steps/choose.py): the naive loop (use_cache=False, every step runs the whole
sequence so far: chapter 1), the eager cached loop (the prompt once, then one token per step at its
explicit position: chapter 2), the compiled or CUDA-graph step (chapter 8), or the fused C step
(chapter 14: the default at batch 1 on a CPU). A tensor batch [B, T] shares its positions; a
ragged batch (a list of prompts) runs each row at its own positions; `parallel_sample` (chapter 3)
prefills one prompt into a paged cache and forks it into n rows that share its blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import Tensor

from .attention import AttentionObserver, AttentionPolicy
from .caches.contract import Cache
from .caches.make import make_cache
from .config import GenerationConfig, resolve_config
from .errors import ConfigError, PromptError
from .model import Model
from .numerics.precision import prompt_products
from .sampling import Generators, make_generators, sample
from .steps.choose import choose_step, prompt_attention_bf16
from .steps.eager import EagerStep


@dataclass
class GenerationStats:
    prefill_s: float = 0.0  # seconds to run the prompt through the model
    ttft_s: float = 0.0  # seconds from the call to the first new token (prefill + sampling)
    decode_s: float = 0.0  # seconds for every token after the first, compile_s left out
    new_tokens: int = 0  # tokens generated per sequence (the longest one, when some stop early)
    decode_tokens_per_s: float = 0.0  # (new_tokens - 1) / decode_s, per sequence
    # The cache's memory (cache.py): keys and values plus everything the cache keeps to use them
    # (scales and zeros, slot positions, block tables, gather buffers), on every tier.
    kv_cache_bytes: int = 0  # bytes held at the end; a preallocated cache counts its whole allocation
    peak_kv_cache_bytes: int = 0  # the most bytes held at any moment, a step's short-lived tensors included
    kv_device_bytes: int = 0  # of kv_cache_bytes, the bytes on the model's device (less with an offload tier)
    kv_blocks_in_use: int | None = None  # paged cache: blocks held by the rows at the end; None: not paged
    kv_blocks_in_pool: int | None = None  # paged cache: blocks in the preallocated pool
    token_latencies_s: list[float] = field(default_factory=list)  # wall time of each new token
    # Percentiles of the decode tokens' latencies (every token after the first): jitter (chapter 8).
    latency_p50_s: float = 0.0
    latency_p90_s: float = 0.0
    latency_p99_s: float = 0.0
    compile_s: float = 0.0  # compile=True / cuda_graphs=True: seconds spent compiling or capturing (0: reused)
    step: str = ""  # the step that ran (steps/eager.py): "naive", "eager", "compiled", "graphed", "fused", "speculative ..."
    # speculative decoding (steps/speculative.py, chapter 15); all 0 without it
    draft_tokens: int = 0  # tokens proposed, over every row and round
    accepted_tokens: int = 0  # of those, the ones the target kept
    acceptance_rate: float = 0.0  # accepted_tokens / draft_tokens
    target_forwards: int = 0  # verify forwards, counted per row (the prompt's not included)
    mean_acceptance_length: float = 0.0  # tokens emitted per target forward, the bonus token included
    draft_s: float = 0.0  # seconds spent proposing (the draft model's forwards, the n-gram search)
    verify_s: float = 0.0  # seconds spent in the target's verify forwards and the acceptance rule


@dataclass
class GenerationOutput:
    tokens: Tensor | list[Tensor]  # [B, T + n]: the prompt then the new tokens, as transformers returns them;
    # for a list of prompts, a list of 1-D tensors: each prompt then its new tokens, up to its own stop
    stats: GenerationStats


def check_prompt(model: Model, input_ids: Tensor, max_new_tokens: int, config: GenerationConfig | None = None) -> None:
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
    if config is not None and config.stop_token_ids and max(config.stop_token_ids) >= V:
        raise ConfigError(f"stop_token_ids={list(config.stop_token_ids)} holds ids the model can never "
                          f"produce: its vocabulary is [0, {V - 1}]. Use ids from the model's tokenizer.")


def make_policy(config: GenerationConfig, cache: Cache | None,
                observers: tuple[AttentionObserver, ...] = ()) -> AttentionPolicy | None:
    """The attention policy (window, sinks, sparse, observers) that `config` selects, with the
    observers the cache needs; None: plain causal attention."""
    cache_observers = tuple(cache.observers) if cache is not None else ()
    return AttentionPolicy.from_config(config, (*observers, *cache_observers))


def _record_cache(stats: GenerationStats, cache: Cache | None) -> None:
    if cache is not None:
        stats.kv_cache_bytes, stats.peak_kv_cache_bytes = cache.nbytes, cache.peak_nbytes
        stats.kv_device_bytes = cache.device_nbytes
        if cache.blocks is not None:
            stats.kv_blocks_in_use, stats.kv_blocks_in_pool = cache.blocks


def run_steps(model: Model, step: EagerStep, input_ids: Tensor, input_pos: Tensor, cache: Cache | None,
              policy: AttentionPolicy | None, config: GenerationConfig, stats: GenerationStats,
              next_pos: Callable[[int, Tensor], Tensor], stop: bool = True,
              generators: Generators = None,
              after_prefill: Callable[[Tensor], Tensor] | None = None) -> Iterator[Tensor]:
    """The loop itself: prefill input_ids [B, T] at input_pos, then sample and decode until
    max_new_tokens or (with `stop`) every row has produced a stop token. Yields the next tokens [B]
    and fills `stats` as it goes.

    next_pos(i, finished [B] bool) gives the positions of step i's token: [1] for rows in lockstep,
    or [B, 1] per row. A finished row is fed its stop token again (its output is discarded).
    after_prefill maps the prompt's logits before the first sample (parallel sampling's fork).
    generators: one per row of the sampled batch (sampling.make_generators), None when greedy.
    """
    n = config.max_new_tokens
    stats.step = step.name
    if n == 0:
        return
    stop_list = config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids
    stop_ids = torch.tensor(stop_list if stop else (), dtype=torch.long, device=input_ids.device)
    pad = stop_list[0] if stop_list else 0  # finished sequences are padded with their stop token
    start = last = time.perf_counter()
    with step.grad_mode():
        with prompt_products(config.prefill_precision, model, prompt_attention_bf16(model, config)):  # the prompt's products in their own format (chapter 16)
            logits = step.prefill(model, input_ids, input_pos, cache, policy)
        if after_prefill is not None:
            logits = after_prefill(logits)
        stats.prefill_s = time.perf_counter() - start
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=input_ids.device)  # [B] (after a fork: n)
        for i in range(n):
            # a CUDA-graph step samples inside its graph: from the second token on, `logits` are tokens
            token = logits if step.samples_inside and i > 0 else sample(logits, config, generators)  # [B]
            token = torch.where(finished, torch.full_like(token, pad), token)
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - start
            stats.token_latencies_s.append(now - last)
            last = now
            stats.new_tokens = i + 1
            _record_cache(stats, cache)
            yield token
            finished |= torch.isin(token, stop_ids)
            if i == n - 1 or bool(finished.all()):
                break
            logits = step.decode(model, token[:, None], next_pos(i, finished), cache, policy)
    step.report(stats)
    _finish_stats(stats, start)


def _finish_stats(stats: GenerationStats, start: float) -> None:
    """The decode time, rate and latency percentiles from what the loop recorded (start: the call's
    perf_counter)."""
    stats.decode_s = time.perf_counter() - start - stats.ttft_s - stats.compile_s
    if stats.new_tokens > 1 and stats.decode_s > 0:
        stats.decode_tokens_per_s = (stats.new_tokens - 1) / stats.decode_s
    # the percentiles of decode steps as they run: a step that compiled or captured is left out
    decode = sorted(stats.token_latencies_s[2 if stats.compile_s > 0 else 1:])
    if decode:
        stats.latency_p50_s, stats.latency_p90_s, stats.latency_p99_s = (
            decode[min(len(decode) - 1, int(q * len(decode)))] for q in (0.5, 0.9, 0.99))


def _start_batch(model: Model, input_ids: Tensor, config: GenerationConfig,
                 observers: tuple[AttentionObserver, ...], draft_model) -> tuple[EagerStep, Generators]:
    """A tensor batch's checks, its step and its generators (one per row), before any work (so that
    stream raises at the call, not at its first next())."""
    check_prompt(model, input_ids, config.max_new_tokens, config)
    generators = make_generators(config, input_ids.shape[0], input_ids.device)
    return choose_step(model, config, input_ids.shape[0], observers, sample, generators, draft_model=draft_model,
                       max_len=input_ids.shape[1] + config.max_new_tokens), generators


def _stream_batch(model: Model, input_ids: Tensor, config: GenerationConfig, stats: GenerationStats,
                  observers: tuple[AttentionObserver, ...], step: EagerStep,
                  generators: Generators) -> Iterator[Tensor]:
    """A tensor batch [B, T]: every row at positions 0..T-1, then T, T + 1, ... in lockstep (the loop
    feeds the rows in lockstep; a speculative step's rows verify at their own positions)."""
    B, T = input_ids.shape
    with step.grad_mode():
        cache = make_cache(model, config, B, T + config.max_new_tokens,
                           ragged=B > 1 and config.speculative_method is not None)
        policy = make_policy(config, cache, observers)
    input_pos = torch.arange(T, device=input_ids.device)
    yield from run_steps(model, step, input_ids, input_pos, cache, policy, config, stats,
                         lambda i, finished: torch.tensor([T + i], device=input_ids.device), generators=generators)


def generate(model: Model, input_ids: Tensor, config: GenerationConfig | None = None, *,
             observers: tuple[AttentionObserver, ...] = (), draft_model: Model | None = None,
             **overrides) -> GenerationOutput:
    """Generate up to max_new_tokens after input_ids [B, T] -> GenerationOutput(tokens [B, T+n], stats).

    input_ids may also be a list of 1-D prompts of different lengths (a ragged batch): each row
    runs at its own positions and stops at its own stop token; tokens is then a list of 1-D tensors.
    `observers` see every layer's attention probabilities (e.g. entropy.EntropyMonitor).
    `draft_model` proposes tokens for speculative_method="draft" (steps/speculative.py): any minigen
    Model with the target's vocabulary (minigen.drafts makes them from the target).
    With do_sample, row r draws from its own generator seeded (seed + r) mod 2**64 (sampling.py):
    its tokens equal that prompt generated alone with that seed, whatever it is batched with.
    """
    config = resolve_config(config, overrides)
    if isinstance(input_ids, (list, tuple)):
        return _generate_ragged(model, input_ids, config, tuple(observers), draft_model)
    stats = GenerationStats()
    step, generators = _start_batch(model, input_ids, config, tuple(observers), draft_model)
    new = list(_stream_batch(model, input_ids, config, stats, tuple(observers), step, generators))
    tokens = torch.cat([input_ids, torch.stack(new, dim=1)], dim=1) if new else input_ids.clone()
    return GenerationOutput(tokens=tokens, stats=stats)


def stream(model: Model, input_ids: Tensor, config: GenerationConfig | None = None, *,
           observers: tuple[AttentionObserver, ...] = (), stats: GenerationStats | None = None,
           draft_model: Model | None = None, **overrides) -> Iterator[Tensor]:
    """Yield each new token [B] as soon as it is sampled; `stats`, when given, is filled as the
    tokens come (the TTFT at the first, the decode rate and percentiles once the stream ends)."""
    config = resolve_config(config, overrides)
    # Check here: a generator function would only raise at the first next(), far from the call.
    step, generators = _start_batch(model, input_ids, config, tuple(observers), draft_model)
    return _stream_batch(model, input_ids, config, stats if stats is not None else GenerationStats(),
                         tuple(observers), step, generators)


# ---------------------------------------------------------------- prefix sharing: parallel sampling
@dataclass
class ParallelSample:
    tokens: Tensor  # [n, T + new]: the prompt followed by each sample's new tokens
    blocks_after_fork: int  # physical blocks held right after the fork (the prompt's, shared)
    blocks_used: int  # physical blocks held at the end
    blocks_unshared: int  # blocks n separate caches would hold at the end
    shared_hit_rate: float  # block-table entries served by a shared block, at the end


def parallel_sample(model: Model, input_ids: Tensor, n: int, config: GenerationConfig | None = None,
                    **overrides) -> ParallelSample:
    """Prefill one prompt [1, T] once, fork it into n rows that share its blocks, sample each row.

    Every row runs max_new_tokens (stop tokens are ignored). cache_chunk_size defaults to 16; the
    cache is paged (and may be quantized, windowed or offloaded before the fork, as the config says).
    Sample r draws from its own generator, seeded (seed + r) mod 2**64: it equals
    generate(model, input_ids, config, seed=seed + r), and the n samples differ.
    """
    _check_parallel_args(input_ids, n)
    config = resolve_config(config, overrides)
    if config.cache_chunk_size is None:
        config = config.replace(cache_chunk_size=16)
    if config.prefetch_depth is not None:
        raise ConfigError(f"parallel_sample forks the paged cache's rows, which an offload tier "
                          f"(prefetch_depth={config.prefetch_depth}) holds: set prefetch_depth=None")
    if config.speculative_method is not None:
        raise ConfigError(f"parallel_sample forks one prompt's blocks into n rows, and speculative_method="
                          f"{config.speculative_method!r} verifies each row at its own positions: set "
                          "speculative_method=None, or generate(model, ids.expand(n, -1), config, do_sample=True)")
    check_prompt(model, input_ids, config.max_new_tokens, config)
    step = choose_step(model, config, n)  # paged: the eager step (the table keeps the fused one off)
    T, new, bs = input_ids.shape[1], config.max_new_tokens, config.cache_chunk_size
    unshared = n * math.ceil((T + new) / bs)
    cache = make_cache(model, config, 1, T + new, pool_rows=n)  # one row now, n after the fork
    policy = make_policy(config, cache)
    forked: list[int] = []

    def fork(logits: Tensor) -> Tensor:  # [1, V] -> [n, V]: one prompt, n rows sharing its blocks
        cache.fork(n)
        forked.append(cache.blocks[0])  # blocks in use
        return logits.expand(n, -1)

    tokens = list(run_steps(model, step, input_ids, torch.arange(T, device=input_ids.device), cache, policy,
                            config, GenerationStats(), lambda i, _: torch.tensor([T + i], device=input_ids.device),
                            stop=False, generators=make_generators(config, n, input_ids.device), after_prefill=fork))
    out = torch.cat([input_ids.expand(n, -1), torch.stack(tokens, dim=1)], dim=1) if tokens else input_ids.expand(n, -1)
    in_use = cache.blocks[0]
    result = ParallelSample(out, forked[0] if forked else in_use, in_use, unshared, cache.shared_hit_rate)
    cache.free()
    return result


def _check_parallel_args(input_ids, n) -> None:
    """parallel_sample's arguments, before any work: n an int >= 1 (a bool is not a count), one prompt [1, T]."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"n={n!r} is invalid: use an integer >= 1 (samples to draw)")
    if not isinstance(input_ids, Tensor):
        got = f"a {type(input_ids).__name__}"
    elif input_ids.dim() != 2 or input_ids.shape[0] != 1:
        got = f"shape {tuple(input_ids.shape)}"
    elif input_ids.dtype not in (torch.int64, torch.int32):
        got = f"dtype {input_ids.dtype}"
    else:
        return
    raise PromptError(f"parallel_sample takes one prompt, a [1, T] integer tensor of token ids; got {got}: use "
                      "tokenizer(text, return_tensors='pt').input_ids, or torch.tensor([ids])")


# ---------------------------------------------------------------- ragged batches: one position vector per row
def check_prompts(model: Model, prompts, config: GenerationConfig) -> None:
    """Raise PromptError for a prompt list the model cannot take: empty, or a prompt that is not 1-D ids."""
    if not prompts:
        raise PromptError("the prompt list is empty: give at least one prompt, a 1-D tensor of token ids")
    for i, p in enumerate(prompts):
        if not isinstance(p, Tensor) or p.dim() != 1:
            shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise PromptError(f"prompt {i} must be a 1-D integer tensor of token ids, got {shape}; "
                              "use tokenizer(text, return_tensors='pt').input_ids[0]")
        if p.numel() == 0:
            raise PromptError(f"prompt {i} of {len(prompts)} is empty: give at least one token to condition on")
        check_prompt(model, p[None], config.max_new_tokens, config)


def _generate_ragged(model: Model, prompts, config: GenerationConfig, observers: tuple,
                     draft_model: Model | None = None) -> GenerationOutput:
    """Prompts of different lengths in one batch: left-padded, each row at its own positions
    0..len-1 (padding at -1, never written or attended), then decoded at its own position; a row
    that has stopped is fed at position -1, so it writes nothing."""
    check_prompts(model, prompts, config)
    if observers:
        raise ConfigError("observers with a list of prompts: an observer would see the padding rows' attention. "
                          "Generate the prompts one at a time, or as one [B, T] tensor of equal lengths.")
    lens = [p.numel() for p in prompts]
    B, T = len(prompts), max(lens)
    generators = make_generators(config, B, model.device)  # row r: seed + r
    step = choose_step(model, config, B, generators=generators, ragged=True, draft_model=draft_model,
                       max_len=T + config.max_new_tokens)
    stats, device, n = GenerationStats(), model.device, config.max_new_tokens
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    pos = torch.full((B, T), -1, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):  # left padding: every row's last column is its last token
        ids[b, T - lens[b]:], pos[b, T - lens[b]:] = p.to(device), torch.arange(lens[b], device=device)
    row_lens = torch.tensor(lens, device=device)
    with torch.inference_mode():
        cache = make_cache(model, config, B, T + n, ragged=True)
        policy = make_policy(config, cache)

    def next_pos(i: int, finished: Tensor) -> Tensor:  # [B, 1]: each row after its own prompt; -1 once done
        return torch.where(finished, -1, row_lens + i)[:, None]

    new = list(run_steps(model, step, ids, pos, cache, policy, config, stats, next_pos, generators=generators))
    stop = set(config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids)
    out: list[list[int]] = [[] for _ in range(B)]
    for token in new:  # each row up to and including its own stop
        for b, t in enumerate(token.tolist()):
            if not out[b] or (out[b][-1] not in stop and len(out[b]) < n):
                out[b].append(t)
    tokens = [torch.cat([p, torch.tensor(t, dtype=p.dtype, device=p.device)]) for p, t in zip(prompts, out)]
    return GenerationOutput(tokens=tokens, stats=stats)
