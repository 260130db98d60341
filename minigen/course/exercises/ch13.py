"""Chapter 13 exercise: pick the cheapest cache settings that fit a memory budget.

`cheapest_fit(options, budget_bytes)`: `options` is a list of dicts, one per cache setting, each
`{"config": {...GenerationConfig fields...}, "total_bytes": int, "expected_loss_pct": float}`
(weights + KV cache + activations, and the perplexity change the chapters measured). Return the
`config` of the option that fits (`total_bytes <= budget_bytes`) with the least expected loss;
among equal losses, the one with the fewest bytes (where bytes tie too, as bf16 and fp16 do, either
is right). Return None when nothing fits.

The checker compares your choice with the memory planner's (`minigen.measure.plan`) for SmolLM2's shape,
batch 8 and 8,192 tokens, under several budgets, handing you the planner's options shuffled.
"""

from __future__ import annotations

import importlib
import random

from ...model import ModelConfig
from . import ExerciseFailed

planner = importlib.import_module("minigen.measure.plan")  # the module: `minigen.measure.plan` is the function

# SmolLM2-135M's shape (its config.json), so that the checker needs no checkpoint
SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                      hidden_dim=1536, max_seq_len=8192)
BATCH, CONTEXT = 8, 8192
MIB = 2**20
BUDGETS = {  # label -> budget in bytes: each picks another answer (the prompt in chunks where it must be)
    "6 GiB (everything fits)": 6 * 2**30,
    "1.6 GiB": int(1.6 * 2**30),
    "1.2 GiB": int(1.2 * 2**30),
    "620 MiB": 620 * MIB,
    "590 MiB (nothing fits)": 590 * MIB,
}


# ---------------------------------------------------------------- worked solution
def solution_cheapest_fit(options: list[dict], budget_bytes: int) -> dict | None:
    """Keep what fits; the least loss first, then the fewest bytes."""
    fitting = [o for o in options if o["total_bytes"] <= budget_bytes]
    if not fitting:
        return None
    return min(fitting, key=lambda o: (o["expected_loss_pct"], o["total_bytes"]))["config"]


# ---------------------------------------------------------------- the cases
def _cases() -> list[tuple[str, list[dict], int, dict | None]]:
    """(label, options as the exercise gets them, budget, the planner's answer)."""
    rng = random.Random(13)
    cases = []
    for label, budget in BUDGETS.items():
        p = planner.plan(SMOLLM2, batch=BATCH, context=CONTEXT, budget_bytes=budget)
        options = [{"config": dict(o.config), "total_bytes": o.total_bytes, "expected_loss_pct": o.expected_loss_pct}
                   for o in p.options]
        rng.shuffle(options)  # the planner's order would give the answer away
        cases.append((label, options, budget, dict(p.config) if p.fits else None))
    return cases


def _same_cost(options: list[dict], got, want) -> bool:
    """Whether `got` is another option with the loss and bytes of the planner's pick (a tie)."""
    cost = {repr(o["config"]): (o["expected_loss_pct"], o["total_bytes"]) for o in options}
    return want is not None and repr(got) in cost and cost[repr(got)] == cost[repr(want)]


def _hint(options: list[dict], budget: int, got, want) -> str:
    by_config = {repr(o["config"]): o for o in options}
    fitting = [o for o in options if o["total_bytes"] <= budget]
    mine = by_config.get(repr(got))
    if want is None:
        return "nothing fits this budget: return None"
    if got is None:
        return "some options fit: compare total_bytes with the budget (<=)"
    if mine is None:
        return "return the `config` dict of one of the options"
    if mine["total_bytes"] > budget:
        return f"that option needs {mine['total_bytes'] / MIB:,.1f} MiB, more than the budget"
    if fitting and mine is min(fitting, key=lambda o: o["total_bytes"]):
        return "that is the option with the fewest bytes; rank by expected_loss_pct first"
    if mine["expected_loss_pct"] == by_config[repr(want)]["expected_loss_pct"]:
        return "equal losses: take the one with the fewest bytes"
    return "among the options that fit, take the least expected_loss_pct"


def check_cheapest_fit(fn) -> bool:
    """fn(options, budget_bytes) -> the config dict the planner picks, or None when nothing fits."""
    cases = _cases()
    for label, options, budget, want in cases:
        got = fn([dict(o, config=dict(o["config"])) for o in options], budget)
        if got != want and not _same_cost(options, got, want):
            raise ExerciseFailed(f"cheapest_fit: for a budget of {label} (batch {BATCH}, {CONTEXT:,} tokens) the "
                                 f"planner picks {want}, you picked {got}. Hint: {_hint(options, budget, got, want)}")
    print(f"✓ cheapest_fit: all {len(cases)} budgets agree with minigen.measure.plan")
    return True
