"""Issue 25's hardening, one case per reproducer: what hostile input found, and what it gets now.

Each `@case` here is a row of docs/bad_inputs.md, run by `test_row` in tests/test_bad_inputs.py
(which imports this module), exactly as that module's own cases are: an error row must raise its
named `MinigenError` with the quoted text, a behaviour row asserts the behaviour itself. Case
functions take pytest fixtures by name (tiny_model, tmp_path, monkeypatch, ...). The tests below
the cases (the Engine's property tests) run here.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from test_bad_inputs import case

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures
_SAMPLING = dict(max_new_tokens=12, do_sample=True, temperature=1.0, stop_token_ids=[])


def _sampling_prompts() -> list[torch.Tensor]:
    return [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6]), torch.tensor([5, 3, 5, 8, 9, 7, 9])]


def _sampling_alone(model, prompt: torch.Tensor, seed: int, **config) -> list[int]:
    """The new tokens of `prompt` generated on its own with `seed`."""
    out = minigen.generate(model, prompt[None], seed=seed, **(_SAMPLING | config)).tokens[0]
    return out[prompt.numel():].tolist()


@case("sampling-ragged-rows-independent")
def _(tiny_model):
    prompts = _sampling_prompts()
    out = minigen.generate(tiny_model, prompts, seed=11, **_SAMPLING).tokens
    rows = [o[p.numel():].tolist() for o, p in zip(out, prompts)]
    assert rows == [_sampling_alone(tiny_model, p, 11 + r) for r, p in enumerate(prompts)]
    assert rows[0] != _sampling_alone(tiny_model, prompts[0], 12)  # the seed matters: this can fail


@case("sampling-tensor-rows-independent")
def _(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]])
    out = minigen.generate(tiny_model, ids, seed=2**64 - 2, **_SAMPLING).tokens[:, 5:]
    # row r's seed is (seed + r) mod 2**64: the third row wraps round to 0
    assert [row.tolist() for row in out] == [_sampling_alone(tiny_model, p, s)
                                             for p, s in zip(ids, (2**64 - 2, 2**64 - 1, 0))]


@case("sampling-stream-rows-independent")
def _(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    out = torch.stack(list(minigen.stream(tiny_model, ids, seed=11, **_SAMPLING)), dim=1)
    assert [row.tolist() for row in out] == [_sampling_alone(tiny_model, p, 11 + r) for r, p in enumerate(ids)]


@case("sampling-parallel-rows-independent")
def _(tiny_model):
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = minigen.parallel_sample(tiny_model, prompt, 3, seed=11, **_SAMPLING).tokens[:, 5:]
    rows = [row.tolist() for row in out]
    assert rows == [_sampling_alone(tiny_model, prompt[0], 11 + r) for r in range(3)]
    assert len({tuple(r) for r in rows}) == 3  # the n samples still differ from each other


@case("sampling-engine-row-zero")
def _(tiny_model):
    prompts = _sampling_prompts()
    engine = minigen.Engine(tiny_model, {"cache_chunk_size": 4})
    for r, p in enumerate(prompts):
        engine.add_request(p, seed=11 + r, **_SAMPLING)
    served = engine.run()
    batch = minigen.generate(tiny_model, prompts, seed=11, **_SAMPLING).tokens
    for r, p in enumerate(prompts):  # request r (seed 11 + r) == row r of a batch seeded 11 == alone
        assert served[r].tolist() == batch[r].tolist() == p.tolist() + _sampling_alone(tiny_model, p, 11 + r)


@case("sampling-speculative-rows-independent")
def _(tiny_model):
    prompts = [torch.tensor([3, 1, 4, 3, 1, 4, 3, 1]), torch.tensor([9, 2, 9, 2, 9])]
    spec = _SAMPLING | dict(speculative_method="ngram", num_speculative_tokens=3)
    out = minigen.generate(tiny_model, prompts, seed=11, **spec).tokens
    rows = [o[p.numel():].tolist() for o, p in zip(out, prompts)]
    assert rows == [_sampling_alone(tiny_model, p, 11 + r, **spec) for r, p in enumerate(prompts)]


@case("config-temperature-denormal")
def _(tiny_model):
    prompts = _sampling_prompts()
    greedy = minigen.generate(tiny_model, prompts, max_new_tokens=8, stop_token_ids=[]).tokens
    for temperature in (5e-324, 1e-40):  # 0.0 in float32, and a float32 subnormal
        tiny = minigen.generate(tiny_model, prompts, max_new_tokens=8, stop_token_ids=[], do_sample=True,
                                temperature=temperature, seed=0).tokens
        assert [t.tolist() for t in tiny] == [g.tolist() for g in greedy]
    assert any(g[-8:].tolist() != [0] * 8 for g in greedy)  # greedy is not the NaN's argmax, token 0


@case("parallel-sample-n-bool")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([[3, 1, 4]]), True)


@case("parallel-sample-list-prompt")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, [1, 2, 3], 2)


@case("parallel-sample-1d-prompt")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([1, 2, 3]), 2)


@case("parallel-sample-float-prompt")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([[1.0, 2.0]]), 2)


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes


# ---------------------------------------------------------------- 4-9: config, CLI integers, sizes, argument types


# ---------------------------------------------------------------- 10-12: output files and what is cached


# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum


# ---------------------------------------------------------------- 14: the 4-bit cache's scales


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
