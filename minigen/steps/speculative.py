"""Speculative decoding (chapter 13): propose k tokens cheaply, check them all in one forward.

Shapes: B batch rows, k proposed tokens, T = k + 1 verified positions, V vocabulary.

At batch 1 a decode step streams every weight to produce one token (chapter 10's roofline), so a
forward of k + 1 tokens costs little more than a forward of one: the several-row kernels read each
weight once for all of them. A proposer guesses the next k tokens; the target runs the last
accepted token and the k guesses in one forward, which gives its own next-token distribution at
each of the k + 1 positions; the guesses it agrees with are kept, and the first position where it
disagrees gives one more token from the target itself (the bonus), so every forward emits at least
one token, and up to k + 1.

    proposers: NgramProposer   prompt lookup: what followed the last match of the newest n-gram
               DraftProposer   a smaller model (a layer-skipping or quantized self-draft, drafts.py)
    the rule:  accept_greedy   keep the guesses equal to the target's argmax, then its argmax
               accept_sampled  Leviathan et al. 2023 / Chen et al. 2023: keep guess x with probability
                               min(1, p(x) / q(x)), else draw from max(0, p - q) normalised: the tokens
                               come out distributed exactly as the target's own samples

Penalties, logit_bias and structured masks (decoding/logits.py) process both sides: the draft draws
each proposal from its processed logits, as if the proposals before it were kept (`after`), and the
rule compares the target's processed distribution at each position (`speculate`) with that q, so
the tokens kept are distributed exactly as the loop's own processed samples (greedy: its argmax).
The loop advances the state with every token it hands out; a round never changes it.

Rejected positions leave the cache through the contract alone: the next forward writes from the
first rejected position, and a write at position p forgets every position >= p (caches/contract.py):
the contiguous cache overwrites, the paged cache gives the blocks back, the window's ring keeps k
spare slots (window.py). Caches that cannot forget (heavy hitters, quantized groups) are refused
by the combination table.

`SpeculativeStep` is a step object of generate's one loop (eager.py): the loop feeds it one token a
row and it hands back one token a row, running a round (propose, verify, accept) whenever a row has
no accepted token left to hand out. Rows are independent: each keeps its own text, its own
positions, its own accepted tokens and (sampling) its own generator, which alone draws its
proposals and its acceptance tests; a round runs the rows that need one, the others as padding.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch
from torch import Tensor

from ..run_rules import FUSED_MAX_ROWS
from ..config import GenerationConfig
from ..decoding.logprobs import token_logprobs
from ..errors import ConfigError
from ..model import Model
from ..sampling import Generators, draw, greedy, probabilities
from .eager import EagerStep


# ---------------------------------------------------------------- proposers
def ngram_proposal(text: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup (Saxena 2023; transformers' prompt_lookup_num_tokens, vLLM's "ngram"): for n from
    max_n down to min_n, find the last earlier occurrence of the text's final n tokens and propose
    the (up to) k tokens that followed it; [] when no n-gram recurs."""
    for n in range(min(max_n, len(text) - 1), min_n - 1, -1):
        tail = text[-n:]
        for start in range(len(text) - n - 1, -1, -1):  # latest match first, never the tail itself
            if text[start:start + n] == tail:
                return text[start + n:start + n + k]
    return []


class NgramProposer:
    """Proposes from the text itself: no model, no cost but a search (q is a point mass)."""
    name = "ngram"

    def __init__(self, config: GenerationConfig):
        self.k, self.min_n, self.max_n = config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max

    def start(self, texts: list[list[int]]) -> None:
        """Nothing to prepare: the proposals come from the text."""

    def propose(self, rows: list[int], texts: list[list[int]], ks: list[int], generators: Generators,
                processing=None) -> tuple[list[list[int]], list[Tensor | None]]:
        """Up to ks[i] tokens for each row in `rows` -> (proposals, None: q is one-hot on each proposal).
        The text's own continuation, whatever the processing: the acceptance rule weighs it by p alone."""
        return [ngram_proposal(texts[b], k, self.min_n, self.max_n) if k else [] for b, k in zip(rows, ks)], \
            [None] * len(rows)

    def accepted(self, row: int, kept: int) -> None:
        """Nothing cached to rewind."""


def draft_config(config: GenerationConfig) -> GenerationConfig:
    """The draft's own config: the target's sampling (so that q is what the draft draws from), a plain
    full-precision cache, no speculation, and int8_activations=False where the target's config says so
    (an int4 draft of an fp32 target then proposes with fp32 activations; else "auto": a quantized
    draft takes int8 ones where they measured faster, as on an AMD Zen 1)."""
    sampling = {"temperature": config.temperature, "top_k": config.top_k, "top_p": config.top_p, "min_p": config.min_p}
    return GenerationConfig(max_new_tokens=config.max_new_tokens, do_sample=not greedy(config),
                            int8_activations=False if config.int8_activations is False else "auto",
                            **(sampling if not greedy(config) else {}))


class DraftProposer:
    """A draft model proposes k tokens autoregressively from its own cache, which it rewinds to the
    accepted text at the next round (a write at p forgets positions >= p). It samples as the target
    would (same temperature, top-k, top-p) and keeps its probabilities q for the acceptance rule."""
    name = "draft"

    def __init__(self, draft, config: GenerationConfig, step: EagerStep, batch: int, cache):
        """config: draft_config(the target's); step and cache: the draft's own, from its plan
        (run_plan.make_plan(draft, config, batch, "draft"): rows at their own positions when batch > 1)."""
        self.model, self.config, self.step, self.batch, self.cache = draft, config, step, batch, cache
        self.ragged = batch > 1  # rows drift apart as they accept different counts: per-row positions
        self.cached = [0] * batch  # positions of each row's text held in the draft's cache
        self.fed = [0] * batch  # of each row's latest proposals, how many went into that cache (all but the last)

    def start(self, texts: list[list[int]]) -> None:
        self.cached = [0] * self.batch  # a write at position 0 forgets the previous text
        self.fed = [0] * self.batch

    def _positions(self, pos: list[list[int]], width: int) -> Tensor:
        """Per-row positions, left-padded with -1 to `width` ([T] at batch 1) -> [B, width]."""
        if not self.ragged:
            return torch.tensor(pos[0], device=self.model.device)
        return torch.tensor([[-1] * (width - len(p)) + p for p in pos], device=self.model.device)

    def _forward(self, tokens: list[list[int]], pos: list[list[int]]) -> Tensor:
        """Feed each row its tokens at its positions (rows with none: padding) -> next-token logits [B, V]."""
        width = max(1, max(len(t) for t in tokens))
        ids = torch.tensor([[0] * (width - len(t)) + t for t in tokens], device=self.model.device)
        input_pos = self._positions(pos, width)
        if width == 1:
            return self.step.decode(self.model, ids, input_pos, self.cache)
        if width <= FUSED_MAX_ROWS:  # a catch-up of a few tokens: the step's verify (one C call when fused)
            return self.step.verify(self.model, ids, input_pos, self.cache)[:, -1]
        return self.step.prefill(self.model, ids, input_pos, self.cache)  # the prompt

    def propose(self, rows: list[int], texts: list[list[int]], ks: list[int], generators: list[torch.Generator] | None,
                processing=None) -> tuple[list[list[int]], list[Tensor | None]]:
        """Catch each row's cache up with its text, then draw max(ks) tokens -> (proposals, q [k, V] each).
        Row b draws its ks proposals from generators[b] alone (None: greedy). `processing` (decoding/logits.py):
        each proposal drawn from the draft's processed logits, as if the row's proposals before it were kept."""
        B, need = self.batch, dict(zip(rows, ks))
        steps = max(ks)
        out: dict[int, list[int]] = {b: [] for b in rows}
        probs: dict[int, list[Tensor]] = {b: [] for b in rows}
        if steps == 0:
            return [[] for _ in rows], [None] * len(rows)
        with self.step.grad_mode():
            tokens = [texts[b][self.cached[b]:] if b in need else [] for b in range(B)]
            pos = [list(range(self.cached[b], len(texts[b]))) if b in need else [] for b in range(B)]
            for b in rows:
                self.cached[b] = len(texts[b])
            for i in range(steps):
                logits = self._forward(tokens, pos)  # [B, V]
                drawing = [b for b in rows if i < need[b]]  # the rows that still want a proposal
                logits = torch.stack([processing.after(b, logits[b], out[b]) if processing is not None else logits[b]
                                      for b in drawing])  # [len(drawing), V]
                q = probabilities(logits, self.config) if not greedy(self.config) else None
                if q is None:
                    new = dict(zip(drawing, logits.argmax(-1).tolist()))
                else:  # each row from its own generator, and only what it asked for: as it would alone
                    new = dict(zip(drawing, torch.stack([draw(q[j], generators[b])
                                                         for j, b in enumerate(drawing)]).tolist()))
                tokens, pos = [[] for _ in range(B)], [[] for _ in range(B)]
                for j, b in enumerate(drawing):
                    out[b].append(new[b])
                    if q is not None:
                        probs[b].append(q[j])
                    if i + 1 < need[b]:  # the last proposal is never fed: the target checks it
                        tokens[b], pos[b] = [new[b]], [self.cached[b] + i]
                if not any(tokens):
                    break
        for b in rows:
            self.fed[b] = max(len(out[b]) - 1, 0)
        return [out[b] for b in rows], [torch.stack(probs[b]) if probs[b] else None for b in rows]

    def accepted(self, row: int, kept: int) -> None:
        """`kept` of the row's proposals were accepted: its cache holds the text up to the last one
        fed (the last proposal never was); the rest is forgotten at the next write."""
        self.cached[row] += min(kept, self.fed[row])


# ---------------------------------------------------------------- the acceptance rules
def accept_greedy(logits: Tensor, proposal: list[int], q: Tensor | None, config: GenerationConfig,
                  generator: torch.Generator | None) -> list[int]:
    """logits [k + 1, V] of the target at the last token and each proposal -> the tokens emitted:
    the longest prefix of the proposal that matches the target's argmax, then the argmax after it."""
    best = logits.argmax(dim=-1).tolist()  # [k + 1]
    m = 0
    while m < len(proposal) and proposal[m] == best[m]:
        m += 1
    return proposal[:m] + [best[m]]


def accept_sampled(logits: Tensor, proposal: list[int], q: Tensor | None, config: GenerationConfig,
                   generator: torch.Generator | None) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): logits [k + 1, V] of the target,
    the proposal and its probabilities q [k, V] under the proposer (None: each proposal had probability
    1, prompt lookup) -> the tokens emitted, distributed exactly as sampling from the target.

    Proposal x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
    token comes from max(0, p_i - q_i) normalised, and when all are kept one more from p_{k+1}."""
    p = probabilities(logits, config)  # [k + 1, V]: what sample() would draw from at each position
    out: list[int] = []
    for i, x in enumerate(proposal):
        qi = q[i] if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.shape[-1]).to(p)
        u = torch.rand((), generator=generator, device=p.device)
        if u * qi[x] < p[i, x]:  # u < p/q without dividing by a q of 0
            out.append(x)
            continue
        residual = (p[i] - qi).clamp_(min=0)
        if residual.sum() <= 0:  # p == q up to rounding: a rejection has probability 0; draw from p
            residual = p[i]
        return out + [int(draw(residual / residual.sum(), generator))]
    return out + [int(draw(p[len(proposal)], generator))]


# ---------------------------------------------------------------- the step
class SpeculativeStep(EagerStep):
    """Wraps the target's step (eager, or fused at batch 1): prefill as it does, then rounds of
    propose / verify / accept, handing the loop one accepted token per row per call."""
    name = "speculative"
    samples_inside = True  # the rule draws the tokens; the loop samples only the prompt's first one

    def __init__(self, target: EagerStep, proposer, config: GenerationConfig,
                 generators: list[torch.Generator] | None, ragged: bool):
        """generators: one per row (sampling.make_generators), None: greedy."""
        self.target, self.proposer, self.config, self.generators = target, proposer, config, generators
        self.name = f"speculative ({proposer.name}) over {target.name}"
        self.ragged = ragged  # rows at their own positions [B, T] (a batch of more than one row)
        self.rule: Callable = accept_greedy if greedy(config) else accept_sampled
        self.texts: list[list[int]] = []  # each row's prompt and tokens so far
        self.prompt_lens: list[int] = []
        self.cached: list[int] = []  # positions of each row's text whose keys and values the target holds
        self.queue: list[deque] = []  # accepted tokens not yet handed to the loop
        # logprobs=k: each queued token's (decoding/logprobs.py), from the verify forward that accepted it
        self.logprob_queue: list[deque] = []
        self.last_logprobs: list = []  # those of the tokens decode last handed out (None: a stopped row)
        # what GenerationStats reports (generate.py)
        self.draft_tokens = self.accepted_tokens = self.forwards = self.emitted = 0
        self.draft_s = self.verify_s = 0.0

    def grad_mode(self):
        return self.target.grad_mode()

    def prefill(self, model, input_ids: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        logits = self.target.prefill(model, input_ids, input_pos, cache, policy, ops)
        real = input_pos >= 0 if input_pos.dim() == 2 else torch.ones_like(input_ids, dtype=torch.bool)
        self.texts = [row[keep].tolist() for row, keep in zip(input_ids, real)]
        self.prompt_lens = [len(t) for t in self.texts]
        self.cached = list(self.prompt_lens)
        self.queue = [deque() for _ in self.texts]
        self.logprob_queue = [deque() for _ in self.texts]
        self.proposer.start(self.texts)
        return logits

    def decode(self, model, tokens: Tensor, input_pos: Tensor, cache, policy=None, ops=None) -> Tensor:
        """The loop's latest token of each row [B, 1] at input_pos ([1] shared, or [B, 1]; -1: the row
        has stopped) -> the next token of each row [B]. `ops` run the target's verify forwards."""
        B = tokens.shape[0]
        pos = input_pos.expand(B, 1)[:, 0].tolist() if input_pos.dim() == 2 else [int(input_pos[0])] * B
        fed = tokens[:, 0].tolist()
        need = []
        for b in range(B):
            if pos[b] < 0:
                continue
            self.texts[b].append(fed[b])
            assert pos[b] == len(self.texts[b]) - 1, "speculative step: the loop fed a position out of order"
            if not self.queue[b]:
                need.append(b)
        if need:
            self._round(model, need, cache, policy, ops)
        out = [self.queue[b].popleft() if pos[b] >= 0 else 0 for b in range(B)]
        if self.config.logprobs is not None:
            self.last_logprobs = [self.logprob_queue[b].popleft() if pos[b] >= 0 else None for b in range(B)]
        return torch.tensor(out, device=tokens.device)

    def _round(self, model, rows: list[int], cache, policy, ops=None) -> None:
        """Propose, verify in one forward, accept: each row in `rows` gets its next accepted tokens."""
        n = self.config.max_new_tokens
        # a round emits up to k + 1 tokens: propose no more than the row can still use
        ks = [min(self.config.num_speculative_tokens, n - (len(self.texts[b]) - self.prompt_lens[b]) - 1)
              for b in rows]
        start = time.perf_counter()
        proposals, qs = self.proposer.propose(rows, self.texts, ks, self.generators, self.processing)
        self.draft_s += time.perf_counter() - start
        start = time.perf_counter()
        logits = self._verify(model, rows, proposals, cache, policy, ops)  # [len(rows), T, V]
        for i, (b, proposal, q) in enumerate(zip(rows, proposals, qs)):
            generator = self.generators[b] if self.generators is not None else None  # row b's own
            raw = verified = logits[i, :len(proposal) + 1]  # [len + 1, V]
            if self.processing is not None:  # what the loop would sample from, had it taken the proposals
                verified = self.processing.speculate(b, verified, proposal)
            emitted = self.rule(verified, proposal, q, self.config, generator)
            if self.config.logprobs is not None:  # token j's distribution is the raw logits at position j
                self.logprob_queue[b].extend(token_logprobs(raw[j], t, self.config.logprobs)
                                             for j, t in enumerate(emitted))
            kept = len(emitted) - 1
            self.cached[b] += 1 + kept  # the fed token and the kept proposals; the rest is forgotten
            self.proposer.accepted(b, kept)
            self.queue[b].extend(emitted)
            self.draft_tokens += len(proposal)
            self.accepted_tokens += kept
            self.emitted += len(emitted)
            self.forwards += 1
        self.verify_s += time.perf_counter() - start

    def _verify(self, model, rows: list[int], proposals: list[list[int]], cache, policy, ops=None) -> Tensor:
        """One target forward over each row's last token and its proposal -> logits [len(rows), T, V]."""
        device = model.device
        T = 1 + max(len(p) for p in proposals)
        if not self.ragged:  # one row: positions [T]
            (b,), (proposal,) = rows, proposals
            ids = torch.tensor([[self.texts[b][-1], *proposal]], device=device)
            pos = torch.arange(self.cached[b], self.cached[b] + T, device=device)
            if T == 1:  # nothing proposed: a plain decode step
                return self.target.decode(model, ids, pos, cache, policy, ops)[:, None]
            return self.target.verify(model, ids, pos, cache, policy, ops)
        B = len(self.texts)
        ids = torch.zeros(B, T, dtype=torch.long, device=device)
        pos = torch.full((B, T), -1, dtype=torch.long, device=device)  # rows not in this round: padding
        for b, proposal in zip(rows, proposals):  # right-padded: position t of the row is column t
            row = [self.texts[b][-1], *proposal]
            ids[b, :len(row)] = torch.tensor(row, device=device)
            pos[b, :len(row)] = torch.arange(self.cached[b], self.cached[b] + len(row), device=device)
        if T == 1:
            return self.target.decode(model, ids, pos, cache, policy, ops)[rows][:, None]
        return self.target.verify(model, ids, pos, cache, policy, ops)[rows]

    def report(self, stats) -> None:
        super().report(stats)
        stats.draft_tokens, stats.accepted_tokens = self.draft_tokens, self.accepted_tokens
        stats.acceptance_rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        stats.target_forwards = self.forwards
        stats.mean_acceptance_length = self.emitted / self.forwards if self.forwards else 0.0
        stats.draft_s, stats.verify_s = self.draft_s, self.verify_s


# ---------------------------------------------------------------- checks and construction
def check_draft(config: GenerationConfig, model, draft_model) -> None:
    """Refuse, before any work, a draft model that does not fit the config or the target."""
    if config.speculative_method == "draft" and draft_model is None:
        raise ConfigError("speculative_method='draft' needs a draft model: generate(model, ids, config, "
                          "draft_model=draft), e.g. minigen.drafts.layer_skip(model, 12); or use "
                          "speculative_method='ngram', which needs none")
    if draft_model is None:
        return
    if config.speculative_method != "draft":
        raise ConfigError(f"draft_model= is given but speculative_method={config.speculative_method!r}: set "
                          "speculative_method='draft' to let it propose, or drop draft_model")
    if not isinstance(draft_model, Model):
        raise ConfigError(f"draft_model must be a minigen Model (minigen.load, minigen.from_hf or "
                          f"minigen.drafts), got {type(draft_model).__name__}")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"the draft model's vocabulary has {draft_model.config.vocab_size} tokens and the "
                          f"target's {model.config.vocab_size}: speculative_method='draft' needs a draft with the "
                          "target's tokenizer (a self-draft: minigen.drafts.layer_skip or drafts.quantized)")
    if draft_model.device != model.device:
        raise ConfigError(f"the draft model is on {draft_model.device} and the target on {model.device}: "
                          f"speculative_method='draft' refuses to move tokens between devices every step. Fix: "
                          f"draft_model.to({str(model.device)!r})")
