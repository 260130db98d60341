"""GenerationConfig: the one dataclass whose fields switch each optimization on or off.

Every field is validated in `__post_init__` with a message that names the key, the value and the
allowed range, so a typo in `generation_config.json` fails loudly before any model work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
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
