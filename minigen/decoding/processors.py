"""Logits processors: pure functions of a batch's logits and what each row has produced (chapter "Decoding").

Shapes: B rows, V vocabulary. Each returns new logits [B, V] and changes nothing it is given.

    repetition_penalize   transformers' RepetitionPenaltyLogitsProcessor (Keskar et al. 2019, CTRL):
                          every token the row has seen (prompt and new tokens) has its logit divided by
                          the penalty when positive, multiplied when negative: less likely either way
    openai_penalize       OpenAI's frequency and presence penalties, over the row's new tokens only:
                          logit[j] -= count[j] x frequency + (count[j] > 0) x presence
    bias                  OpenAI's logit_bias: a fixed number added to chosen tokens' logits
    mask                  structured output: -inf outside each row's allowed tokens

decoding/logits.py keeps each row's state (what it has seen, how often) and applies them in that
order; min-p is a cut of the tempered distribution and lives with the others in sampling.probabilities.
"""

from __future__ import annotations

import torch
from torch import Tensor


def repetition_penalize(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """logits [B, V], seen [B, V] bool (the row's prompt and new tokens) -> penalized logits [B, V]:
    a seen token's logit is logit * penalty where negative, logit / penalty where not."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def openai_penalize(logits: Tensor, counts: Tensor, frequency: float, presence: float) -> Tensor:
    """logits [B, V], counts [B, V] (how often the row generated each token) -> logits minus
    counts x frequency and minus presence where a count is positive (OpenAI's documented formula)."""
    counts = counts.to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


def bias(logits: Tensor, bias_tensor: Tensor) -> Tensor:
    """logits [B, V] + bias_tensor [V]: the same bias for every row (0 where the config names none)."""
    return logits + bias_tensor


def mask(logits: Tensor, allowed: Tensor) -> Tensor:
    """logits [B, V] with -inf where allowed [B, V] is False: the distribution restricted to the
    allowed tokens, renormalised by the softmax that follows."""
    return logits.masked_fill(~allowed, float("-inf"))
