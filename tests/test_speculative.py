"""Speculative decoding (chapter 13): propose k tokens, verify them in one forward, keep what the
target agrees with.

Oracles: plain greedy decoding (the same config without speculative_method), token for token, on
every cache the combination table applies speculation to, for k = 1..8 and every proposer; each row
of a batch generated alone, without speculation.

The prompts repeat themselves, so prompt lookup has n-grams to propose from, and the drafts range
from the target itself (accepts everything) to an unrelated model (almost nothing): each test
checks that proposals were made, and the greedy ones that some were accepted and some rejected,
so the rewind of every cache runs.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import ConfigError, GenerationConfig, drafts
from minigen.caches import make
from minigen.caches.window import WindowKVCache
from minigen.sampling import probabilities
from minigen.steps.speculative import draft_config
from minigen.steps import speculative

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():
    return minigen.from_hf(tiny_hf("llama"))


@pytest.fixture(scope="module")
def tiny_bf16():
    """The same tiny Llama converted to bf16 weights (fp32 activations on a CPU: precision.py)."""
    return minigen.from_hf(tiny_hf("llama"), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def another():
    """A different tiny random model with the same vocabulary (another seed)."""
    return minigen.from_hf(tiny_hf("llama", seed=1))


# proposer -> (speculative_method, the draft made from the target and `another`)
PROPOSERS = {
    "ngram": ("ngram", lambda target, another: None),
    "layer_skip": ("draft", lambda target, another: drafts.layer_skip(target, 1)),
    "unrelated": ("draft", lambda target, another: drafts.unrelated(target)),
    "another model": ("draft", lambda target, another: another),
    "itself": ("draft", lambda target, another: target),
}
# Every cache the combination table applies speculation to (combinations.APPLIED, and the pairs it
# does not refuse), with a window shorter than the text (a 12-token prompt and 20 new tokens).
CACHES = {
    "contiguous": {},
    "eager": dict(fused_decode=False),  # the default ("auto") runs the fused C step at batch 1
    "fused": dict(fused_decode=True),
    "paged 4": dict(cache_chunk_size=4),
    "paged 16": dict(cache_chunk_size=16),
    "window": dict(window_size=6, sink_tokens=0),
    "window with sinks": dict(window_size=6, sink_tokens=2),
    "paged window": dict(cache_chunk_size=4, window_size=6, sink_tokens=1),
    "offload": dict(prefetch_depth=0),
    "offload paged window": dict(prefetch_depth=1, cache_chunk_size=4, window_size=8, sink_tokens=1),
    "sparse top-k": dict(sparse_top_k=4),
    "sparse threshold": dict(sparsity_threshold=0.3),
    "window sparse": dict(window_size=8, sink_tokens=2, sparse_top_k=4),
    "fp16 cache": dict(kv_dtype="float16"),
}
# The caches that take a batch's rows at their own positions (speculating rows move apart; the
# others are refused for several rows: places.RAGGED_REFUSED).
ROW_CACHES = ("contiguous", "paged 4", "paged 16", "window", "window with sinks", "paged window", "fp16 cache")
NEW = 20  # new tokens per greedy run


@pytest.fixture(scope="module")
def plain():
    """Plain greedy decoding without speculation, each (model, prompt, config) run once per module."""
    done: dict = {}

    def run(model, prompt: torch.Tensor, **config) -> torch.Tensor:
        key = (id(model), tuple(prompt.shape), tuple(prompt.flatten().tolist()), repr(sorted(config.items())))
        if key not in done:
            done[key] = minigen.generate(model, prompt, **config).tokens
        return done[key]
    return run


def repeating(n: int, seed: int, vocab: int = 97) -> torch.Tensor:
    """A prompt [1, 2.5 n] that says n random tokens twice and starts a third time: prompt lookup
    finds n-grams to propose from."""
    base = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base, base[:n // 2]])[None]


# ---------------------------------------------------------------- regressions
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_draft_cache_counted_its_unfed_last_proposal(tiny, k):
    # The draft feeds itself all of its k proposals but the last (the target checks that one), yet
    # DraftProposer.accepted counted every accepted proposal as cached: when all k were accepted its
    # cache skipped a position, and its next proposals read a stale key there. The target as its own
    # draft agrees with every greedy proposal, so its acceptance rate is exactly 1 (it was 0.73 to
    # 0.86 here), in a batch too.
    prompt = repeating(7, seed=0)
    kw = dict(max_new_tokens=20, stop_token_ids=[], speculative_method="draft", num_speculative_tokens=k,
              draft_model=tiny)
    alone = minigen.generate(tiny, prompt, **kw).stats
    assert alone.draft_tokens > 0 and alone.acceptance_rate == 1.0, (alone.draft_tokens, alone.accepted_tokens)
    rows = minigen.generate(tiny, [prompt[0], prompt[0, :5]], **kw).stats
    assert rows.draft_tokens > 0 and rows.acceptance_rate == 1.0, (rows.draft_tokens, rows.accepted_tokens)


# ---------------------------------------------------------------- greedy: token for token
def speculate(model, prompt, proposer: str, draft, k: int, **config):
    method, _ = PROPOSERS[proposer]
    return minigen.generate(model, prompt, speculative_method=method, num_speculative_tokens=k,
                            draft_model=draft, **config)


EXACT = ("contiguous", "eager", "fused", "paged 4", "paged 16", "offload")  # every key kept, in the weights' dtype


def check_acceptance(proposer: str, cache: str, accepted: int, rejected: int) -> None:
    """What each proposer must have done over a test's runs (draft_tokens > 0 is checked per run)."""
    if proposer == "itself" and cache in EXACT:  # the target agrees with its own argmax every time
        # (the draft keeps a plain full cache: beside a window, sparse keys or a 16-bit cache it is
        # another function than the target, and may disagree)
        assert rejected == 0, f"the target rejected {rejected} of its own greedy proposals"
    elif proposer in ("ngram", "layer_skip"):  # both kinds of round happened: kept, and rewound
        assert accepted > 0 and rejected > 0, (accepted, rejected)


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("dtype, cache", [("fp32", c) for c in CACHES] + [("bf16", c) for c in CACHES
                                                                         if c != "fp16 cache"])
def test_greedy_speculation_equals_plain_greedy(tiny, tiny_bf16, another, plain, dtype, cache, proposer):
    """fp32, and bf16 weights with a bf16 cache (for time, bf16 takes k = 1, 2, 5 and 8)."""
    model = tiny if dtype == "fp32" else tiny_bf16
    config = dict(CACHES[cache], max_new_tokens=NEW, stop_token_ids=[])
    if dtype == "bf16":
        config["kv_dtype"] = "bfloat16"
    draft = PROPOSERS[proposer][1](model, another)
    prompt = repeating(5, seed=15)  # 12 tokens; its n-grams and the layer-skip draft get some accepted on every cache
    want = plain(model, prompt, **config)
    accepted = rejected = 0
    for k in range(1, 9) if dtype == "fp32" else (1, 2, 5, 8):
        out = speculate(model, prompt, proposer, draft, k, **config)
        assert torch.equal(out.tokens, want), f"k={k}: {out.tokens[0, -NEW:].tolist()} != {want[0, -NEW:].tolist()}"
        s = out.stats
        assert s.draft_tokens > 0, f"k={k}: nothing was proposed"
        # every verify forward emits the kept proposals and one token of the target's own; the first
        # token comes from the prompt's forward
        assert s.accepted_tokens + s.target_forwards == NEW - 1, (k, s.accepted_tokens, s.target_forwards)
        assert s.acceptance_rate == s.accepted_tokens / s.draft_tokens
        accepted, rejected = accepted + s.accepted_tokens, rejected + s.draft_tokens - s.accepted_tokens
    check_acceptance(proposer, cache, accepted, rejected)


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
def test_greedy_speculation_with_the_triton_kernel_equals_plain(tiny, another, plain, proposer):
    # verify steps run through torch, steps with nothing proposed through the kernel (in Triton's
    # interpreter on a CPU: slow, so one k)
    pytest.importorskip("triton")
    config = dict(attention_backend="triton", cache_chunk_size=4, max_new_tokens=12, stop_token_ids=[])
    prompt = repeating(7, seed=0)
    out = speculate(tiny, prompt, proposer, PROPOSERS[proposer][1](tiny, another), 3, **config)
    assert out.stats.draft_tokens > 0
    assert torch.equal(out.tokens, plain(tiny, prompt, **config))


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize("cache", ROW_CACHES)
def test_every_row_of_a_batch_equals_that_row_alone_without_speculation(tiny, another, plain, cache, proposer):
    config = dict(CACHES[cache], max_new_tokens=16, stop_token_ids=[])
    draft = PROPOSERS[proposer][1](tiny, another)
    ragged = [repeating(5, seed=15)[0], repeating(5, seed=1)[0, :9], repeating(6, seed=2)[0, :4]]
    tensor = torch.cat([repeating(5, seed) for seed in (15, 19, 21)])  # [3, 12]
    accepted = rejected = 0
    for k in (1, 3, 8):
        out = speculate(tiny, ragged, proposer, draft, k, **config)
        for p, got in zip(ragged, out.tokens):
            want = plain(tiny, p[None], **config)[0]
            assert torch.equal(got, want), f"k={k}, a prompt of {p.numel()}: {got.tolist()} != {want.tolist()}"
        both = speculate(tiny, tensor, proposer, draft, k, **config)
        for row in range(tensor.shape[0]):
            want = plain(tiny, tensor[row:row + 1], **config)[0]
            assert torch.equal(both.tokens[row], want), f"k={k}, row {row}"
        for s in (out.stats, both.stats):
            assert s.draft_tokens > 0
            accepted, rejected = accepted + s.accepted_tokens, rejected + s.draft_tokens - s.accepted_tokens
    check_acceptance(proposer, cache, accepted, rejected)


class NoSpareRing(WindowKVCache):
    """The ring buffer without spare slots, whatever make_cache asks for: what it was before speculation."""

    def __init__(self, *args, spare: int = 0, **kwargs):
        super().__init__(*args, spare=0, **kwargs)


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_the_window_ring_keeps_spare_slots_for_a_rewind(tiny, another, plain, monkeypatch, proposer, sinks):
    # A verify step writes k + 1 positions p..p+k into a ring of `window` slots, overwriting positions
    # p - window .. p + k - window; when the target rejects proposal m + 1, the next query at p + m + 1
    # still needs positions from p + m + 2 - window on, which the overwrite took for m + 2 <= k. With k
    # spare slots nothing it needs is overwritten; without them the text changes.
    config = dict(window_size=6, sink_tokens=sinks, max_new_tokens=NEW, stop_token_ids=[])
    prompt, k = repeating(5, seed=15), 4
    draft = PROPOSERS[proposer][1](tiny, another)
    want = plain(tiny, prompt, **config)
    rows = [prompt[0], prompt[0, :7]]
    assert torch.equal(speculate(tiny, prompt, proposer, draft, k, **config).tokens, want)
    monkeypatch.setattr(make, "WindowKVCache", NoSpareRing)
    without = speculate(tiny, prompt, proposer, draft, k, **config)
    assert without.stats.draft_tokens > without.stats.accepted_tokens  # rejected proposals, rewound
    assert not torch.equal(without.tokens, want), "the ring needs no spare slots? then make.py need not add them"
    in_rows = speculate(tiny, rows, proposer, draft, k, **config).tokens  # per-row positions: the same ring rule
    assert not all(torch.equal(got, plain(tiny, p[None], **config)[0]) for p, got in zip(rows, in_rows))


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
def test_each_row_stops_at_its_own_stop_while_speculating(tiny, another, plain, proposer):
    prompts = [repeating(5, seed=15)[0], repeating(5, seed=1)[0, :9], repeating(6, seed=2)[0, :4]]
    free = plain(tiny, prompts[1][None], max_new_tokens=12, stop_token_ids=[])[0]
    stop = int(free[9 + 4])  # row 1's fifth new token: row 1 stops there, the others maybe elsewhere
    config = dict(max_new_tokens=12, stop_token_ids=[stop])
    out = speculate(tiny, prompts, proposer, PROPOSERS[proposer][1](tiny, another), 4, **config)
    assert out.tokens[1].numel() == 9 + 5 and int(out.tokens[1][-1]) == stop
    for p, got in zip(prompts, out.tokens):
        alone = plain(tiny, p[None], **config)[0]
        stops = [i for i, t in enumerate(alone[p.numel():].tolist()) if t == stop]
        alone = alone[:p.numel() + stops[0] + 1] if stops else alone  # alone pads after its stop: cut there
        assert torch.equal(got, alone), (p.numel(), got.tolist(), alone.tolist())
    # alone too, the stop ends the generation
    one = speculate(tiny, prompts[1][None], proposer, PROPOSERS[proposer][1](tiny, another), 4, **config)
    assert one.tokens.shape[1] == 9 + 5 and one.stats.new_tokens == 5
    # a tensor batch pads a stopped row with its stop token, as plain decoding's batch does
    tensor = torch.cat([repeating(5, seed) for seed in (15, 19, 21)])  # [3, 12]
    stop = int(plain(tiny, tensor[1:2], max_new_tokens=12, stop_token_ids=[])[0, 12 + 3])
    config = dict(max_new_tokens=12, stop_token_ids=[stop])
    both = speculate(tiny, tensor, proposer, PROPOSERS[proposer][1](tiny, another), 4, **config)
    want = plain(tiny, tensor, **config)
    assert torch.equal(both.tokens, want) and (want[1, 12 + 3:] == stop).all(), (both.tokens.tolist(), want.tolist())


def test_stream_yields_what_generate_returns(tiny):
    prompt = repeating(5, seed=15)
    config = dict(max_new_tokens=NEW, stop_token_ids=[], speculative_method="draft", num_speculative_tokens=3)
    stats = minigen.GenerationStats()
    streamed = list(minigen.stream(tiny, prompt, stats=stats, draft_model=drafts.layer_skip(tiny, 1), **config))
    whole = minigen.generate(tiny, prompt, draft_model=drafts.layer_skip(tiny, 1), **config)
    assert torch.equal(torch.stack(streamed, dim=1), whole.tokens[:, prompt.shape[1]:])
    assert stats.draft_tokens == whole.stats.draft_tokens > 0 and stats.step == whole.stats.step


def test_a_draft_in_another_dtype_is_accepted(tiny, tiny_bf16, plain):
    # the draft's precision is its own: the tokens are the target's whatever it proposes
    prompt, config = repeating(5, seed=15), dict(max_new_tokens=NEW, stop_token_ids=[])
    for target, draft in ((tiny, tiny_bf16), (tiny_bf16, tiny)):
        out = speculate(target, prompt, "itself", draft, 4, **config)
        assert torch.equal(out.tokens, plain(target, prompt, **config))
        assert out.stats.accepted_tokens > 0  # the same weights, rounded: they mostly agree


# ---------------------------------------------------------------- SmolLM2
SMOL_CASES = {  # name -> (speculative_method, the draft, k, the cache)
    "ngram": ("ngram", None, 4, {}),
    "ngram paged": ("ngram", None, 3, dict(cache_chunk_size=16)),
    "ngram window": ("ngram", None, 5, dict(window_size=16, sink_tokens=4)),
    "itself": ("draft", lambda m: m, 4, {}),
    "layer_skip": ("draft", lambda m: drafts.layer_skip(m, 24), 2, {}),
}


@pytest.fixture(scope="module")
def smol_prompt(smollm2):
    _, tok = smollm2
    return tok("The cat sat on the mat. The dog sat on the log. The cat sat on the", return_tensors="pt").input_ids


@pytest.mark.parametrize("name", SMOL_CASES)
def test_smollm2_greedy_speculation_equals_plain(smollm2, smol_prompt, name):
    model, _ = smollm2
    method, make_draft, k, cache = SMOL_CASES[name]
    config = dict(cache, max_new_tokens=24, stop_token_ids=[])
    out = minigen.generate(model, smol_prompt, speculative_method=method, num_speculative_tokens=k,
                           draft_model=make_draft(model) if make_draft else None, **config)
    assert torch.equal(out.tokens, minigen.generate(model, smol_prompt, **config).tokens)
    s = out.stats
    assert s.draft_tokens > 0
    if name == "itself":
        assert s.acceptance_rate == 1.0
    elif method == "ngram":  # the text repeats itself: prompt lookup is right about some of it
        assert 0 < s.accepted_tokens < s.draft_tokens


def test_smollm2_rows_equal_alone_while_speculating(smollm2, smol_prompt):
    model, tok = smollm2
    prompts = [smol_prompt[0], tok("One, two, three, four, one, two,", return_tensors="pt").input_ids[0]]
    config = dict(max_new_tokens=16, stop_token_ids=[])
    out = minigen.generate(model, prompts, speculative_method="ngram", **config)
    for p, got in zip(prompts, out.tokens):
        assert torch.equal(got, minigen.generate(model, p[None], **config).tokens[0])
    assert out.stats.accepted_tokens > 0


# ---------------------------------------------------------------- sampling: the target's distribution, exactly
SAMPLES = 2000  # rows of one tensor batch: independent samples
P_MIN = 1e-3  # the p-value below which a sampler fails; a seeded run gives the same p-value every time
SMALL_PROMPT = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 3, 1, 4, 1, 5]])  # every token occurs: lookup proposes after any


@pytest.fixture(scope="module")
def small():
    """(target, draft): two tiny random Llamas with a vocabulary of 8, so that two tokens have 64 outcomes."""
    return (minigen.from_hf(tiny_hf("llama", vocab_size=8)), minigen.from_hf(tiny_hf("llama", seed=3, vocab_size=8)))


def exact_three(model, prompt: torch.Tensor, temperature: float = 1.0, top_k: int | None = None) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) [V, V, V], the obvious way: full forwards without a cache, each next
    token's softmax of the last logits divided by the temperature, cut to the top k."""
    def next_probs(ids):  # [N, T] -> [N, V]
        with torch.inference_mode():
            logits = model(ids, torch.arange(ids.shape[1]))[:, -1].double() / temperature
        if top_k is not None:
            logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        return logits.softmax(dim=-1)

    V = model.config.vocab_size
    tokens = torch.arange(V)
    after_one = torch.cat([prompt.expand(V, -1), tokens[:, None]], dim=1)  # row a: the prompt, then a
    after_two = torch.cat([prompt.expand(V * V, -1), torch.cartesian_prod(tokens, tokens)], dim=1)  # row a V + b
    p1, p2, p3 = next_probs(prompt)[0], next_probs(after_one), next_probs(after_two).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of observed counts against exact probabilities -> the p-value. A count
    in a cell of probability 0 fails outright; cells expecting fewer than 5 are merged into one (the
    chi-square approximation wants about 5 per cell)."""
    counts, probs = counts.flatten().double(), probs.flatten()
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was drawn"
    observed, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))  # P(chi2 with len - 1 dof > statistic)


def sampled_p_values(small, method: str | None, k: int, sampling: dict, seed: int = 0):
    """Draw SAMPLES texts of k + 2 new tokens (the round after the first token proposes k: a round
    proposes no more than the tokens still to come, minus its own) -> (p-value of (t1, t2), p-value
    of (t2, t3), stats)."""
    target, draft = small
    T, V = SMALL_PROMPT.shape[1], target.config.vocab_size
    extra = dict(speculative_method=method, num_speculative_tokens=k) if method else {}
    out = minigen.generate(target, SMALL_PROMPT.expand(SAMPLES, -1), max_new_tokens=k + 2, do_sample=True, seed=seed,
                           stop_token_ids=[], draft_model=draft if method == "draft" else None, **extra, **sampling)
    t1, t2, t3 = out.tokens[:, T], out.tokens[:, T + 1], out.tokens[:, T + 2]
    exact = exact_three(target, SMALL_PROMPT, **sampling)
    first_two = chi_square_p(torch.bincount(t1 * V + t2, minlength=V * V), exact.sum(dim=2))
    second_third = chi_square_p(torch.bincount(t2 * V + t3, minlength=V * V), exact.sum(dim=0))
    return first_two, second_third, out.stats


SAMPLING = {"t=1": {}, "t=0.7 top-4": dict(temperature=0.7, top_k=4)}


@pytest.mark.parametrize("method, k", [(None, 1), ("ngram", 1), ("ngram", 2), ("draft", 1), ("draft", 2)])
@pytest.mark.parametrize("sampling", SAMPLING)
def test_speculative_sampling_draws_the_target_s_distribution(small, method, k, sampling):
    # t2 is the round's first proposal kept or the residual's draw; t3 the bonus token (k = 1) or the
    # second proposal's verdict (k = 2). Plain sampling (None) passes the same test.
    first_two, second_third, s = sampled_p_values(small, method, k, SAMPLING[sampling])
    assert first_two > P_MIN and second_third > P_MIN, (first_two, second_third)
    if method is not None:  # every row proposed at its second token; some kept, some not
        assert s.draft_tokens >= SAMPLES and 0 < s.accepted_tokens < s.draft_tokens, (s.draft_tokens, s.accepted_tokens)


def always_accept(logits, proposal, q, config, generator):
    """A wrong rule: keep every proposal, then a bonus token from the target."""
    p = probabilities(logits, config)
    return proposal + [int(speculative.draw(p[len(proposal)], generator))]


def resample_from_p(logits, proposal, q, config, generator):
    """A wrong rule: the right test min(1, p / q), but a rejection draws from p, not max(0, p - q)."""
    p = probabilities(logits, config)
    for i, x in enumerate(proposal):
        qx = q[i, x] if q is not None else 1.0
        if torch.rand((), generator=generator) * qx >= p[i, x]:
            return proposal[:i] + [int(speculative.draw(p[i], generator))]
    return proposal + [int(speculative.draw(p[len(proposal)], generator))]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("rule", [always_accept, resample_from_p], ids=["always accept", "resample from p"])
def test_a_wrong_acceptance_rule_fails_the_distribution_test(small, monkeypatch, method, rule):
    # SpeculativeStep picks its rule from the module when it is built: the planted rule runs
    monkeypatch.setattr(speculative, "accept_sampled", rule)
    first_two, _, _ = sampled_p_values(small, method, 1, {})
    assert first_two < 1e-6, first_two


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
def test_a_seed_gives_the_same_tokens(tiny, another, proposer):
    rows = repeating(5, seed=15).expand(3, -1)
    draft = PROPOSERS[proposer][1](tiny, another)
    config = dict(max_new_tokens=NEW, stop_token_ids=[], do_sample=True)
    first, again, other = (speculate(tiny, rows, proposer, draft, 4, seed=seed, **config).tokens for seed in (1, 1, 2))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.equal(first[0], first[1])  # the rows are samples of their own


# ---------------------------------------------------------------- bad input: refused up front, with the fix
IDS = torch.tensor([[1, 2, 3, 1, 2]])


def ngram(**config) -> GenerationConfig:
    return GenerationConfig(speculative_method="ngram", **config)


# case -> (what the user does to the tiny model, fragments of the message: the settings and the fix)
BAD = {
    **{f"k={v!r}": (lambda m, v=v: ngram(num_speculative_tokens=v),
                    [f"num_speculative_tokens={v!r} is invalid", "speculative_method='ngram'", "use an integer >= 1"])
       for v in (0, -1, 2.5, True, "4")},
    "k without a method": (lambda m: GenerationConfig(num_speculative_tokens=3),
                           ["num_speculative_tokens=3", "without speculative_method",
                            "set speculative_method='ngram'"]),
    "unknown method": (lambda m: GenerationConfig(speculative_method="eagle"),
                       ["speculative_method='eagle' is invalid", '"ngram"', '"draft"']),
    "draft without a model": (lambda m: minigen.generate(m, IDS, speculative_method="draft"),
                              ["speculative_method='draft' needs a draft model", "draft_model=", "'ngram'"]),
    "draft without a model, stream": (lambda m: minigen.stream(m, IDS, speculative_method="draft"),  # at the call
                                      ["speculative_method='draft' needs a draft model", "draft_model="]),
    "draft without a model, rows": (lambda m: minigen.generate(m, [IDS[0], IDS[0, :2]], speculative_method="draft"),
                                    ["speculative_method='draft' needs a draft model", "draft_model="]),
    "a draft model without draft": (lambda m: minigen.generate(m, IDS, draft_model=drafts.unrelated(m)),
                                    ["draft_model=", "speculative_method=None", "set speculative_method='draft'",
                                     "drop draft_model"]),
    "a draft model with ngram": (lambda m: minigen.generate(m, IDS, speculative_method="ngram",
                                                            draft_model=drafts.unrelated(m)),
                                 ["draft_model=", "speculative_method='ngram'", "drop draft_model"]),
    "a draft that is no model": (lambda m: minigen.generate(m, IDS, speculative_method="draft", draft_model="tiny"),
                                 ["draft_model must be a minigen Model", "got str"]),
    "a draft with another vocabulary": (lambda m: minigen.generate(m, IDS, speculative_method="draft",
                                                                   draft_model=minigen.from_hf(tiny_hf(vocab_size=50))),
                                        ["vocabulary has 50 tokens", "the target's 97", "the target's tokenizer"]),
    "a draft on another device": (lambda m: minigen.generate(m, IDS, speculative_method="draft",
                                                             draft_model=drafts.unrelated(m).to("meta")),
                                  ["the draft model is on meta and the target on cpu", "Fix: draft_model.to('cpu')"]),
    "lookup min above max": (lambda m: ngram(prompt_lookup_min=3, prompt_lookup_max=2),
                             ["prompt_lookup_min=3 is more than prompt_lookup_max=2", "use prompt_lookup_min <= 2"]),
    "lookup min 0": (lambda m: ngram(prompt_lookup_min=0), ["prompt_lookup_min=0 is invalid", "integer >= 1"]),
    "lookup without ngram": (lambda m: GenerationConfig(speculative_method="draft", prompt_lookup_max=5),
                             ["prompt_lookup_max=5 has no effect without speculative_method='ngram'",
                              "set speculative_method='ngram'"]),
    **{f"with {key}": (lambda m, key=key, value=value: ngram(**{key: value}),
                       [f"{key}={value!r}" if key != "use_cache" else "use_cache=False", "speculative_method='ngram'",
                        "do not combine", "Fix: drop one: speculative_method=None or"])
       for key, value in (("kv_budget", 8), ("quant_bits", 4), ("compile", True), ("cuda_graphs", True),
                          ("use_cache", False))},
    "the serving engine": (lambda m: minigen.Engine(m, ngram()),
                           ["speculative_method='ngram' does not combine with the serving engine",
                            "Fix: speculative_method=None"]),
    "the serving engine, per request": (
        lambda m: minigen.Engine(m, num_blocks=4).add_request([1, 2], speculative_method="ngram"),
        ["speculative_method cannot change per request", "Engine(model, config)"]),
    "observers": (lambda m: minigen.generate(m, IDS, speculative_method="ngram",
                                             observers=(lambda layer, probs: None,)),
                  ["speculative decoding with observers", "Fix: speculative_method=None"]),
    "parallel_sample": (lambda m: minigen.parallel_sample(m, IDS, 3, do_sample=True, speculative_method="ngram"),
                        ["parallel_sample", "speculative_method='ngram'", "set speculative_method=None"]),
    **{f"rows with {key}": (lambda m, key=key, value=value: minigen.generate(
        m, IDS.expand(2, -1), speculative_method="ngram", **{key: value}),
        [f"{key}={value!r} does not combine with speculative decoding of several rows", f"Fix: {key}=None"])
       for key, value in (("prefetch_depth", 0), ("sparse_top_k", 4))},
}


@pytest.mark.parametrize("case", BAD)
def test_bad_speculative_input_is_a_config_error_naming_the_settings_and_the_fix(tiny, case):
    do, fragments = BAD[case]
    with pytest.raises(ConfigError) as e:
        do(tiny)
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__), \
        "a library traceback is chained to the error"
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


def test_the_draft_keeps_fp32_activations_where_the_target_config_asks_for_them():
    """int8_activations=False reaches the draft's own config (chapter 13's int4 draft on the target's grid is
    the target only so); otherwise the draft decides for itself ("auto")."""
    assert draft_config(GenerationConfig(int8_activations=False)).int8_activations is False
    assert draft_config(GenerationConfig()).int8_activations == "auto"
    assert draft_config(GenerationConfig(int8_activations=True)).int8_activations == "auto"
