"""Where a plan runs: the rule table's third axis (combinations.py holds the other two: which features
combine, and what each needs of the model and the machine).

A plan (run_plan.py) is built for one place: generate's tensor batch, a ragged batch, the serving
engine, parallel_sample, score, the profiler, or a speculative draft. Each place that cannot run a
feature says so here, with why and the fix; plan.make_plan checks the table once, before any work.
A place not listed runs every feature that the pairs (combinations.REFUSED) and the model's and
machine's rules (run_rules.RUN_RULES) allow.
"""

from __future__ import annotations

from typing import Callable

from .combinations import describe, switch_off
from .errors import ConfigError

# ---------------------------------------------------------------- per-row positions
# Features that cannot run rows at different positions (a ragged batch, the serving engine):
# feature -> (why, the fix). Every other feature takes per-row positions [B, T] (cache.py).
RAGGED_REFUSED: dict[str, str] = {
    "use_cache=False": "the naive loop recomputes every row's whole sequence; ragged batches go through the cache",
    "prefetch_depth": "the offload tier moves one batch's layers in lockstep",
    "kv_budget": "heavy hitters evict per row from attention that padding queries would pollute",
    "sparse": "sparse selection ranks keys per query, padding queries included",
    "compile": "a compiled step has one shape; ragged rows plan their positions on the host",
    "cuda_graphs": "a captured step has one shape; ragged rows plan their positions on the host",
    "attention_backend": "the Triton kernel reads rows at one shared length",
    "fused_decode": "the fused step decodes every row at one shared position",
    "num_beams": "beam search runs a tensor batch [B, T], its k beams a prompt in lockstep",
}


def check_rows(c: "GenerationConfig", what: str, table: dict[str, str]) -> None:
    """Refuse, with the key and the fix, a feature that cannot take per-row positions (`table`)."""
    for feature in c.features():
        if feature in table:
            fix = switch_off(feature)
            raise ConfigError(f"{describe(c, feature)} does not combine with {what}: {table[feature]}. Fix: {fix}.")


WHERES = ("generate", "ragged", "engine", "parallel_sample", "score", "profile", "draft")
_ROWS = {feature: (why, switch_off(feature)) for feature, why in RAGGED_REFUSED.items()}
_BEAMS = "generate(model, ids, num_beams=k) runs beam search"
WHERE_REFUSED: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "ragged": ("a ragged batch (rows at different positions)", {
        **_ROWS, "num_beams": (RAGGED_REFUSED["num_beams"], "num_beams=1, or prompts of one length as a [B, T] tensor")}),
    "engine": ("the serving engine", {  # its rows sit in a paged pool, which the fused step reads in place
        **{feature: rows for feature, rows in _ROWS.items() if feature != "fused_decode"},
        "prefetch_depth": ("the engine's pool of blocks stays on the device", "prefetch_depth=None"),
        "speculative_method": ("the engine's steps decode one token per sequence: speculative decoding runs in "
                               "generate and stream (a list of prompts is a ragged batch)", "speculative_method=None"),
        "quant_bits": ("the quantized paged cache keeps each row's open block in a per-batch buffer that the "
                       "engine's changing rows cannot share, and a prefix-cache hit or a recompute after preemption "
                       "would read quantized keys where the prompt alone is attended in full precision "
                       "(generate(model, prompts) runs a quantized ragged batch, one cache per row)", "quant_bits=None"),
        "num_beams": ("the engine schedules one sequence per request, and a beam search needs k rows reordered every "
                      "step", f"num_beams=1 ({_BEAMS})"),
        "prefill_chunk_size": ("prefill_chunk_size is generate's setting: the engine splits prompts by the tokens "
                               "one step may run", "Engine(..., max_num_batched_tokens={prefill_chunk_size}) and prefill_chunk_size=None"),
    }),
    "parallel_sample": ("parallel_sample", {
        "prefetch_depth": ("parallel_sample forks the paged cache's rows, which an offload tier holds",
                           "set prefetch_depth=None"),
        "speculative_method": ("parallel_sample forks one prompt's blocks into n rows, and speculative decoding "
                               "verifies each row at its own positions", "set speculative_method=None, or "
                               "generate(model, ids, config, n=n, do_sample=True)"),
        "num_beams": ("parallel_sample draws n samples of one prompt; a beam search keeps k beams and returns the best",
                      f"num_beams=1 ({_BEAMS})"),
    }),
    "profile": ("the profiler", {
        "use_cache=False": ("use_cache=False has no decode step to profile: each step recomputes the sequence "
                            "(chapter 1)", "use_cache=True, or time it with `python -m minigen bench`"),
        "cuda_graphs": ("cuda_graphs=True replays a captured graph that the profiler sees as one launch",
                        "profile with compile=True or without either"),
        "fused_decode": ("fused_decode=True runs each decode step as one C call that the profiler cannot split "
                         "into categories", "profile without it, and time it with `python -m minigen bench --set "
                         "fused_decode=true`"),
        "num_beams": ("the profiler times the plain loop's steps, not a beam search's", "num_beams=1"),
    }),
}

# Settings (not cache features) that a place cannot run: where -> {key: (refuses, why, fix)}.
_SAMPLES = "n samples a prompt are rows of generate's batch"
_NO_TEXT = "it returns scores or timings, not text: no sample to repeat, no new token's log-probability to return"
SETTINGS_REFUSED: dict[str, dict[str, tuple[Callable, str, str]]] = {
    "engine": {"n": (lambda c: c.n > 1, "the engine schedules one sequence per request, and " + _SAMPLES,
                     "add n requests seeded seed + i (as minigen serve does), or generate(model, ids, n=...)")},
    "parallel_sample": {"n": (lambda c: c.n > 1, "parallel_sample counts its samples with its own argument n",
                              "parallel_sample(model, ids, n) with the config's n=1")},
    **{where: {"n": (lambda c: c.n > 1, _NO_TEXT, "n=1"),
               "logprobs": (lambda c: c.logprobs is not None, _NO_TEXT, "logprobs=None")}
       for where in ("score", "profile")},
}


def check_settings(c: "GenerationConfig", where: str) -> None:
    """Refuse, with the key and the fix, a setting (not a cache feature) that `where` cannot run (SETTINGS_REFUSED)."""
    for key, (refuses, why, fix) in SETTINGS_REFUSED.get(where, {}).items():
        if refuses(c):
            place = WHERE_REFUSED.get(where, (where,))[0]
            raise ConfigError(f"{key}={getattr(c, key)!r} does not combine with {place}: {why}. Fix: {fix}.")


def check_where(c: "GenerationConfig", where: str) -> None:
    """Refuse, with the key and the fix, a feature or setting that `where` cannot run (WHERE_REFUSED,
    SETTINGS_REFUSED)."""
    if where not in WHERES:
        raise ConfigError(f"where={where!r} is not a place a plan runs: use one of {', '.join(map(repr, WHERES))}")
    check_settings(c, where)
    what, table = WHERE_REFUSED.get(where, ("", {}))
    for feature in c.features():
        if feature in table:
            why, fix = table[feature]  # a fix may name the config's own values: {prefill_chunk_size}
            raise ConfigError(f"{describe(c, feature)} does not combine with {what}: {why}. "
                              f"Fix: {fix.format_map(c.to_dict())}.")
