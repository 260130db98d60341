"""n samples a prompt and log-probabilities (decoding/logprobs.py) through every step kind.

The oracle for a logprob is transformers: the same model run teacher-forced over the prompt and the
tokens the generation kept, log_softmax of its raw logits at each new token's position. The oracle
for n is generate itself: output row b * n + j is prompt b generated alone with seed + b * n + j.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import GenerationConfig, drafts
from minigen.serving.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")
K = 3  # alternatives recorded per token
STOP = 7  # a stop id that the tiny model's greedy rows reach at different steps (checked below)
ATOL = 2e-4  # the logprob of an fp32 forward against transformers': the sums in another order


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf("llama")
    return hf, minigen.from_hf(hf)


def oracle(hf, prompt: torch.Tensor, new: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(new), V] at the positions that produced `new` after `prompt` [T]."""
    full = torch.cat([prompt, torch.tensor(new, dtype=prompt.dtype)])[None]
    with torch.no_grad():
        logits = hf(full).logits[0, len(prompt) - 1:len(prompt) - 1 + len(new)]
    return torch.log_softmax(logits.float(), dim=-1)


def check_row(hf, prompt: torch.Tensor, new: list[int], entries: list) -> None:
    """One row's entries against transformers: one per kept token, its logprob and the top K."""
    assert len(entries) == len(new), (len(entries), len(new))
    if not new:
        return
    expect = oracle(hf, prompt, new)
    for j, (token, (logprob, top)) in enumerate(zip(new, entries)):
        assert logprob == pytest.approx(expect[j, token].item(), abs=ATOL), (j, token)
        values, ids = expect[j].topk(K)
        assert [i for i, _ in top] == ids.tolist(), j
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=ATOL)


def kept(row: torch.Tensor, T: int, stop: int | None = STOP) -> list[int]:
    """A tensor batch row's new tokens up to and including its stop (the padding after it dropped)."""
    new = row[T:].tolist()
    return new[:new.index(stop) + 1] if stop in new else new


STEP_KINDS = {  # each a different path from logits to a recorded token
    "fused (the default at batch 1 here)": {},
    "eager": {"fused_decode": False},
    "paged": {"cache_chunk_size": 4},
    "naive loop": {"use_cache": False},
    "prompt in pieces": {"prefill_chunk_size": 3},
    "speculative ngram": {"speculative_method": "ngram"},
    "speculative draft, sampled": {"speculative_method": "draft", "do_sample": True, "seed": 4},
    "sampled with penalties and a bias": {"do_sample": True, "seed": 9, "temperature": 0.7, "top_k": 20,
                                          "repetition_penalty": 1.3, "logit_bias": {3: 5.0}},
}


@pytest.mark.parametrize("settings", STEP_KINDS.values(), ids=STEP_KINDS.keys())
def test_logprobs_equal_transformers_on_every_step_kind(tiny, settings):
    """The raw logits' logprob and top K of every kept token, whichever step produced it and however
    it was sampled, in a batch of one, a tensor batch of two (rows that stop apart) and a ragged batch."""
    hf, model = tiny
    draft = drafts.layer_skip(model, 1) if settings.get("speculative_method") == "draft" else None
    config = GenerationConfig(max_new_tokens=8, logprobs=K, stop_token_ids=[STOP], **settings)
    prompts = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    one = minigen.generate(model, prompts[:1], config, draft_model=draft)
    check_row(hf, prompts[0], kept(one.tokens[0], 6), one.logprobs[0])
    if config.use_cache:  # the naive loop runs one row at a time (RAGGED_REFUSED); batches below
        both = minigen.generate(model, prompts, config, draft_model=draft)
        for b in range(2):
            check_row(hf, prompts[b], kept(both.tokens[b], 6), both.logprobs[b])
        ragged = [prompts[0, :4], prompts[1]]
        out = minigen.generate(model, ragged, config, draft_model=draft)
        for b, p in enumerate(ragged):
            check_row(hf, p, out.tokens[b][len(p):].tolist(), out.logprobs[b])


def test_the_rows_stop_apart(tiny):
    """STOP ends the two greedy rows of the batch above at different steps: a row's list ends at its own stop."""
    _, model = tiny
    prompts = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    out = minigen.generate(model, prompts, max_new_tokens=8, logprobs=0, stop_token_ids=[STOP])
    lengths = [len(row) for row in out.logprobs]
    assert lengths == [len(kept(row, 6)) for row in out.tokens] and len(set(lengths)) == 2, lengths
    assert all(top == [] for row in out.logprobs for _, top in row)  # logprobs=0: the token's own alone


def test_parallel_sample_records_each_sample(tiny):
    hf, model = tiny
    prompt = torch.tensor([[5, 9, 14, 2]])
    out = minigen.parallel_sample(model, prompt, 3, do_sample=True, seed=1, max_new_tokens=5, logprobs=K)
    for r in range(3):
        check_row(hf, prompt[0], out.tokens[r, 4:].tolist(), out.logprobs[r])


def test_n_rows_are_each_prompt_alone_with_its_seed(tiny):
    """Row b * n + j equals prompt b generated alone with seed + b * n + j, in a tensor batch and a
    ragged one, through the default step and a speculative one; a prompt's samples differ."""
    _, model = tiny
    prompts = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    for settings in ({}, {"speculative_method": "ngram"}, {"cache_chunk_size": 4}):
        config = GenerationConfig(max_new_tokens=6, do_sample=True, seed=11, n=3, **settings)
        out = minigen.generate(model, prompts, config)
        ragged = minigen.generate(model, [prompts[0, :3], prompts[1]], config)
        assert out.tokens.shape == (6, 11) and len(ragged.tokens) == 6
        for b in range(2):
            for j in range(3):
                alone = config.replace(n=1, seed=11 + b * 3 + j)
                assert torch.equal(out.tokens[b * 3 + j], minigen.generate(model, prompts[b:b + 1], alone).tokens[0])
                prompt = prompts[0, :3] if b == 0 else prompts[1]
                assert torch.equal(ragged.tokens[b * 3 + j], minigen.generate(model, [prompt], alone).tokens[0])
            assert len({tuple(out.tokens[b * 3 + j].tolist()) for j in range(3)}) > 1, "a prompt's samples differ"


def test_n_and_logprobs_in_the_plan_and_stream(tiny):
    """print(plan) names them; stream yields B * n tokens a step, the same as generate's rows."""
    _, model = tiny
    config = GenerationConfig(max_new_tokens=4, do_sample=True, seed=2, n=2, logprobs=1)
    plan = minigen.make_plan(model, config, 2)
    assert "n=2 samples a prompt" in str(plan) and "top 1, from the raw logits" in str(plan)
    ids = torch.tensor([[4, 8, 15]])
    steps = list(minigen.stream(model, ids, config.replace(logprobs=None)))
    assert all(t.shape == (2,) for t in steps)
    assert torch.equal(torch.stack(steps, 1), minigen.generate(model, ids, config).tokens[:, 3:])


def test_the_engine_records_the_configs_logprobs(tiny):
    """Engine(config with logprobs=k): every request records k alternatives, unless it asks for its own."""
    hf, model = tiny
    engine = Engine(model, GenerationConfig(max_new_tokens=4, logprobs=K))
    a = engine.add_request([3, 1, 4, 1, 5])
    b = engine.add_request([2, 7, 1, 8], logprobs=0)
    engine.run()
    ra, rb = engine.requests[a], engine.requests[b]
    assert len(ra.logprobs) == 4 and all(len(top) == K for _, top in ra.logprobs)
    assert all(top == [] for _, top in rb.logprobs)
    check_row(hf, torch.tensor([3, 1, 4, 1, 5]), ra.output, ra.logprobs)
