"""Models that bring their own window (Mistral, Qwen2 with sliding layers; caches/hybrid.py, chapter 7):
greedy tokens equal `transformers`' beyond the window on every path that composes with it, and
every path that does not is refused by name.

Oracle: `transformers`' own generate on the same tiny random model (fp32, eager attention), which
applies each layer's window as its modelling code says; for a window imposed on top (window_size),
the naive loop and a dense masked loop written in test_window.py. Sizes: a prompt of 20 tokens, a
window of 8, 16 new tokens, so the prompt and the generation both run past the window.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import ConfigError, Engine, GenerationConfig
from minigen.caches.hybrid import HybridKVCache
from minigen.caches.make import make_cache
from minigen.caches.quantized import QuantizedPagedKVCache
from minigen.combinations import FEATURES
from minigen.run_rules import Run, run_refusals
from minigen.course.table import MODEL_WINDOW
from minigen.model import Model
from minigen.steps.choose import choose_step, run_of
from minigen.steps.eager import EagerStep, decode_step, prefill
from test_window import reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

T, WINDOW, NEW = 20, 8, 16
# Mistral slides in every layer; Qwen2 with use_sliding_window slides from max_window_layers on:
# layer 0 full, layers 1 and 2 sliding.
KINDS = {"mistral": dict(sliding_window=WINDOW, num_hidden_layers=3),
         "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3)}
LAYER_TYPES = {"mistral": ("sliding_attention",) * 3,
               "qwen2": ("full_attention", "sliding_attention", "sliding_attention")}
# fp32 against transformers: the same ops in another order differ by a few ulps per op (fp32's
# eps is 1.2e-7); through 3 layers of sums of 32-64 products, on logits of a few units, that is
# ~1e-6 (measured 2e-6). 1e-4 leaves a 50x margin and is far below the ~1 that attending one key
# outside the window moves a logit here (test_a_missed_window_moves_logits_far_outside_the_tolerance).
ATOL = RTOL = 1e-4


@pytest.fixture(scope="module", params=list(KINDS))
def sliding(request):
    """(kind, transformers model, minigen model, prompt [1, T], transformers' greedy tokens [1, T + NEW])."""
    kind = request.param
    hf = tiny_hf(kind, **KINDS[kind])
    model = minigen.from_hf(hf)
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    return kind, hf, model, ids, want


def greedy(model, ids, **config):
    return minigen.generate(model, ids, max_new_tokens=NEW, stop_token_ids=[], **config)


def without_windows(model: Model) -> Model:
    """The same weights with every layer full (layer_types=None): the uniform model."""
    uniform = Model(dataclasses.replace(model.config, layer_types=None, sliding_window=None))
    uniform.load_state_dict(model.state_dict())
    return uniform.eval()


def spy_make_cache(monkeypatch) -> list:
    """Record each cache a generation's plan builds (run_plan.Plan.make_cache); the plan's description
    sizes the same cache on the meta device, which is not recorded."""
    built = []

    def spy(model, *a, **kw):
        cache = make_cache(model, *a, **kw)
        if model.device.type != "meta":
            built.append(cache)
        return cache
    monkeypatch.setattr(sys.modules["minigen.run_plan"], "make_cache", spy)
    return built


# ---------------------------------------------------------------- the config, as transformers reads it
def test_the_layer_types_are_transformers(sliding):
    kind, _, model, _, _ = sliding
    assert model.config.layer_types == LAYER_TYPES[kind] and model.config.sliding_window == WINDOW
    assert model.config.max_seq_len == 128  # max_position_embeddings: the window no longer caps it


# ---------------------------------------------------------------- token identity past the window
PATHS = {
    "default": {},
    "naive loop": dict(use_cache=False),
    "paged": dict(cache_chunk_size=4),
    "prefill in pieces": dict(prefill_chunk_size=5),
    "paged, prefill in pieces": dict(cache_chunk_size=4, prefill_chunk_size=5),
    "offload tier": dict(prefetch_depth=0),
    "eager step": dict(fused_decode=False),
    "sparse, every key": dict(sparse_top_k=64),  # top-64 of at most 36 keys: every key the mask leaves
}


@pytest.mark.parametrize("path", PATHS)
def test_tokens_equal_transformers_past_the_window(sliding, path):
    _, _, model, ids, want = sliding
    assert torch.equal(greedy(model, ids, **PATHS[path]).tokens, want)


def test_a_prompt_inside_the_window_then_generation_past_it(sliding):
    """A 5-token prompt (SDPA's causal tiles: it fits the window), then 16 steps that leave it."""
    _, hf, model, _, _ = sliding
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    for config in ({}, dict(cache_chunk_size=4, prefill_chunk_size=3)):
        assert torch.equal(greedy(model, ids, **config).tokens, theirs), config


def test_the_default_cache_is_hybrid_and_smaller(sliding, monkeypatch):
    """make_cache gives the hybrid cache by default: a ring of WINDOW slots per sliding layer."""
    kind, _, model, ids, want = sliding
    built = spy_make_cache(monkeypatch)
    assert torch.equal(greedy(model, ids).tokens, want)
    assert len(built) == 1 and isinstance(built[0], HybridKVCache)
    uniform = make_cache(without_windows(model), GenerationConfig(), 1, T + NEW)
    assert built[0].nbytes < uniform.nbytes
    # ring: WINDOW slots of k and v per sliding layer, plus its slot positions (int64)
    c = model.config
    per_slot = 2 * c.n_kv_heads * c.head_dim * 4
    full = LAYER_TYPES[kind].count("full_attention")
    assert built[0].nbytes == (full * (T + NEW) + c.sliding_layers * WINDOW) * per_slot + WINDOW * 8


@pytest.mark.slow
def test_compiled_step_equals_transformers(sliding):
    _, _, model, ids, want = sliding
    assert torch.equal(greedy(model, ids, compile=True).tokens, want)


def test_logits_equal_transformers_at_prefill_and_at_every_decode_step(sliding):
    """Prefill's logits [T, V], then each decode step's [V] against transformers' forward over the
    whole sequence: every query past position WINDOW reads the ring, not the whole history."""
    _, hf, model, ids, want = sliding
    with torch.no_grad():
        theirs = hf(want).logits[0]  # [T + NEW, V]
    cache = make_cache(model, GenerationConfig(), 1, T + NEW)
    assert isinstance(cache, HybridKVCache)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, torch.arange(T)), theirs[None, :T], atol=ATOL, rtol=RTOL)
        prefill(model, ids, cache)
        for p in range(T, T + NEW - 1):
            got = decode_step(model, want[:, p:p + 1], torch.tensor([p]), cache)
            torch.testing.assert_close(got[0], theirs[p], atol=ATOL, rtol=RTOL)


def test_a_missed_window_moves_logits_far_outside_the_tolerance(sliding):
    """The tolerance above has teeth: the same weights with every layer full (the window ignored,
    the bug of the issue's first report) differ past the window by far more than ATOL."""
    _, hf, model, _, want = sliding
    with torch.no_grad():
        theirs = hf(want).logits[0]
        uniform = without_windows(model)(want, torch.arange(T + NEW))[0]
    assert torch.allclose(uniform[:WINDOW], theirs[:WINDOW], atol=ATOL, rtol=RTOL)  # inside the window: equal
    assert (uniform[WINDOW:] - theirs[WINDOW:]).abs().max() > 100 * ATOL


def test_bf16_runs(sliding):
    """kv_dtype=bfloat16 and a bf16 model run on the hybrid cache (bf16 is lossy: no identity claimed)."""
    kind, _, model, ids, _ = sliding
    out = greedy(model, ids, kv_dtype="bfloat16")
    assert out.tokens.shape == (1, T + NEW) and torch.equal(out.tokens[:, :T], ids)
    cache = make_cache(model, GenerationConfig(kv_dtype="bfloat16"), 1, T + NEW)
    assert isinstance(cache, HybridKVCache) and all(t.dtype == torch.bfloat16 for t in cache.layer_tensors())
    half = minigen.from_hf(tiny_hf(kind, **KINDS[kind])).to(torch.bfloat16)
    out = greedy(half, ids)
    assert out.tokens.shape == (1, T + NEW) and int(out.tokens.max()) < 97


def test_quantized_paged_cache_keeps_every_position_and_masks_each_sliding_layer(sliding, monkeypatch):
    """quant_bits=8 with cache_chunk_size chooses the storage: the quantized paged cache (not the
    hybrid one) keeps every position of every layer, and the model masks each sliding layer to its
    window. Oracle: the same cache on the uniform model gives other tokens (it sees every key),
    and transformers' tokens are kept (8-bit codes of groups of 4: an error of ~0.4% of a key's
    range, far from any greedy tie of this model)."""
    _, _, model, ids, want = sliding
    config = dict(quant_bits=8, quant_group_size=4, cache_chunk_size=4)
    built = spy_make_cache(monkeypatch)
    got = greedy(model, ids, **config).tokens
    assert isinstance(built[0], QuantizedPagedKVCache)
    assert torch.equal(got, want)
    uniform = greedy(without_windows(model), ids, **config).tokens
    assert not torch.equal(uniform, want)  # (so the model's masks, not the cache, kept the windows)


def test_speculative_rewinds_inside_the_ring(sliding):
    """ngram proposals on a prompt of repeats: rejected proposals rewind the ring, whose spare slots
    (num_speculative_tokens) keep what the rewound positions' windows need. Oracle: plain greedy."""
    _, hf, model, _, _ = sliding
    motif = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(5))
    ids = motif.repeat(4)[None]  # [1, 20]: every 4-gram repeats, so ngram always proposes
    plain = greedy(model, ids).tokens
    with torch.no_grad():
        assert torch.equal(plain, hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                              do_sample=False))
    out = greedy(model, ids, speculative_method="ngram", num_speculative_tokens=3)
    assert torch.equal(out.tokens, plain)
    s = out.stats
    assert s.draft_tokens > s.accepted_tokens  # some proposals were rejected: the ring rewound
    cache = make_cache(model, GenerationConfig(speculative_method="ngram", num_speculative_tokens=3), 1, T + NEW)
    assert cache.ring.ring == WINDOW + 3


def test_without_spare_slots_a_rewind_loses_keys(sliding, monkeypatch):
    """The case above has teeth: a ring of just the window (spare=0) overwrote keys a rewound
    position's window needs, and the tokens changed."""
    _, _, model, _, _ = sliding
    ids = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(5)).repeat(4)[None]
    plain = greedy(model, ids).tokens

    class NoSpare(HybridKVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "spare": 0})

    monkeypatch.setattr(sys.modules["minigen.caches.make"], "HybridKVCache", NoSpare)
    out = greedy(model, ids, speculative_method="ngram", num_speculative_tokens=3).tokens
    assert not torch.equal(out, plain)


def test_a_draft_model_and_speculative_rows_equal_transformers(sliding):
    """speculative_method='draft' with another seed's model as the draft (its own hybrid cache; most
    proposals rejected), and ngram on a ragged batch of two: each row equals transformers alone."""
    kind, hf, model, ids, want = sliding
    draft = minigen.from_hf(tiny_hf(kind, seed=3, **KINDS[kind]))
    out = greedy(model, ids, speculative_method="draft", num_speculative_tokens=3, draft_model=draft)
    assert torch.equal(out.tokens, want) and out.stats.draft_tokens > out.stats.accepted_tokens
    a = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(5)).repeat(4)
    rows = greedy(model, [a, a[:13]], speculative_method="ngram", num_speculative_tokens=3).tokens
    for p, row in zip((a, a[:13]), rows):
        with torch.no_grad():
            theirs = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW, do_sample=False)
        assert torch.equal(row, theirs[0])


def test_rows_of_a_batch_never_influence_each_other(sliding):
    """Two prompts of different lengths (a ragged batch: left padding, per-row positions), and two
    different prompts of one length: each row equals transformers on that prompt alone."""
    _, hf, model, ids, want = sliding
    other = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_other = hf.generate(other, attention_mask=torch.ones_like(other), max_new_tokens=NEW, do_sample=False)
    ragged = greedy(model, [ids[0], other[0]]).tokens
    assert torch.equal(ragged[0], want[0]) and torch.equal(ragged[1], want_other[0])
    second = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want_second = hf.generate(second, attention_mask=torch.ones_like(second), max_new_tokens=NEW,
                                  do_sample=False)
    batch = greedy(model, torch.cat([ids, second])).tokens
    assert torch.equal(batch, torch.cat([want, want_second]))


def test_the_engine_equals_transformers_per_request(sliding):
    """The Engine's paged pool keeps every position; each sliding layer is masked to its window."""
    _, hf, model, ids, want = sliding
    prompts = [ids[0], torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)), ids[0, :11]]
    engine = Engine(model, {"cache_chunk_size": 4}, max_batch_size=2)
    for p in prompts:
        engine.add_request(p, max_new_tokens=NEW, stop_token_ids=[])
    out = engine.run()
    for i, p in enumerate(prompts):
        with torch.no_grad():
            theirs = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=NEW,
                                 do_sample=False)[0]
        assert out[i].tolist() == theirs.tolist(), i


# ---------------------------------------------------------------- a window imposed on top, and refusals
def test_a_smaller_window_on_top_masks_every_layer(sliding):
    """window_size=6 <= 8 with 2 sinks: every layer (full ones too) sees its sinks and last 6, as
    the naive loop and the dense masked loop of test_window.py with that window say."""
    _, _, model, ids, want = sliding
    config = dict(window_size=6, sink_tokens=2)
    got = greedy(model, ids, **config).tokens
    assert torch.equal(got, greedy(model, ids, use_cache=False, **config).tokens)
    assert torch.equal(got[0], reference_greedy(model, ids[0], NEW, 6, 2))
    assert not torch.equal(got, want)  # the imposed window changed the text: it was applied


def test_a_larger_window_on_top_is_refused_with_both_numbers(sliding):
    _, _, model, ids, _ = sliding
    with pytest.raises(ConfigError, match=r"window_size=9 is larger than this model's own sliding_window=8"):
        greedy(model, ids, window_size=9)


@pytest.mark.parametrize("setting, message", [
    (dict(fused_decode=True), r"this model's sliding layers attend only the last 8"),
    (dict(attention_backend="triton", cache_chunk_size=16), r"this model's sliding layers attend the last 8"),
])
def test_paths_without_per_layer_windows_are_refused(sliding, setting, message):
    _, _, model, ids, _ = sliding
    with pytest.raises(ConfigError, match=message):
        greedy(model, ids, **setting)


def test_fused_auto_falls_back_to_the_eager_step(sliding):
    _, _, model, _, _ = sliding
    config = GenerationConfig(fused_decode="auto")
    assert type(choose_step(model, config, 1)) is EagerStep
    uniform = without_windows(model)
    if run_of(uniform, config, 1).c_kernel_ok:  # where the C kernel runs, auto picks it for the uniform model
        assert type(choose_step(uniform, config, 1)) is not EagerStep


# ---------------------------------------------------------------- the degenerate window
@pytest.mark.parametrize("kind", KINDS)
def test_a_window_at_least_the_length_is_full_attention(kind):
    """sliding_window >= prompt + new tokens: the same tokens as the model with layer_types=None."""
    hf = tiny_hf(kind, **dict(KINDS[kind], sliding_window=T + NEW))
    model = minigen.from_hf(hf)
    assert model.config.sliding_layers > 0
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(0))
    got = greedy(model, ids).tokens
    assert torch.equal(got, greedy(without_windows(model), ids).tokens)
    with torch.no_grad():
        assert torch.equal(got, hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                            do_sample=False))


def test_a_window_that_holds_the_whole_context_slides_nothing(sliding):
    """Mistral's default sliding_window (4,096) in a model of 4,096 positions: full attention, so the
    paths that mask every layer alike (fused_decode, the Triton backend) are not refused."""
    _, _, model, _, _ = sliding
    c = model.config
    assert c.own_window == c.sliding_window < c.max_seq_len
    wide = dataclasses.replace(c, sliding_window=c.max_seq_len)
    assert wide.layer_types == c.layer_types and wide.sliding_layers == 0 and wide.own_window == 0
    assert all(wide.kv_positions(i, c.max_seq_len) == c.max_seq_len for i in range(c.n_layers))
    model = minigen.Model(wide).eval()
    for run in (dict(), dict(fused_decode="auto")):
        assert not isinstance(make_cache(model, GenerationConfig(**run), 1, 32), HybridKVCache)


# ---------------------------------------------------------------- the README's list (course/table.py: MODEL_WINDOW)
SWITCH = {"use_cache=False": dict(use_cache=False), "attention_backend": dict(attention_backend="triton",
                                                                              cache_chunk_size=4),
          "cache_chunk_size": dict(cache_chunk_size=4), "prefetch_depth": dict(prefetch_depth=0),
          "quant_bits": dict(quant_bits=8, quant_group_size=4), "window_size": dict(window_size=WINDOW, sink_tokens=0),
          "sparse": dict(sparse_top_k=4), "kv_budget": dict(kv_budget=12), "compile": dict(compile=True),
          "cuda_graphs": dict(cuda_graphs=True), "fused_decode": dict(fused_decode=True),
          "speculative_method": dict(speculative_method="ngram", num_speculative_tokens=3),
          "prefill_precision": dict(prefill_precision="bfloat16"), "prefill_chunk_size": dict(prefill_chunk_size=5),
          "num_beams": dict(num_beams=3)}


def test_the_model_window_list_agrees_with_the_run_rules():
    """Every feature has a line; a line says refused exactly where a RUN_RULE that reads the model's
    window refuses it (a Run that knows only model_window: every other rule waits)."""
    assert set(MODEL_WINDOW) == set(FEATURES) == set(SWITCH)
    for feature, (verdict, _) in MODEL_WINDOW.items():
        refusals = run_refusals(GenerationConfig(**SWITCH[feature]), Run(model_window=WINDOW))
        assert not run_refusals(GenerationConfig(**SWITCH[feature]), Run(model_window=0)), feature
        if verdict == "applied up to the model's window":  # window_size: up to WINDOW, then refused
            assert not refusals and run_refusals(GenerationConfig(window_size=WINDOW + 1), Run(model_window=WINDOW))
        else:
            assert verdict in ("applied", "refused") and bool(refusals) == (verdict == "refused"), feature


@pytest.mark.parametrize("feature", [f for f, (verdict, _) in MODEL_WINDOW.items() if verdict != "refused"])
def test_what_the_list_applies_runs_on_a_sliding_model(sliding, feature):
    """Each applied feature runs past the window on both models, where this machine runs it on the
    uniform model too (cuda_graphs needs CUDA; compile has its own slow test above)."""
    kind, _, model, ids, want = sliding
    config = SWITCH[feature]
    if feature == "compile":
        pytest.skip("test_compiled_step_equals_transformers (slow)")
    try:
        minigen.generate(without_windows(model), ids, max_new_tokens=2, **config)
    except ConfigError as e:
        pytest.skip(f"this machine does not run {feature}: {e}")
    out = greedy(model, ids, **config)
    assert out.tokens.shape == (1, T + NEW)
    if feature == "window_size" and kind == "mistral":  # every layer slides over 8: the same model, no sinks
        assert torch.equal(out.tokens, want)
