"""How the settings of a GenerationConfig combine: the one table of features, the pairs refused
(with why and the fix), the pairs applied with a note, and the settings that need another.

config.py checks every config against these tables when it is built; `combination_table` renders
them as the README's table (scripts/update_readme.py). Each rule reads only a config's fields.
"""

from __future__ import annotations

from typing import Callable

from .errors import ConfigError

Rule = Callable[["GenerationConfig"], bool]  # reads a config's fields (config.py's GenerationConfig)

# ---------------------------------------------------------------- settings that need a switch
# setting -> (the switch it needs, whether the switch is on, how to turn it on). A setting left at
# its default is fine either way; one set to anything else while its switch is off is refused.
SWITCHES: dict[str, tuple[str, Rule, str]] = {
    "temperature": ("do_sample", lambda c: c.do_sample, "set do_sample=True"),
    "top_k": ("do_sample", lambda c: c.do_sample, "set do_sample=True"),
    "top_p": ("do_sample", lambda c: c.do_sample, "set do_sample=True"),
    "seed": ("do_sample", lambda c: c.do_sample, "set do_sample=True (greedy decoding draws nothing)"),
    "sink_tokens": ("window_size", lambda c: c.window_size is not None, "set window_size (e.g. 128)"),
    "sparse_score": ("sparse_top_k or sparsity_threshold", lambda c: c.sparse,
                     "set sparse_top_k (e.g. 64) or sparsity_threshold (e.g. 0.1)"),
    "quant_group_size": ("quant_bits", lambda c: c.quant_bits is not None, "set quant_bits (8 or 4)"),
    "quant_key_axis": ("quant_bits", lambda c: c.quant_bits is not None, "set quant_bits (8 or 4)"),
    "quant_residual": ("quant_bits", lambda c: c.quant_bits is not None, "set quant_bits (8 or 4)"),
    "kv_dtype": ("use_cache=True", lambda c: c.use_cache, "set use_cache=True (the naive loop keeps no cache)"),
}


# ---------------------------------------------------------------- how the cache features combine
# Each feature is switched on by one key (sparse attention by either of two). The naive loop
# (use_cache=False) keeps no cache, so it combines only with what attention does by itself.
FEATURES: dict[str, tuple[Rule, str]] = {
    "use_cache=False": (lambda c: not c.use_cache, "the naive loop: no cache, recompute everything"),
    "attention_backend": (lambda c: c.attention_backend == "triton",
                          "set to \"triton\": the fused decode-attention kernel over paged blocks (chapter 9)"),
    "cache_chunk_size": (lambda c: c.cache_chunk_size is not None, "paged blocks (chapter 3)"),
    "prefetch_depth": (lambda c: c.prefetch_depth is not None, "an offload tier with prefetch (chapter 3)"),
    "quant_bits": (lambda c: c.quant_bits is not None, "group-wise quantized codes (chapter 4)"),
    "window_size": (lambda c: c.window_size is not None, "a window with sinks (chapter 5)"),
    "sparse": (lambda c: c.sparse, "sparse_top_k / sparsity_threshold: sparse key selection (chapter 6)"),
    "kv_budget": (lambda c: c.kv_budget is not None, "heavy-hitter (H2O) eviction (chapter 6)"),
    "compile": (lambda c: c.compile, "torch.compile of the decode step (chapter 8)"),
    "cuda_graphs": (lambda c: c.cuda_graphs, "CUDA-graph capture and replay of the decode step (chapter 8)"),
    "fused_decode": (lambda c: c.fused_decode is True,
                     "set to True: every layer of a batch-1 decode step in one C call (chapter 14); the default "
                     "\"auto\" runs it wherever this table allows"),
}

def _switch_off(feature: str) -> str:
    """How to turn a feature of FEATURES off, as a fix names it."""
    return {"use_cache=False": "use_cache=True", "compile": "compile=False", "cuda_graphs": "cuda_graphs=False",
            "fused_decode": "fused_decode=False", "attention_backend": "attention_backend='torch'",
            "sparse": "sparse_top_k=None and sparsity_threshold=None"}.get(feature, f"{feature}=None")


# The pairs that do not combine: why, and the fix. Every pair not listed combines, and each
# feature in it is applied (tests/test_combinations.py runs the whole space).
REFUSED: dict[frozenset[str], tuple[str, str]] = {
    frozenset({"use_cache=False", "cache_chunk_size"}): (
        "the naive loop keeps no cache to page", "set use_cache=True, or cache_chunk_size=None"),
    frozenset({"use_cache=False", "prefetch_depth"}): (
        "the naive loop keeps no cache to offload", "set use_cache=True, or prefetch_depth=None"),
    frozenset({"use_cache=False", "quant_bits"}): (
        "the naive loop keeps no cache to quantize", "set use_cache=True, or quant_bits=None"),
    frozenset({"use_cache=False", "kv_budget"}): (
        "the naive loop keeps no cache to evict from", "set use_cache=True, or kv_budget=None"),
    frozenset({"cache_chunk_size", "kv_budget"}): (
        "heavy hitters evict single tokens while paging frees whole blocks",
        "drop one: cache_chunk_size=None or kv_budget=None"),
    frozenset({"quant_bits", "kv_budget"}): (
        "heavy-hitter eviction moves tokens between slots, which a quantized group cannot follow",
        "drop one: quant_bits=None or kv_budget=None"),
    frozenset({"prefetch_depth", "kv_budget"}): (
        "heavy-hitter eviction compacts every layer at once, but the offload tier holds only "
        "prefetch_depth + 1 layers on the device", "drop one: prefetch_depth=None or kv_budget=None"),
    frozenset({"compile", "cuda_graphs"}): (
        "cuda_graphs captures the eager step; a compiled step is captured by torch.compile(mode='reduce-overhead')",
        "pick one: compile=False or cuda_graphs=False"),
}
# The fused step writes the contiguous cache's slots from C and attends every cached token.
for _other, _why in (("use_cache=False", "the naive loop keeps no cache to decode from"),
                     ("attention_backend", "the Triton kernel reads paged blocks; the fused step writes the contiguous cache"),
                     ("cache_chunk_size", "the fused step writes the contiguous cache, not blocks"),
                     ("prefetch_depth", "the fused step reads every layer's cache in one C call; the tier moves them from Python"),
                     ("quant_bits", "the fused step stores keys and values in fp32 or bf16, not codes"),
                     ("window_size", "the fused step attends every cached token; it has no window"),
                     ("sparse", "the fused step attends every cached token; sparse selection needs the scores in torch"),
                     ("kv_budget", "heavy hitters need the attention probabilities, which the fused step keeps in C"),
                     ("compile", "the fused step is C, which torch.compile cannot trace"),
                     ("cuda_graphs", "the fused step runs on a CPU; CUDA graphs on a GPU")):
    REFUSED[frozenset({"fused_decode", _other})] = (_why, f"drop one: fused_decode=False or {_switch_off(_other)}")
# Compiling and capturing need a decode step of fixed shapes and addresses, with no host sync and
# no Python bookkeeping inside: the contiguous cache and the ring buffer have one.
for _step, _why in (("use_cache=False", "the naive loop feeds a longer sequence every step: a new shape each time"),
                    ("cache_chunk_size", "the paged cache plans its blocks on the host every step"),
                    ("prefetch_depth", "the offload tier moves layers with Python bookkeeping between them"),
                    ("quant_bits", "the quantized cache's step changes shape as groups leave its window"),
                    ("kv_budget", "heavy hitters evict on the host and observe attention from Python")):
    REFUSED[frozenset({"compile", _step})] = (_why, f"drop one: compile=False or {_switch_off(_step)}")
    REFUSED[frozenset({"cuda_graphs", _step})] = (_why, f"drop one: cuda_graphs=False or {_switch_off(_step)}")
# The Triton kernel reads paged blocks (full precision or 8/4-bit codes) through the block tables,
# one query token per row, with the window and sinks as masks from positions. What it cannot read:
for _other, _why in (("use_cache=False", "the naive loop keeps no cache for the kernel to read"),
                     ("prefetch_depth", "the kernel reads blocks resident on the device; the offload tier moves them"),
                     ("sparse", "the kernel attends every key of the window; sparse selection needs the scores in torch"),
                     ("kv_budget", "heavy hitters need the attention probabilities, which the kernel never writes"),
                     ("compile", "the paged cache plans its blocks on the host every step"),
                     ("cuda_graphs", "the paged cache plans its blocks on the host every step")):
    REFUSED[frozenset({"attention_backend", _other})] = (_why, f"drop one: attention_backend='torch' or "
                                                              f"{_switch_off(_other)}")
# How the less obvious pairs are applied (README's table shows these as notes).
APPLIED: dict[frozenset[str], str] = {
    frozenset({"use_cache=False", "window_size"}): "the window masks the recomputed sequence",
    frozenset({"cache_chunk_size", "window_size"}): "blocks wholly outside the window go back to the pool",
    frozenset({"cache_chunk_size", "quant_bits"}): "full blocks are stored quantized; each row's open block in "
                                                   "full precision",
    frozenset({"quant_bits", "window_size"}): "without cache_chunk_size the window is a mask and the quantized "
                                              "cache keeps every token",
    frozenset({"window_size", "kv_budget"}): "the window masks the tokens heavy hitters keep",
    frozenset({"sparse", "kv_budget"}): "heavy hitters score the attention that sparse selection leaves",
}
APPLIED[frozenset({"attention_backend", "cache_chunk_size"})] = ("decode steps read the blocks through the tables "
                                                                 "in place; a prompt goes through torch")
APPLIED[frozenset({"attention_backend", "quant_bits"})] = ("8- and 4-bit codes are dequantized as they are loaded; "
                                                           "the open block is read from its own full-precision buffer")
APPLIED[frozenset({"attention_backend", "window_size"})] = "the kernel masks the window and sinks from positions"
for _other in ("cache_chunk_size", "quant_bits", "window_size", "sparse"):
    APPLIED[frozenset({"prefetch_depth", _other})] = "the offload tier wraps the cache, whatever it stores"
for _other in ("use_cache=False", "cache_chunk_size", "quant_bits", "window_size"):
    APPLIED.setdefault(frozenset({"sparse", _other}), "sparse selection runs on the keys attention sees")

# Settings of one feature that another refuses.
REFUSED_SETTINGS: list[tuple[str, str, Rule, str, str]] = [
    ("quant_residual", "cache_chunk_size", lambda c: c.quant_residual is not None and c.cache_chunk_size is not None,
     "in the paged cache each row's open block is the full-precision window",
     "leave quant_residual=None (the open block holds the newest tokens), or set cache_chunk_size=None"),
    ("attention_backend", "cache_chunk_size", lambda c: c.attention_backend == "triton" and c.cache_chunk_size is None,
     "the kernel reads blocks through a block table, and the contiguous caches have none",
     "set cache_chunk_size (e.g. 16), or attention_backend='torch'"),
    ("attention_backend", "quant_bits", lambda c: c.attention_backend == "triton" and c.quant_bits == 2,
     "the kernel unpacks 8- and 4-bit codes only", "use quant_bits=8 or 4, or attention_backend='torch'"),
]


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
    "fused_decode": "the fused step decodes one sequence at a time (batch 1)",
}
# The serving engine (engine.py) runs every sequence in one pool of full-precision paged blocks.
ENGINE_REFUSED: dict[str, str] = {
    **RAGGED_REFUSED,
    "prefetch_depth": "the engine's pool of blocks stays on the device",
    "quant_bits": "the quantized paged cache keeps each row's open block in a per-batch buffer that the engine's "
                  "changing rows cannot share, and a prefix-cache hit or a recompute after preemption would read "
                  "quantized keys where the prompt alone is attended in full precision (generate(model, prompts) "
                  "runs a quantized ragged batch, one cache per row)",
}


def check_rows(c: "GenerationConfig", what: str, table: dict[str, str]) -> None:
    """Refuse, with the key and the fix, a feature that cannot take per-row positions (`table`)."""
    for feature in c.features():
        if feature in table:
            fix = _switch_off(feature)
            raise ConfigError(f"{_describe(c, feature)} does not combine with {what}: {table[feature]}. Fix: {fix}.")


def refused_with(c: "GenerationConfig", feature: str) -> list[str]:
    """The features `c` switches on that the table refuses beside `feature` (which need not be on):
    what keeps fused_decode="auto" on the eager step."""
    return [other for other in c.features() if frozenset({feature, other}) in REFUSED]


def check_combinations(c: "GenerationConfig") -> None:
    on = c.features()
    for i, a in enumerate(on):
        for b in on[i + 1:]:
            refused = REFUSED.get(frozenset({a, b}))
            if refused:
                why, fix = refused
                raise ConfigError(f"{_describe(c, a)} and {_describe(c, b)} do not combine: {why}. Fix: {fix}.")
    for key, other, clash, why, fix in REFUSED_SETTINGS:
        if clash(c):
            raise ConfigError(f"{key}={getattr(c, key)!r} and {other}={getattr(c, other)!r} do not combine: "
                              f"{why}. Fix: {fix}.")


def _describe(c: "GenerationConfig", feature: str) -> str:
    if feature == "use_cache=False":
        return feature
    if feature in ("compile", "cuda_graphs", "fused_decode"):
        return f"{feature}=True"
    if feature == "sparse":
        keys = [k for k in ("sparse_top_k", "sparsity_threshold") if getattr(c, k) is not None]
        return " and ".join(f"{k}={getattr(c, k)!r}" for k in keys)
    return f"{feature}={getattr(c, feature)!r}"


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
                cells.append(f"yes ({'abcdefghijklmn'[applied.index(APPLIED[pair])]})")
            else:
                cells.append("yes")
        rows.append(f"| `{a}` | " + " | ".join(cells) + " |")
    rows += ["", "Switched on by: " + "; ".join(f"`{n}`: {what}" for n, (_, what) in FEATURES.items()) + ".", ""]
    rows += [f"{i}. Refused: {note}." for i, note in enumerate(refused, 1)]
    rows += [""] + [f"- ({'abcdefghijklmn'[i]}) {note}." for i, note in enumerate(applied)]
    rows += ["", "Settings that need another:"]
    rows += [f"- `{key}` with `{other}`: refused: {why}; {fix}." for key, other, _, why, fix in REFUSED_SETTINGS]
    needs: dict[str, list[str]] = {}
    for key, (switch, _, _) in SWITCHES.items():
        needs.setdefault(switch, []).append(f"`{key}`")
    rows += [f"- {', '.join(keys)} only with `{switch}`: set to anything but the default without it, refused."
             for switch, keys in needs.items()]
    return "\n".join(rows)
