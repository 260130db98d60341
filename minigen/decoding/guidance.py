"""Structured output with llguidance: the full JSON Schema, regular expressions and Lark grammars.

llguidance (github.com/guidance-ai/llguidance, the library behind llama.cpp's, vLLM's and SGLang's
structured output) compiles a spec into an Earley parser over a lexer of lazy regex automata, walks
the tokenizer's token trie against it, and writes the allowed tokens as a bitmask: one bit per token,
32 tokens per int32 word. This module adapts it to guide.py's interface: `LlgGuide` compiles once per
spec and tokenizer, each row holds an `LlgMatcher`, and `allowed()` unpacks the bitmask into the
bool [V] mask every backend returns.

What llguidance 1.9 does with a JSON schema (checked in tests/test_structured_llg.py):
- whitespace: with JSON_OPTIONS none at all, except exactly ": " after a key and ", " between items
  (the language schema.py produces for minigen's own subset, so the two masks can be compared);
- property order: the schema's `properties` order, whatever `required` lists; an optional property
  may be left out, never moved; a repeated key is refused;
- additionalProperties: absent means JSON Schema's default, true: any other key may follow the
  listed ones (never before them). minigen's own subset treats absent as false, so a schema that
  both backends must read alike states "additionalProperties": false;
- strings: any character but `"`, `\\`, U+0000..U+001F and U+007F, written raw; the escapes \\" \\\\ \\b
  \\f \\n \\r \\t, and \\u00XX only for those control characters (not "\\u00e9", not "\\/": JSON
  allows both, llguidance 1.9 cannot be told to; its json_allow_general_unicode_escapes option
  adds every \\u escape but a lone surrogate, never "\\/");
- enum and const strings: any spelling its strings allow ("foo\\u000abar" as well as "foo\\nbar"),
  where minigen's own backend writes json.dumps' one spelling (the only mask difference found on the
  subset schemas of tests/data/schemas);
- forced text: with NO_FORCING, every tokenization of it (below);
- keywords it does not implement (not, if/then/else, uniqueItems, dependentRequired) are an error,
  which LlgGuide turns into a ConfigError naming the setting, with llguidance's message.

Stop tokens: llguidance knows one EOS set, the tokenizer's, fixed when the LLTokenizer is built (it
is slow to build, so it is built once per tokenizer object and cached). A generation stops at its own
stop ids (stop_token_ids, or the model's eos). So `allowed()` clears llguidance's EOS bits and sets
the row's stop ids exactly when llguidance says the text is accepting; `advance(stop id)` ends the
text without feeding llguidance, and after it only stop ids are allowed (a batch may keep stepping a
finished row; its mask is never empty). A stop id that is also an ordinary token of the grammar is
only allowed where the text is complete. With no stop ids (stop_token_ids=[]) the tokenizer's eos
ends the text, so that a text nothing may extend still has an allowed token.
"""

from __future__ import annotations

import json
import re
import time
import weakref

import llguidance
import llguidance.hf
import numpy as np
import torch

from minigen.decoding.guide import GuideSpec
from minigen.errors import ConfigError

# The GenerationConfig setting each spec kind comes from, named in every ConfigError.
SETTING = {"json_schema": "response_format", "json_object": "response_format",
           "regex": "guided_regex", "grammar": "guided_grammar"}

# What each setting takes, for the fix in an error message.
JSON_SCHEMA_DOC = "github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md"
SYNTAX = {"json_schema": f"a JSON schema of the keywords llguidance implements ({JSON_SCHEMA_DOC})",
          "json_object": f"a JSON schema of the keywords llguidance implements ({JSON_SCHEMA_DOC})",
          "regex": "a regex in Rust's regex syntax (docs.rs/regex/latest/regex/#syntax)",
          "grammar": "a Lark grammar (github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)"}

# Appended to every grammar. Where the grammar forces the next bytes (`{"name": "` at the start of
# the schema's object), llguidance by default allows only the first token of the tokenizer's own
# tokenization of them ('{"', not '{'); no_forcing makes the mask every token that keeps the text a
# valid prefix: the model's distribution restricted to valid texts, and the mask minigen's own
# backend computes. A grammar's own `%llguidance {"no_forcing": false}` comes first and loses.
NO_FORCING = '\n%llguidance {"no_forcing": true}\n'

# No free whitespace: exactly ": " after a key and ", " between items (OpenAI's and json.dumps'
# separators), set as the schema's "x-guidance" over any it has: a schema cannot change the language.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

# One LLTokenizer per tokenizer object (0.3 to 1 s to build for SmolLM2's 49152 tokens); weak keys, so a
# tokenizer that is dropped takes its LLTokenizer with it.
LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ll_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (its token bytes and trie), cached."""
    cached = LL_TOKENIZERS.get(tokenizer)
    if cached is None:
        try:
            cached = llguidance.hf.from_tokenizer(tokenizer)
        except ValueError as e:  # "Only fast tokenizers are supported"
            raise ConfigError(f"guided_backend='llguidance' needs a Hugging Face fast tokenizer: {e}. "
                              "Use guided_backend='minigen' (a JSON-schema subset and regular expressions) "
                              "or load the model's tokenizer.json") from None
        LL_TOKENIZERS[tokenizer] = cached
    return cached


def grammar_text(spec: GuideSpec) -> str:
    """The spec as a Lark grammar for llguidance (not yet checked: LLMatcher checks it), with
    forcing off (NO_FORCING). A JSON schema is embedded with %json, its x-guidance set to JSON_OPTIONS."""
    if spec.kind in ("json_schema", "json_object"):
        try:
            schema = spec.schema()
        except ValueError as e:  # not JSON at all
            raise ConfigError(f"response_format's schema is not JSON ({e}): pass a JSON schema object") from None
        if not isinstance(schema, dict) or not isinstance(schema.get("x-guidance", {}), dict):
            raise ConfigError(f"response_format's schema={shorten(spec.source)} is invalid: pass a JSON schema "
                              "object: {'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        options = {**schema.get("x-guidance", {}), **JSON_OPTIONS}  # ours win: the language is fixed
        return "start: %json " + json.dumps({**schema, "x-guidance": options}) + NO_FORCING
    if spec.kind == "regex":
        return "start: /" + llguidance.regex_to_lark(spec.source) + "/" + NO_FORCING
    if spec.kind == "grammar":
        return spec.source + NO_FORCING  # appended, so that an error's line numbers are the user's
    raise ConfigError(f"GuideSpec kind={spec.kind!r} is invalid: use one of {sorted(SETTING)}")


def llguidance_error(kind: str, error: str) -> str:
    """llguidance's message about a spec, on one line, without what refers to minigen's wrapper: for a
    schema or a regex the position and the source excerpt (they point into `start: %json ...`), for
    a grammar the excerpt's NO_FORCING line."""
    if kind == "grammar":
        error = re.sub(r"\n *\d+ \| %llguidance .*", "", error)
    else:
        error = re.sub(r"^at \d+\(\d+\): ", "", error.split("\n   1 | ")[0])
    return " ".join(error.split())  # one line, as every ConfigError: the caret drawings' lines joined


def unpack_bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [ceil(N/32)] bitmask (bit j of word i = token 32*i+j) -> bool [vocab_size], the tokens
    past the bitmask False. numpy's unpackbits on the little-endian bytes: tens of microseconds for
    49152 tokens; numpy, not torch, because a small torch op can wait milliseconds on its thread pool."""
    n = min(vocab_size, 32 * words.size)
    bits = np.unpackbits(words.view(np.uint8), count=n, bitorder="little").view(bool)  # 0/1 bytes: valid bools
    if n == vocab_size:
        return bits
    return np.concatenate([bits, np.zeros(vocab_size - n, dtype=bool)])


class LlgMatcher:
    """One row's text under an LlgGuide: llguidance's matcher plus the row's stop state."""

    def __init__(self, guide: "LlgGuide", matcher: llguidance.LLMatcher):
        self.guide = guide
        self.matcher = matcher
        self.stopped = False  # a stop id was taken: the text is over
        self.words = np.zeros((guide.ll_tokenizer.vocab_size + 31) // 32, dtype=np.int32)  # bitmask buffer

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: llguidance's mask without its EOS, plus the stop ids when complete."""
        g = self.guide
        if self.stopped:  # only more stops: a batch may step a finished row, and a mask is never empty
            allowed = np.zeros(g.vocab_size, dtype=bool)
        else:
            # llguidance writes the bitmask straight into the row's buffer (it checks the size)
            self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
            allowed = unpack_bits(self.words, g.vocab_size)
            allowed[g.ll_eos] = False
        allowed[g.stop_ids] = self.is_complete()
        return torch.from_numpy(allowed)  # a fresh array each call: the caller may keep or change it

    def advance(self, token: int) -> None:
        """Take a sampled token; a stop id ends the text (llguidance never sees it)."""
        if token in self.guide.stop_set and self.is_complete():
            self.stopped = True
            return
        if self.stopped or not self.matcher.consume_token(token):
            raise ValueError(f"token {token} is not allowed here by the {self.guide.spec.kind} guide "
                             f"(llguidance: {self.matcher.get_error() or 'the text is over'}); sample from allowed()")

    def is_complete(self) -> bool:
        return self.stopped or self.matcher.is_accepting()

    def copy(self) -> "LlgMatcher":
        twin = LlgMatcher(self.guide, self.matcher.deep_copy())
        twin.stopped = self.stopped
        return twin


class LlgGuide:
    """A GuideSpec compiled by llguidance against one tokenizer; rows share it (guide.py's Guide).

    vocab_size: the model's vocabulary (embedding rows), which may exceed the tokenizer's; stop_ids:
    the ids that end a row (the config's stop_token_ids, or the model's eos)."""
    backend = "llguidance"

    def __init__(self, spec: GuideSpec, tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
        self.spec = spec
        self.vocab_size = vocab_size
        self.ll_tokenizer = ll_tokenizer(tokenizer)
        self.ll_eos = np.array([i for i in self.ll_tokenizer.eos_tokens if i < vocab_size], dtype=np.int64)
        # stop_token_ids=[] (never stop) still needs an end for a text that nothing may extend
        # (`{"a": 1}`): the tokenizer's eos, else that row's mask would be empty
        ids = [int(i) for i in stop_ids if 0 <= i < vocab_size] or self.ll_eos.tolist()
        self.stop_ids = np.array(ids, dtype=np.int64)
        self.stop_set = frozenset(ids)
        start = time.perf_counter()
        # log_level=0: a bad spec is reported through is_error(), not printed to stderr
        self.start = llguidance.LLMatcher(self.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar_text(spec)),
                                          log_level=0)
        self.compile_s = time.perf_counter() - start
        if self.start.is_error():
            setting = SETTING[spec.kind]
            raise ConfigError(f"{setting}={shorten(spec.source)} cannot be compiled by llguidance: "
                              f"{llguidance_error(spec.kind, self.start.get_error())}. Pass {SYNTAX[spec.kind]}")

    def matcher(self) -> LlgMatcher:
        """A fresh row: a copy of the compiled start state (copies share the compiled grammar)."""
        return LlgMatcher(self, self.start.deep_copy())


def shorten(text: str, limit: int = 80) -> str:
    """A spec's source for an error message: repr, cut to `limit` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
