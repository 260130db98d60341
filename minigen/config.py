"""GenerationConfig: the one dataclass whose fields switch each optimization on or off.

Every field is validated when the config is built, and again when a field is assigned later, with a
message that names the key, the value and the allowed range, so a typo in `generation_config.json`
fails loudly before any model work starts. An unknown key (a keyword, an assignment, a JSON key) is
refused too, with the closest field or where it belongs (`weight_bits` is `load`'s), and so is a
JSON key given twice. How the cache features combine is decided in one
table (`REFUSED`, combinations.py): a pair in it is refused with both keys and a fix; every other
pair is applied. A config reads no machine: what needs the model or the machine (CUDA, Triton,
the C kernel, the head dim) is checked when a generation chooses its step (run_rules.RUN_RULES).
A setting that only matters with a switch (sinks without a window, a temperature without sampling)
is refused when the switch is off, so nothing a config names is silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Any


from .attention import sparse_on
from .combinations import FEATURES, SWITCHES, check_combinations
from .decoding.guide import GuideSpec
from .decoding.settings import check_decoding, check_text_settings, logit_bias_ids
from .errors import ConfigError
from .checks import MISPLACED_KEYS, TRANSFORMERS_ONLY_KEYS
from .checks import check_bool as _check_bool, check_int as _check_int, is_number as _is_number
from .numerics.precision import DTYPES

KV_DTYPES = tuple(DTYPES)  # the one mapping of dtype names (numerics/precision.py)
ATTENTION_BACKENDS = ("torch", "triton")
PREFILL_PRECISIONS = ("float32", "bfloat16", "int8")
SPECULATIVE_METHODS = (None, "ngram", "draft")

INT64_MAX = 2**63 - 1  # token ids travel as int64 tensors
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed

def _refuse_unknown_keys(cls):
    """Wrap the dataclass's __init__ so that an unknown keyword is a ConfigError that says where it
    belongs or what was meant, not Python's TypeError; the signature stays the dataclass's."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_keys(kwargs, source=f"{cls.__name__}(...)")
        init(self, *args, **kwargs)
    cls.__init__ = __init__
    return cls


@_refuse_unknown_keys
@dataclass
class GenerationConfig:
    # --- sampling (chapter 1) ---
    max_new_tokens: int = 32  # tokens to generate after the prompt
    do_sample: bool = False  # False: greedy argmax; True: sample from the tempered distribution
    # logits are divided by this before sampling (finite, > 0); needs do_sample. Below
    # torch.finfo(torch.float32).tiny (~1.2e-38, where 1/T overflows) sampling is greedy (sampling.py)
    temperature: float = 1.0
    top_k: int | None = None  # keep only the k most likely tokens before sampling; None: all
    top_p: float | None = None  # keep the smallest set whose probability mass reaches p; None: all
    # keep the tokens whose probability is at least min_p x the top token's, in [0, 1] (after
    # temperature, top_k and top_p, as transformers' MinPLogitsWarper); None: all
    min_p: float | None = None
    # --- penalties and bias, on each row's logits before it samples (decoding/; greedy rows too) ---
    # transformers' rule over the row's prompt and new tokens: a seen token's logit is divided by
    # this when positive, multiplied when negative; finite, > 0 (1.0: off; above 1 discourages repeats)
    repetition_penalty: float = 1.0
    # OpenAI's rules over the row's new tokens only: logit -= count x frequency_penalty +
    # (count > 0) x presence_penalty, each in [-2, 2] (0: off)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)
    # seed of the sampling generators: row r of a batch draws from its own, seeded (seed + r) mod 2**64
    # (row 0 = the prompt alone with this seed); None: fresh entropy for each row
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # stop a sequence at these ids; None: the model's eos
    # --- text and structure (chapter 4; vLLM's and OpenAI's names): these read text, so a generation
    # that sets one needs the tokenizer (generate(..., tokenizer=tok), Engine(..., tokenizer=tok))
    stop: tuple[str, ...] | None = None  # up to 4 strings: a row stops once its text holds one (cut from the text)
    # OpenAI's {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, {"type": "json_object"} or
    # {"type": "text"} (no constraint): the reply must be JSON that the schema accepts
    response_format: dict | None = None
    guided_regex: str | None = None  # the reply must match this regular expression (vLLM's name)
    guided_grammar: str | None = None  # the reply must match this grammar, in Lark syntax (llguidance's)
    # who compiles the spec into a token mask: "minigen" (the course's own automaton, for a subset of JSON Schema
    # and regexes), "llguidance" (the full languages), "auto" (minigen's where the spec is in its subset)
    guided_backend: str = "auto"
    # n samples a prompt, each its own row: output row b * n + j is prompt b's sample j (seeded seed + b * n + j)
    n: int = 1
    logprobs: int | None = None  # per new token, its logprob and the top k (0..20) from the raw logits (decoding/logprobs.py)
    # --- the cache (chapter 2) ---
    use_cache: bool = True  # False: the naive loop that recomputes the whole sequence every step
    # --- paged cache and offload (chapter 5) ---
    # block size of the paged cache, in tokens (with quant_bits and keys per channel, a multiple of
    # quant_group_size: a block holds whole groups); None: one contiguous cache
    cache_chunk_size: int | None = None
    prefetch_depth: int | None = None  # keep the KV cache in a second tier, fetch this many layers ahead; None: no tier
    # --- window, sinks and sparse attention (chapters 7-8) ---
    window_size: int | None = None  # each query sees the window_size most recent tokens (itself included); None: all
    sink_tokens: int = 4  # the first tokens, always kept when a window is set (StreamingLLM); needs window_size
    sparse_top_k: int | None = None  # per head and query, attend only the k keys of largest |q.k|/sqrt(Dh); None: all
    sparsity_threshold: float | None = None  # keep keys whose |q.k|/sqrt(Dh) >= this x the head's max, in [0, 1]
    sparse_score: str = "abs"  # rank keys by "abs": |q.k| (the article's rule) or "signed": q.k (by probability)
    kv_budget: int | None = None  # H2O heavy hitters: tokens kept in the cache per row; None: all
    # --- KV quantization (chapter 6) ---
    quant_bits: int | None = None  # bits per cached key/value element: 8 or 4 (2 for experiments); None: full precision
    quant_group_size: int = 32  # elements sharing one 2-byte scale and zero (bf16; fp16 in an fp16 model; KIVI: 32)
    quant_key_axis: str = "channel"  # keys grouped per "channel" (over tokens, KIVI) or per "token" (over channels)
    quant_residual: int | None = None  # most recent tokens kept in full precision (>= group size); None: one group
    # --- precision and compilation (chapters 9 and 11) ---
    kv_dtype: str | None = None  # KV cache storage: "float32", "bfloat16" or "float16"; None: the weights' dtype
    compile: bool = False  # torch.compile the decode step (the contiguous cache or the window's ring buffer)
    cuda_graphs: bool = False  # capture the decode step in a CUDA graph and replay it (CUDA only)
    # every layer of a decode step in one C call (steps/fused.py): "auto" wherever it applies
    # (steps/choose.py says where), True demands it (refused where it cannot run), False forbids it
    fused_decode: bool | str = "auto"
    # --- the fused kernel (chapter 12) ---
    # attention over a paged cache: "torch" (gather + SDPA) or "triton" (reads the blocks in place)
    attention_backend: str = "torch"
    # --- prefill (chapter 3) ---
    # a prompt's matrix products: "float32", "bfloat16" (inputs rounded to bf16, fp32 sums: the bf16
    # dot products of AVX512-BF16 / AMX on a CPU; torch attention's q, k, v too, softmax fp32) or "int8" (int8 codes of weights and activations,
    # int32 sums: AVX512-VNNI / AMX-INT8; numerics/w8a8.py); the decode step keeps its own format
    prefill_precision: str = "float32"
    # int4 / int8 weights (load's weight_bits) times int8 activations, a scale per 32 of them, with
    # integer dot products (numerics/int8_act.py, chapter 10): "auto" wherever it measured faster than
    # fp32 activations here (decode steps and prompts each), True demands it, False forbids it.
    # fp32 and bf16 weights never take it: their decode stays exact
    int8_activations: bool | str = "auto"
    # the prompt runs this many tokens per forward, each piece attending to the cached pieces before
    # it: activations scale with the chunk, not the prompt (transformers' name); None: one forward
    prefill_chunk_size: int | None = None
    # --- speculative decoding (chapter 13; vLLM's names) ---
    speculative_method: str | None = None  # None: off; "ngram": prompt lookup; "draft": generate(..., draft_model=)
    num_speculative_tokens: int = 4  # k: tokens proposed per step, checked by the target in one forward
    prompt_lookup_min: int = 1  # "ngram": the shortest n-gram matched against the text so far
    prompt_lookup_max: int = 3  # "ngram": the longest, tried first
    # --- beam search (beam.py; transformers' names) ---
    num_beams: int = 1  # beams kept per prompt; the best finished one is returned (1: no beam search)
    # a finished beam scores (sum of its log-probs) / (its new tokens ** length_penalty): > 0 favours
    # longer beams, < 0 shorter ones; needs num_beams > 1
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        ids = self.stop_token_ids
        if ids is not None:  # one id, or a list of them, stored as a tuple
            ids = (ids,) if isinstance(ids, int) and not isinstance(ids, bool) else ids
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT64_MAX for i in ids):
                raise ConfigError(f"stop_token_ids={self.stop_token_ids!r} is invalid: use a list of token ids "
                                  ">= 0 (and below 2**63, an int64) from the model's tokenizer, [] for none, "
                                  "or None for the model's eos")
            object.__setattr__(self, "stop_token_ids", tuple(ids))
        if isinstance(self.stop, (str, list)):  # one string, or a JSON list of them, stored as a tuple
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "logit_bias", logit_bias_ids(self.logit_bias))
        _check_values(self)
        _check_switches(self)
        check_combinations(self)
        object.__setattr__(self, "_checked", True)

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning a field after construction validates the whole config with the new value; any
        other name is refused (a typo such as `cfg.max_new_token = 3` would be stored and ignored)."""
        if getattr(self, "_checked", False):
            _check_keys({name: value}, source=f"an assignment (config.{name} = ...)")
            value = getattr(dataclasses.replace(self, **{name: value}), name)  # raises ConfigError
        object.__setattr__(self, name, value)

    # --- construction ---
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def replace(self, **overrides: Any) -> "GenerationConfig":
        """A copy with `overrides` applied; unknown keys raise with the closest known name."""
        _check_keys(overrides, source="keyword override")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "GenerationConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must be a JSON object of config keys, got {type(data).__name__}")
        _check_keys(data, source=source)
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "GenerationConfig":
        """Read a generation_config.json; unreadable files, malformed JSON, a key given twice, nesting
        or unknown keys raise ConfigError."""
        name = repr(os.fspath(path))
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file {name}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {name} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}): "
                              "save it as UTF-8 JSON") from None
        try:
            data = json.loads(text, object_pairs_hook=functools.partial(_unique_keys, source=name))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}. "
                              "Fix the file (keys and strings need double quotes, no trailing commas).") from None
        except RecursionError:  # json's parser recurses once per level: thousands deep is no config
            raise ConfigError(f"{name} is not a generation config: its JSON is nested thousands of levels deep. "
                              "The file must be a flat JSON object of config keys, e.g. "
                              "{\"max_new_tokens\": 64, \"quant_bits\": 4}") from None
        return cls.from_dict(data, source=name)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("stop_token_ids", "stop"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    # --- what the config switches on
    @property
    def sparse(self) -> bool:
        """True when sparse key selection changes attention (top-k, or a threshold above 0)."""
        return sparse_on(self.sparse_top_k, self.sparsity_threshold)

    def guide_spec(self) -> GuideSpec | None:
        """What structured output constrains the reply to (response_format, guided_regex or
        guided_grammar), or None when nothing does."""
        fmt = self.response_format
        if fmt is not None and fmt["type"] == "json_schema":
            return GuideSpec.json_schema(fmt["json_schema"]["schema"])
        if fmt is not None and fmt["type"] == "json_object":
            return GuideSpec("json_object", "")
        if self.guided_regex is not None:
            return GuideSpec("regex", self.guided_regex)
        if self.guided_grammar is not None:
            return GuideSpec("grammar", self.guided_grammar)
        return None

    def features(self) -> list[str]:
        """The cache features this config switches on, by their names in FEATURES."""
        return [name for name, (is_on, _) in FEATURES.items() if is_on(self)]


def resolve_config(config: GenerationConfig | dict | str | os.PathLike | None,
                   overrides: dict[str, Any]) -> GenerationConfig:
    """Turn the `config` argument of generate/perplexity plus keyword overrides into one config."""
    if config is None:
        config = GenerationConfig()
    elif isinstance(config, dict):
        config = GenerationConfig.from_dict(config)
    elif isinstance(config, (str, os.PathLike)):
        config = GenerationConfig.from_json(config)
    elif not isinstance(config, GenerationConfig):
        raise ConfigError(f"config must be a GenerationConfig, a dict or a JSON path, "
                          f"got {type(config).__name__}")
    return config.replace(**overrides) if overrides else config


def _check_keys(data: dict[str, Any], source: str) -> None:
    """Refuse a key that is no field: say where it belongs, that minigen has no such setting, or the
    closest field name."""
    known = GenerationConfig.field_names()
    for key in data:
        if key in known:
            continue
        if key in MISPLACED_KEYS:
            raise ConfigError(f"{key!r} in {source} is not a GenerationConfig setting: it belongs to "
                              f"{MISPLACED_KEYS[key]}")
        if key in TRANSFORMERS_ONLY_KEYS:
            raise ConfigError(f"{key!r} in {source} is not a minigen setting (transformers' generate has it): "
                              f"{TRANSFORMERS_ONLY_KEYS[key]}")
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} in {source}.{hint} "
                          f"Known keys: {', '.join(known)}")


def _unique_keys(pairs: list[tuple[str, Any]], source: str) -> dict[str, Any]:
    """json's object_pairs_hook: a key given twice is refused (json.loads would keep the last silently)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(f"{source} gives the key {key!r} twice ({data[key]!r}, then {value!r}): "
                              "keep one of them")
        data[key] = value
    return data


# ---------------------------------------------------------------- each value on its own
def _check_values(c: GenerationConfig) -> None:
    _check_int("max_new_tokens", c.max_new_tokens, low=0)
    _check_bool("do_sample", c.do_sample)
    _check_bool("use_cache", c.use_cache)
    t = c.temperature
    if not _is_number(t) or not (t > 0 and math.isfinite(t)):
        raise ConfigError(f"temperature={t!r} is invalid: use a finite number > 0 (1.0 leaves the "
                          "distribution as it is; set do_sample=False for greedy)")
    if c.top_k is not None:
        _check_int("top_k", c.top_k, low=1, hint="or None to keep every token")
    if c.top_p is not None and (not _is_number(c.top_p) or not 0 < c.top_p <= 1):
        raise ConfigError(f"top_p={c.top_p!r} is invalid: use a number in (0, 1], or None to keep every token")
    check_decoding(c)  # min_p, the penalties, logit_bias (decoding/settings.py)
    if c.seed is not None:
        _check_int("seed", c.seed, low=0, hint="below 2**64 (the generator's seed is 64 bits), or None")
        if c.seed > SEED_MAX:
            raise ConfigError(f"seed={c.seed!r} is invalid: use an integer >= 0 below 2**64 (the generator's "
                              "seed is 64 bits), or None")
    check_text_settings(c)
    # paged cache and offload (chapter 5)
    if c.cache_chunk_size is not None:
        _check_int("cache_chunk_size", c.cache_chunk_size, low=1,
                   hint="(tokens per block of the paged cache), or None for a contiguous cache")
    if c.prefetch_depth is not None:
        _check_int("prefetch_depth", c.prefetch_depth, low=0,
                   hint="(layers fetched ahead from the offload tier), or None to keep the cache resident")
    # window, sinks, sparse attention, heavy hitters (chapters 7-8)
    if c.window_size is not None:
        _check_int("window_size", c.window_size, low=1, hint="(tokens each query sees), or None for full attention")
    _check_int("sink_tokens", c.sink_tokens, low=0, hint="(first tokens always kept; 0 for a plain sliding window)")
    if c.window_size is not None and c.sink_tokens > c.window_size:
        raise ConfigError(f"sink_tokens={c.sink_tokens} is more than window_size={c.window_size}: use "
                          f"sink_tokens in [0, {c.window_size}] or widen the window")
    if c.sparse_top_k is not None:
        _check_int("sparse_top_k", c.sparse_top_k, low=1, hint="(keys kept per head), or None to keep every key")
    th = c.sparsity_threshold
    if th is not None and (not _is_number(th) or not 0 <= th <= 1):
        raise ConfigError(f"sparsity_threshold={th!r} is invalid: use a number in [0, 1] (a fraction of "
                          "the largest |q.k| score of the head; 0 keeps every key), or None")
    if c.sparse_score not in ("abs", "signed"):
        raise ConfigError(f"sparse_score={c.sparse_score!r} is invalid: use \"abs\" (rank keys by |q.k|, "
                          "the article's rule) or \"signed\" (by q.k, i.e. by attention probability)")
    if c.kv_budget is not None:
        _check_int("kv_budget", c.kv_budget, low=2, hint="(tokens kept by heavy-hitter eviction), or None")
    # KV quantization (chapter 6)
    if c.quant_bits is not None and (not isinstance(c.quant_bits, int) or isinstance(c.quant_bits, bool)
                                     or c.quant_bits not in (8, 4, 2)):
        raise ConfigError(f"quant_bits={c.quant_bits!r} is invalid: use the integer 8 or 4 (2 for experiments), "
                          "or None to keep the KV cache in full precision")
    _check_int("quant_group_size", c.quant_group_size, low=1, hint="(elements per scale and zero; 32 is KIVI's)")
    per_byte = 8 // c.quant_bits if c.quant_bits else 1
    if c.quant_group_size % per_byte:
        raise ConfigError(f"quant_group_size={c.quant_group_size} is invalid with quant_bits={c.quant_bits}: "
                          f"{per_byte} codes share a byte, so use a multiple of {per_byte} (e.g. 32)")
    if c.quant_key_axis not in ("channel", "token"):
        raise ConfigError(f"quant_key_axis={c.quant_key_axis!r} is invalid: use 'channel' (KIVI: one scale "
                          "per channel over a group of tokens) or 'token' (one scale per group of channels)")
    if c.quant_residual is not None:
        _check_int("quant_residual", c.quant_residual, low=c.quant_group_size,
                   hint=f"(>= quant_group_size={c.quant_group_size}: a group is quantized only once it is "
                        "full, so the full-precision window holds at least one group), or None for one group")
    # precision and compilation (chapters 9 and 11)
    if c.kv_dtype is not None and c.kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype={c.kv_dtype!r} is invalid: use one of {', '.join(map(repr, KV_DTYPES))}, "
                          "or None to store the cache in the weights' dtype")
    _check_bool("compile", c.compile)
    _check_bool("cuda_graphs", c.cuda_graphs)
    if c.fused_decode != "auto" and not isinstance(c.fused_decode, bool):
        raise ConfigError(f"fused_decode={c.fused_decode!r} is invalid: use \"auto\" (the fused C step wherever it "
                          "applies, the default), true (demand it) or false (never)")
    if c.int8_activations != "auto" and not isinstance(c.int8_activations, bool):
        raise ConfigError(f"int8_activations={c.int8_activations!r} is invalid: use \"auto\" (int8 activations for "
                          "int4/int8 weights wherever they measured faster here, the default), true (demand them) "
                          "or false (fp32 activations)")
    if c.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={c.attention_backend!r} is invalid: use \"torch\" (gather the blocks, "
                          "then torch's attention) or \"triton\" (the fused kernel of triton_attention.py)")
    if c.prefill_precision not in PREFILL_PRECISIONS:
        raise ConfigError(f"prefill_precision={c.prefill_precision!r} is invalid: use \"float32\" (the default), "
                          "\"bfloat16\" (a prompt's products with bf16 inputs and fp32 sums) or \"int8\" (int8 "
                          "weights and activations, a scale per token and per output channel), chapter 3")
    if c.prefill_chunk_size is not None:
        _check_int("prefill_chunk_size", c.prefill_chunk_size, low=1,
                   hint="(prompt tokens per forward, e.g. 512), or None to run the prompt in one forward")
    # speculative decoding (chapter 13)
    if c.speculative_method not in SPECULATIVE_METHODS:
        raise ConfigError(f"speculative_method={c.speculative_method!r} is invalid: use None (off), \"ngram\" "
                          "(prompt lookup: propose what followed the last match of the newest n-gram) or \"draft\" "
                          "(a smaller model proposes: generate(..., draft_model=...))")
    method = f" with speculative_method={c.speculative_method!r}" if c.speculative_method else ""
    _check_int("num_speculative_tokens", c.num_speculative_tokens, low=1,
               hint=f"(tokens proposed per step{method}; 4 is a common start)")
    _check_int("prompt_lookup_min", c.prompt_lookup_min, low=1, hint="(the shortest n-gram matched)")
    _check_int("prompt_lookup_max", c.prompt_lookup_max, low=1, hint="(the longest n-gram matched, tried first)")
    if c.prompt_lookup_min > c.prompt_lookup_max:
        raise ConfigError(f"prompt_lookup_min={c.prompt_lookup_min} is more than prompt_lookup_max="
                          f"{c.prompt_lookup_max}: the n-grams tried run from the max down to the min, so use "
                          f"prompt_lookup_min <= {c.prompt_lookup_max} or raise prompt_lookup_max")
    # beam search (beam.py)
    _check_int("num_beams", c.num_beams, low=1, hint="(beams kept per prompt; 1: no beam search)")
    if not _is_number(c.length_penalty) or not math.isfinite(c.length_penalty):
        raise ConfigError(f"length_penalty={c.length_penalty!r} is invalid: use a finite number (a finished beam "
                          "scores its log-probs' sum / its length ** length_penalty; 1.0 is transformers' default)")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationConfig)}


def _check_switches(c: GenerationConfig) -> None:
    for key, (switch, is_on, fix) in SWITCHES.items():
        value = getattr(c, key)
        if value != _DEFAULTS[key] and not is_on(c):
            raise ConfigError(f"{key}={value!r} has no effect without {switch}: {fix}, or leave {key} at "
                              f"its default ({_DEFAULTS[key]!r})")
