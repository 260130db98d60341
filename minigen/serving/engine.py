"""`Engine`: continuous batching over one pool of paged blocks (chapter 14).

Shapes: B sequences in a step, T tokens per row of a prefill, V vocabulary; a block holds
`cache_chunk_size` (bs) token positions of every layer, as in vLLM.

    engine = Engine(model, max_batch_size=8, num_blocks=64)
    rid = engine.add_request(prompt_ids, max_new_tokens=32, temperature=0.7, do_sample=True, seed=1)
    for request_id, token in engine.stream(): ...   # each new token as it is sampled
    tokens = engine.run()                            # {request_id: prompt + new tokens, 1-D}
    engine.metrics()                                 # TTFT, TPOT, KV usage, hit rate, ... (scheduler.py)
    engine.forget(rid)                               # a finished request's record goes (a server's memory)

Every `step()` (iteration-level scheduling, as in Orca and vLLM) owns the blocks: the paged cache
and the step that runs the model only read the block tables and write into the blocks they are given.
  1. takes a block for each running sequence whose next token opens one (and the rest of a prompt
     under way); when the pool cannot, preempts the newest running sequence (its blocks go back; it is
     recomputed later);
  2. admits waiting requests that have arrived, first come first served, while `can_admit`
     (scheduler.py) says a batch slot and their prompts' blocks are free, reusing cached prefix blocks,
     and takes their prompts' blocks;
  3. runs the admitted prompts as one ragged prefill ([B, T], each row at its own positions) and
     the running sequences as one decode step ([B, 1], the step's `decode`), or both in the prompts'
     forward where the step gives a decode row decode's bits there (the fused C step: the weights
     stream once), through the same paged cache, each forward after `cache.reserve` (the window's
     frees, the sliding pool's blocks), and samples each row with its own settings and generator;
     with `max_num_batched_tokens` (vLLM's name; chunked prefill, Sarathi-Serve's stall-free
     batching) a step runs at most that many tokens: the decodes first, then prompt chunks in the
     space left, a prompt spread over as many steps as it takes (chapter 14); the chunks then run
     in as many forwards as keep each forward's padded rows within the budget (`forward_groups`), so the
     budget bounds a step's activations too (measure/plan.py: engine_bytes);
  4. gives back the blocks of finished requests (their full blocks stay cached for later hits).
A model with sliding layers (Mistral, Qwen2, Gemma: ModelConfig.layer_types) keeps them in a second
pool that holds each sequence's window only (caches/hybrid.py, HybridPagedKVCache), and serves no
prefix hits: a hit would skip positions whose keys its sliding layers then lack.
Each request's tokens equal generating it alone: rows never see each other (per-row positions
and masks), and each row samples from its own generator, seeded by its own `seed`.
"""

from __future__ import annotations

import math
import reprlib
import time
from typing import Iterator

import torch
from torch import Tensor

from ..config import GenerationConfig, resolve_config
from ..errors import CacheFullError, ConfigError, PromptError, RequestError
from ..generate import check_prompt
from ..paths import available_bytes, check_fits
from ..places import check_settings, check_where
from ..run_plan import make_plan
from ..numerics.precision import DTYPES
from ..sampling import make_generator
from ..caches.hybrid import HybridPagedKVCache
from ..caches.paged import PagedKVCache
from ..decoding.detokenize import StopText
from ..decoding.logprobs import logprobs_count, token_logprobs
from .scheduler import (REQUEST_KEYS, PrefixAllocator, Request, arrival_seconds, blocks_for, can_admit,
                        engine_metrics, forward_groups, prompt_tokens, request_processing)

DEFAULT_BLOCK_SIZE = 16  # cache_chunk_size when the config leaves it None (vLLM's default)
MEMORY_FRACTION = 0.1  # num_blocks=None: the pool takes at most this share of the memory available now
MAX_SLEEP_S = 3600.0  # stream() waits for a far arrival in naps of at most this: time.sleep overflows past ~3e2 years


class Engine:
    """Continuous batching of requests over one pool of `num_blocks` paged blocks.

    num_blocks=None sizes the pool for max_batch_size sequences of the model's whole context,
    capped at MEMORY_FRACTION (10%) of the memory available when the engine starts. A model with
    sliding layers: the pool's blocks hold its full layers only, and its sliding layers sit in a
    fixed pool of `sliding_blocks` (max_batch_size windows, HybridPagedKVCache.sliding_pool_blocks),
    whose bytes come out of that 10% first.
    """

    def __init__(self, model, config: GenerationConfig | dict | None = None, *, max_batch_size: int = 8,
                 num_blocks: int | None = None, max_num_batched_tokens: int | None = None, tokenizer=None):
        self.config = resolve_config(config, {})
        check_where(self.config, "engine")  # what the engine cannot run (places.WHERE_REFUSED), before any work
        if self.config.cache_chunk_size is None:
            self.config = self.config.replace(cache_chunk_size=DEFAULT_BLOCK_SIZE)
        if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size={max_batch_size!r} is invalid: use an integer >= 1 (sequences per step)")
        if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool)
                                       or num_blocks < 1):
            raise ConfigError(f"num_blocks={num_blocks!r} is invalid: use an integer >= 1 (blocks of "
                              f"{self.config.cache_chunk_size} tokens in the pool), or None to size it from memory")
        if max_num_batched_tokens is not None and (
                not isinstance(max_num_batched_tokens, int) or isinstance(max_num_batched_tokens, bool)
                or max_num_batched_tokens < max_batch_size):
            raise ConfigError(f"max_num_batched_tokens={max_num_batched_tokens!r} is invalid: a step runs every "
                              f"running sequence's next token first, so use an integer >= max_batch_size="
                              f"{max_batch_size} (e.g. {max(256, max_batch_size)}: the decodes, then prompt chunks "
                              "in the space left), or None to prefill each admitted prompt whole")
        self.model, self.max_batch_size = model, max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        # rows at their own positions; here the config meets the model and the machine, before the pool
        self.plan = make_plan(model, self.config, max_batch_size, "engine", tokenizer=tokenizer)
        self.tokenizer = tokenizer  # the model's: requests' stop strings and structured output read text
        self.forward_step = self.plan.step
        self.forward_step.reserves = False  # the scheduler (step) reserves every block before each forward
        c, bs = model.config, self.config.cache_chunk_size
        dtype = model.dtype if self.config.kv_dtype is None else DTYPES[self.config.kv_dtype]
        # A model with sliding layers keeps them in a pool of windows (HybridPagedKVCache), unless the
        # config imposes its own window (window_size, with sinks): then every layer keeps its window's blocks
        self.hybrid = c.sliding_layers > 0 and self.config.window_size is None
        layer_bytes = 2 * c.n_kv_heads * c.head_dim * dtype.itemsize * bs  # K and V of one block of one layer
        sliding = c.sliding_layers if self.hybrid else 0
        block_bytes = (c.n_layers - sliding) * layer_bytes  # a block of the engine's pool: the full layers
        self.sliding_blocks = (HybridPagedKVCache.sliding_pool_blocks(
            max_batch_size, c.sliding_window, bs, c.max_seq_len, max_num_batched_tokens or c.max_seq_len)
            if self.hybrid else 0)
        # each block of either pool also costs the allocator's host bookkeeping, measured on its lists
        host_bytes = math.ceil(PrefixAllocator.host_bytes_per_block())
        sliding_bytes = self.sliding_blocks * (sliding * layer_bytes + host_bytes)  # a fixed pool, whatever num_blocks
        if num_blocks is None:
            room = int(MEMORY_FRACTION * available_bytes(model.device)) - sliding_bytes
            fits = room // block_bytes if block_bytes else math.inf  # no full layers: the pool is bookkeeping
            num_blocks = max(1, min(max_batch_size * blocks_for(c.max_seq_len, bs), fits))
        # A pool that all of this device's memory could not hold is refused before its allocator's
        # lists and its tensors are made
        pool_bytes = num_blocks * (block_bytes + host_bytes) + sliding_bytes
        check_fits(pool_bytes, f"num_blocks={num_blocks:,} (a pool of blocks of {bs} tokens)",
                   "Fix: lower num_blocks, or pass num_blocks=None to size the pool from the memory available",
                   ConfigError, model.device)
        self.alloc = PrefixAllocator(num_blocks, bs)  # the engine's pool, which its cache reads through
        if self.hybrid:
            self.cache = HybridPagedKVCache(c.layer_types, c.n_kv_heads, c.head_dim, bs, self.alloc, c.sliding_window,
                                            self.sliding_blocks, dtype, model.device)
        else:
            self.cache = PagedKVCache(c.n_layers, 0, c.n_kv_heads, c.head_dim, bs, num_blocks, dtype, model.device,
                                      self.config.window_size,
                                      self.config.sink_tokens if self.config.window_size is not None else 0,
                                      allocator=self.alloc)
        self.policy = self.plan.make_policy(self.cache)
        self.num_blocks, self.block_size = num_blocks, bs
        self.requests: dict[int, Request] = {}  # id -> request, until forget(id); ids increase from 0
        self._next_id = 0
        self.waiting: list[Request] = []  # arrival order; preempted requests go back to the front
        self.running: list[Request] = []  # admission order: the newest is preempted first
        self.steps: list[dict] = []
        self.preemptions = self.hit_tokens = self.admitted_tokens = 0
        self._t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since the engine was created (t=0 of every time it reports)."""
        return time.perf_counter() - self._t0

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids, *, arrival_s: float | None = None, logprobs: int | None = None,
                    **overrides) -> int:
        """Queue a prompt (1-D token ids) -> its request id (0, 1, ... in add order).

        A prompt is a list or tuple of ints (not bools, not floats) or a 1-D integer tensor ([T] or
        [1, T]), each id in [0, vocab_size). `overrides` are GenerationConfig fields for this request
        only (scheduler.REQUEST_KEYS: sampling, penalties, logit_bias, stop ids and strings, structure). `arrival_s`
        (seconds since t=0, finite and >= 0; default now) replays a workload: the request is not
        admitted before it. `logprobs=k` (0..20) records in `requests[id].logprobs`, per sampled token,
        (its logprob, the top k (id, logprob)) of the model's raw fp32 logits (decoding/logprobs.py);
        None: the config's logprobs (None: nothing). A refused request raises before anything is queued: no id is used.
        """
        config = self.config.replace(**overrides)  # unknown keys: ConfigError with the closest name
        check_settings(config, "engine")  # n > 1: add n requests (the features are the pool's, below)
        cache_keys = sorted(k for k in overrides if k not in REQUEST_KEYS)
        if cache_keys:
            raise ConfigError(f"{', '.join(cache_keys)} cannot change per request: the engine's one pool sets "
                              f"them for every request. Pass them in Engine(model, config); per request: "
                              f"{', '.join(REQUEST_KEYS)}")
        tokens = prompt_tokens(prompt_ids, self.model.config.vocab_size)
        arrival = arrival_seconds(arrival_s, self.now())
        num_logprobs = logprobs_count(logprobs if logprobs is not None else config.logprobs)
        check_prompt(self.model, torch.tensor([tokens]), config.max_new_tokens, config)  # context, stop ids
        rid = self._next_id
        stop = config.stop_token_ids if config.stop_token_ids is not None else self.model.config.eos_token_ids
        req = Request(rid, tokens, config, frozenset(stop), arrival, make_generator(config, self.model.device),
                      num_logprobs=num_logprobs, processing=request_processing(
                          config, tokens, self.model.config.vocab_size, self.model.device, self.tokenizer, frozenset(stop)),
                      text=StopText(self.tokenizer, tokens, config.stop) if config.stop else None)
        need = blocks_for(req.max_positions, self.block_size)
        if need > self.num_blocks:
            raise PromptError(f"request of {len(req.prompt)} prompt tokens + max_new_tokens={config.max_new_tokens} "
                              f"needs {need} blocks of {self.block_size} tokens, and the pool holds {self.num_blocks}: "
                              f"raise num_blocks to at least {need}, or lower max_new_tokens or the prompt")
        self.requests[rid], self._next_id = req, rid + 1
        req.enter("queued", req.arrival_s)
        if config.max_new_tokens == 0:
            self._finish(req, "length")
        else:
            at = next((i for i, r in enumerate(self.waiting) if r.arrival_s > req.arrival_s), len(self.waiting))
            self.waiting.insert(at, req)
        return rid

    def _request(self, request_id) -> Request:
        """The request of an id add_request returned; RequestError for any other value (a bool is no id:
        Python would take True for 1)."""
        is_id = isinstance(request_id, int) and not isinstance(request_id, bool)
        if not is_id or request_id not in self.requests:
            ids = f"ids 0..{self._next_id - 1}" if self._next_id else "no requests yet"
            gone = " (finished and forgotten)" if is_id and 0 <= request_id < self._next_id else ""
            raise RequestError(f"unknown request id {reprlib.repr(request_id)} ({type(request_id).__name__}){gone}: this "
                               f"engine has {ids}, {len(self.requests)} remembered; use an int (not a bool) that "
                               "add_request returned and forget() did not drop")
        return self.requests[request_id]

    def cancel(self, request_id: int) -> None:
        """Stop a request now: its blocks go back to the pool; run() still returns the tokens it has."""
        req = self._request(request_id)
        if req.status == "finished":
            raise RequestError(f"request {request_id} is already {'cancelled' if req.finish_reason == 'cancelled' else 'finished'}"
                               f" ({req.finish_reason}): there is nothing left to cancel")
        (self.waiting if req.status == "waiting" else self.running).remove(req)
        self._finish(req, "cancelled")

    def forget(self, request_id: int) -> None:
        """Drop a finished (or cancelled) request's record, so that a long-running server's memory stays
        bounded: run() and metrics() leave it out, and its id is never given again."""
        req = self._request(request_id)
        if req.status != "finished":
            raise RequestError(f"request {request_id} is still {req.status}: only a finished or cancelled request "
                               "can be forgotten; cancel it first, or let it finish")
        del self.requests[request_id]

    def _free(self, req: Request) -> None:
        """Give back a request's blocks: the engine's pool and, for sliding layers, their window's pool."""
        if self.hybrid:
            self.cache.free(req.seq)
        self.alloc.free_sequence(req.seq)
        req.seq = None

    def _finish(self, req: Request, reason: str) -> None:
        if req.seq is not None:
            self._free(req)
        req.status, req.finish_reason, req.finish_s = "finished", reason, self.now()
        req.enter(None, req.finish_s)

    def _preempt(self, req: Request) -> None:
        """Recompute later: give its blocks back, and queue it first."""
        self._free(req)
        req.computed, req.status, req.prefilled = 0, "waiting", False
        req.preemptions += 1
        self.preemptions += 1
        req.enter("preempted", self.now())
        self.running.remove(req)
        self.waiting.insert(0, req)

    # ---------------------------------------------------------------- one step
    def step(self) -> dict[int, list[int]]:
        """Schedule, run one prefill and one decode forward, sample -> {request_id: new token ids}.
        With nothing to run (no request has arrived) it returns {} and records no step."""
        began, t = time.perf_counter(), self.now()
        # 1. the blocks of the running sequences' next tokens (and of the rest of the prompts partly
        #    prefilled), taken now: preempt the newest while the pool cannot hold them
        while self.running and not self._claim(self.running):
            self._preempt(self.running[-1])
        decoding = [r for r in self.running if r.prefilled]
        budget = None if self.max_num_batched_tokens is None else self.max_num_batched_tokens - len(decoding)
        # 2. prompt chunks: first the prompts already under way, in admission order ...
        chunks: list[tuple[Request, list[int]]] = []
        for req in self.running:
            if not req.prefilled and (budget is None or budget > 0):
                chunks.append((req, self._chunk(req, budget)))
                budget = None if budget is None else budget - len(chunks[-1][1])
        # ... then arrived requests, in order, while a slot and their blocks are free (and tokens are left)
        while self.waiting and self.waiting[0].arrival_s <= t and (budget is None or budget > 0):
            req = self.waiting[0]
            # no prefix hits with sliding layers: their window's keys of the skipped positions do not exist
            hits = [] if self.hybrid else self.alloc.lookup(req.block_keys((len(req.tokens) - 1) // self.block_size,
                                                                           self.block_size))
            fresh = blocks_for(len(req.tokens), self.block_size) - len(hits)
            revived = sum(self.alloc.refs[b] == 0 for b in hits)  # cached blocks no one holds: they leave the free list
            # the running sequences' blocks are taken already: none is left to reserve for them
            if not can_admit(fresh + revived, len(self.alloc.free), 0, len(self.running), self.max_batch_size):
                break
            self.waiting.pop(0)
            self._admit(req, hits)  # takes its prompt's blocks
            self.running.append(req)
            chunks.append((req, self._chunk(req, budget)))
            budget = None if budget is None else budget - len(chunks[-1][1])
        new: dict[int, list[int]] = {}
        if not chunks and not decoding:  # nothing has arrived yet (or the pool is full): no step to record
            return new
        with self.forward_step.grad_mode():
            # 3. ragged prefills of the prompt chunks, each from its first uncached position, and a decode step of
            #    every running sequence: in the last prompt forward where the step gives decode rows decode's bits
            groups = forward_groups(chunks, self.max_num_batched_tokens)
            mixed = bool(groups and decoding) and self.forward_step.takes_decodes_with_prompts(self.plan.prompt_ops)
            for i, group in enumerate(groups):
                riders = decoding if mixed and i == len(groups) - 1 else []  # the weights stream once for both
                self._forward([r for r, _ in group] + riders, [c for _, c in group] + [r.tokens[-1:] for r in riders],
                              new)
            if decoding and not mixed:
                self._forward(decoding, [r.tokens[-1:] for r in decoding], new, prompt=False)
        for req in [r for r, _ in chunks] + decoding:  # 4. finished requests give their blocks back
            if req.output and req.prefilled and (req.stopped() or len(req.output) >= req.config.max_new_tokens):
                self.running.remove(req)
                self._finish(req, "stop" if req.stopped() else "length")
        self.steps.append({"t_s": t, "step_s": time.perf_counter() - began,
                           "batch_size": len(chunks) + len(decoding), "kv_usage": self.alloc.n_used / self.num_blocks,
                           "prefill_tokens": sum(len(c) for _, c in chunks), "decode_tokens": len(decoding)})
        return new

    def _chunk(self, req: Request, budget: int | None) -> list[int]:
        """The tokens of `req`'s prompt (and output, after a preemption) this step computes: the rest, or
        the first `budget` of them."""
        rest = req.tokens[req.computed:]
        return rest if budget is None else rest[:budget]

    def _claim(self, reqs: list[Request]) -> bool:
        """Take the blocks that the next token of each of `reqs` (the rest of its prompt, while it is
        under way) is written into, copies on write included, all or none -> whether the pool held them."""
        spans = [(r.seq, r.computed, r.computed + 1 if r.prefilled else len(r.tokens)) for r in reqs]
        try:
            self.cache.copy_blocks(self.alloc.claim_all(spans))
        except CacheFullError:
            return False
        return True

    def _admit(self, req: Request, hits: list[int]) -> None:
        req.seq = self.alloc.add_sequence()
        self.alloc.share(req.seq, hits)
        req.computed = req.registered = req.cached = len(hits) * self.block_size
        self._claim([req])  # can_admit saw that its blocks are free
        req.cached_tokens += req.cached
        self.hit_tokens += req.cached
        self.admitted_tokens += len(req.tokens)
        req.status = "running"
        now = self.now()
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now
        req.enter("prefill", now)

    def _forward(self, reqs: list[Request], chunks: list[list[int]], new: dict[int, list[int]],
                 prompt: bool = True) -> None:
        """Run each request's `chunk` of tokens at its own positions (left padding) and sample its next
        token where the chunk reaches the end of its tokens (a prompt's earlier chunks only fill the cache).
        prompt=False: the decode step, whose products keep fp32 whatever prefill_precision says."""
        B, T, device = len(reqs), max(len(c) for c in chunks), self.model.device
        ids = torch.zeros(B, T, dtype=torch.long)
        pos = torch.full((B, T), -1, dtype=torch.long)
        for b, (req, chunk) in enumerate(zip(reqs, chunks)):
            ids[b, T - len(chunk):] = torch.tensor(chunk)
            pos[b, T - len(chunk):] = torch.arange(req.computed, req.computed + len(chunk))
        self.cache.select_rows([r.seq for r in reqs])
        # the blocks of this forward, before it: the full pool's were claimed; the window's frees and the
        # sliding pool's blocks are taken here, so the forward only reads the tables and writes the blocks
        self.cache.reserve(pos)
        # the prompts' products in their format (chapter 3); a decode step of more than 16 rows keeps fp32
        ops = self.plan.prompt_ops if prompt else self.plan.decode_ops  # the format and backend the plan chose
        step = self.forward_step.prefill if prompt else self.forward_step.decode
        logits = step(self.model, ids.to(device), pos.to(device), self.cache, self.policy, ops=ops)
        greedy = logits.argmax(dim=-1).tolist()
        now = self.now()
        for b, (req, chunk) in enumerate(zip(reqs, chunks)):
            req.computed += len(chunk)
            if req.computed == len(req.tokens):  # the last chunk: the logits of its last token are the next's
                plain = not req.config.do_sample and req.processing is None and req.text is None  # the argmax is its token
                token = greedy[b] if plain else req.sample_next(logits[b:b + 1])
                req.output.append(token)
                if req.num_logprobs is not None:  # only rows that asked pay for the softmax
                    req.logprobs.append(token_logprobs(logits[b], token, req.num_logprobs))
                req.prefilled = True
                new.setdefault(req.id, []).append(token)
                if req.first_token_s is None:
                    req.first_token_s = now
                if req.phases[-1][0] == "prefill":
                    req.enter("decode", now)
            if self.hybrid:  # no prefix cache (see step): nothing to offer
                continue
            n_full = req.computed // self.block_size  # offer its newly full blocks to the prefix cache
            table = self.alloc.tables[req.seq]
            for j, key in enumerate(req.block_keys(n_full, self.block_size)[req.registered:], req.registered):
                if table[j] >= 0:
                    self.alloc.register(table[j], key)
            req.registered = n_full

    # ---------------------------------------------------------------- driving it
    def unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stream(self) -> Iterator[tuple[int, int]]:
        """Step until every request has finished, yielding (request_id, token_id) as each token is sampled.
        While nothing runs and the next request has not arrived yet, it sleeps until it does."""
        while self.unfinished():
            if not self.running and self.waiting and self.waiting[0].arrival_s > self.now():
                time.sleep(min(max(0.0, self.waiting[0].arrival_s - self.now()), MAX_SLEEP_S))
            for rid, tokens in self.step().items():
                for token in tokens:
                    yield rid, token

    def run(self) -> dict[int, Tensor]:
        """Step until every request has finished -> {request_id: prompt + new tokens, 1-D}, every request
        added so far and not forgotten (a cancelled one with the tokens it had)."""
        for _ in self.stream():
            pass
        return {r.id: torch.tensor(r.tokens, dtype=torch.long) for r in self.requests.values()}

    def metrics(self) -> dict:
        """Serving metrics (times in seconds since t=0, the engine's creation), over finished requests:
        "ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s": {"p50", "p90", "p99", "mean", "n"};
        "output_tokens_per_s"; "preemptions"; "prefix_cache_hit_rate" (prompt tokens served from cached
        blocks / prompt tokens admitted); "steps": one {"t_s", "step_s", "batch_size", "kv_usage",
        "prefill_tokens", "decode_tokens"} per step(); "kv_usage", "batch_size" and "tokens_per_step" (prompt
        and decode tokens the step ran, at most max_num_batched_tokens) per step; "requests":
        per request its counts, times, finish_reason and phases [phase, start_s, end_s];
        "num_blocks", "block_size", "max_batch_size", "max_num_batched_tokens"; "sliding_blocks": the pool
        of a model's sliding layers (0: none; such a model serves no prefix hits, so its hit rate is 0)."""
        out = engine_metrics(list(self.requests.values()), self.steps, self.now(), self.preemptions, self.hit_tokens,
                              self.admitted_tokens)
        return {**out, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "max_batch_size": self.max_batch_size, "max_num_batched_tokens": self.max_num_batched_tokens,
                "sliding_blocks": self.sliding_blocks}
