"""GenerationConfig: the one dataclass whose fields switch each optimization on or off.

Every field is validated in `__post_init__` with a message that names the key, the value and the
allowed range, so a typo in `generation_config.json` fails loudly before any model work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError


@dataclass
class GenerationConfig:
    # --- sampling (chapter 1) ---
    max_new_tokens: int = 32  # tokens to generate after the prompt
    do_sample: bool = False  # False: greedy argmax; True: sample from the tempered distribution
    temperature: float = 1.0  # logits are divided by this before sampling (> 0)
    top_k: int | None = None  # keep only the k most likely tokens before sampling; None: all
    top_p: float | None = None  # keep the smallest set whose probability mass reaches p; None: all
    seed: int | None = None  # seed of the sampling generator; None: nondeterministic
    stop_token_ids: tuple[int, ...] | None = None  # stop a sequence at these ids; None: the model's eos
    # --- the cache (chapter 2) ---
    use_cache: bool = True  # False: the naive loop that recomputes the whole sequence every step
    # --- paged cache and offload (chapter 3; checked by _check_paging) ---
    cache_chunk_size: int | None = None  # block size of the paged cache, in tokens; None: one contiguous cache
    prefetch_depth: int | None = None  # keep the KV cache in a second tier, fetch this many layers ahead; None: no tier
    # --- window, sinks and sparse attention (chapters 5-6; checked by _check_attention) ---
    window_size: int | None = None  # each query sees the window_size most recent tokens (itself included); None: all
    sink_tokens: int = 4  # the first tokens, always kept when a window is set (StreamingLLM); ignored without one
    sparse_top_k: int | None = None  # per head and query, attend only the k keys of largest |q.k|/sqrt(Dh); None: all
    sparsity_threshold: float | None = None  # keep keys whose |q.k|/sqrt(Dh) >= this x the head's max, in [0, 1]
    sparse_score: str = "abs"  # rank keys by "abs": |q.k| (the article's rule) or "signed": q.k (by probability)
    kv_budget: int | None = None  # H2O heavy hitters: tokens kept in the cache (recent + most attended); None: all
    # --- KV quantization (chapter 4; checked by _check_quant) ---
    quant_bits: int | None = None  # bits per cached key/value element: 8 or 4 (2 for experiments); None: full precision
    quant_group_size: int = 32  # elements that share one fp16 scale and zero (KIVI: 32)
    quant_key_axis: str = "channel"  # keys grouped per "channel" (over tokens, KIVI) or per "token" (over channels)
    quant_residual: int | None = None  # most recent tokens kept in full precision (>= group size); None: one group

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_bool("do_sample", self.do_sample)
        _check_bool("use_cache", self.use_cache)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature!r} is invalid: use a number > 0 "
                              "(1.0 leaves the distribution as it is; set do_sample=False for greedy)")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, low=1, hint="or None to keep every token")
        if self.top_p is not None:
            if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                    or not 0 < self.top_p <= 1:
                raise ConfigError(f"top_p={self.top_p!r} is invalid: use a number in (0, 1], "
                                  "or None to keep every token")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, int) and not isinstance(ids, bool):
                ids = (ids,)
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ConfigError(f"stop_token_ids={self.stop_token_ids!r} is invalid: use a list "
                                  "of token ids >= 0, [] for none, or None for the model's eos")
            self.stop_token_ids = tuple(ids)
        _check_attention(self)
        _check_paging(self)
        _check_quant(self)

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
        """Read a generation_config.json; malformed JSON or unknown keys raise ConfigError."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{os.fspath(path)!r} is not valid JSON: {e.msg} at line {e.lineno}, "
                              f"column {e.colno}. Fix the file (keys and strings need double quotes, "
                              "no trailing commas).") from None
        return cls.from_dict(data, source=repr(os.fspath(path)))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["stop_token_ids"] is not None:
            d["stop_token_ids"] = list(d["stop_token_ids"])
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


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
    known = GenerationConfig.field_names()
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r} in {source}.{hint} "
                              f"Known keys: {', '.join(known)}")


def _check_attention(c: GenerationConfig) -> None:
    """Validate the window / sinks / sparse / heavy-hitter fields (chapters 5-6)."""
    if c.window_size is not None:
        _check_int("window_size", c.window_size, low=1, hint="(tokens each query sees), or None for full attention")
    _check_int("sink_tokens", c.sink_tokens, low=0, hint="(first tokens always kept; 0 for a plain sliding window)")
    if c.window_size is not None and c.sink_tokens > c.window_size:
        raise ConfigError(f"sink_tokens={c.sink_tokens} is more than window_size={c.window_size}: use "
                          f"sink_tokens in [0, {c.window_size}] or widen the window")
    if c.sparse_top_k is not None:
        _check_int("sparse_top_k", c.sparse_top_k, low=1, hint="(keys kept per head), or None to keep every key")
    t = c.sparsity_threshold
    if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1):
        raise ConfigError(f"sparsity_threshold={t!r} is invalid: use a number in [0, 1] (a fraction of "
                          "the largest |q.k| score of the head; 0 keeps every key), or None")
    if c.sparse_score not in ("abs", "signed"):
        raise ConfigError(f"sparse_score={c.sparse_score!r} is invalid: use \"abs\" (rank keys by |q.k|, "
                          "the article's rule) or \"signed\" (by q.k, i.e. by attention probability)")
    if c.kv_budget is not None:
        _check_int("kv_budget", c.kv_budget, low=2, hint="(tokens kept by heavy-hitter eviction), or None")


def _check_paging(c: GenerationConfig) -> None:
    """Validate the paged-cache and offload fields (chapter 3)."""
    if c.cache_chunk_size is not None:
        _check_int("cache_chunk_size", c.cache_chunk_size, low=1,
                   hint="(tokens per block of the paged cache), or None for a contiguous cache")
    if c.prefetch_depth is not None:
        _check_int("prefetch_depth", c.prefetch_depth, low=0,
                   hint="(layers fetched ahead from the offload tier), or None to keep the cache resident")


def _check_quant(c: GenerationConfig) -> None:
    """Validate the KV quantization fields (chapter 4)."""
    if c.quant_bits is not None and (c.quant_bits not in (8, 4, 2) or isinstance(c.quant_bits, bool)):
        raise ConfigError(f"quant_bits={c.quant_bits!r} is invalid: use 8 or 4 (2 for experiments), "
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


def _check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low \
        and (high is None or value <= high)
    if not ok:
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name}={value!r} is invalid: use an integer {rng}"
                          + (f" {hint}" if hint else ""))


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is invalid: use true or false")
