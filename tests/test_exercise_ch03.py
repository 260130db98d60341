"""Chapter 3's exercise: a prompt's activations as int8 codes, one scale a row (w8a8.quantize_rows).
The worked solution passes, each usual mistake fails with its hint, and an answer that calls minigen's
own quantize_rows (or the worked solution) fails however it reaches it."""

from __future__ import annotations

import pytest
import torch

from minigen.course.exercises import ExerciseFailed, ch03
from minigen.numerics import w8a8


def test_the_worked_solution_passes_and_gives_w8a8s_codes():
    assert ch03.check_quantize_rows(ch03.solution_quantize_rows)
    x = torch.randn(5, 64)
    keep = torch.ones(64)
    keep[3] = 0
    for codes, scales in (ch03.solution_quantize_rows(x, keep), w8a8.quantize_rows(x, keep)):
        assert codes.dtype == torch.int8 and scales.shape == (5, 1) and codes[:, 3].eq(0).all()


def one_scale(x, keep=None):  # one scale for the whole prompt: rows change each other's codes
    x = x * keep if keep is not None else x
    a = x.abs().amax() / 127
    return torch.round(x / a).to(torch.int8), a.expand(x.shape[0], 1)


def keep_ignored(x, keep=None):
    a = x.abs().amax(-1, keepdim=True) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.round(x / a).to(torch.int8), a


def truncated(x, keep=None):
    x = x * keep if keep is not None else x
    a = x.abs().amax(-1, keepdim=True) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    return (x / a).to(torch.int8), a


def no_127(x, keep=None):
    x = x * keep if keep is not None else x
    a = x.abs().amax(-1, keepdim=True)
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.round(x / a).to(torch.int8), a


def zero_row_nan(x, keep=None):
    x = x * keep if keep is not None else x
    a = x.abs().amax(-1, keepdim=True) / 127
    return torch.round(x / a).to(torch.int8), a


def wider_codes(x, keep=None):
    codes, a = w8a8_free(x, keep)
    return codes.to(torch.int32), a


def w8a8_free(x, keep):
    x = x * keep if keep is not None else x
    a = x.abs().amax(-1, keepdim=True) / 127
    a = torch.where(a > 0, a, torch.ones_like(a))
    return torch.round(x / a).to(torch.int8), a


@pytest.mark.parametrize("wrong, hint", [
    (one_scale, "one scale a row"), (keep_ignored, "multiply the row by keep"), (truncated, "torch.round"),
    (no_127, "max \\|x\\| / 127"), (zero_row_nan, "row of zeros|1 for a row of zeros"),
    (wider_codes, "not torch.int8"), (lambda x, keep=None: None, "return a pair")])
def test_the_usual_mistakes_fail_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseFailed, match=hint):
        ch03.check_quantize_rows(wrong)


def test_a_hand_written_answer_passes():
    assert ch03.check_quantize_rows(w8a8_free)


@pytest.mark.parametrize("calls, name", [
    (w8a8.quantize_rows, "quantize_rows"), (lambda x, keep=None: w8a8.quantize_rows(x, keep), "quantize_rows"),
    (lambda x, keep=None: ch03.solution_quantize_rows(x, keep), "solution_quantize_rows")])
def test_an_answer_that_calls_minigens_own_fails(calls, name):
    with pytest.raises(ExerciseFailed, match=f"calls minigen's own {name}"):
        ch03.check_quantize_rows(calls)
    x = torch.randn(2, 32)  # restored afterwards
    assert torch.equal(w8a8.quantize_rows(x)[0], ch03.solution_quantize_rows(x)[0])
