"""The README's table of how the settings combine, rendered from combinations.py's tables, and the
list of what composes with a model's own sliding window (MODEL_WINDOW, below) (scripts/update_readme.py
writes it; tests/test_combinations.py checks the README holds it)."""

from __future__ import annotations

import string

from ..combinations import APPLIED, FEATURES, REFUSED, REFUSED_SETTINGS, SWITCHES
from ..places import SETTINGS_REFUSED, WHERE_REFUSED

# A model trained with sliding layers (ModelConfig.layer_types: Mistral, Qwen2, Gemma 3) gets the
# hybrid cache by default (caches/hybrid.py). What each feature does beside it: feature -> (applied,
# refused, or applied up to a bound and refused past it; how). The refusals are RUN_RULES that read
# model_window in combinations.py (tests/test_hybrid.py checks the two agree, and runs what is applied).
_KEEP_EVERY = ("keeps every position of every layer, and the model masks each sliding layer to its window "
               "(the hybrid cache's saving needs the default storage)")
MODEL_WINDOW: dict[str, tuple[str, str]] = {
    "use_cache=False": ("applied", "the naive loop masks each sliding layer to its window"),
    "attention_backend": ("refused", "the Triton kernels mask every layer with one window; use "
                                     "attention_backend='torch'"),
    "cache_chunk_size": ("applied", f"the paged cache {_KEEP_EVERY}; the serving engine instead keeps the sliding "
                         "layers in a pool of windows beside its full layers' pool (HybridPagedKVCache)"),
    "prefetch_depth": ("applied", f"the offload tier over a contiguous cache {_KEEP_EVERY}"),
    "quant_bits": ("applied", f"the quantized cache {_KEEP_EVERY}"),
    "window_size": ("applied up to the model's window", "window_size <= sliding_window: the smaller window (with "
                    "sink_tokens, which need window_size) masks every layer, full ones included, in one ring; "
                    "a larger window_size is refused with both numbers"),
    "sparse": ("applied", "on the hybrid cache: each layer selects among the keys its own mask leaves"),
    "kv_budget": ("applied", "heavy hitters evict from every layer alike, and the model masks each sliding layer "
                             "to its window"),
    "compile": ("applied", "the compiled decode step runs the hybrid cache in one graph"),
    "cuda_graphs": ("applied", "the hybrid cache keeps its positions on the device, as capture needs (untested "
                               "here: it needs a GPU)"),
    "fused_decode": ("refused", "fused_decode=True attends every cached position in every layer; the default "
                                "'auto' runs the eager step"),
    "speculative_method": ("applied", "each ring keeps num_speculative_tokens spare slots, so a rewind finds the "
                                      "window it needs"),
    "prefill_precision": ("applied", "only the prompt's products change precision"),
    "prefill_chunk_size": ("applied", "each piece reads the pieces before it from the hybrid cache, each layer "
                                      "masked to its own window"),
    "num_beams": ("applied", "beam search reorders the rows of both parts, the full layers' cache and the rings"),
}


def combination_table() -> str:
    """The Markdown table of which cache features combine (README, 'How the features combine')."""
    names = list(FEATURES)
    refused: list[str] = []  # numbered notes
    applied: list[str] = []  # lettered notes
    rows = ["| | " + " | ".join(f"`{n}`" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        cells = []
        for b in names:
            pair = frozenset({a, b})
            if a == b:
                cells.append("")
            elif pair in REFUSED:
                note = "{}; {}".format(*REFUSED[pair])
                refused += [note] if note not in refused else []
                cells.append(f"no ({refused.index(note) + 1})")
            elif pair in APPLIED:
                applied += [APPLIED[pair]] if APPLIED[pair] not in applied else []
                cells.append(f"yes ({string.ascii_lowercase[applied.index(APPLIED[pair])]})")
            else:
                cells.append("yes")
        rows.append(f"| `{a}` | " + " | ".join(cells) + " |")
    rows += ["", "Switched on by: " + "; ".join(f"`{n}`: {what}" for n, (_, what) in FEATURES.items()) + ".", ""]
    rows += [f"{i}. Refused: {note}." for i, note in enumerate(refused, 1)]
    rows += [""] + [f"- ({string.ascii_lowercase[i]}) {note}." for i, note in enumerate(applied)]
    rows += ["", "Settings that need another:"]
    rows += [f"- `{key}` with `{other}`: refused: {why}; {fix}." for key, other, _, why, fix in REFUSED_SETTINGS]
    needs: dict[str, list[str]] = {}
    for key, (switch, _, _) in SWITCHES.items():
        needs.setdefault(switch, []).append(f"`{key}`")
    rows += [f"- {', '.join(keys)} only with `{switch}`: set to anything but the default without it, refused."
             for switch, keys in needs.items()]
    rows += ["", "Settings a place cannot run (each place's cache features are refused in places.py):"]
    rows += [f"- `{key}` in {WHERE_REFUSED.get(where, (where,))[0]}: refused: {why}; {fix}."
             for where, table in SETTINGS_REFUSED.items() for key, (_, why, fix) in table.items()]
    rows += ["", "Models with their own sliding window (`ModelConfig.layer_types`: Mistral, Qwen2 with "
             "`use_sliding_window`, Gemma 3; chapter 7) get the hybrid cache, a ring per sliding layer and every position "
             "per full layer. Beside it:"]
    rows += [f"- `{feature}`: {verdict}: {how}." for feature, (verdict, how) in MODEL_WINDOW.items()]
    return "\n".join(rows)
