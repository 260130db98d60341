"""The whole space of GenerationConfig: a config either builds and runs every feature it names, or
is refused up front with a ConfigError that names its keys (config.REFUSED and the settings that
need a switch). Hypothesis draws every field.

Oracles, per feature, on a tiny random model scoring a 48-token text teacher-forced:
- exact features (paged blocks without quantization, an offload tier) leave every NLL as it is,
  within fp32 rounding of a different summation order;
- lossy features (quantized codes, a window, sparse selection, heavy hitters), each the only lossy
  one switched on, change the NLLs when their setting bites (a window shorter than the text, a
  budget smaller than it, ...) and leave them as they are when it cannot (a window as long as the
  text, a threshold of 0);
- batch rows never influence each other: greedy rows batched equal each row alone;
- speculation changes how many forwards run, never the greedy tokens (every greedy config that
  runs is run with prompt lookup too, where the table applies it), nor any NLL (the window's spare
  slots for rewinds are masked).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import minigen
from conftest import tiny_hf
from minigen import ConfigError, GenerationConfig, drafts
from minigen.combinations import APPLIED, FEATURES, REFUSED, refused_with
from minigen.places import RAGGED_REFUSED
from minigen.course.table import combination_table
from minigen.evaluate import score

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT_LEN = 48
EXACT_ATOL = 2e-5  # NLLs of ~5 nats, summed in another order (gathered blocks, offload slots): a few ulps
EXACT_RTOL = 1e-5  # and of up to ~11 nats (a 16-bit cache: measured 6.4e-6 relative between the paged and contiguous layouts)
# A 16-bit cache (kv_dtype) where a layout sums in another order upstream: one fp32 ulp there can round a later
# layer's key to the neighbouring 16-bit number (an fp16 ulp is 2^-11 of it). Measured 6.6e-5 relative (window 12,
# no sinks, fp16, paged against the ring): three times that, ~1e-3 of a 5-nat NLL, still well under what a
# wrong key or a lost block moves (1e-3 to 1, CHANGE).
FLIP_RTOL = 2e-4
CHANGE = 1e-4  # a lossy feature that bites moves some NLL by far more (measured: 1e-3 to 1)


def maybe(strategy):
    return st.none() | strategy


# Every field of GenerationConfig, with values around the edges that matter for a 48-token text.
FIELDS = {
    "max_new_tokens": st.integers(0, 5),
    "do_sample": st.booleans(),
    "temperature": st.sampled_from([1.0, 0.7, 1e-3]),
    "top_k": maybe(st.integers(1, 120)),
    "top_p": maybe(st.sampled_from([0.05, 0.5, 1.0])),
    # min-p, penalties and bias: not drawn by configs() (a draw more would move every later example of the
    # derandomized search), but run by the test's explicit examples (PROCESSED)
    "min_p": maybe(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
    "repetition_penalty": st.sampled_from([1.0, 1.3, 0.8]),
    "frequency_penalty": st.sampled_from([0.0, 0.5, -1.0]),
    "presence_penalty": st.sampled_from([0.0, 1.0]),
    "logit_bias": maybe(st.dictionaries(st.integers(0, 96), st.sampled_from([-100.0, 3.0]), max_size=2)),
    "seed": maybe(st.integers(0, 2**64 - 1)),
    "stop_token_ids": maybe(st.lists(st.integers(0, 96), max_size=2)),
    # the text settings need a tokenizer, which the tiny model has not: test_structured*.py and test_stops.py
    "stop": st.none(),
    "response_format": st.none(),
    "guided_regex": st.none(),
    "guided_grammar": st.none(),
    "guided_backend": st.just("auto"),
    # n and logprobs change what generate returns, not what a forward computes (score refuses them):
    # test_samples.py runs them through every step kind
    "n": st.just(1),
    "logprobs": st.none(),
    "use_cache": st.booleans(),
    "cache_chunk_size": maybe(st.sampled_from([1, 3, 4, 8, 16, 64])),
    "prefetch_depth": maybe(st.integers(0, 3)),
    "window_size": maybe(st.sampled_from([1, 5, 12, 30, 60])),
    "sink_tokens": st.integers(0, 6),
    "sparse_top_k": maybe(st.sampled_from([1, 8, 30, 100])),
    "sparsity_threshold": maybe(st.sampled_from([0.0, 0.3, 0.6])),
    "sparse_score": st.sampled_from(["abs", "signed"]),
    "kv_budget": maybe(st.sampled_from([2, 10, 30, 100])),
    "quant_bits": maybe(st.sampled_from([8, 4, 2])),
    "quant_group_size": st.sampled_from([4, 8, 16, 32]),
    "quant_key_axis": st.sampled_from(["channel", "token"]),
    "quant_residual": maybe(st.sampled_from([4, 8, 16, 40])),
    "kv_dtype": maybe(st.sampled_from(["float32", "bfloat16", "float16"])),
    "compile": st.booleans(),
    "cuda_graphs": st.booleans(),
    "attention_backend": st.sampled_from(["torch", "triton"]),
    "fused_decode": st.sampled_from(["auto", True, False]),
    "speculative_method": maybe(st.sampled_from(["ngram", "draft"])),
    "num_speculative_tokens": st.integers(1, 8),
    "prompt_lookup_min": st.integers(1, 3),  # min > max is refused (test_speculative.py): not drawn here
    "prompt_lookup_max": st.integers(3, 5),
    "prefill_precision": st.sampled_from(["float32", "bfloat16", "int8"]),
    "prefill_chunk_size": maybe(st.sampled_from([1, 3, 8, 16])),
    # True demands int4/int8 weights, which the tiny fp32 model has not (a RUN_RULE refuses it: test_int8_activations.py)
    "int8_activations": st.sampled_from(["auto", False]),
    "num_beams": st.integers(2, 4),  # drawn when beam search is switched on (1, the default, is off)
    "length_penalty": st.sampled_from([1.0, 0.5, 2.0, -1.0]),
}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}
LOSSY = ("quant_bits", "window_size", "sparse", "kv_budget", "prefill_precision")


SWITCHES = {"use_cache=False": ["use_cache"], "cache_chunk_size": ["cache_chunk_size"],
            "prefetch_depth": ["prefetch_depth"], "quant_bits": ["quant_bits"], "window_size": ["window_size"],
            "sparse": ["sparse_top_k", "sparsity_threshold"], "kv_budget": ["kv_budget"],
            "compile": ["compile"], "cuda_graphs": ["cuda_graphs"], "attention_backend": ["attention_backend"],
            "fused_decode": ["fused_decode"], "speculative_method": ["speculative_method"],
            "prefill_precision": ["prefill_precision"], "prefill_chunk_size": ["prefill_chunk_size"],
            "num_beams": ["num_beams"]}
# A compile costs seconds; cuda_graphs is refused on a CPU (when it runs); the Triton kernel runs in its interpreter
# on a CPU (a step of the tiny model: ~0.1 s; a config that runs scores the text through it twice or more: ~7 s),
# and needs cache_chunk_size, so it is drawn with one.
RARE = {"compile": 0.08, "cuda_graphs": 0.04, "attention_backend": 0.1, "fused_decode": 0.1}
NEEDS = {"do_sample": ["temperature", "top_k", "top_p", "seed"], "window_size": ["sink_tokens"],
         "sparse": ["sparse_score"], "quant_bits": ["quant_group_size", "quant_key_axis", "quant_residual"],
         "speculative_method": ["num_speculative_tokens"],
         "speculative_method='ngram'": ["prompt_lookup_min", "prompt_lookup_max"], "num_beams": ["length_penalty"]}


@st.composite
def configs(draw):
    """Up to three cache features switched on (every pair, refused ones included, is reachable),
    each with its own settings; a setting whose switch is off is sometimes set anyway, to be refused."""
    fields = dict(DEFAULTS)
    # a seeded Random picks the features: hypothesis's own draws favour empty sets, and every
    # pair of features should come up
    rnd = draw(st.randoms(use_true_random=False))
    common = [f for f in SWITCHES if f not in RARE]
    on = rnd.sample(common, rnd.choice([1, 2, 2, 3])) + [f for f, p in RARE.items() if rnd.random() < p]
    for feature in on:
        if feature == "use_cache=False":
            fields["use_cache"] = False
        elif feature == "attention_backend":
            fields[feature] = "triton"
            if rnd.random() < 0.8:  # without blocks it is refused (REFUSED_SETTINGS)
                fields["cache_chunk_size"] = draw(FIELDS["cache_chunk_size"].filter(lambda v: v is not None))
        elif feature in RARE:
            fields[feature] = True
        elif feature == "prefill_precision":
            fields[feature] = rnd.choice(["bfloat16", "int8"])
        elif feature == "sparse":
            fields["sparse_top_k"] = draw(FIELDS["sparse_top_k"])
            fields["sparsity_threshold"] = draw(FIELDS["sparsity_threshold"] if fields["sparse_top_k"] is None
                                                else FIELDS["sparsity_threshold"])
            if fields["sparse_top_k"] is None and fields["sparsity_threshold"] is None:
                fields["sparsity_threshold"] = 0.3
        else:
            fields[feature] = draw(FIELDS[feature].filter(lambda v: v is not None))
    fields["do_sample"] = draw(FIELDS["do_sample"])
    for switch, keys in NEEDS.items():
        is_on = (fields["do_sample"] if switch == "do_sample" else fields["speculative_method"] == "ngram"
                 if switch == "speculative_method='ngram'" else switch in on)
        for key in keys:
            if is_on or draw(st.integers(0, 39)) == 0:  # now and then, a setting without its switch
                fields[key] = draw(FIELDS[key])
    for key in ("max_new_tokens", "stop_token_ids", "kv_dtype"):
        fields[key] = draw(FIELDS[key])
    return fields


# Penalties and bias process each row's logits (decoding/logits.py): greedy rows batched still equal each
# alone, speculation still gives the plain greedy tokens, and cuda_graphs refuses them.
PROCESSED = [
    {"max_new_tokens": 5, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "logit_bias": {5: 3.0, 9: -100.0},
     "cache_chunk_size": 8},
    {"max_new_tokens": 4, "presence_penalty": 1.0, "do_sample": True, "min_p": 0.1, "seed": 3, "window_size": 12,
     "speculative_method": "ngram"},
    {"max_new_tokens": 3, "repetition_penalty": 0.8, "presence_penalty": -1.0, "fused_decode": True},
    {"repetition_penalty": 1.3, "cuda_graphs": True},
]


def test_the_strategies_cover_every_field():
    assert set(FIELDS) == set(GenerationConfig.field_names())


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama with head dim 16 (so group sizes 4, 8, 16 fit and 32 does not)."""
    return minigen.from_hf(tiny_hf("llama", hidden_size=64))


@pytest.fixture(scope="module")
def draft(tiny):
    """speculative_method="draft"'s draft: the tiny model's first layer (some proposals kept, some not)."""
    return drafts.layer_skip(tiny, 1)


@pytest.fixture(scope="module")
def text():
    return torch.randint(0, 97, (TEXT_LEN,), generator=torch.Generator().manual_seed(7))


def off(config: GenerationConfig, feature: str) -> GenerationConfig:
    """`config` with one feature switched off, and the settings that only it needed back at their defaults."""
    keys = {"quant_bits": ("quant_bits", "quant_group_size", "quant_key_axis", "quant_residual"),
            "window_size": ("window_size", "sink_tokens"),
            "sparse": ("sparse_top_k", "sparsity_threshold", "sparse_score"),
            "kv_budget": ("kv_budget",),
            "cache_chunk_size": ("cache_chunk_size", "quant_residual", "attention_backend"),
            "prefetch_depth": ("prefetch_depth",),
            "speculative_method": ("speculative_method", "num_speculative_tokens", "prompt_lookup_min",
                                   "prompt_lookup_max"),
            "prefill_precision": ("prefill_precision",), "prefill_chunk_size": ("prefill_chunk_size",)}[feature]
    return dataclasses.replace(config, **{k: DEFAULTS[k] for k in keys})


def bites(config: GenerationConfig, feature: str) -> bool | None:
    """True when the feature must change some NLL of the text, False when it cannot, None when
    the test does not predict it (a lossy setting that may or may not round a logit differently)."""
    c = config
    if feature == "window_size":
        return c.window_size + c.sink_tokens < TEXT_LEN - 1
    if feature == "kv_budget":
        return c.kv_budget < TEXT_LEN - 1
    if feature == "sparse":
        visible = TEXT_LEN if c.window_size is None else min(TEXT_LEN, c.window_size + c.sink_tokens)
        top_k_bites = c.sparse_top_k is not None and c.sparse_top_k < visible - 1
        threshold_bites = (c.sparsity_threshold or 0) >= 0.3
        if top_k_bites or threshold_bites:
            return True
        return False if (c.sparsity_threshold or 0) == 0 and not top_k_bites else None
    if feature == "quant_bits":  # 8-bit codes move the NLLs too little to promise a change
        if c.quant_bits == 8:
            return None
        if c.cache_chunk_size is not None:  # whole blocks are quantized once full
            return c.cache_chunk_size <= TEXT_LEN // 2 or None
        residual = c.quant_residual or c.quant_group_size
        return residual + c.quant_group_size <= TEXT_LEN // 2 or None
    if feature == "prefill_precision":  # bf16 or int8 products where a forward has more than 16 rows: run_nll feeds
        return not c.use_cache  # the naive loop the whole text, a cache one token at a time
    raise ValueError(feature)


def run_nll(model, text, config):
    return score(model, text, config, chunk_size=1 if config.use_cache else None).nll


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=configs())
@example(fields={**DEFAULTS, "cache_chunk_size": 256, "quant_bits": 4, "window_size": 128,
                 "sparsity_threshold": 0.1, "prefetch_depth": 2})  # the article's generation_config.json
@example(fields={**DEFAULTS, "cache_chunk_size": 8, "quant_bits": 4, "quant_group_size": 8,
                 "window_size": 12, "prefetch_depth": 1})
@example(fields={**DEFAULTS, "kv_budget": 10, "sparse_top_k": 8, "window_size": 30})
@example(fields={**DEFAULTS, "cache_chunk_size": 8, "quant_bits": 4, "quant_group_size": 8, "window_size": 12,
                 "attention_backend": "triton", "max_new_tokens": 3})
@example(fields={**DEFAULTS, **PROCESSED[0]})
@example(fields={**DEFAULTS, **PROCESSED[1]})
@example(fields={**DEFAULTS, **PROCESSED[2]})
@example(fields={**DEFAULTS, **PROCESSED[3]})
def test_a_config_either_runs_every_feature_or_is_refused(tiny, draft, text, fields):
    named = {k for k, v in fields.items() if v != DEFAULTS[k]}  # what the user wrote
    try:
        config = GenerationConfig(**fields)
        nll = run_nll(tiny, text, config)
    except ConfigError as e:
        # Refused up front (by the config, or for this model's shapes by make_cache): the message
        # names the value that cannot be applied.
        assert any(f"{k}=" in str(e) for k in named), (str(e), named)
        return
    assert torch.isfinite(nll).all()

    # It runs, through generate too (sampling, stops, stats), and its rows are independent.
    prompts = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    if config.fused_decode is True:  # the C step is the torch step's arithmetic, in another order
        torch.testing.assert_close(nll, run_nll(tiny, text, config.replace(fused_decode=False)),
                                   atol=EXACT_ATOL, rtol=EXACT_RTOL)
    draft = draft if config.speculative_method == "draft" else None
    try:
        both = minigen.generate(tiny, prompts, config, draft_model=draft)
    except ConfigError as e:  # speculating rows move apart: what cannot take per-row positions is refused for two
        assert config.speculative_method is not None and "speculative decoding of several rows" in str(e), str(e)
        assert any(f"{k}=" in str(e) for k in named), (str(e), named)
        prompts = prompts[:1]
        both = minigen.generate(tiny, prompts, config, draft_model=draft)
    assert both.tokens.shape[0] == len(prompts) and both.tokens.shape[1] <= 20 + config.max_new_tokens
    if not config.do_sample and config.max_new_tokens:
        for row in range(len(prompts)):
            alone = minigen.generate(tiny, prompts[row:row + 1], config, draft_model=draft).tokens[0]
            n = min(len(alone), both.tokens.shape[1])
            assert torch.equal(both.tokens[row, :n], alone[:n]), f"row {row} depends on its neighbour"

    on = config.features()
    s = both.stats
    if "cache_chunk_size" in on and config.max_new_tokens:
        assert s.kv_blocks_in_pool is not None and 0 < s.kv_blocks_in_use <= s.kv_blocks_in_pool
    if "prefetch_depth" in on and config.max_new_tokens and config.prefetch_depth + 1 < tiny.config.n_layers:
        assert s.kv_device_bytes < s.kv_cache_bytes
    # The kernel changes how attention reads the cache, never the greedy tokens.
    if config.attention_backend == "triton" and not config.do_sample:
        torch.testing.assert_close(both.tokens, minigen.generate(tiny, prompts, config.replace(
            attention_backend="torch")).tokens, atol=0, rtol=0)
    # Speculation changes how many forwards run, never the greedy tokens: a greedy config runs with
    # prompt lookup switched on too, wherever the table applies it (not through the Triton kernel's
    # interpreter, for time: test_speculative.py runs that).
    if not config.do_sample and config.max_new_tokens and config.attention_backend == "torch" \
            and not refused_with(config, "speculative_method"):
        speculating = config if config.speculative_method else config.replace(speculative_method="ngram")
        rows = prompts[:1] if RAGGED_REFUSED.keys() & set(config.features()) else prompts
        plain = minigen.generate(tiny, rows, off(config, "speculative_method")).tokens
        torch.testing.assert_close(minigen.generate(tiny, rows, speculating, draft_model=draft).tokens, plain,
                                   atol=0, rtol=0)
    # Running the prompt in pieces changes how many forwards it takes, never the greedy tokens (in fp32:
    # under prefill_precision='bfloat16' a piece of 16 rows or fewer runs its products in fp32; a
    # quantized cache hands a piece the earlier pieces' keys quantized, as the combination table says).
    if "prefill_chunk_size" in on and not config.do_sample and config.prefill_precision == "float32" \
            and config.kv_dtype in (None, "float32") and "quant_bits" not in on:
        torch.testing.assert_close(both.tokens, minigen.generate(tiny, prompts, off(config, "prefill_chunk_size"),
                                                                 draft_model=draft).tokens, atol=0, rtol=0)
    # Compiling changes how the step runs, never its tokens.
    if config.compile and not config.do_sample:
        torch.testing.assert_close(both.tokens, minigen.generate(tiny, prompts, config.replace(compile=False)).tokens,
                                   atol=0, rtol=0)
    # Exact features change nothing but where the bytes live (in a 16-bit cache, up to a rounding flip).
    rtol = FLIP_RTOL if config.kv_dtype in ("bfloat16", "float16") else EXACT_RTOL
    for feature in ("prefetch_depth", "cache_chunk_size", "speculative_method"):
        if feature in on and not (feature == "cache_chunk_size" and "quant_bits" in on):
            torch.testing.assert_close(nll, run_nll(tiny, text, off(config, feature)), atol=EXACT_ATOL, rtol=rtol)
    # A lossy feature alone among the lossy ones changes the NLLs exactly when it bites.
    lossy = [f for f in LOSSY if f in on]
    if len(lossy) == 1:
        expect = bites(config, lossy[0])
        delta = (nll - run_nll(tiny, text, off(config, lossy[0]))).abs().max().item()
        if expect is True:
            assert delta > CHANGE, f"{lossy[0]} changed nothing ({delta:.2e}) although it bites"
        elif expect is False:
            assert delta < EXACT_ATOL, f"{lossy[0]} changed the NLLs ({delta:.2e}) where it cannot bite"


# ---------------------------------------------------------------- the table
def test_refused_pairs_name_both_keys_and_a_fix():
    switch = {"use_cache=False": {"use_cache": False}, "cache_chunk_size": {"cache_chunk_size": 32},
              "prefetch_depth": {"prefetch_depth": 1}, "quant_bits": {"quant_bits": 4},
              "window_size": {"window_size": 32}, "sparse": {"sparse_top_k": 8}, "kv_budget": {"kv_budget": 16},
              "compile": {"compile": True}, "cuda_graphs": {"cuda_graphs": True},
              "attention_backend": {"attention_backend": "triton", "cache_chunk_size": 32},  # needs blocks
              "fused_decode": {"fused_decode": True}, "speculative_method": {"speculative_method": "ngram"},
              "prefill_precision": {"prefill_precision": "bfloat16"}, "prefill_chunk_size": {"prefill_chunk_size": 8},
              "num_beams": {"num_beams": 2}}
    assert set(switch) == set(FEATURES)
    for pair, (why, fix) in REFUSED.items():
        a, b = sorted(pair)
        with pytest.raises(ConfigError) as e:
            GenerationConfig(**{**switch[a], **switch[b]})
        msg = str(e.value)
        for feature in (a, b):
            key = next(iter(switch[feature]))
            assert f"{key}=" in msg, msg
        assert why in msg and fix in msg
    for a in FEATURES:  # every other pair builds
        for b in FEATURES:
            if a < b and frozenset({a, b}) not in REFUSED:
                GenerationConfig(**{**switch[a], **switch[b]})  # cuda_graphs too: a config reads no machine


def test_the_readme_shows_the_table():
    from pathlib import Path
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    assert combination_table() in readme, "run python scripts/update_readme.py"


def test_attention_backend_is_torch_or_triton():
    assert GenerationConfig().attention_backend == "torch"
    for bad in ("cuda", "Triton", None, 1):
        with pytest.raises(ConfigError, match=r"attention_backend=.*\"torch\".*\"triton\""):
            GenerationConfig(attention_backend=bad)
    # The kernel needs blocks, and 8- or 4-bit codes: refused up front, naming both keys and the fix.
    with pytest.raises(ConfigError, match=r"attention_backend='triton' and cache_chunk_size=None.*cache_chunk_size"):
        GenerationConfig(attention_backend="triton")
    with pytest.raises(ConfigError, match=r"attention_backend='triton' and quant_bits=2.*quant_bits=8 or 4"):
        GenerationConfig(attention_backend="triton", cache_chunk_size=16, quant_bits=2)
    GenerationConfig(attention_backend="triton", cache_chunk_size=32, quant_bits=4, window_size=8)  # builds


def test_the_run_rules_name_features_and_the_fused_step_takes_what_they_say():
    from minigen.run_rules import FUSED_CACHE, FUSED_WEIGHTS, RUN_RULES, Run
    from minigen.steps import fused
    # int8_activations is no feature of the table (it changes numbers, not what runs beside what): its rules
    # are checked where it is demanded (steps/choose.int8_activations)
    assert {feature for feature, *_ in RUN_RULES} <= set(FEATURES) | {"int8_activations"}
    assert all(set(reads) <= set(Run.__dataclass_fields__) for _, reads, *_ in RUN_RULES)
    assert [str(d).removeprefix("torch.") for d in fused.KINDS] == list(FUSED_WEIGHTS[:2])  # then int8, int4
    assert [str(d).removeprefix("torch.") for d in fused.CACHE_DTYPES] == list(FUSED_CACHE)
    assert not REFUSED.keys() & APPLIED.keys(), "a pair is both refused and applied"


def test_the_fused_row_limit_is_the_c_kernel_s():
    import re
    from pathlib import Path
    from minigen.run_rules import FUSED_MAX_ROWS
    header = (Path(minigen.__file__).parent / "kernels" / "csrc" / "kernels.h").read_text(encoding="utf-8")
    assert int(re.search(r"#define DECODE_MAX_ROWS (\d+)", header).group(1)) == FUSED_MAX_ROWS
