"""LogitsProcessing: each row's penalties, bias and structured-output mask, applied to its logits
before it samples (chapter "Decoding").

Shapes: B rows, V vocabulary, k proposed tokens.

    processing = LogitsProcessing(config, prompts, vocab_size, device)   # only where needed(config)
    token = sample(processing(logits), config, generators)               # logits [B, V] -> [B]
    processing.advance(token)                                            # the rows' new tokens join their state

The order for one row's logits (fp32): repetition_penalty (over the row's prompt and new tokens,
transformers' rule), frequency and presence penalties (over its new tokens only, OpenAI's rule),
logit_bias, the structured mask (-inf outside Matcher.allowed()); then sample() tempers and cuts
(temperature, top-k, top-p, min-p) or takes the argmax. Every row keeps its own state: a row's
penalties read only that row's tokens, so a row batched with others samples as it would alone.

A generation that sets none of these never builds one (`needed` is False): its loop is the plain
one, and costs nothing more. Speculative decoding asks what a row's logits would become after
tokens it has not taken yet (`speculate`, `after`): the acceptance rule then compares the target's
and the draft's processed distributions, and the tokens it keeps are exactly the target's.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ..config import GenerationConfig
from .guide import Matcher
from .processors import bias, mask, openai_penalize, repetition_penalize


class LogitsProcessing:
    """The processing state of every row of one generation: what each row has seen (its prompt and
    new tokens, [B, V] bool), how often it generated each token ([B, V]), and its Matcher."""

    def __init__(self, config: GenerationConfig, prompts: Sequence[Tensor], vocab_size: int,
                 device: torch.device | str, matchers: Sequence[Matcher | None] | None = None):
        """prompts: each row's prompt, 1-D token ids (no padding); matchers: one per row or None."""
        self.config, self.vocab_size, self.device = config, vocab_size, torch.device(device)
        self.rows = len(prompts)
        B, V = self.rows, vocab_size
        self.seen: Tensor | None = None  # [B, V] bool: the row's prompt and new tokens (repetition_penalty)
        if config.repetition_penalty != 1.0:
            self.seen = torch.zeros(B, V, dtype=torch.bool, device=self.device)
            for b, prompt in enumerate(prompts):
                self.seen[b, prompt.to(self.device, torch.long)] = True
        self.counts: Tensor | None = None  # [B, V] fp32: how often the row generated each token (OpenAI's)
        if config.frequency_penalty != 0 or config.presence_penalty != 0:
            self.counts = torch.zeros(B, V, dtype=torch.float32, device=self.device)
        self.bias: Tensor | None = None  # [V]: logit_bias, 0 for the ids it does not name
        if config.logit_bias:
            self.bias = torch.zeros(V, dtype=torch.float32, device=self.device)
            ids = torch.tensor(list(config.logit_bias), dtype=torch.long)
            self.bias[ids.to(self.device)] = torch.tensor(list(config.logit_bias.values()),
                                                          dtype=torch.float32, device=self.device)
        assert matchers is None or len(matchers) == B, "one matcher (or None) per row"
        self.matchers: list[Matcher | None] | None = \
            list(matchers) if matchers is not None and any(m is not None for m in matchers) else None

    @staticmethod
    def needed(config: GenerationConfig) -> bool:
        """Whether `config` processes logits at all (False: the loop samples the raw logits, as before)."""
        return (config.repetition_penalty != 1.0 or config.frequency_penalty != 0 or config.presence_penalty != 0
                or bool(config.logit_bias) or config.guide_spec() is not None)

    def _process(self, logits: Tensor, seen: Tensor | None, counts: Tensor | None,
                 allowed: Tensor | None) -> Tensor:
        """logits [N, V] with their rows' seen [N, V], counts [N, V] and allowed [N, V] -> processed, fp32."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if seen is not None:
            logits = repetition_penalize(logits, seen, self.config.repetition_penalty)
        if counts is not None:
            logits = openai_penalize(logits, counts, self.config.frequency_penalty, self.config.presence_penalty)
        if self.bias is not None:
            logits = bias(logits, self.bias)
        if allowed is not None:
            logits = mask(logits, allowed)
        return logits

    def _allowed(self, rows: list[int]) -> Tensor | None:
        """[len(rows), V] bool: each row's Matcher.allowed() (every token for a row without one)."""
        if self.matchers is None:
            return None
        everything = torch.ones(self.vocab_size, dtype=torch.bool, device=self.device)
        return torch.stack([self.matchers[b].allowed().to(self.device) if self.matchers[b] is not None
                            else everything for b in rows])

    def __call__(self, logits: Tensor, rows: Sequence[int] | None = None) -> Tensor:
        """logits [B, V] of every row (or [len(rows), V] of `rows`, in that order) -> processed [.., V]."""
        rows = list(range(self.rows)) if rows is None else list(rows)
        assert logits.shape == (len(rows), self.vocab_size), f"logits {tuple(logits.shape)} for {len(rows)} rows"
        index = torch.tensor(rows, device=self.device)
        return self._process(logits, self.seen[index] if self.seen is not None else None,
                             self.counts[index] if self.counts is not None else None, self._allowed(rows))

    def advance(self, tokens: Tensor, rows: Sequence[int] | None = None, finished: Tensor | None = None) -> None:
        """Each row's new token, tokens [B] (or [len(rows)] of `rows`), joins its state. finished [B] bool:
        rows that had stopped before this token (their token is padding): their state stays."""
        rows = list(range(self.rows)) if rows is None else list(rows)
        index = torch.tensor(rows, device=self.device)
        tokens = tokens.to(self.device, torch.long)
        live = ~finished.to(self.device) if finished is not None else torch.ones(len(rows), dtype=torch.bool,
                                                                                   device=self.device)
        if self.seen is not None:  # one token per row: no index repeats, so a plain write is exact
            self.seen[index, tokens] |= live
        if self.counts is not None:
            self.counts.index_put_((index, tokens), live.to(torch.float32), accumulate=True)
        if self.matchers is not None:
            for b, token, alive in zip(rows, tokens.tolist(), live.tolist()):
                if alive and self.matchers[b] is not None:
                    self.matchers[b].advance(token)

    def fork(self, n: int) -> None:
        """parallel_sample: the one row's state becomes n rows', each its own from here on."""
        assert self.rows == 1, "fork: one prompt's state, forked into n rows"
        self.rows = n
        if self.seen is not None:
            self.seen = self.seen.expand(n, -1).clone()
        if self.counts is not None:
            self.counts = self.counts.expand(n, -1).clone()
        if self.matchers is not None:
            self.matchers = [self.matchers[0]] + [self.matchers[0].copy() for _ in range(n - 1)]

    def speculate(self, row: int, logits: Tensor, proposal: Sequence[int]) -> Tensor:
        """logits [j + 1, V] of `row` at its last token and after each token of proposal (j <= k of
        them) -> processed [j + 1, V]: position i as the row would process it after proposal[:i].
        The state does not change (speculative decoding checks a proposal before any of it is kept)."""
        T, V = logits.shape
        assert T <= len(proposal) + 1, "speculate: position i needs proposal[:i]"
        extra = torch.zeros(T, V, dtype=torch.float32, device=self.device)  # [T, V]: counts of proposal[:i]
        if T > 1:
            extra[torch.arange(1, T, device=self.device), torch.tensor(proposal[:T - 1], device=self.device)] = 1
            extra = extra.cumsum(dim=0)
        seen = self.seen[row] | (extra > 0) if self.seen is not None else None
        counts = self.counts[row] + extra if self.counts is not None else None
        allowed = None
        if self.matchers is not None and self.matchers[row] is not None:
            matcher, masks = self.matchers[row].copy(), []
            for i in range(T):
                masks.append(matcher.allowed().to(self.device))
                if i + 1 < T:
                    if not masks[-1][proposal[i]]:  # an invalid proposal is rejected here: what follows is never read
                        masks += [masks[-1]] * (T - 1 - i)
                        break
                    matcher.advance(proposal[i])
            allowed = torch.stack(masks)
        return self._process(logits, seen, counts, allowed)

    def after(self, row: int, logits: Tensor, tokens: Sequence[int]) -> Tensor:
        """logits [V] of `row` after `tokens` it has not taken yet -> processed [V] (a draft's next
        proposal, which sees the row's text and the proposals before it)."""
        return self.speculate(row, logits.expand(len(tokens) + 1, -1), tokens)[-1]
