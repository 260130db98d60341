"""Chapter 4 exercise: min-p sampling.

`min_p_probabilities(logits, temperature, min_p) -> probs`: logits [B, V] (fp32; -inf where a token
is already ruled out), a temperature > 0 and min_p in [0, 1]. Return the distribution [B, V] that
sampling draws from with `GenerationConfig(do_sample=True, temperature=temperature, min_p=min_p)`:
the tempered softmax, then every token whose probability is below min_p times the row's largest
probability set to 0, the rest renormalised to sum to 1 (transformers' MinPLogitsWarper, applied
after the temperature as its warpers are; Nguyen et al. 2024, "Min P Sampling").

The checker computes that distribution itself, the obvious way, on random logits of several shapes,
scales and temperatures, and compares yours row by row. It fails an answer that calls minigen's own
`sampling.probabilities` (which applies min_p once GenerationConfig has it) or the worked solution
(`forbidding` swaps their code while your answer runs), and names the usual mistakes: min-p applied
before the temperature, a threshold on the probability itself instead of a fraction of the top one,
a strict comparison that drops the top token at min_p = 1, probabilities left unnormalised.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ...sampling import probabilities
from . import ExerciseFailed, forbidding

ATOL = 1e-6  # fp32 softmaxes computed in another order differ by a few units of 2^-24 per entry


# ---------------------------------------------------------------- worked solution
def solution_min_p_probabilities(logits: Tensor, temperature: float, min_p: float) -> Tensor:
    """Temper, softmax, drop p < min_p * max p, renormalise: [B, V] -> [B, V]."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V], after the temperature
    floor = min_p * probs.amax(dim=-1, keepdim=True)  # [B, 1]: a fraction of each row's top probability
    kept = probs.masked_fill(probs < floor, 0.0)  # the top token always stays: max p >= min_p * max p
    return kept / kept.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- the checker's own reference
def reference(logits: Tensor, temperature: float, min_p: float) -> Tensor:
    """The distribution written token by token in log space: token j survives when
    (l_j - l_max) / T >= log(min_p), i.e. p_j >= min_p * p_max after the temperature."""
    scaled = logits.double() / temperature  # float64: the reference is the exact side
    gap = scaled - scaled.amax(dim=-1, keepdim=True)  # log(p_j / p_max), <= 0
    keep = gap >= torch.log(torch.tensor(min_p, dtype=torch.float64)) if min_p > 0 else torch.isfinite(gap)
    return torch.softmax(gap.masked_fill(~keep, float("-inf")), dim=-1).float()


def _cases() -> list[tuple[str, Tensor, float, float]]:
    """(label, logits [B, V], temperature, min_p): random rows at several scales, and the edges."""
    g = torch.Generator().manual_seed(2)
    flat = torch.randn(4, 50, generator=g)  # logits of spread ~1: many tokens near the top
    peaked = 4 * torch.randn(3, 1000, generator=g)  # a few tokens hold most of the mass
    masked = torch.randn(2, 40, generator=g).masked_fill(torch.rand(2, 40, generator=g) < 0.5, float("-inf"))
    return [("flat rows, temperature 1, min_p 0.1", flat, 1.0, 0.1),
            ("flat rows, temperature 0.5, min_p 0.2", flat, 0.5, 0.2),
            ("peaked rows, temperature 1.5, min_p 0.05", peaked, 1.5, 0.05),
            ("peaked rows, temperature 0.7, min_p 0.3", peaked, 0.7, 0.3),
            ("rows with tokens already masked to -inf, temperature 2, min_p 0.1", masked, 2.0, 0.1),
            ("min_p 0: nothing dropped, the tempered softmax itself", flat, 0.8, 0.0),
            ("min_p 1: only the top token of each row", peaked, 1.0, 1.0)]


def _hint(logits: Tensor, temperature: float, min_p: float, got: Tensor) -> str:
    """The known mistake `got` matches, or ""."""
    def close(other: Tensor) -> bool:
        return other.shape == got.shape and bool(torch.allclose(got, other, atol=ATOL, equal_nan=True))

    cut_first = reference(logits, 1.0, min_p).double() ** (1 / temperature)  # the cut untempered, then tempered
    if close((cut_first / cut_first.sum(-1, keepdim=True)).float()):
        return ("min-p comes after the temperature: compare the tempered probabilities with min_p times the "
                "tempered top one (you cut the untempered distribution, then tempered what was left)")
    if torch.isnan(got).any() and min_p == 1.0:  # only a strict p > min_p * max p empties a row here
        return ("with min_p = 1 a row came out NaN: keep the tokens whose p >= min_p * max p (drop only p < it); "
                "the top token always meets that, so a row is never empty")
    absolute = torch.softmax(logits.double() / temperature, dim=-1)
    absolute = absolute.masked_fill(absolute < min_p, 0.0)  # a row may keep nothing: 0 / 0, as such an answer gets
    if close((absolute / absolute.sum(-1, keepdim=True)).float()):
        return "the threshold is min_p times the row's largest probability, not min_p itself"
    if (got < 0).any() or torch.isinf(got).any():
        return "return probabilities (softmax, then zeros for the dropped tokens), not masked logits"
    sums = got.sum(dim=-1)
    if not torch.allclose(sums, torch.ones_like(sums), atol=1e-4):
        return "renormalise: the kept probabilities must sum to 1 in every row"
    return ""


def check_min_p_probabilities(fn: Callable) -> bool:
    """fn(logits [B, V], temperature, min_p) -> probs [B, V], the distribution min-p sampling draws from."""
    forbidden = [probabilities] + ([] if fn is solution_min_p_probabilities else [solution_min_p_probabilities])
    for label, logits, temperature, min_p in _cases():
        expected = reference(logits, temperature, min_p)
        with forbidding(*forbidden):
            got = fn(logits.clone(), temperature, min_p)
        if not isinstance(got, Tensor):
            raise ExerciseFailed(f"min_p_probabilities returned {type(got).__name__}: return a tensor of "
                                 f"probabilities shaped like the logits, {tuple(logits.shape)}")
        if got.shape != expected.shape:
            raise ExerciseFailed(f"min_p_probabilities, {label}: shape {tuple(got.shape)}, expected "
                                 f"{tuple(expected.shape)} (one distribution per row of logits)")
        got = got.detach().float()
        if not torch.allclose(got, expected, atol=ATOL):
            hint = _hint(logits, temperature, min_p, got)
            row = int(((got - expected).abs().nan_to_num(1.0).amax(dim=-1)).argmax())
            kept_exp, kept_got = int((expected[row] > 0).sum()), int((got[row].nan_to_num(0.0) > 0).sum())
            raise ExerciseFailed(f"min_p_probabilities, {label}: row {row} keeps {kept_got} tokens where min-p "
                                 f"keeps {kept_exp}, and differs by up to "
                                 f"{float((got[row] - expected[row]).abs().nan_to_num(float('inf')).max()):.3g}"
                                 + (f". Hint: {hint}" if hint else ""))
    print(f"✓ min_p_probabilities: all {len(_cases())} cases agree with the reference distribution")
    return True
