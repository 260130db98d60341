"""The serving engine's bookkeeping, without a model: requests, the admission rule, prefix caching.

Shapes: none; token ids are Python ints, blocks are ids into one pool of `n_blocks` blocks of
`block_size` token slots (blocks.py), and times are seconds since the engine started.

Continuous batching (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023) schedules every step anew: the
running sequences decode one token each, then waiting requests join while a batch slot and the
blocks their prompts need are free (`can_admit`). When the running sequences' next tokens need
more blocks than are free, the newest one is preempted: its blocks go back, and it waits to be
recomputed from its prompt and the tokens it already has.

Prefix caching: a full block is keyed by a hash of its tokens and of every token before it (a
chain of hashes, as vLLM's automatic prefix caching), so two requests that share a system prompt
share its blocks, by reference count. A block nobody holds stays in the pool with its contents
and its key until the pool needs it: blocks that hold nothing are handed out first, then cached
ones in least-recently-used order (`PrefixAllocator`).
"""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..caches.blocks import BlockAllocator
from ..config import GenerationConfig
from ..decoding.detokenize import StopText
from ..decoding.logits import LogitsProcessing
from ..decoding.structured import compile_guide, require_tokenizer
from ..errors import ConfigError, PromptError
from ..sampling import sample
from .metrics import latency_stats


# ---------------------------------------------------------------- what a request and the engine take
# The serving engine (engine.py) runs every sequence in one pool of full-precision paged
# blocks. A request may override only what sampling and stopping mean for it; the rest is the pool's.
# What the engine cannot run at all is places.WHERE_REFUSED["engine"].
REQUEST_KEYS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids",
                "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "stop",
                "response_format", "guided_regex", "guided_grammar", "guided_backend")
PROMPTS_ACCEPTED = "a 1-D list or tuple of int token ids, or a 1-D integer tensor ([T] or [1, T])"


def request_processing(config: GenerationConfig, tokens: list[int], vocab_size: int, device: torch.device,
                       tokenizer=None, stop: frozenset[int] = frozenset()) -> LogitsProcessing | None:
    """A request's own logits processing (one row, from its prompt; its own Matcher of the structure
    its config names, compiled once per spec: decoding/structured.py), or None where it processes nothing."""
    require_tokenizer(config, tokenizer, "Engine(model, config, tokenizer=tok)")
    if not LogitsProcessing.needed(config):
        return None
    guide = compile_guide(config, tokenizer, vocab_size, sorted(stop))
    return LogitsProcessing(config, [torch.tensor(tokens, dtype=torch.long)], vocab_size, device,
                            [guide.matcher()] if guide is not None else None)


def prompt_tokens(prompt_ids, vocab_size: int) -> list[int]:
    """A request's prompt -> its token ids, each in [0, vocab_size); PromptError for anything else.
    Checked before any conversion: torch would truncate floats and bools to ids, and give raw errors
    for text, None, ragged lists and ids past int64."""
    given = f"{reprlib.repr(prompt_ids)} ({type(prompt_ids).__name__})"
    if isinstance(prompt_ids, Tensor):
        ids = prompt_ids[0] if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1 else prompt_ids
        if ids.dim() != 1 or ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise PromptError(f"the prompt is a {prompt_ids.dtype} tensor of shape {tuple(prompt_ids.shape)}: "
                              f"give {PROMPTS_ACCEPTED}")
        tokens = ids.tolist()
    elif isinstance(prompt_ids, (list, tuple)):
        for i, x in enumerate(prompt_ids):  # a bool is an int to Python, never a token id
            if not isinstance(x, numbers.Integral) or isinstance(x, bool):
                raise PromptError(f"the prompt's item {i} is {reprlib.repr(x)} ({type(x).__name__}): give "
                                  f"{PROMPTS_ACCEPTED}")
        tokens = [int(x) for x in prompt_ids]
    else:
        raise PromptError(f"the prompt is {given}: give {PROMPTS_ACCEPTED} (text: encode it with the "
                          "model's tokenizer first)")
    if not tokens:
        raise PromptError(f"the prompt is empty ({given}): give at least one token id")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError(f"the prompt's token id {tokens[bad]} (item {bad}) is outside this model's vocabulary "
                          f"[0, {vocab_size - 1}]: use the model's own tokenizer")
    return tokens


def arrival_seconds(arrival_s, now: float) -> float:
    """`add_request`'s arrival_s -> seconds since t=0 (None: now); ConfigError unless finite and >= 0."""
    if arrival_s is None:
        return now
    if (not isinstance(arrival_s, numbers.Real) or isinstance(arrival_s, bool)
            or not math.isfinite(arrival_s) or arrival_s < 0):
        raise ConfigError(f"arrival_s={reprlib.repr(arrival_s)} is invalid: use a finite number of seconds >= 0 "
                          "since the engine started (engine.now() is now), or None to arrive now")
    return float(arrival_s)


def can_admit(blocks_needed: int, free_blocks: int, reserved_blocks: int, running: int, max_batch_size: int) -> bool:
    """The admission rule: a waiting request joins the batch when a batch slot is free and the blocks
    its prompt needs fit in the free blocks left after those reserved for the running sequences'
    next tokens (so that admitting it never forces a preemption in the same step)."""
    return running < max_batch_size and blocks_needed <= free_blocks - reserved_blocks


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return math.ceil(tokens / block_size)


def forward_groups(chunks: list[tuple[Request, list[int]]], max_num_batched_tokens: int | None
                   ) -> list[list[tuple[Request, list[int]]]]:
    """The forwards that run a step's prompt chunks. A forward left-pads its chunks to the longest,
    so with max_num_batched_tokens every forward keeps its padded rows (chunks x longest) within the
    budget: a long chunk and a short one run apart, never as two long rows. Without a budget every
    chunk runs in one forward."""
    if max_num_batched_tokens is None:
        return [chunks] if chunks else []
    groups: list[list[tuple[Request, list[int]]]] = []
    for chunk in sorted(chunks, key=lambda rc: -len(rc[1])):  # the longest first: it sets its group's width
        group = groups[-1] if groups else None
        if group is not None and (len(group) + 1) * len(group[0][1]) <= max_num_batched_tokens:
            group.append(chunk)
        else:
            groups.append([chunk])
    return groups


def block_hashes(tokens: list[int], block_size: int, start: int = 0, prev: int | None = None) -> list[int]:
    """The chain hash of each full block of `tokens` from block `start`: hash(previous block's key,
    this block's tokens), so a key names a block's tokens and everything before them."""
    keys = []
    for j in range(start, len(tokens) // block_size):
        prev = hash((prev, tuple(tokens[j * block_size:(j + 1) * block_size])))
        keys.append(prev)
    return keys


class PrefixAllocator(BlockAllocator):
    """A BlockAllocator whose full blocks can be found again by their key (prefix caching).

    `free` keeps blocks with no key at its end (handed out first: it is a stack) and free blocks
    with a key before them, the least recently released nearest the end: taking one evicts it.
    """

    def __init__(self, n_blocks: int, block_size: int):
        super().__init__(n_blocks, block_size)
        self.key_of: dict[int, int] = {}  # block -> its key
        self.block_of: dict[int, int] = {}  # key -> block

    def register(self, block: int, key: int) -> None:
        """Remember that `block` (full) holds the tokens named by `key`, unless another block already does."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key], self.key_of[block] = block, key

    def lookup(self, keys: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (stops at the first key not cached)."""
        found = []
        for key in keys:
            if key not in self.block_of:
                break
            found.append(self.block_of[key])
        return found

    def free_sequence(self, seq: int) -> None:
        """Release its blocks last first: a prefix's tail is then evicted before its head, which
        every later block's key depends on (vLLM frees in the same order)."""
        self.tables[seq].reverse()
        super().free_sequence(seq)

    def take(self) -> int:
        b = super().take()
        key = self.key_of.pop(b, None)
        if key is not None:  # evicted: its tokens are about to be overwritten
            del self.block_of[key]
        return b

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.key_of:
                self.free.insert(0, b)  # kept for a later hit; the most recently released is evicted last
            else:
                self.fill[b] = 0
                self.free.append(b)


@dataclass
class Request:
    """One request's tokens, its own sampling settings and its history (times in seconds since t=0)."""
    id: int
    prompt: list[int]
    config: GenerationConfig  # the engine's config with this request's overrides
    stop: frozenset[int]  # stop token ids
    arrival_s: float
    generator: torch.Generator | None = None  # its own sampling generator (seeded per request)
    output: list[int] = field(default_factory=list)
    seq: int | None = None  # the allocator's sequence while it holds blocks
    computed: int = 0  # positions whose keys and values sit in the cache
    prefilled: bool = False  # its prompt (and any output, after a preemption) fully computed: it decodes
    keys: list[int] = field(default_factory=list)  # chain hashes of its full blocks, in order
    registered: int = 0  # its logical blocks already offered to the prefix cache (this admission)
    status: str = "waiting"  # "waiting", "running", "finished"
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0  # prompt positions served from cached blocks (every admission)
    cached: int = 0  # of those, at its latest admission
    preemptions: int = 0
    num_logprobs: int | None = None  # logprobs=k: record each sampled token's logprob and the top k (None: none)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # one per output token
    phases: list[list] = field(default_factory=list)  # [phase, start_s, end_s or None while open]
    processing: LogitsProcessing | None = None  # its penalties, bias and mask (decoding/logits.py); None: raw logits
    text: StopText | None = None  # its text, where config.stop's strings end it (None: no stop strings)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def max_positions(self) -> int:
        """Positions it can ever write: prompt + max_new_tokens - 1 (the last token is never fed back)."""
        return len(self.prompt) + max(self.config.max_new_tokens, 1) - 1

    def sample_next(self, logits: Tensor) -> int:
        """Sample its next token from its row's logits [1, V]: its penalties, bias and mask first (from its own
        tokens alone), then its own sampling settings and generator; the token joins its state."""
        if self.processing is not None:
            logits = self.processing(logits)
        token = sample(logits, self.config, self.generator)  # [1]
        if self.processing is not None:
            self.processing.advance(token)
        if self.text is not None:
            self.text.push(int(token))
        return int(token)

    def stopped(self) -> bool:
        """Its last token is a stop id, or completed one of its stop strings."""
        return self.output[-1] in self.stop or (self.text is not None and self.text.matched)

    def block_keys(self, n: int, block_size: int) -> list[int]:
        """The keys of its first n full blocks (computed once, extended as it grows)."""
        if len(self.keys) < n:
            self.keys += block_hashes(self.tokens[:n * block_size], block_size, len(self.keys),
                                      self.keys[-1] if self.keys else None)
        return self.keys[:n]

    def enter(self, phase: str, now: float) -> None:
        """Close the open phase at `now` and open `phase` (None: just close)."""
        if self.phases and self.phases[-1][2] is None:
            self.phases[-1][2] = now
        if phase is not None:
            self.phases.append([phase, now, None])


# ---------------------------------------------------------------- the metrics, as vLLM names them
def engine_metrics(requests: list[Request], steps: list[dict], now: float, preemptions: int,
                    hit_tokens: int, admitted_tokens: int) -> dict:
    """The metrics dict of Engine.metrics() (its docstring lists the keys), from the Engine's live
    Request objects and steps (serving/metrics.py's summarize reads finished runs' records)."""
    done = [r for r in requests if r.status == "finished"]
    timed = [r for r in done if r.first_token_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in timed]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.output) - 1) for r in timed if len(r.output) > 1]
    e2e = [r.finish_s - r.arrival_s for r in done]
    queue = [r.first_scheduled_s - r.arrival_s for r in done if r.first_scheduled_s is not None]
    span = (max(r.finish_s for r in done) - min(r.arrival_s for r in done)) if done else 0.0
    out_tokens = sum(len(r.output) for r in done)
    return {
        "ttft_s": latency_stats(ttft), "tpot_s": latency_stats(tpot),
        "e2e_latency_s": latency_stats(e2e), "queue_time_s": latency_stats(queue),
        "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "preemptions": preemptions,
        "prefix_cache_hit_rate": hit_tokens / admitted_tokens if admitted_tokens else 0.0,
        "steps": [dict(s) for s in steps],
        "kv_usage": [s["kv_usage"] for s in steps], "batch_size": [s["batch_size"] for s in steps],
        "tokens_per_step": [s["prefill_tokens"] + s["decode_tokens"] for s in steps],
        "requests": [{"request_id": r.id, "prompt_tokens": len(r.prompt), "output_tokens": len(r.output),
                      "cached_tokens": r.cached_tokens, "preemptions": r.preemptions, "arrival_s": r.arrival_s,
                      "first_scheduled_s": r.first_scheduled_s, "first_token_s": r.first_token_s,
                      "finish_s": r.finish_s, "finish_reason": r.finish_reason,
                      "phases": [[p, a, now if b is None else b] for p, a, b in r.phases]} for r in requests],
    }
