"""compile_guide: the structure a config names (response_format, guided_regex, guided_grammar),
compiled once against the tokenizer by the backend it names, and shared by every row under it.

guided_backend="auto" is llguidance: it takes the full JSON Schema, regexes and Lark grammars, and
it compiles each of the 30 test schemas in under 4 ms where minigen's own automaton takes up to 87 ms
on its 22 (docs/runs/mask_cost.json, scripts/mask_cost.py: compile times, and the mask's cost per
decode step, per schema: at most 3.1% of a SmolLM2 step as the loop sees it, on a quiet Xeon). guided_backend="minigen" runs the course's own automaton (automaton.py,
schema.py, token_mask.py) on its subset, and refuses the rest by name.
"""

from __future__ import annotations

import functools

from ..errors import ConfigError
from .guidance import LlgGuide
from .guide import Guide, GuideSpec
from .token_mask import OwnGuide

BACKENDS = {"minigen": OwnGuide, "llguidance": LlgGuide}
SETTINGS = {"json_schema": "response_format", "json_object": "response_format", "regex": "guided_regex",
            "grammar": "guided_grammar"}


def text_settings(config) -> list[str]:
    """The settings of `config` that read text, so need the tokenizer (stop strings, a structure)."""
    return [k for k in ("stop", "response_format", "guided_regex", "guided_grammar") if getattr(config, k) is not None]


def require_tokenizer(config, tokenizer, call: str = "generate(model, ids, config, tokenizer=tok)") -> None:
    """ConfigError when `config` sets a text setting and no tokenizer was given: name both and the fix."""
    named = text_settings(config)
    if named and tokenizer is None:
        raise ConfigError(f"{' and '.join(named)} read the text the tokens spell, so they need the model's "
                          f"tokenizer: {call} (minigen.load returns it beside the model)")


def compile_guide(config, tokenizer, vocab_size: int, stop_ids) -> Guide | None:
    """The Guide of config.guide_spec() for this tokenizer and vocabulary, or None when the config
    names no structure. stop_ids end a row (the config's stop_token_ids or the model's eos); with
    none (stop_token_ids=[]) the tokenizer's eos ends a text that nothing may extend. Cached: the
    same spec, tokenizer and backend compile once."""
    spec = config.guide_spec()
    if spec is None:
        return None
    require_tokenizer(config, tokenizer)
    stops = tuple(int(i) for i in stop_ids) or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())
    backend = "llguidance" if config.guided_backend == "auto" else config.guided_backend
    return compiled(spec, tokenizer, vocab_size, stops, backend)


@functools.lru_cache(maxsize=32)
def compiled(spec: GuideSpec, tokenizer, vocab_size: int, stop_ids: tuple[int, ...], backend: str) -> Guide:
    """One compile per (spec, tokenizer, vocabulary, stop ids, backend); a refusal is not cached."""
    return BACKENDS[backend](spec, tokenizer, vocab_size, stop_ids)
