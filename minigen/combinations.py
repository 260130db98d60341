"""How the settings of a GenerationConfig combine: the one table of features, the pairs refused
(with why and the fix), the pairs applied with a note, and the settings that need another.

config.py checks every config against these tables when it is built; course/table.py renders
them as the README's table (scripts/update_readme.py). These rules read only a config's fields.
What a config needs of the model and the machine (the fused C step, Triton, CUDA, the head dim)
is the second axis (run_rules.py: RUN_RULES, checked once per generation, when its step is chosen
in steps/choose.py). What each place a plan runs cannot run is the third axis (places.py). Every
table is data: nothing here changes after import.
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
    "min_p": ("do_sample", lambda c: c.do_sample, "set do_sample=True"),
    "seed": ("do_sample", lambda c: c.do_sample, "set do_sample=True (greedy decoding draws nothing)"),
    "guided_backend": ("response_format, guided_regex or guided_grammar", lambda c: c.guide_spec() is not None,
                       "set response_format, guided_regex or guided_grammar"),
    "sink_tokens": ("window_size", lambda c: c.window_size is not None, "set window_size (e.g. 128)"),
    "sparse_score": ("sparse_top_k or sparsity_threshold", lambda c: c.sparse,
                     "set sparse_top_k (e.g. 64) or sparsity_threshold (e.g. 0.1)"),
    "quant_group_size": ("quant_bits", lambda c: c.quant_bits is not None, "set quant_bits (8 or 4)"),
    "quant_key_axis": ("quant_bits", lambda c: c.quant_bits is not None, "set quant_bits (8 or 4)"),
    "quant_residual": ("quant_bits", lambda c: c.quant_bits is not None, "set quant_bits (8 or 4)"),
    "kv_dtype": ("use_cache=True", lambda c: c.use_cache, "set use_cache=True (the naive loop keeps no cache)"),
    "num_speculative_tokens": ("speculative_method", lambda c: c.speculative_method is not None,
                               "set speculative_method='ngram' or 'draft'"),
    **{key: ("speculative_method='ngram'", lambda c: c.speculative_method == "ngram",
             "set speculative_method='ngram' (prompt lookup)") for key in ("prompt_lookup_min", "prompt_lookup_max")},
    "length_penalty": ("num_beams > 1", lambda c: c.num_beams > 1, "set num_beams (e.g. 4)"),
}


# ---------------------------------------------------------------- how the cache features combine
# Each feature is switched on by one key (sparse attention by either of two). The naive loop
# (use_cache=False) keeps no cache, so it combines only with what attention does by itself.
FEATURES: dict[str, tuple[Rule, str]] = {
    "use_cache=False": (lambda c: not c.use_cache, "the naive loop: no cache, recompute everything"),
    "attention_backend": (lambda c: c.attention_backend == "triton",
                          "set to \"triton\": fused attention kernels that read the paged blocks in place, for "
                          "decode steps and prompts (chapter 12)"),
    "cache_chunk_size": (lambda c: c.cache_chunk_size is not None, "paged blocks (chapter 5)"),
    "prefetch_depth": (lambda c: c.prefetch_depth is not None, "an offload tier with prefetch (chapter 5)"),
    "quant_bits": (lambda c: c.quant_bits is not None, "group-wise quantized codes (chapter 6)"),
    "window_size": (lambda c: c.window_size is not None, "a window with sinks (chapter 7)"),
    "sparse": (lambda c: c.sparse, "sparse_top_k / sparsity_threshold: sparse key selection (chapter 8)"),
    "kv_budget": (lambda c: c.kv_budget is not None, "heavy-hitter (H2O) eviction (chapter 8)"),
    "compile": (lambda c: c.compile, "torch.compile of the decode step (chapter 11)"),
    "cuda_graphs": (lambda c: c.cuda_graphs, "CUDA-graph capture and replay of the decode step (chapter 11)"),
    "fused_decode": (lambda c: c.fused_decode is True,
                     "set to True: every layer of a decode step in one C call (chapter 10); the default "
                     "\"auto\" runs it wherever this table allows"),
    "speculative_method": (lambda c: c.speculative_method is not None,
                           "\"ngram\" or \"draft\": propose k tokens, verify them in one forward (chapter 13)"),
    "prefill_precision": (lambda c: c.prefill_precision != "float32",
                          "\"bfloat16\" or \"int8\": a prompt's products of more than 16 rows with bf16 inputs and "
                          "fp32 sums, or int8 weights and activations (a scale per token) and int32 sums (chapter "
                          "16); a draft model's prompt and every decode step stay as they are"),
    "prefill_chunk_size": (lambda c: c.prefill_chunk_size is not None,
                           "a prompt run this many tokens per forward, each piece reading the pieces before it "
                           "from the cache: activations scale with the piece, not the prompt (chapter 3)"),
    "num_beams": (lambda c: c.num_beams > 1, "k beams a prompt (beam.py), the cache's rows reordered in place each "
                  "step"),
}

def switch_off(feature: str) -> str:
    """How to turn a feature of FEATURES off, as a fix names it."""
    return {"use_cache=False": "use_cache=True", "compile": "compile=False", "cuda_graphs": "cuda_graphs=False",
            "fused_decode": "fused_decode=False", "attention_backend": "attention_backend='torch'",
            "sparse": "sparse_top_k=None and sparsity_threshold=None", "num_beams": "num_beams=1",
            "prefill_precision": "prefill_precision='float32'"}.get(feature, f"{feature}=None")


# The pairs that do not combine: feature -> {another feature: why}. The fix drops one of the two.
# Every pair not listed combines, and each feature in it is applied (tests/test_combinations.py
# runs the whole space). A pair is declared once, under the feature whose constraint it is.
_STATIC_STEP = {  # compiling and capturing need a decode step of fixed shapes and addresses, with
    # no host sync and no Python bookkeeping inside: the contiguous cache and the ring buffer have one
    "use_cache=False": "the naive loop feeds a longer sequence every step: a new shape each time",
    "cache_chunk_size": "the paged cache plans its blocks on the host every step",
    "prefetch_depth": "the offload tier moves layers with Python bookkeeping between them",
    "quant_bits": "the quantized cache's step changes shape as groups leave its window",
    "kv_budget": "heavy hitters evict on the host and observe attention from Python",
}
_REFUSED_BESIDE: dict[str, dict[str, str]] = {
    "use_cache=False": {
        "cache_chunk_size": "the naive loop keeps no cache to page",
        "prefetch_depth": "the naive loop keeps no cache to offload",
        "quant_bits": "the naive loop keeps no cache to quantize",
        "kv_budget": "the naive loop keeps no cache to evict from",
        "prefill_chunk_size": "the naive loop keeps no cache for a prompt's pieces to meet in",
    },
    "kv_budget": {
        "cache_chunk_size": "heavy hitters evict single tokens while paging frees whole blocks",
        "quant_bits": "heavy-hitter eviction moves tokens between slots, which a quantized group cannot follow",
        "prefetch_depth": "heavy-hitter eviction compacts every layer at once, but the offload tier holds only "
                          "prefetch_depth + 1 layers on the device",
        "prefill_chunk_size": "heavy hitters would evict between a prompt's pieces, by attention that has not yet "
                              "seen the rest of the prompt: another cache than the whole prompt's",
    },
    "cuda_graphs": {
        "compile": "cuda_graphs captures the eager step; a compiled step is captured by "
                   "torch.compile(mode='reduce-overhead')",
        **_STATIC_STEP,
    },
    "compile": _STATIC_STEP,
    # The fused step writes the cache's slots from C (a contiguous cache's, or a paged pool's through its
    # block tables) and attends every cached token.
    "fused_decode": {
        "use_cache=False": "the naive loop keeps no cache to decode from",
        "attention_backend": "the Triton kernel and the fused step each read the paged blocks their own way: one "
                             "decode step runs one of them",
        "prefetch_depth": "the fused step reads every layer's cache in one C call; the tier moves them from Python",
        "quant_bits": "the fused step stores keys and values in fp32 or bf16, not codes",
        "window_size": "the fused step attends every cached token; it has no window",
        "sparse": "the fused step attends every cached token; sparse selection needs the scores in torch",
        "kv_budget": "heavy hitters need the attention probabilities, which the fused step keeps in C",
        "compile": "the fused step is C, which torch.compile cannot trace",
        "cuda_graphs": "the fused step runs on a CPU; CUDA graphs on a GPU",
    },
    # Verification writes k + 1 positions, then rewinds the rejected ones (caches.contract: a write at p
    # forgets every position >= p), and one forward checks them all.
    "speculative_method": {
        "use_cache=False": "the naive loop recomputes every token anyway: there is no cached step to save",
        "quant_bits": "a group quantized with rejected tokens cannot be rewound, and a verify step's queries would "
                      "see in full precision keys that plain decoding sees quantized (not the same text)",
        "kv_budget": "an eviction is final: a rejected token's attention would already have evicted another",
        "compile": "the compiled step has one shape, one token; verification runs k + 1",
        "cuda_graphs": "no captured verify step exists: the captured step decodes one token",
    },
    "num_beams": {**dict.fromkeys(("use_cache=False", "cache_chunk_size", "prefetch_depth", "quant_bits", "kv_budget",
                                   "attention_backend", "compile"), "beam search reorders rows in place between eager "
                                  "steps, in a contiguous cache or a ring only (their reorder_rows)"),
                  "cuda_graphs": "the captured step samples one token per row inside its graph",
                  "speculative_method": "each row accepts its own count of tokens, while beams move in lockstep"},
    # The Triton kernels read paged blocks (full precision or 8/4-bit codes) through the block
    # tables, one query token per row (decode) or a prompt's tokens (FlashAttention), with the
    # window and sinks as masks from positions.
    "attention_backend": {
        "use_cache=False": "the naive loop keeps no cache for the kernel to read",
        "prefetch_depth": "the kernel reads blocks resident on the device; the offload tier moves them",
        "sparse": "the kernel attends every key of the window; sparse selection needs the scores in torch",
        "kv_budget": "heavy hitters need the attention probabilities, which the kernel never writes",
        "compile": "the paged cache plans its blocks on the host every step",
        "cuda_graphs": "the paged cache plans its blocks on the host every step",
    },
}
# How the less obvious pairs are applied (README's table shows these as notes).
_APPLIED_BESIDE: dict[str, dict[str, str]] = {
    "window_size": {
        "use_cache=False": "the window masks the recomputed sequence",
        "cache_chunk_size": "blocks wholly outside the window go back to the pool",
        "quant_bits": "without cache_chunk_size the window is a mask and the quantized cache keeps every token",
        "kv_budget": "the window masks the tokens heavy hitters keep",
    },
    "quant_bits": {"cache_chunk_size": "full blocks are stored quantized; each row's open block in full precision"},
    "prefill_chunk_size": {
        "quant_bits": "each piece of the prompt reads the full groups of the pieces before it quantized, as a "
                      "decode step does",
        "prefill_precision": "a piece of 16 tokens or fewer runs its products in fp32, as any short forward",
        "speculative_method": "the target's prompt and the draft's run in pieces",
    },
    "sparse": {
        "kv_budget": "heavy hitters score the attention that sparse selection leaves",
        **{other: "sparse selection runs on the keys attention sees"
           for other in ("use_cache=False", "cache_chunk_size", "quant_bits", "window_size")},
    },
    "attention_backend": {
        "cache_chunk_size": "decode steps and prompts read the blocks through the tables in place",
        "quant_bits": "8- and 4-bit codes are dequantized as they are loaded; the open block is read from its own "
                      "full-precision buffer",
        "window_size": "the kernel masks the window and sinks from positions",
    },
    "fused_decode": {
        "cache_chunk_size": "a decode step reads and writes the blocks in place through the tables (the serving "
                            "engine's rows each at its own position); prompts and verify chunks run eagerly; "
                            "generate takes it on a paged cache when fused_decode=True, the engine on \"auto\" "
                            "where it measured faster",
    },
    "prefetch_depth": {other: "the offload tier wraps the cache, whatever it stores"
                       for other in ("cache_chunk_size", "quant_bits", "window_size", "sparse", "speculative_method")},
    "speculative_method": {
        "cache_chunk_size": "a rewind gives the blocks past the accepted tokens back to the pool",
        "window_size": "the ring keeps num_speculative_tokens spare slots, so a rewind never loses a slot the "
                       "window still needs",
        "attention_backend": "verification runs k + 1 tokens through the prompt kernel; a step with no proposal "
                             "through the decode kernel",
        "fused_decode": "at batch 1 the fused step verifies k + 1 tokens in one C call",
    },
}


def _pairs(beside: dict[str, dict[str, str]]) -> dict[frozenset[str], str]:
    """{frozenset({a, b}): note} from feature -> {other: note}; a pair declared twice is a mistake."""
    pairs: dict[frozenset[str], str] = {}
    for a, others in beside.items():
        for b, note in others.items():
            pair = frozenset({a, b})
            if pair in pairs or a == b or not {a, b} <= FEATURES.keys():
                raise AssertionError(f"combinations: the pair {a} / {b} is declared twice or names no feature")
            pairs[pair] = note
    return pairs


_pairs(_REFUSED_BESIDE)  # each pair once
REFUSED: dict[frozenset[str], tuple[str, str]] = {  # pair -> (why, the fix)
    frozenset({a, b}): (why, f"drop one: {switch_off(a)} or {switch_off(b)}")
    for a, others in _REFUSED_BESIDE.items() for b, why in others.items()}
APPLIED: dict[frozenset[str], str] = _pairs(_APPLIED_BESIDE)

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
    *(("int8_activations", step, lambda c, step=step: c.int8_activations is True and getattr(c, step),
       "int8 activations run in minigen's C kernels, which a compiled or captured step does not call",
       f"int8_activations=False (or \"auto\", which leaves them out there), or {step}=False")
      for step in ("compile", "cuda_graphs")),
    ("num_beams", "do_sample", lambda c: c.num_beams > 1 and c.do_sample, "beam sampling (transformers' num_beams with "
     "do_sample) is not implemented: minigen's beam search is deterministic", "do_sample=False, or num_beams=1 to sample"),
    *((key, "cuda_graphs", lambda c, key=key, off=off: c.cuda_graphs and (getattr(c, key) or off) != off,
       "the captured step samples inside its graph from the model's raw logits, and penalties and biases are "
       "applied on the host before a sample (decoding/logits.py), penalties from each row's tokens so far",
       f"cuda_graphs=False (compile=True runs them), or leave {key} at its default")
      for key, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                       ("logit_bias", None))),
    *((key, "cuda_graphs", lambda c, key=key: c.cuda_graphs and getattr(c, key) is not None,
       "the captured step samples inside its graph and checks only stop ids there, and this setting reads each "
       "row's text on the host before a sample (a stop string, or the structured-output mask from its state)",
       f"cuda_graphs=False (compile=True runs it), or {key}=None")
      for key in ("stop", "response_format", "guided_regex", "guided_grammar")),
    *((key, "num_beams", lambda c, key=key, off=off: c.num_beams > 1 and (getattr(c, key) or off) != off,
       "beam search (beam.py) scores its beams by the model's own log-probabilities, which penalties, a bias, a "
       "mask or a stop string would change per beam, and minigen's beams do not carry that state",
       f"num_beams=1, or leave {key} at its default")
      for key, off in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                       ("logit_bias", None), ("stop", None), ("response_format", None), ("guided_regex", None),
                       ("guided_grammar", None))),
    ("logprobs", "cuda_graphs", lambda c: c.cuda_graphs and c.logprobs is not None, "the captured step samples inside "
     "its graph, and its logits never reach the host, where a token's log-probability is read",
     "cuda_graphs=False (compile=True records them), or logprobs=None"),
    ("logprobs", "num_beams", lambda c: c.num_beams > 1 and c.logprobs is not None, "beam search knows its tokens "
     "only when it ends, and minigen's beams keep no per-token log-probabilities", "num_beams=1, or logprobs=None"),
    ("n", "num_beams", lambda c: c.num_beams > 1 and c.n > 1, "beam search returns each prompt's best beam, and n "
     "draws n samples of a prompt", "num_beams=1 with do_sample=True to draw n samples, or n=1"),
]


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
                raise ConfigError(f"{describe(c, a)} and {describe(c, b)} do not combine: {why}. Fix: {fix}.")
    for key, other, clash, why, fix in REFUSED_SETTINGS:
        if clash(c):
            raise ConfigError(f"{key}={getattr(c, key)!r} and {other}={getattr(c, other)!r} do not combine: "
                              f"{why}. Fix: {fix}.")
    bs, G = c.cache_chunk_size, c.quant_group_size  # keys per channel: grouped over one block's tokens
    if c.quant_bits is not None and bs is not None and c.quant_key_axis == "channel" and bs % G:
        fix = f"use cache_chunk_size={G * -(-bs // G)}, or quant_key_axis='token'"
        raise ConfigError(f"cache_chunk_size={bs} is not a multiple of quant_group_size={G}: keys are quantized "
                          f"per channel over {G} tokens of one block, so {fix}")


def describe(c: "GenerationConfig", feature: str) -> str:
    if feature == "use_cache=False":
        return feature
    if feature in ("compile", "cuda_graphs", "fused_decode"):
        return f"{feature}=True"
    if feature == "sparse":
        keys = [k for k in ("sparse_top_k", "sparsity_threshold") if getattr(c, k) is not None]
        return " and ".join(f"{k}={getattr(c, k)!r}" for k in keys)
    return f"{feature}={getattr(c, feature)!r}"
