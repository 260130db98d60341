"""Small checks of one setting's value, shared by the validators of GenerationConfig (config.py) and
its text settings (decoding/settings.py): each raises ConfigError naming the key, the value and the range."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low \
        and (high is None or value <= high)
    if not ok:
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name}={value!r} is invalid: use an integer {rng}"
                          + (f" {hint}" if hint else ""))


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is invalid: use true or false")
