"""What structured output constrains a row to, and the interface both of its backends share.

A `GuideSpec` says what the text must match: a JSON schema (OpenAI's response_format), any JSON
object, a regular expression (vLLM's guided_regex) or a grammar (guided_grammar, Lark syntax). A
backend compiles it once against the tokenizer into a `Guide` (minigen's own automaton,
token_mask.py, for a subset of JSON Schema and regular expressions; llguidance for the full
languages, guidance.py); each row that generates under it holds its own `Matcher`, the state of one
text. Before every sample the row's logits outside `Matcher.allowed()` become -inf: the model's own
distribution restricted to the tokens that keep the text a valid prefix (chapter "Decoding").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

import torch

GUIDE_KINDS = ("json_schema", "json_object", "regex", "grammar")


@dataclass(frozen=True)
class GuideSpec:
    """What a row's text must match. `source`: the schema as JSON text (its keys in their order: an
    object's properties are written in the schema's order), the regex or the grammar; hashable, so a
    compiled Guide can be cached per spec."""
    kind: str  # one of GUIDE_KINDS
    source: str

    @classmethod
    def json_schema(cls, schema: dict) -> "GuideSpec":
        return cls("json_schema", json.dumps(schema))

    def schema(self) -> dict:
        """The JSON schema of a "json_schema" spec ({"type": "object"} for "json_object")."""
        return json.loads(self.source) if self.kind == "json_schema" else {"type": "object"}


class Matcher(Protocol):
    """One row's state under a Guide: which tokens may come next, and the tokens taken so far."""

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens after which the text is still a valid prefix; the stop ids
        too, exactly when the text so far is a whole match. Ids past the tokenizer's are never allowed."""

    def advance(self, token: int) -> None:
        """Take a sampled token (one that allowed() allowed); a stop id ends the text."""

    def is_complete(self) -> bool:
        """The text so far is a whole match (a stop token may come next)."""

    def copy(self) -> "Matcher":
        """An independent copy (speculative proposals, beams, parallel samples)."""


class Guide(Protocol):
    """A spec compiled against one tokenizer: shared by every row that generates under it."""
    backend: str  # "minigen" or "llguidance"
    compile_s: float  # seconds the compile took

    def matcher(self) -> Matcher:
        """A fresh Matcher at the start of a text."""
