"""The generation loop: generate, stream, ragged batches and parallel sampling, all through one loop.

Shapes: B batch, T prompt tokens, n new tokens, V vocabulary.

    generate ─> make_plan ─> plan.make_cache ─> step.prefill(prompt) ─> sample ─> step.decode(token) ─> ...

`run_steps` is the loop, the one place where prefill and decode steps run; a generation builds its
plan once (run_plan.py: `print(plan)` says what runs), which holds the step object: the naive loop
(use_cache=False, every step runs the whole sequence so far: chapter 1), the eager cached loop (the
prompt once, then one token per step at its explicit position: chapter 2), the compiled or CUDA-graph
step (chapter 11), or the fused C step (chapter 10: the default at batch 1 on a CPU). A tensor batch [B, T] shares its positions; a
ragged batch (a list of prompts) runs each row at its own positions; `parallel_sample` (chapter 5)
prefills one prompt into a paged cache and forks it into n rows that share its blocks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from .attention import AttentionObserver
from .beam import beam_search
from .caches.contract import Cache
from .config import GenerationConfig, resolve_config
from .decoding.logits import LogitsProcessing
from .decoding.settings import check_vocabulary
from .errors import ConfigError, PromptError
from .model import Model
from .run_plan import Plan, given_plan, make_plan
from .decoding.detokenize import StopText
from .decoding.guide import Guide
from .decoding.logprobs import RowLogprobs, TokenLogprobs
from .sampling import sample
from .stats import GenerationStats, finish_timing, record_cache


@dataclass
class GenerationOutput:
    tokens: Tensor | list[Tensor]  # [B, T + n]: the prompt then the new tokens, as transformers returns them;
    # for a list of prompts, a list of 1-D tensors: each prompt then its new tokens, up to its own stop
    stats: GenerationStats
    # each row's new text (generate(..., tokenizer=tok)), cut before a stop string; None without a tokenizer
    texts: list[str] | None = None
    # logprobs=k: each row's (logprob, top k [(id, logprob)]) per new token, up to its stop (decoding/logprobs.py)
    logprobs: list[list[TokenLogprobs]] | None = None


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
    if config is not None:
        check_vocabulary(config, V)  # logit_bias's ids


def run_steps(model: Model, plan: Plan, input_ids: Tensor, input_pos: Tensor, cache: Cache | None, policy,
              stats: GenerationStats, next_pos: Callable[[int, Tensor], Tensor], stop: bool = True,
              after_prefill: Callable[[Tensor], Tensor] | None = None,
              texts: list[StopText] | None = None, logprobs: RowLogprobs | None = None) -> Iterator[Tensor]:
    """The loop itself: prefill input_ids [B, T] at input_pos, then sample and decode until
    max_new_tokens or (with `stop`) every row has produced a stop token. Yields the next tokens [B]
    and fills `stats` as it goes. `plan` holds the step, the config and the generators (run_plan.py).

    next_pos(i, finished [B] bool) gives the positions of step i's token: [1] for rows in lockstep,
    or [B, 1] per row. A finished row is fed its stop token again (its output is discarded).
    after_prefill maps the prompt's logits before the first sample (parallel sampling's fork).
    A step that loops on the device (GraphedStep, cuda_graphs) takes over after the first token: its
    tokens come in chunks of steps/graphs.STOP_CHECK_EVERY, as the host reads its stop flags.
    Penalties, logit_bias (and structured output) process each row's logits before it samples, from
    that row's own tokens (decoding/logits.py); a step that samples inside (speculative) reads the
    same state through step.processing. texts: each row's StopText (row_texts), which its live tokens
    join; a row whose text reaches one of config.stop stops there. logprobs: where each live row's
    token's log-probabilities go, read from the raw logits it was sampled from (a speculative step
    hands over those of the verify forward that accepted it).
    """
    step, config, generators = plan.step, plan.config, plan.generators
    n = config.max_new_tokens
    stats.step, stats.plan = step.name, str(plan)
    if n == 0:
        return
    stop_list = config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids
    stop_ids = torch.tensor(stop_list if stop else (), dtype=torch.long, device=input_ids.device)
    pad = stop_list[0] if stop_list else 0  # finished sequences are padded with their stop token
    start = last = time.perf_counter()
    with step.grad_mode():
        # the prompt's products in their own format (chapter 3), and the attention backend: the plan's ops
        logits = step.prefill(model, input_ids, input_pos, cache, policy, ops=plan.prompt_ops)
        processing = step.processing = row_processing(config, input_ids, input_pos, model.config.vocab_size, plan.guide)
        if after_prefill is not None:
            logits = after_prefill(logits)
            if processing is not None and logits.shape[0] != processing.rows:  # parallel sampling's fork
                processing.fork(logits.shape[0])
        stats.prefill_s = time.perf_counter() - start
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=input_ids.device)  # [B] (after a fork: n)
        for i in range(n):
            # a CUDA-graph step samples inside its graph: from the second token on, `logits` are tokens
            if step.samples_inside and i > 0:
                token = logits
            else:  # each row's penalties, bias and mask first, from its own tokens (decoding/logits.py)
                token = sample(processing(logits) if processing is not None else logits, config, generators)  # [B]
            token = torch.where(finished, torch.full_like(token, pad), token)
            if logprobs is not None:  # the model's own view of each live row's token
                if step.samples_inside and i > 0:
                    logprobs.add(step.last_logprobs, (~finished).tolist())
                else:
                    logprobs.record(logits, token, (~finished).tolist())
            if processing is not None:  # the row's token joins its state (a stopped row's padding does not)
                processing.advance(token, finished=finished)
            if texts is not None:  # and its text, where a stop string may end the row
                for text, t, done in zip(texts, token.tolist(), finished.tolist()):
                    if not done:
                        text.push(t)
                if config.stop:  # only stop strings end a row on its text
                    finished |= torch.tensor([text.matched for text in texts], device=finished.device)
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - start
            stats.token_latencies_s.append(now - last)
            last = now
            stats.new_tokens = i + 1
            record_cache(stats, cache)
            yield token
            finished |= torch.isin(token, stop_ids)
            if i == n - 1 or bool(finished.all()):
                break
            if step.loops_on_device:  # cuda_graphs: every later token from the device's own loop (steps/graphs.py)
                yield from _device_tokens(step.decode_loop(model, token, next_pos(i, finished), finished, cache, policy,
                                                           n - 1 - i, stop_ids, pad, plan.decode_ops), stats, cache, last)
                break
            logits = step.decode(model, token[:, None], next_pos(i, finished), cache, policy, ops=plan.decode_ops)
    step.report(stats)
    finish_timing(stats.timing, start)


def row_processing(config: GenerationConfig, input_ids: Tensor, input_pos: Tensor,
                   vocab_size: int, guide: Guide | None = None) -> LogitsProcessing | None:
    """Each row's logits processing, from its own prompt (input_ids [B, T] without the padding at
    position -1) and, under structured output, its own Matcher of `guide`; None where the config
    processes nothing."""
    if not LogitsProcessing.needed(config):
        return None
    real = input_pos >= 0 if input_pos.dim() == 2 else torch.ones_like(input_ids, dtype=torch.bool)
    matchers = [guide.matcher() for _ in range(input_ids.shape[0])] if guide is not None else None
    return LogitsProcessing(config, [row[keep] for row, keep in zip(input_ids, real)], vocab_size, input_ids.device,
                            matchers)


def row_texts(plan: Plan, prompts: list[Tensor]) -> list[StopText] | None:
    """Each row's StopText (its new text, cut at config.stop) where the plan has a tokenizer; else None."""
    if plan.tokenizer is None:
        return None
    return [StopText(plan.tokenizer, p.tolist(), plan.config.stop) for p in prompts]


def _device_tokens(chunks: Iterator[list[Tensor]], stats: GenerationStats, cache: Cache | None,
                   last: float) -> Iterator[Tensor]:
    """Yield the tokens of a device loop's chunks, filling `stats`: each token's latency is its
    chunk's wall time divided evenly among the chunk's tokens (the host sees a chunk at once)."""
    for chunk in chunks:
        now = time.perf_counter()
        for token in chunk:
            stats.token_latencies_s.append((now - last) / len(chunk))
            stats.new_tokens += 1
            yield token
        last = now
    record_cache(stats, cache)


def _start_batch(model: Model, input_ids: Tensor, config: GenerationConfig, observers: tuple[AttentionObserver, ...],
                 draft_model, plan: Plan | None, tokenizer=None) -> Plan:
    """A tensor batch's checks and its plan, before any work (so that stream raises at the call, not
    at its first next()). Beam search runs num_beams rows a prompt."""
    check_prompt(model, input_ids, config.max_new_tokens, config)
    B, max_len = input_ids.shape[0] * config.num_beams, input_ids.shape[1] + config.max_new_tokens
    if plan is None:
        return make_plan(model, config, B, "generate", max_len=max_len, observers=observers, draft_model=draft_model,
                         tokenizer=tokenizer)
    return plan.check_fits(B, max_len)


def _stream_batch(model: Model, input_ids: Tensor, plan: Plan, stats: GenerationStats,
                  texts: list[StopText] | None = None, logprobs: RowLogprobs | None = None) -> Iterator[Tensor]:
    """A tensor batch [B, T]: every row at positions 0..T-1, then T, T + 1, ... in lockstep (the loop
    feeds the rows in lockstep; a speculative step's rows verify at their own positions)."""
    T = input_ids.shape[1]
    cache = plan.make_cache(model)
    with plan.step.grad_mode():
        policy = plan.make_policy(cache)
    input_pos = torch.arange(T, device=input_ids.device)
    yield from run_steps(model, plan, input_ids, input_pos, cache, policy, stats,
                         lambda i, finished: torch.tensor([T + i], device=input_ids.device), texts=texts,
                         logprobs=logprobs)


def generate(model: Model, input_ids: Tensor, config: GenerationConfig | None = None, *,
             observers: tuple[AttentionObserver, ...] = (), draft_model: Model | None = None,
             plan: Plan | None = None, tokenizer=None, **overrides) -> GenerationOutput:
    """Generate up to max_new_tokens after input_ids [B, T] -> GenerationOutput(tokens [B, T+n], stats).

    input_ids may also be a list of 1-D prompts of different lengths (a ragged batch): each row
    runs at its own positions and stops at its own stop token; tokens is then a list of 1-D tensors.
    `observers` see every layer's attention probabilities (e.g. entropy.EntropyMonitor).
    `draft_model` proposes tokens for speculative_method="draft" (steps/speculative.py): any minigen
    Model with the target's vocabulary (minigen.drafts makes them from the target).
    With do_sample, row r draws from its own generator seeded (seed + r) mod 2**64 (sampling.py):
    its tokens equal that prompt generated alone with that seed, whatever it is batched with.
    `plan`: one that make_plan built (and print(plan) showed) for this batch, run instead of a new
    one; it holds its config. stats.plan says, in words, what ran.
    num_beams=k > 1: beam search (beam.py), each prompt's best of k beams, as transformers' generate
    returns it (a plan for it runs B x k rows).
    `tokenizer` (the model's): GenerationOutput.texts holds each row's new text; the settings that read
    text need it (stop strings, response_format, guided_regex, guided_grammar).
    n=k > 1: k samples of each prompt, as k rows of one batch (each prompt's prefill runs k times: for
    one prompt's blocks shared, see parallel_sample); output row b * k + j is prompt b's sample j,
    seeded (seed + b * k + j), and a plan given for it holds B x k rows.
    logprobs=k: GenerationOutput.logprobs (decoding/logprobs.py).
    """
    where = "ragged" if isinstance(input_ids, (list, tuple)) else "generate"
    config = given_plan(plan, config, overrides, where, observers=observers, draft_model=draft_model) \
        or resolve_config(config, overrides)
    input_ids = each_n_times(input_ids, config.n)
    if where == "ragged":
        return _generate_ragged(model, input_ids, config, tuple(observers), draft_model, plan, tokenizer)
    stats = GenerationStats()
    plan = _start_batch(model, input_ids, config, tuple(observers), draft_model, plan, tokenizer)
    if config.num_beams > 1:  # beam search (beam.py): the best of num_beams beams a prompt
        return GenerationOutput(tokens=beam_search(model, input_ids, plan, stats), stats=stats)
    texts, logprobs = row_texts(plan, list(input_ids)), row_logprobs(config, input_ids.shape[0])
    new = list(_stream_batch(model, input_ids, plan, stats, texts, logprobs))
    tokens = torch.cat([input_ids, torch.stack(new, dim=1)], dim=1) if new else input_ids.clone()
    return GenerationOutput(tokens=tokens, stats=stats, texts=[t.text() for t in texts] if texts else None,
                            logprobs=logprobs.rows if logprobs is not None else None)


def each_n_times(input_ids, n: int):
    """Each prompt n times in a row ([B, T] -> [B * n, T], or a list of B prompts -> B * n): n samples a prompt."""
    if n == 1 or not isinstance(input_ids, (Tensor, list, tuple)):
        return input_ids
    if isinstance(input_ids, Tensor):
        return input_ids.repeat_interleave(n, dim=0) if input_ids.dim() == 2 else input_ids
    return [p for p in input_ids for _ in range(n)]


def row_logprobs(config: GenerationConfig, rows: int) -> RowLogprobs | None:
    """Where a generation that asks for logprobs (config.logprobs=k) records them; None where it asks for none."""
    if config.logprobs is None:
        return None
    return RowLogprobs(config.logprobs, rows)


def stream(model: Model, input_ids: Tensor, config: GenerationConfig | None = None, *,
           observers: tuple[AttentionObserver, ...] = (), stats: GenerationStats | None = None,
           draft_model: Model | None = None, plan: Plan | None = None, tokenizer=None, **overrides) -> Iterator[Tensor]:
    """Yield each new token [B] (with n > 1: [B * n]) as soon as it is sampled; `stats`, when given, is
    filled as the tokens come (the TTFT at the first, the decode rate and percentiles once the stream ends)."""
    config = given_plan(plan, config, overrides, "generate", observers=observers, draft_model=draft_model) \
        or resolve_config(config, overrides)
    if config.num_beams > 1:
        raise ConfigError(f"stream with num_beams={config.num_beams}: a beam search knows its tokens only when it ends "
                          "(a later step may drop the beam a token was on). Fix: generate(model, ids, num_beams=...) "
                          "in Python (`minigen generate` streams), or num_beams=1 to stream")
    if config.logprobs is not None:
        raise ConfigError(f"stream with logprobs={config.logprobs}: stream yields each step's tokens [B] alone. Fix: "
                          "generate(model, ids, logprobs=k) (GenerationOutput.logprobs), or the serving engine's "
                          "AsyncEngine.submit(ids, logprobs=k), whose stream carries them token by token")
    # Check here: a generator function would only raise at the first next(), far from the call.
    input_ids = each_n_times(input_ids, config.n)  # n samples a prompt: rows b * n + j
    plan = _start_batch(model, input_ids, config, tuple(observers), draft_model, plan, tokenizer)
    return _stream_batch(model, input_ids, plan, stats if stats is not None else GenerationStats(),
                         row_texts(plan, list(input_ids)))


# ---------------------------------------------------------------- prefix sharing: parallel sampling
@dataclass
class ParallelSample:
    tokens: Tensor  # [n, T + new]: the prompt followed by each sample's new tokens
    blocks_after_fork: int  # physical blocks held right after the fork (the prompt's, shared)
    blocks_used: int  # physical blocks held at the end
    blocks_unshared: int  # blocks n separate caches would hold at the end
    shared_hit_rate: float  # block-table entries served by a shared block, at the end
    logprobs: list[list[TokenLogprobs]] | None = None  # logprobs=k: each sample's, per new token (decoding/logprobs.py)


def parallel_sample(model: Model, input_ids: Tensor, n: int, config: GenerationConfig | None = None, *,
                    plan: Plan | None = None, tokenizer=None, **overrides) -> ParallelSample:
    """Prefill one prompt [1, T] once, fork it into n rows that share its blocks, sample each row.

    Every row runs max_new_tokens (stop tokens are ignored). cache_chunk_size defaults to 16; the
    cache is paged (and may be quantized, windowed or offloaded before the fork, as the config says).
    Sample r draws from its own generator, seeded (seed + r) mod 2**64: it equals
    generate(model, input_ids, config, seed=seed + r), and the n samples differ.
    """
    _check_parallel_args(input_ids, n)
    config = given_plan(plan, config, overrides, "parallel_sample") or resolve_config(config, overrides)
    if config.stop:
        raise ConfigError(f"stop={list(config.stop)} with parallel_sample: its n samples each run max_new_tokens, "
                          "stop ids and strings alike ignored. Fix: generate(model, ids, config, n=n, do_sample=True, "
                          "tokenizer=tok), whose rows stop at their own stop strings")
    check_prompt(model, input_ids, config.max_new_tokens, config)
    T, new = input_ids.shape[1], config.max_new_tokens
    # paged (the plan's blocks of 16 where the config names none): the eager step, which the table keeps
    plan = plan.check_fits(n, T + new) if plan else make_plan(model, config, n, "parallel_sample", max_len=T + new,
                                                                   tokenizer=tokenizer)
    bs = plan.config.cache_chunk_size
    unshared = n * math.ceil((T + new) / bs)
    cache = plan.make_cache(model, rows=1, pool_rows=n)  # one row now, n after the fork
    policy = plan.make_policy(cache)
    forked: list[int] = []
    logprobs = row_logprobs(config, n)

    def fork(logits: Tensor) -> Tensor:  # [1, V] -> [n, V]: one prompt, n rows sharing its blocks
        cache.fork(n)
        forked.append(cache.blocks[0])  # blocks in use
        return logits.expand(n, -1)

    tokens = list(run_steps(model, plan, input_ids, torch.arange(T, device=input_ids.device), cache, policy,
                            GenerationStats(), lambda i, _: torch.tensor([T + i], device=input_ids.device),
                            stop=False, after_prefill=fork, logprobs=logprobs))
    out = torch.cat([input_ids.expand(n, -1), torch.stack(tokens, dim=1)], dim=1) if tokens else input_ids.expand(n, -1)
    in_use = cache.blocks[0]
    result = ParallelSample(out, forked[0] if forked else in_use, in_use, unshared, cache.shared_hit_rate,
                            logprobs.rows if logprobs is not None else None)
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
                     draft_model: Model | None = None, plan: Plan | None = None, tokenizer=None) -> GenerationOutput:
    """Prompts of different lengths in one batch: left-padded, each row at its own positions
    0..len-1 (padding at -1, never written or attended), then decoded at its own position; a row
    that has stopped is fed at position -1, so it writes nothing."""
    check_prompts(model, prompts, config)
    if observers:
        raise ConfigError("observers with a list of prompts: an observer would see the padding rows' attention. "
                          "Generate the prompts one at a time, or as one [B, T] tensor of equal lengths.")
    lens = [p.numel() for p in prompts]
    B, T, n = len(prompts), max(lens), config.max_new_tokens
    plan = plan.check_fits(B, T + n) if plan else make_plan(model, config, B, "ragged", max_len=T + n,
                                                           draft_model=draft_model, tokenizer=tokenizer)
    stats, device = GenerationStats(), model.device
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    pos = torch.full((B, T), -1, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):  # left padding: every row's last column is its last token
        ids[b, T - lens[b]:], pos[b, T - lens[b]:] = p.to(device), torch.arange(lens[b], device=device)
    row_lens = torch.tensor(lens, device=device)
    cache = plan.make_cache(model)
    with torch.inference_mode():
        policy = plan.make_policy(cache)

    def next_pos(i: int, finished: Tensor) -> Tensor:  # [B, 1]: each row after its own prompt; -1 once done
        return torch.where(finished, -1, row_lens + i)[:, None]

    texts, logprobs = row_texts(plan, list(prompts)), row_logprobs(config, B)
    new = list(run_steps(model, plan, ids, pos, cache, policy, stats, next_pos, texts=texts, logprobs=logprobs))
    stop = set(config.stop_token_ids if config.stop_token_ids is not None else model.config.eos_token_ids)
    out: list[list[int]] = [[] for _ in range(B)]
    for token in new:  # each row up to and including its own stop (a stop id, or the token its stop string ends in)
        for b, t in enumerate(token.tolist()):
            ended = texts is not None and texts[b].matched and len(out[b]) >= texts[b].pushed
            if not out[b] or (out[b][-1] not in stop and len(out[b]) < n and not ended):
                out[b].append(t)
    tokens = [torch.cat([p, torch.tensor(t, dtype=p.dtype, device=p.device)]) for p, t in zip(prompts, out)]
    return GenerationOutput(tokens=tokens, stats=stats, texts=[t.text() for t in texts] if texts else None,
                            logprobs=logprobs.rows if logprobs is not None else None)
