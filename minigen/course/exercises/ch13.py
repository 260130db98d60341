"""Chapter 13 exercise: the acceptance rule of speculative sampling.

`accept(logits, proposal, q, config, generator) -> list[int]`, the signature of
minigen.steps.speculative.accept_sampled: logits [k + 1, V] of the target at the last accepted token
and at each of the k proposed tokens; the proposal (k token ids); q [k, V], the probabilities the
proposer drew each proposal from (None for prompt lookup, which proposes each token for sure); the
GenerationConfig (temperature, top-k, top-p); the torch.Generator to draw with. Return the tokens the
round emits: the proposals kept, in order, then one token of the target's, so 1 to k + 1 tokens.

The checker first gives your rule a draft whose q equals the target's p (every guess must then be
kept), then installs it in minigen's speculative loop and generates thousands of rows of a tiny
random model (8 tokens of vocabulary), once with a layer-skipping draft and once with prompt lookup,
and compares how often each 3-token continuation came out with its exact probability (chi-square).
It fails when your rule calls minigen's own accept_sampled or this module's worked solution, by any
name (`forbidding` swaps their code while your rule runs).

`installed(rule)` is the same injection for the chapter's demonstrations; `keep_every_proposal` and
`resample_from_target` are two planted mistakes.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

from ...config import GenerationConfig
from ...drafts import layer_skip
from ...generate import generate
from ...sampling import probabilities
from ...steps import speculative
from ..distributions import chi_square, continuation_probabilities, outcome_counts, tiny_llama, total_variation
from . import ExerciseFailed, forbidding

MINIGEN_RULE = speculative.accept_sampled  # the package's rule: an answer must not call it
P_MIN = 1e-4  # a p-value below this fails: exact sampling strays that far once in 10,000 checks
ROWS = 4000  # rows generated per case (one generate call); a wrong rule's p-value is then below 1e-20
K, NEW = 2, 4  # proposals a round; new tokens a row: the first is the loop's, the next three the rounds'


# ---------------------------------------------------------------- worked solution
def solution_accept_sampled(logits: Tensor, proposal: list[int], q: Tensor | None, config: GenerationConfig,
                            generator: torch.Generator | None) -> list[int]:
    """Keep proposal x with probability min(1, p(x) / q(x)); at the first rejection emit a token of
    the residual max(0, p - q); with none rejected, one more from the target's last position."""
    p = probabilities(logits, config)  # [k + 1, V]: what the target samples from (tempered, cut)
    emitted: list[int] = []
    for i, x in enumerate(proposal):
        q_i = torch.zeros_like(p[i]).index_fill_(0, torch.tensor([x]), 1.0) if q is None else q[i]  # lookup: for sure
        if torch.rand((), generator=generator) * q_i[x] < p[i, x]:  # u < p(x) / q(x), never dividing by 0
            emitted.append(int(x))
            continue
        residual = (p[i] - q_i).clamp(min=0)  # where the target wants more than the proposer gave
        if float(residual.sum()) <= 0:  # p == q up to rounding: this rejection had probability 0
            residual = p[i]
        return emitted + [int(torch.multinomial(residual, 1, generator=generator))]
    return emitted + [int(torch.multinomial(p[len(proposal)], 1, generator=generator))]


# ---------------------------------------------------------------- two planted mistakes
def keep_every_proposal(logits, proposal, q, config, generator) -> list[int]:
    """Wrong: keeps every proposal, then the target's token: the draft's distribution comes out."""
    p = probabilities(logits, config)
    return list(proposal) + [int(torch.multinomial(p[len(proposal)], 1, generator=generator))]


def resample_from_target(logits, proposal, q, config, generator) -> list[int]:
    """Wrong: the right test, but a rejected position draws from p itself instead of max(0, p - q):
    tokens the draft likes come out too often (they were already offered, and kept as often as p allows)."""
    p = probabilities(logits, config)
    for i, x in enumerate(proposal):
        q_x = 1.0 if q is None else float(q[i, x])
        if float(torch.rand((), generator=generator)) * q_x >= float(p[i, x]):
            return list(proposal[:i]) + [int(torch.multinomial(p[i], 1, generator=generator))]
    return list(proposal) + [int(torch.multinomial(p[len(proposal)], 1, generator=generator))]


# ---------------------------------------------------------------- running a rule inside generate
@contextlib.contextmanager
def installed(rule: Callable):
    """Within the block, speculative sampling uses `rule` (SpeculativeStep picks accept_sampled from its
    module when it is built, so generate calls inside the block get `rule`)."""
    before = speculative.accept_sampled
    speculative.accept_sampled = rule
    try:
        yield
    finally:
        speculative.accept_sampled = before


_CALLS_MINIGEN = ("your rule calls minigen's own accept_sampled (minigen.steps.speculative.accept_sampled): "
                  "write the rule yourself; minigen.sampling.probabilities(logits, config) gives the target's p")


class _Guard:
    """Wraps an answer: refuses a call of minigen's rule through its module (installed, it is this
    wrapper) and checks the shape of what the answer returns. A call of the function itself, by any
    name, is refused by `forbidding` around the run (`_forbidden`)."""

    def __init__(self, fn: Callable):
        self.fn, self.inside = fn, False

    def __call__(self, logits, proposal, q, config, generator):
        if self.inside:  # the answer called speculative.accept_sampled, which is this wrapper now
            raise ExerciseFailed(_CALLS_MINIGEN)
        self.inside = True
        try:
            got = self.fn(logits, proposal, q, config, generator)
        finally:
            self.inside = False
        return _checked(got, proposal)


def _forbidden(fn: Callable):
    """minigen's rule and the worked solution raise while the answer runs (the worked solution is
    allowed only as the answer itself: the chapter checks it so that nbval passes)."""
    return forbidding(MINIGEN_RULE, *([] if fn is solution_accept_sampled else [solution_accept_sampled]))


def _checked(got, proposal: list[int]) -> list[int]:
    if got is None:
        raise ExerciseFailed("accept returned None: return the list of tokens the round emits")
    try:
        got = [int(t) for t in got]
    except (TypeError, ValueError):
        raise ExerciseFailed(f"accept returned {type(got).__name__}: return a list of token ids (ints)") from None
    if not 1 <= len(got) <= len(proposal) + 1:
        raise ExerciseFailed(f"accept emitted {len(got)} tokens for {len(proposal)} proposals: a round emits the "
                             f"proposals it keeps and then one token of the target's, 1 to {len(proposal) + 1}")
    if got[:-1] != list(proposal[:len(got) - 1]):
        raise ExerciseFailed(f"accept emitted {got} for the proposal {list(proposal)}: the tokens before the last "
                             "must be the proposal's first ones, kept in order (the last is the target's own)")
    return got


# ---------------------------------------------------------------- the cases
def _cases() -> list[tuple[str, dict, Tensor]]:
    """(label, generate's keywords, the prompt) for the tiny target: a draft, and prompt lookup."""
    draft_cfg = GenerationConfig(do_sample=True, temperature=0.8, top_k=6, speculative_method="draft",
                                 num_speculative_tokens=K, max_new_tokens=NEW, stop_token_ids=[], seed=15)
    lookup_cfg = GenerationConfig(do_sample=True, speculative_method="ngram", num_speculative_tokens=K,
                                  max_new_tokens=NEW, stop_token_ids=[], seed=16)
    return [("a one-layer draft (temperature 0.8, top-k 6)", {"config": draft_cfg, "draft": True},
             torch.tensor([1, 5, 2, 7, 1, 5])),
            ("prompt lookup (q is None: each proposal is certain)", {"config": lookup_cfg, "draft": False},
             torch.tensor([3, 1, 4, 1, 5, 1, 4, 1]))]


def run_rule(rule: Callable, model, prompt: Tensor, config: GenerationConfig, draft=None, rows: int = ROWS):
    """Generate `rows` rows with `rule` installed -> (the counts of the rounds' 3 tokens, the stats)."""
    with installed(rule):
        out = generate(model, prompt.expand(rows, -1), config, draft_model=draft)
    return outcome_counts(out.tokens[:, len(prompt) + 1:], model.config.vocab_size), out.stats


def _keeps_what_the_target_would_draw(fn: Callable) -> None:
    """A draft whose q equals the target's p: min(1, p(x) / q(x)) = 1, so every guess must be kept. (A
    rule that never keeps a guess and draws from p is exact too, and gives up the whole speed-up.)"""
    g = torch.Generator().manual_seed(15)
    config = GenerationConfig(do_sample=True)
    logits = torch.randn(K + 1, 8, generator=g)
    q = probabilities(logits[:K], config)
    for _ in range(50):
        proposal = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(K)]
        with _forbidden(fn):
            got = _Guard(fn)(logits.clone(), proposal, q.clone(), config, g)
        if got[:K] != proposal:
            raise ExerciseFailed(f"accept: with q equal to the target's p every guess must be kept (min(1, p / q) = 1), "
                                 f"yet for the proposal {proposal} yours emitted {got}. Hint: keep x when u < p(x) / q(x), "
                                 "u uniform in [0, 1); rejecting more often than that is still exact, but slow")


def check_accept_sampled(fn: Callable) -> bool:
    """Runs fn as speculative sampling's acceptance rule; its tokens must come out as the target's."""
    # One thread: the tiny model's ops take microseconds, and a second thread's hand-offs cost far more
    # (tests/conftest.py, one_thread: ten times slower on a busy two-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _check(fn)
    finally:
        torch.set_num_threads(threads)


def _check(fn: Callable) -> bool:
    _keeps_what_the_target_would_draw(fn)
    model = tiny_llama(8, seed=0)
    for label, case, prompt in _cases():
        config, draft = case["config"], layer_skip(model, 1) if case["draft"] else None
        exact = continuation_probabilities(model, prompt, NEW, config).sum(0)  # [V, V, V]: the first token summed out
        with _forbidden(fn):  # the exact distribution above and the hints' runs below use minigen's own
            counts, stats = run_rule(_Guard(fn), model, prompt, config, draft)
        stat, dof, p_value = chi_square(counts, exact)
        if p_value < P_MIN:
            _, right = run_rule(solution_accept_sampled, model, prompt, config, draft)
            if stats.acceptance_rate > 0.99 > right.acceptance_rate:
                hint = "you keep every proposal: keep x with probability min(1, p(x) / q(x))"
            elif float(counts[exact == 0].sum()) > 0:
                hint = ("your rounds emit tokens the target never samples with this config (top-k cuts them): "
                        "take p from minigen.sampling.probabilities(logits, config), which applies the "
                        "temperature, top-k and top-p")
            elif abs(stats.acceptance_rate - right.acceptance_rate) > 0.05:
                hint = (f"you kept {stats.acceptance_rate:.0%} of the proposals where the rule keeps about "
                        f"{right.acceptance_rate:.0%}: keep x with probability min(1, p(x) / q(x)), p from "
                        "minigen.sampling.probabilities(logits, config)")
            else:
                hint = ("after a rejection, draw from the residual max(0, p - q) normalised, not from p: the "
                        "proposal has had its chance already")
            raise ExerciseFailed(f"accept, {label}: the 3 tokens the rounds emit are not distributed as the "
                                 f"target samples them (chi-square {stat:.0f} on {dof} degrees of freedom, p-value "
                                 f"{p_value:.1e}; total variation {total_variation(counts, exact):.3f}). Hint: {hint}")
        print(f"✓ accept, {label}: {ROWS:,} rows distributed as the target's "
              f"(p-value {p_value:.2f}; {stats.acceptance_rate:.0%} of the proposals kept)")
    return True
