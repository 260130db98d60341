"""The settings that read text, checked when a GenerationConfig is built (config.py calls
check_text_settings): stop strings, and what structured output constrains a reply to
(response_format, guided_regex, guided_grammar) and who compiles it (guided_backend). Each refusal is
a ConfigError naming the key, the value and what to write instead."""

from __future__ import annotations

from ..errors import ConfigError

MAX_STOP_STRINGS = 4  # OpenAI's limit, and vLLM's
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
GUIDED_BACKENDS = ("auto", "minigen", "llguidance")
_FORMAT_SHAPE = ('{"type": "json_schema", "json_schema": {"name": "reply", "schema": {"type": "object", ...}}}, '
                 '{"type": "json_object"} or {"type": "text"}')


def check_text_settings(c) -> None:
    """stop, response_format, guided_regex, guided_grammar and guided_backend (chapter 2b)."""
    if c.stop is not None:
        if not isinstance(c.stop, tuple) or not all(isinstance(s, str) for s in c.stop):
            raise ConfigError(f"stop={c.stop!r} is invalid: use a string or a list of up to {MAX_STOP_STRINGS} "
                              "strings, or None for no stop strings")
        if not 1 <= len(c.stop) <= MAX_STOP_STRINGS or not all(c.stop):
            raise ConfigError(f"stop={list(c.stop)!r} is invalid: use 1 to {MAX_STOP_STRINGS} non-empty strings "
                              "(an empty string would match before any text), or None for no stop strings")
    fmt = c.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in RESPONSE_FORMATS:
            raise ConfigError(f"response_format={fmt!r} is invalid: use {_FORMAT_SHAPE}, or None")
        extra = set(fmt) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
        inner = fmt.get("json_schema")
        if extra or (kind == "json_schema" and not (isinstance(inner, dict) and isinstance(inner.get("schema"), dict))):
            raise ConfigError(f"response_format={fmt!r} is invalid: a json_schema format holds its schema under "
                              f"json_schema.schema (OpenAI's shape), and no other keys: use {_FORMAT_SHAPE}")
        if kind == "text":  # no constraint, stored as None so that nothing downstream asks twice
            object.__setattr__(c, "response_format", None)
    for key in ("guided_regex", "guided_grammar"):
        value = getattr(c, key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{key}={value!r} is invalid: use a non-empty string, or None")
    named = [k for k in ("response_format", "guided_regex", "guided_grammar") if getattr(c, k) is not None]
    if len(named) > 1:
        raise ConfigError(f"{' and '.join(named)} are both set: a reply follows one structure. Keep one of them")
    if c.guided_backend not in GUIDED_BACKENDS:
        raise ConfigError(f"guided_backend={c.guided_backend!r} is invalid: use \"auto\" (minigen's own automaton "
                          "where the spec is in its subset, else llguidance), \"minigen\" or \"llguidance\"")
