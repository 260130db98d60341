"""Penalties, logit bias and min-p (chapter "Decoding"): decoding/processors.py, decoding/logits.py
and sampling.probabilities.

Oracles:
- each processor equals transformers' LogitsProcessor of the same name on random logits
  (RepetitionPenaltyLogitsProcessor, MinPLogitsWarper after the temperature / top-k / top-p warpers,
  SequenceBiasLogitsProcessor for single tokens); OpenAI's penalties follow their documented formula,
  written here the obvious way;
- generate with repetition_penalty equals transformers' greedy generate(repetition_penalty=...) (fp32);
- a row's penalties read only its own tokens: a row of a tensor batch, of a ragged batch and a request
  of the Engine each equal that prompt generated alone; parallel_sample's rows equal their seeds alone;
- speculative decoding keeps exactly the processed distribution: greedy equals plain greedy token for
  token, and sampled tokens pass a chi-square test against the exact processed distribution of a model
  with a vocabulary of 8 (every continuation enumerated), masks included (a fake structured Matcher);
  a rule that compares unprocessed distributions fails the same test.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
import transformers as tf

import minigen
from conftest import tiny_hf
from minigen import ConfigError, Engine, GenerationConfig, drafts
from minigen.course.distributions import chi_square, tiny_llama
from minigen.decoding import processors
from minigen.decoding.logits import LogitsProcessing
from minigen.sampling import probabilities

pytestmark = pytest.mark.usefixtures("one_thread")
generate_module = importlib.import_module("minigen.generate")  # the module (minigen.generate is the function)

V = 97  # the tiny Llama's vocabulary


def random_logits(B: int = 4, seed: int = 0) -> torch.Tensor:
    """Logits [B, V] spread over several units, some negative, some positive (both sides of the
    repetition rule), with a few exact ties at 0."""
    logits = 3 * torch.randn(B, V, generator=torch.Generator().manual_seed(seed))
    logits[:, :3] = 0.0
    return logits


def random_prompts(B: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (int(n),), generator=g) for n in torch.randint(3, 30, (B,), generator=g)]


# ---------------------------------------------------------------- each processor against its reference
@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    logits, prompts = random_logits(), random_prompts()
    processing = LogitsProcessing(GenerationConfig(repetition_penalty=penalty), prompts, V, "cpu")
    for b, prompt in enumerate(prompts):  # transformers reads one row's ids at a time (they differ in length)
        want = tf.RepetitionPenaltyLogitsProcessor(penalty)(prompt[None], logits[b:b + 1].clone())
        torch.testing.assert_close(processing(logits[b:b + 1], rows=[b]), want, atol=0, rtol=0)
    # and after new tokens: the row's seen set grows by them
    new = torch.tensor([5, 6, 7, 8])
    processing.advance(new)
    for b, prompt in enumerate(prompts):
        ids = torch.cat([prompt, new[b:b + 1]])[None]
        want = tf.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[b:b + 1].clone())
        torch.testing.assert_close(processing(logits)[b:b + 1], want, atol=0, rtol=0)


@pytest.mark.parametrize("frequency, presence", [(0.5, 0.0), (0.0, 1.5), (-1.0, 2.0), (2.0, -2.0)])
def test_openai_penalties_follow_the_documented_formula(frequency, presence):
    # platform.openai.com/docs/advanced-usage: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence,
    # c[j] how often token j was sampled before the current position (the prompt is not counted)
    logits, prompts = random_logits(2), random_prompts(2)
    processing = LogitsProcessing(GenerationConfig(frequency_penalty=frequency, presence_penalty=presence),
                                  prompts, V, "cpu")
    torch.testing.assert_close(processing(logits), logits, atol=0, rtol=0)  # the prompt counts for nothing
    generated = [[4, 9, 4, 4], [11, 12, 13, 11]]
    for column in zip(*generated):
        processing.advance(torch.tensor(column))
    want = logits.clone()
    for b, tokens in enumerate(generated):
        for j in range(V):
            c = tokens.count(j)
            want[b, j] = logits[b, j] - c * frequency - float(c > 0) * presence
    torch.testing.assert_close(processing(logits), want, atol=1e-6, rtol=0)


def test_logit_bias_equals_transformers_sequence_bias_of_single_tokens():
    bias = {3: 2.5, 40: -100.0, 96: 7.0}
    logits = random_logits()
    processing = LogitsProcessing(GenerationConfig(logit_bias=bias), random_prompts(), V, "cpu")
    want = tf.SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()])(
        torch.zeros(4, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(processing(logits), want, atol=0, rtol=0)
    assert processors.bias(logits, torch.zeros(V)).equal(logits)


@pytest.mark.parametrize("sampling", [dict(min_p=0.1), dict(min_p=0.3, temperature=0.7),
                                      dict(min_p=0.05, top_k=20, temperature=1.5), dict(min_p=0.2, top_p=0.9),
                                      dict(min_p=1.0), dict(min_p=0.0)])
def test_min_p_equals_transformers_warpers(sampling):
    config = GenerationConfig(do_sample=True, **sampling)
    warpers = [tf.TemperatureLogitsWarper(config.temperature)]  # transformers' order: temperature, top-k, top-p, min-p
    if config.top_k is not None:
        warpers.append(tf.TopKLogitsWarper(config.top_k))
    if config.top_p is not None:
        warpers.append(tf.TopPLogitsWarper(config.top_p))
    warpers.append(tf.MinPLogitsWarper(config.min_p))
    logits = random_logits(8, seed=3)
    scores = logits.clone()
    for warper in warpers:
        scores = warper(None, scores)
    torch.testing.assert_close(probabilities(logits, config), scores.softmax(dim=-1), atol=1e-6, rtol=1e-5)
    if config.min_p == 1.0:  # only the top token (and its ties) stays
        assert ((probabilities(logits, config) > 0).sum(dim=-1) == 1).all()


def test_nothing_to_process_builds_nothing():
    assert not LogitsProcessing.needed(GenerationConfig())
    assert not LogitsProcessing.needed(GenerationConfig(logit_bias={}, do_sample=True, min_p=0.1))
    for key, value in (("repetition_penalty", 1.1), ("frequency_penalty", 0.1), ("presence_penalty", -0.1),
                       ("logit_bias", {1: 1.0})):
        assert LogitsProcessing.needed(GenerationConfig(**{key: value}))
    # and the default loop never builds one
    assert generate_module.row_processing(GenerationConfig(), torch.tensor([[1, 2]]), torch.arange(2), V) is None


def test_the_order_is_repetition_then_openai_then_bias():
    config = GenerationConfig(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={7: 3.0})
    logits = random_logits(1)
    processing = LogitsProcessing(config, [torch.tensor([7, 8])], V, "cpu")
    processing.advance(torch.tensor([7]))
    want = logits.clone()
    for j in (7, 8):  # seen: divided or multiplied first
        want[0, j] = want[0, j] / 2 if want[0, j] >= 0 else want[0, j] * 2
    want[0, 7] = want[0, 7] - 1.0 - 0.5 + 3.0  # then the new token's count, then the bias
    torch.testing.assert_close(processing(logits), want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- a fake structured Matcher (guide.py's interface)
class Parity:
    """Allows even tokens first, then alternates parity; every text is complete (no stop ids). A
    stand-in for a structured-output Matcher: enough to see the mask applied, advanced and copied."""

    def __init__(self, vocab: int, last: int | None = None):
        self.vocab, self.last = vocab, last

    def allowed(self) -> torch.Tensor:
        want = 0 if self.last is None else 1 - self.last % 2
        return torch.arange(self.vocab) % 2 == want

    def advance(self, token: int) -> None:
        assert self.allowed()[token], f"token {token} was not allowed"
        self.last = token

    def is_complete(self) -> bool:
        return True

    def copy(self) -> "Parity":
        return Parity(self.vocab, self.last)


def test_a_matcher_masks_each_row_and_forks_and_speculates_without_moving():
    config = GenerationConfig(repetition_penalty=1.5)
    logits = random_logits(2)
    processing = LogitsProcessing(config, random_prompts(2), V, "cpu", matchers=[Parity(V), None])
    out = processing(logits)
    assert torch.isinf(out[0, 1::2]).all() and torch.isfinite(out[0, ::2]).all()
    assert torch.isfinite(out[1]).all()  # a row without a matcher is not masked
    # speculate: position i sees the proposal's first i tokens; the state does not move
    proposal = [4, 7, 10]
    spec = processing.speculate(0, logits[:1].expand(4, -1), proposal)
    for i in range(4):
        alone = LogitsProcessing(config, [random_prompts(2)[0]], V, "cpu", matchers=[Parity(V)])
        for token in proposal[:i]:
            alone.advance(torch.tensor([token]))
        torch.testing.assert_close(spec[i], alone(logits[:1])[0], atol=0, rtol=0)
    assert processing.matchers[0].last is None
    # advance, then fork: each row's matcher and counts are its own
    processing.advance(torch.tensor([2, 3]))
    single = LogitsProcessing(config, [torch.tensor([1, 2])], V, "cpu", matchers=[Parity(V)])
    single.fork(3)
    single.advance(torch.tensor([0, 2, 4]))
    assert [m.last for m in single.matchers] == [0, 2, 4]
    assert single.seen[:, 4].tolist() == [False, False, True]


# ---------------------------------------------------------------- through generate, against transformers
@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf("llama")
    return hf, minigen.from_hf(hf)


@pytest.mark.parametrize("fused", ["auto", False], ids=["default step", "eager"])
@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_greedy_repetition_penalty_equals_transformers_generate(tiny, penalty, fused):
    hf, model = tiny
    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3]])
    want = hf.generate(prompt, max_new_tokens=24, do_sample=False, repetition_penalty=penalty)
    got = minigen.generate(model, prompt, max_new_tokens=24, repetition_penalty=penalty, stop_token_ids=[],
                           fused_decode=fused)
    assert torch.equal(got.tokens, want)
    plain = minigen.generate(model, prompt, max_new_tokens=24, stop_token_ids=[]).tokens
    assert not torch.equal(got.tokens, plain), "the penalty changed nothing: the test would not see it missing"


SETTINGS = {
    "repetition": dict(repetition_penalty=1.4),
    "openai": dict(frequency_penalty=1.0, presence_penalty=0.6),
    "bias": dict(logit_bias={5: 4.0, 7: -100.0}),
    "all, sampled": dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={3: 2.0}, do_sample=True, seed=4,
                         min_p=0.05),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_each_row_reads_only_its_own_tokens(tiny, setting):
    _, model = tiny
    config = dict(max_new_tokens=12, stop_token_ids=[], **SETTINGS[setting])
    seed = config.pop("seed", None)
    seeded = (lambda r: dict(seed=seed + r)) if seed is not None else (lambda r: {})
    batch = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(2))
    both = minigen.generate(model, batch, **config, **seeded(0)).tokens
    for r in range(3):  # a tensor batch: row r draws as that prompt alone with seed + r
        assert torch.equal(both[r], minigen.generate(model, batch[r:r + 1], **config, **seeded(r)).tokens[0])
    prompts = random_prompts(3, seed=5)
    ragged = minigen.generate(model, prompts, **config, **seeded(0)).tokens
    for r, p in enumerate(prompts):
        assert torch.equal(ragged[r], minigen.generate(model, p[None], **config, **seeded(r)).tokens[0])
    if seed is not None:  # parallel_sample forks one prompt's state into n rows
        forked = minigen.parallel_sample(model, batch[:1], 3, **config, seed=seed).tokens
        for r in range(3):
            assert torch.equal(forked[r], minigen.generate(model, batch[:1], **config, seed=seed + r).tokens[0])


def test_the_engine_s_requests_with_different_penalties_equal_each_alone(tiny):
    _, model = tiny
    prompts = random_prompts(4, seed=7)
    engine = Engine(model, max_batch_size=4, num_blocks=64)
    ids = [engine.add_request(p, max_new_tokens=10, stop_token_ids=[], **s) for p, s in zip(prompts, SETTINGS.values())]
    out = engine.run()
    for rid, p, s in zip(ids, prompts, SETTINGS.values()):
        assert torch.equal(out[rid], minigen.generate(model, p[None], max_new_tokens=10, stop_token_ids=[], **s).tokens[0])


def test_a_preempted_request_keeps_its_penalties(tiny):
    # 8 blocks of 4 for three requests of up to 22 positions: some are preempted and recomputed from their prompt
    # and output; their processing state (prompt and output seen, output counted) stays as it was
    _, model = tiny
    prompts = random_prompts(3, seed=11)
    prompts = [p[:12] for p in prompts]
    engine = Engine(model, {"cache_chunk_size": 4}, max_batch_size=3, num_blocks=8)
    settings = list(SETTINGS.values())[:3]
    ids = [engine.add_request(p, max_new_tokens=9, stop_token_ids=[], **s) for p, s in zip(prompts, settings)]
    out = engine.run()
    assert engine.metrics()["preemptions"] > 0
    for rid, p, s in zip(ids, prompts, settings):
        assert torch.equal(out[rid], minigen.generate(model, p[None], max_new_tokens=9, stop_token_ids=[], **s).tokens[0])


def test_the_fused_step_with_penalties_equals_the_eager_step(tiny):
    # the fused C step returns logits like any other: the loop processes them before it samples
    _, model = tiny
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    config = dict(max_new_tokens=8, stop_token_ids=[], repetition_penalty=1.3, presence_penalty=0.5, logit_bias={4: 2.0})
    out = minigen.generate(model, prompt, fused_decode=True, **config)
    assert out.stats.step == "fused"
    assert torch.equal(out.tokens, minigen.generate(model, prompt, fused_decode=False, **config).tokens)


@pytest.mark.slow
def test_a_compiled_step_with_penalties_equals_the_eager_step(tiny):
    _, model = tiny
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    config = dict(max_new_tokens=6, stop_token_ids=[], repetition_penalty=1.3, frequency_penalty=0.5)
    want = minigen.generate(model, prompt, fused_decode=False, **config).tokens
    assert torch.equal(minigen.generate(model, prompt, compile=True, **config).tokens, want)


# ---------------------------------------------------------------- speculative decoding: exact with processing
PROPOSERS = {"ngram": ("ngram", lambda m: None), "layer skip": ("draft", lambda m: drafts.layer_skip(m, 1)),
             "itself": ("draft", lambda m: m)}


@pytest.mark.parametrize("setting", ["repetition", "openai", "bias"])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_speculation_with_penalties_equals_plain_greedy(tiny, setting, proposer):
    _, model = tiny
    base = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([base, base[:5]])[None]  # every token occurs: prompt lookup proposes after any
    config = dict(max_new_tokens=20, stop_token_ids=[], **SETTINGS[setting])
    method, make_draft = PROPOSERS[proposer]
    plain = minigen.generate(model, prompt, **config).tokens
    out = minigen.generate(model, prompt, speculative_method=method, draft_model=make_draft(model), **config)
    assert torch.equal(out.tokens, plain)
    assert out.stats.draft_tokens > 0
    if proposer == "itself":  # the draft's processed distribution is the target's: every proposal kept
        assert out.stats.accepted_tokens == out.stats.draft_tokens


SAMPLES = 2000
P_MIN = 1e-3  # a seeded run gives the same p-value every time
SMALL_PROMPT = torch.tensor([[0, 1, 2, 3, 1, 2, 3]])  # tokens 4..7 unseen: the penalties' sets grow as it samples
PENALTIES = dict(repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.4, logit_bias={5: 1.0, 6: -0.5})


@pytest.fixture(scope="module")
def small():
    """(target, draft): random Llamas with a vocabulary of 8 (three tokens: 512 continuations)."""
    return tiny_llama(8, seed=0), tiny_llama(8, seed=3)


def reference(logits: torch.Tensor, prompt: list[int], new: list[int], parity: bool) -> torch.Tensor:
    """One row's processed logits [V], the obvious way: loops over the vocabulary."""
    out = logits.clone()
    for j in range(len(out)):
        if j in prompt or j in new:
            out[j] = out[j] * PENALTIES["repetition_penalty"] if out[j] < 0 else out[j] / PENALTIES["repetition_penalty"]
        c = new.count(j)
        out[j] -= c * PENALTIES["frequency_penalty"] + (c > 0) * PENALTIES["presence_penalty"]
        out[j] += PENALTIES["logit_bias"].get(j, 0.0)
        want = 0 if not new else 1 - new[-1] % 2
        if parity and j % 2 != want:
            out[j] = float("-inf")
    return out


@torch.inference_mode()
def exact_processed(model, prompt: torch.Tensor, n: int, sampling: dict, parity: bool) -> torch.Tensor:
    """P(x1..xn | prompt) [V] * n with every step's logits processed by `reference`, then tempered and cut."""
    Vs = model.config.vocab_size
    config = GenerationConfig(do_sample=True, **sampling)
    joint = torch.ones((), dtype=torch.float64)
    for i in range(n):
        prefixes = list(itertools.product(range(Vs), repeat=i))
        ids = torch.tensor([prompt[0].tolist() + list(p) for p in prefixes])
        logits = model(ids, torch.arange(ids.shape[1]), None, last_only=True)[:, -1].double()
        processed = torch.stack([reference(row, prompt[0].tolist(), list(p), parity) for row, p in zip(logits, prefixes)])
        joint = joint[..., None] * probabilities(processed, config).view(*[Vs] * i, Vs)
    return joint


def sampled_statistics(small, method, sampling: dict, parity: bool, k: int = 2):
    """Draw SAMPLES texts of k + 2 tokens -> chi-square (statistic, dof, p) of (t1, t2) and of (t2, t3), and stats."""
    target, draft = small
    T, Vs = SMALL_PROMPT.shape[1], target.config.vocab_size
    extra = dict(speculative_method=method, num_speculative_tokens=k) if method else {}
    out = minigen.generate(target, SMALL_PROMPT.expand(SAMPLES, -1), max_new_tokens=k + 2, do_sample=True, seed=0,
                           stop_token_ids=[], draft_model=draft if method == "draft" else None, **extra, **sampling,
                           **PENALTIES)
    t1, t2, t3 = (out.tokens[:, T + i] for i in range(3))
    exact = exact_processed(target, SMALL_PROMPT, 3, sampling, parity)
    first_two = chi_square(torch.bincount(t1 * Vs + t2, minlength=Vs * Vs).double(), exact.sum(dim=2))
    second_third = chi_square(torch.bincount(t2 * Vs + t3, minlength=Vs * Vs).double(), exact.sum(dim=0))
    return first_two, second_third, out.stats


def with_parity(monkeypatch):
    """Every row of the loop generates under a Parity matcher (a structured mask), penalties beside it."""
    def build(config, input_ids, input_pos, vocab_size, guide=None):
        return LogitsProcessing(config, list(input_ids), vocab_size, input_ids.device,
                                matchers=[Parity(vocab_size) for _ in range(len(input_ids))])
    monkeypatch.setattr(generate_module, "row_processing", build)


@pytest.mark.parametrize("parity", [False, True], ids=["penalties", "penalties and a mask"])
@pytest.mark.parametrize("method", [None, "ngram", "draft"])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=1.5, min_p=0.05)], ids=["t=1", "t=1.5 min-p"])
def test_speculative_sampling_with_penalties_draws_the_processed_distribution(small, monkeypatch, method, sampling,
                                                                               parity):
    if parity:
        with_parity(monkeypatch)
    (s12, dof12, p12), (s23, dof23, p23), stats = sampled_statistics(small, method, sampling, parity)
    print(f"chi-square (t1, t2): {s12:.1f} on {dof12} dof, p = {p12:.3f}; (t2, t3): {s23:.1f} on {dof23} dof, "
          f"p = {p23:.3f}")
    assert dof12 >= 3 and dof23 >= 3, "too few outcomes for the test to see anything"
    assert p12 > P_MIN and p23 > P_MIN, (p12, p23)
    if method is not None:  # rounds proposed (prompt lookup finds no match after 4..7); some kept, some not
        assert 0 < stats.accepted_tokens < stats.draft_tokens, (stats.accepted_tokens, stats.draft_tokens)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_acceptance_against_unprocessed_distributions_fails_the_test(small, monkeypatch, method):
    # a planted bug: the target's verified logits go to the rule unprocessed (the loop's first token is still processed)
    monkeypatch.setattr(LogitsProcessing, "speculate", lambda self, row, logits, proposal: logits)
    (_, _, p12), _, _ = sampled_statistics(small, method, {}, parity=False)
    assert p12 < 1e-6, p12


# ---------------------------------------------------------------- refusals
def test_logit_bias_outside_the_vocabulary_is_refused_before_any_work(tiny):
    _, model = tiny
    with pytest.raises(ConfigError, match=r"logit_bias names the token id 97, outside this model's vocabulary \[0, 96\]"):
        minigen.generate(model, torch.tensor([[1, 2]]), logit_bias={97: 1.0, 3: 1.0})
    with pytest.raises(ConfigError, match=r"token id 500"):
        minigen.make_plan(model, GenerationConfig(logit_bias={"500": -100}))
    with pytest.raises(ConfigError, match=r"token id 120"):
        Engine(model, max_batch_size=1, num_blocks=8).add_request([1, 2], logit_bias={120: 1})


def test_json_keys_are_token_ids(tmp_path):
    path = tmp_path / "generation_config.json"
    GenerationConfig(logit_bias={5: -100, 17: 2.5}).to_json(path)  # JSON writes the keys as strings
    assert GenerationConfig.from_json(path).logit_bias == {5: -100, 17: 2.5}
    with pytest.raises(ConfigError, match=r"logit_bias has the key '-3', which is no token id"):
        GenerationConfig(logit_bias={"-3": 1})
