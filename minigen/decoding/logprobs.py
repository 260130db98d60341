"""Log-probabilities of the tokens a generation picks (chapter 4; OpenAI's `logprobs` / `top_logprobs`).

Shapes: B rows, V vocabulary.

For each new token of a row: (the log-probability of that token, the k most likely (id, log-probability),
most likely first), read from the model's raw fp32 logits, before temperature, top-k, top-p, min-p,
penalties, bias or a structured mask reshape them (vLLM's default, "raw_logprobs"): a logprob says
what the model thinks of the token, whichever way the token was chosen. `generate(..., logprobs=k)`
fills GenerationOutput.logprobs (generate.py's loop, and steps/speculative.py for the tokens a
verify forward accepts); the serving engine records a request's with `add_request(logprobs=k)`.
"""

from __future__ import annotations

import numbers
import reprlib

import torch
from torch import Tensor

from ..errors import ConfigError

MAX_LOGPROBS = 20  # alternatives one may ask for per token (OpenAI's API allows 0..20)

# one new token: (its log-probability, [(id, log-probability)] of the k most likely, most likely first)
TokenLogprobs = tuple[float, list[tuple[int, float]]]


def logprobs_count(logprobs, key: str = "logprobs") -> int | None:
    """The alternatives to record per token (None: record nothing); ConfigError unless None or an
    int in 0..MAX_LOGPROBS."""
    if logprobs is not None and (not isinstance(logprobs, numbers.Integral) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise ConfigError(f"{key}={reprlib.repr(logprobs)} is invalid: use an integer in 0..{MAX_LOGPROBS} (the "
                          "most likely tokens to record beside each new one; 0: its own logprob only), or None to "
                          "record none")
    return None if logprobs is None else int(logprobs)


def token_logprobs(logits: Tensor, token: int, k: int) -> TokenLogprobs:
    """One row's raw logits [V] -> (the log-probability of `token`, the top k (id, log-probability) in
    descending order), in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top = torch.topk(logp, k)  # sorted: the most likely first
    return float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist()))


class RowLogprobs:
    """Each row's TokenLogprobs, one per new token it keeps (a row that has stopped records nothing)."""

    def __init__(self, k: int, rows: int):
        self.k = k
        self.rows: list[list[TokenLogprobs]] = [[] for _ in range(rows)]

    def record(self, logits: Tensor, tokens: Tensor, live: list[bool]) -> None:
        """The loop's step: logits [B, V] (raw) and the tokens [B] sampled from them, for the live rows."""
        self.add([token_logprobs(logits[b], t, self.k) if on else None
                  for b, (t, on) in enumerate(zip(tokens.tolist(), live))], live)

    def add(self, entries: list[TokenLogprobs | None], live: list[bool]) -> None:
        """One entry per row, as a step that samples inside hands them over; a row not live records nothing."""
        for row, entry, on in zip(self.rows, entries, live):
            if on and entry is not None:
                row.append(entry)
