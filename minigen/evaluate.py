"""Teacher-forced evaluation through the same cache path that generation uses.

Shapes: T tokens in the text, C tokens fed per step (`chunk_size`), V vocabulary.

Lossy caches (quantized, windowed, sparse) only show their loss when the model reads back what
they stored, so `score` feeds the text `chunk_size` tokens at a time into the cache that the
config selects: `chunk_size=1` is exactly how decoding sees the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .steps.eager import forward
from .config import GenerationConfig, resolve_config
from .entropy import EntropyRecorder
from .errors import PromptError
from .generate import check_prompt
from .run_plan import Plan, given_plan, make_plan
from .model import Model


@dataclass
class Score:
    nll: Tensor  # [T-1] negative log-likelihood of each next token, in nats
    top1: Tensor  # [T-1] the model's argmax prediction for each next token

    @property
    def perplexity(self) -> float:
        """exp(mean NLL); inf when the mean is past what a float holds (a model that is sure and wrong)."""
        mean = self.nll.mean().item()
        return math.exp(mean) if mean < 709 else math.inf


def score(model: Model, token_ids: Tensor, config: GenerationConfig | None = None,
          chunk_size: int | None = None, *, observers=(), plan: Plan | None = None, **overrides) -> Score:
    """Feed token_ids [T] (or [1, T]) teacher-forced, `chunk_size` tokens per forward call.

    chunk_size=None feeds the whole text at once (or the config's prefill_chunk_size tokens per
    call), except when the config's cache changes what a later token reads (quant_bits, kv_budget):
    the tokens of one call are attended as computed, so these caches are then fed one token at a
    time, as decoding reads them.
    `observers` see every layer's attention probabilities (attention.AttentionObserver).
    `plan`: one make_plan built with where="score" for this text's length, run instead of a new one.
    """
    config = given_plan(plan, config, overrides, "score", observers=observers) or resolve_config(config, overrides)
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() not in (1, 2):
        raise PromptError(f"token_ids must be an integer tensor [T] or [1, T], got "
                          f"{tuple(token_ids.shape) if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__}")
    ids = token_ids.reshape(1, -1) if token_ids.dim() == 1 else token_ids
    if ids.shape[0] != 1 or ids.shape[1] < 2:
        raise PromptError(f"score a single sequence of at least 2 tokens, got shape {tuple(token_ids.shape)}")
    T = ids.shape[1]
    if T > model.config.max_seq_len:
        raise PromptError(f"the text has {T} tokens but the model's context is {model.config.max_seq_len}: "
                          f"score at most {model.config.max_seq_len} tokens at a time")
    check_prompt(model, ids, 0)  # integer ids inside the vocabulary
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):  # before `or`: 0 is falsy
        raise PromptError(f"chunk_size={chunk_size!r} is invalid: use an integer >= 1 or None")
    reads_back = config.use_cache and (config.quant_bits is not None or config.kv_budget is not None)
    C = chunk_size or (1 if reads_back else config.prefill_chunk_size or T)
    # what the model and machine cannot run is refused here; a prompt format that measured slower than
    # fp32 runs, with a warning. fused_decode=True scores what the fused step computes, one token at a
    # time; "auto" keeps the chunked forward (the plan's eager step), which reads each weight once per
    # chunk rather than once per token
    plan = (plan.check_fits(1, T) if plan
            else make_plan(model, config, 1, "score", max_len=T, observers=tuple(observers)))
    step = plan.step if plan.step.name == "fused" else None
    if step is not None:
        C = 1
    logits = []
    # a chunk of more than 16 tokens is a prompt's products: prefill_precision applies (chapter 3), to
    # every row's logits here (a prefill computes only the last row's, in fp32)
    with torch.inference_mode():
        ops = plan.decode_ops if C == 1 else plan.prompt_ops  # one token a forward is a decode step's work
        if not config.use_cache:  # naive: one pass over everything (identical to chunking a full cache)
            policy = plan.make_policy(None)
            logits.append(model(ids, torch.arange(T, device=ids.device), policy=policy, ops=ops)[0])
        else:
            cache = plan.make_cache(model)
            policy = plan.make_policy(cache)
            for s in range(0, T, C):
                pos = torch.arange(s, min(s + C, T), device=ids.device)
                if step is not None:
                    logits.append(step.decode(model, ids[:, s:s + 1], pos, cache, ops=ops))  # [1, V]
                    continue
                logits.append(forward(model, ids[:, s:s + C], pos, cache, policy, ops=ops)[0])  # [C, V]
    logits = torch.cat(logits)[:-1]  # [T-1, V]: position t predicts token t+1
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    return Score(nll=nll, top1=logits.argmax(-1))


def perplexity(model: Model, token_ids: Tensor, config: GenerationConfig | None = None,
               chunk_size: int | None = None, **overrides) -> float:
    """exp(mean next-token NLL) of token_ids under the cache path that `config` selects."""
    return score(model, token_ids, config, chunk_size, **overrides).perplexity


def top1_agreement(model: Model, token_ids: Tensor, config: GenerationConfig | None = None,
                   reference: GenerationConfig | None = None, chunk_size: int | None = 1,
                   **overrides) -> float:
    """Fraction of positions where `config`'s argmax equals the reference config's (default: exact)."""
    test = score(model, token_ids, config, chunk_size, **overrides).top1
    ref = score(model, token_ids, reference or GenerationConfig(), chunk_size).top1
    return (test == ref).float().mean().item()


def attention_entropy(model: Model, token_ids: Tensor, config: GenerationConfig | None = None,
                      chunk_size: int | None = None, **overrides) -> Tensor:
    """Entropy in nats of every layer's, head's and query's attention over token_ids: [L, H, T].

    Runs `score` through the cache and attention policy that `config` selects (window, sinks,
    sparse), so the entropy is that of the attention the model really used. See entropy.py.
    """
    recorder = EntropyRecorder(model.config.n_layers)
    score(model, token_ids, config, chunk_size, observers=(recorder,), **overrides)
    return recorder.result()
