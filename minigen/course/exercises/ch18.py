"""Chapter 18 exercise: the memory planner's choice, built by hand.

`plan_choice(rows, weights_bytes, budget_bytes)`: the settings `minigen.plan` would pick for SmolLM2
at batch 8 and 8,192 tokens under a memory budget, from the numbers the planner works with:

- `rows`: one dict per cache setting (storage, window), in no particular order:
  `{"config": {...GenerationConfig fields...}, "expected_loss_pct": float, "bytes": {chunk: (kv, acts)}}`.
  `bytes` maps each way of running the prompt to its KV-cache bytes and its activation bytes:
  `None` is the whole prompt in one forward, an integer is `prefill_chunk_size` (chapter 3);
- `weights_bytes`: the model's weights;
- `budget_bytes`: the memory there is.

Return the config to run (with `"prefill_chunk_size": chunk` added when the prompt runs in chunks),
or None when no setting fits. Chapter 18, section 1 says what the planner weighs; the hints of a
wrong answer say which part of its rule you missed.

The checker compares your choice with `minigen.plan`'s under several budgets, with the planner's own
functions patched to raise: your rule must do the work.
"""

from __future__ import annotations

import importlib
import random

from ...config import GenerationConfig
from ...checkpoints.model_config import ModelConfig
from . import ExerciseFailed, forbidding

planner = importlib.import_module("minigen.measure.plan")  # the module: `minigen.measure.plan` is the function

# SmolLM2-135M's shape (its config.json), so that the checker needs no checkpoint
SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                      hidden_dim=1536, max_seq_len=8192)
BATCH, CONTEXT = 8, 8192
MIB, GIB = 2**20, 2**30
BUDGETS = {  # label -> budget in bytes: each picks another answer (the prompt in chunks where it must be)
    "6 GiB (everything fits whole)": 6 * GIB,
    "3 GiB": 3 * GIB,
    "1.6 GiB": int(1.6 * GIB),
    "1.2 GiB": int(1.2 * GIB),
    "620 MiB": 620 * MIB,
    "590 MiB (nothing fits)": 590 * MIB,
}


# ---------------------------------------------------------------- worked solution
def solution_plan_choice(rows: list[dict], weights_bytes: int, budget_bytes: int) -> dict | None:
    """Per setting, run the prompt whole if that fits, else in the largest chunk that does; among the
    settings that fit, the least expected loss, then the fewest bytes."""
    room = budget_bytes - weights_bytes  # what the cache and the activations may take
    fitting = []  # (loss, total bytes, config)
    for row in rows:
        ways = sorted(row["bytes"], key=lambda c: -float("inf") if c is None else -c)  # whole, then 2048, 1024...
        for chunk in ways:
            kv, acts = row["bytes"][chunk]
            if kv + acts <= room:
                config = dict(row["config"], **({"prefill_chunk_size": chunk} if chunk else {}))
                fitting.append((row["expected_loss_pct"], weights_bytes + kv + acts, config))
                break
    if not fitting:
        return None
    return min(fitting, key=lambda f: (f[0], f[1]))[2]


# ---------------------------------------------------------------- the cases
def _rows(cfg: ModelConfig, batch: int, context: int) -> list[dict]:
    """Every setting the planner weighs, with its bytes for each way of running the prompt."""
    rows = []
    for fields, _, _, loss, _ in planner.options(cfg, batch, context):  # room=None: the prompt whole
        ways = {}
        for chunk in (None, *(c for c in planner.PREFILL_CHUNKS if c < context)):
            config = GenerationConfig(**fields, prefill_chunk_size=chunk)
            ways[chunk] = (planner.kv_cache_bytes(cfg, config, batch, context),
                           planner.activation_bytes(cfg, batch, context, "float32", config))
        rows.append({"config": dict(fields), "expected_loss_pct": loss, "bytes": ways})
    return rows


_CACHE: dict = {}


def _cases() -> list[tuple[str, list[dict], int, int, dict | None]]:
    """(label, rows as the exercise gets them, weights bytes, budget, the planner's answer)."""
    if not _CACHE:
        rows = _rows(SMOLLM2, BATCH, CONTEXT)
        weights = planner.weights_bytes(SMOLLM2)
        budgets = dict(BUDGETS)
        exact = planner.plan(SMOLLM2, batch=BATCH, context=CONTEXT, budget_bytes=budgets["1.6 GiB"])
        budgets["exactly what the 1.6 GiB pick needs"] = exact.total_bytes  # a fit to the byte is a fit
        wants = {}
        for label, budget in budgets.items():
            p = planner.plan(SMOLLM2, batch=BATCH, context=CONTEXT, budget_bytes=budget)
            wants[label] = (budget, dict(p.config) if p.fits else None)
        _CACHE.update(rows=rows, weights=weights, wants=wants)
    rng = random.Random(13)
    cases = []
    for label, (budget, want) in _CACHE["wants"].items():
        rows = [dict(r, config=dict(r["config"]), bytes=dict(rng.sample(list(r["bytes"].items()), len(r["bytes"]))))
                for r in _CACHE["rows"]]
        rng.shuffle(rows)  # the planner's order would give part of the answer away
        cases.append((label, rows, _CACHE["weights"], budget, want))
    return cases


def _cost(rows: list[dict], weights: int, budget: int, config) -> tuple | None:
    """(loss, total bytes, fits) of a returned config, or None when it is no setting of `rows`."""
    if not isinstance(config, dict):
        return None
    base = {k: v for k, v in config.items() if k != "prefill_chunk_size"}
    for r in rows:
        if r["config"] == base and config.get("prefill_chunk_size") in r["bytes"]:
            kv, acts = r["bytes"][config.get("prefill_chunk_size")]
            return r["expected_loss_pct"], weights + kv + acts, weights + kv + acts <= budget
    return None


# ---------------------------------------------------------------- what a wrong answer missed
def _variant(rows, weights, budget, *, count_weights=True, ways="largest", rank="loss", strict=False):
    """The planner's rule with one part changed: a known wrong answer, to name it in a hint."""
    room = budget - (weights if count_weights else 0)
    fitting = []
    for r in rows:
        chunks = sorted((c for c in r["bytes"] if c is not None), reverse=True)
        order = {"largest": [None, *chunks], "smallest": [None, *chunks[::-1]], "whole": [None],
                 "always": chunks}[ways]
        for chunk in order:
            kv, acts = r["bytes"][chunk]
            if kv + acts < room if strict else kv + acts <= room:
                fitting.append((r["expected_loss_pct"], weights + kv + acts,
                                dict(r["config"], **({"prefill_chunk_size": chunk} if chunk else {}))))
                break
    if not fitting:
        return None
    key = {"loss": lambda f: (f[0], f[1]), "bytes": lambda f: (f[1], f[0]), "most": lambda f: (f[0], -f[1])}[rank]
    return min(fitting, key=key)[2]


MISTAKES = [
    (dict(count_weights=False), "the budget holds the weights too: a setting fits when weights + KV + activations "
                                "stay within it"),
    (dict(ways="whole"), "when the whole prompt does not fit, run it in chunks (prefill_chunk_size): the same "
                         "tokens for far fewer activation bytes"),
    (dict(ways="smallest"), "a larger chunk runs the prompt in fewer forwards: after the whole prompt, try the "
                            "largest chunk first"),
    (dict(ways="always"), "the whole prompt (chunk None) is the fastest prefill: take it wherever it fits"),
    (dict(rank="bytes"), "the planner spends the budget on quality: among the settings that fit, rank by "
                         "expected_loss_pct first"),
    (dict(rank="most"), "equal losses: take the one with the fewest bytes"),
    (dict(strict=True), "a setting that needs exactly the budget fits (<=, not <)"),
]


def _hint(rows, weights, budget, got, want) -> str:
    if want is None:
        return "nothing fits this budget: return None"
    if got is None:
        return "some settings fit: compare weights + KV + activations with the budget"
    mine = _cost(rows, weights, budget, got)
    if mine is None:
        return ("return the `config` dict of one of the rows, with \"prefill_chunk_size\" added when the prompt "
                "runs in chunks (one of the row's `bytes` keys)")
    hits = [hint for kwargs, hint in MISTAKES if _variant(rows, weights, budget, **kwargs) == got]
    if not mine[2]:
        hits.insert(0, f"that choice needs {mine[1] / MIB:,.1f} MiB, more than the budget")
    return "; or ".join(hits) or "among the settings that fit, the least expected loss, then the fewest bytes"


def check_plan_choice(fn) -> bool:
    """fn(rows, weights_bytes, budget_bytes) -> the config minigen.plan picks, or None when nothing fits."""
    cases = _cases()  # the planner's answers, computed before its functions are patched to raise
    answers = []
    worked = fn is solution_plan_choice  # the notebook runs the worked solution until you write yours
    with forbidding(planner.plan, planner.options, *([] if worked else [solution_plan_choice])):
        for _, rows, weights, budget, _ in cases:
            mine = [dict(r, config=dict(r["config"]), bytes=dict(r["bytes"])) for r in rows]
            answers.append(fn(mine, weights, budget))
    for (label, rows, weights, budget, want), got in zip(cases, answers):
        tie = want is not None and _cost(rows, weights, budget, got) == _cost(rows, weights, budget, want)
        if got != want and not tie:
            raise ExerciseFailed(f"plan_choice: for a budget of {label} (batch {BATCH}, {CONTEXT:,} tokens) the "
                                 f"planner picks {want}, you picked {got}. Hint: {_hint(rows, weights, budget, got, want)}")
    print(f"✓ plan_choice: all {len(cases)} budgets agree with minigen.plan"
          + (" (the worked solution: yours is not checked yet)" if worked else ""))
    return True
