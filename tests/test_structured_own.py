"""minigen's own structured output (decoding/automaton.py, schema.py, token_mask.py) against oracles.

- The DFA against Python's re.fullmatch (hypothesis draws the strings), over UTF-8 bytes included.
- The mask is exact: on small finite languages, enumerated independently, a token is allowed exactly
  when some string of the language starts with the text plus the token (a toy vocabulary, with
  tokens that split UTF-8 characters), and the stop id exactly when the text is in the language.
- On SmolLM2's real vocabulary the mask equals a token-by-token check with the `regex` package's
  partial matching, and random walks under JSON schemas give texts that json.loads and jsonschema accept.
- What the subset does not take is a ConfigError naming the construct and pointing to llguidance.
"""

import itertools
import json
import random
import re
from types import SimpleNamespace

import jsonschema
import pytest
import regex
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigen.decoding.automaton import Dfa
from minigen.decoding.guide import GuideSpec
from minigen.decoding.schema import schema_to_regex
from minigen.decoding.token_mask import OwnGuide, allowed_reference, bytes_to_unicode, token_bytes
from minigen.errors import ConfigError, ModelLoadError
from minigen.loading import load_tokenizer, resolve_folder

pytestmark = pytest.mark.usefixtures("one_thread")  # masks are small tensors: no thread pool hand-offs

PATTERNS = [r"a|b*", r"(ab|c)+\d?", r"[a-c]{2,4}", r"x{3}", r"(a|)b{1,}", r"\w+@\w+\.com", r"[^ab]c?",
            r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", r"\s*\S", r'"([^"\\]|\\.)*"', r"(?:é|ü)+.",
            r"[\x41-\x43\u00e9-\u00eb]{1,2}", r"\(\)\[\]\{\}\.\*", r"^ab$", r"(a?){0,3}b", r"", r"ab|c[^\s\S]d"]


class ToyTokenizer:
    """The few methods token_bytes reads, over a list of byte strings written in GPT-2's byte-level
    alphabet; id 0 is the special stop token <|im_end|>."""

    def __init__(self, tokens: list[bytes]):
        table = bytes_to_unicode()
        self.pieces = ["<|im_end|>"] + ["".join(table[b] for b in t) for t in tokens]
        self.all_special_ids = [0]
        self.added_tokens_decoder = {0: SimpleNamespace(content="<|im_end|>", special=True)}

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    try:
        return load_tokenizer(resolve_folder("smollm2-135m"))
    except ModelLoadError as e:
        pytest.skip(f"SmolLM2 is not available: {e}")


# --- The automaton -----------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", PATTERNS)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_dfa_agrees_with_re_fullmatch(pattern, data):
    """Matching strings (drawn from the pattern) and arbitrary ones, across UTF-8 widths."""
    compiled = re.compile(pattern, re.ASCII)
    dfa = Dfa.from_regex(pattern)
    text = data.draw(st.one_of(st.from_regex(compiled, fullmatch=True),
                               st.text(alphabet="abcx019 .@-éü\"\\()[]{}*\u20ac\U0001F600", max_size=8)))
    assert dfa.matches(text) == bool(compiled.fullmatch(text)), text


@pytest.mark.parametrize("pattern", [".", r'[^"\\]', r"[\u0100-\uffff]", r"[^a]"])
def test_utf8_boundaries_and_invalid_bytes(pattern):
    """Code points at every UTF-8 length boundary, and byte strings that are not UTF-8."""
    dfa = Dfa.from_regex(pattern)
    for cp in (0x0, 0x0A, 0x22, 0x5C, 0x61, 0x7F, 0x80, 0xFF, 0x100, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF,
               0x10000, 0x10FFFF):
        assert dfa.matches(chr(cp)) == bool(re.fullmatch(pattern, chr(cp))), hex(cp)
    for bad in (b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xc3", b"\xe2\x82"):
        assert not dfa.matches(bad), bad  # overlong, surrogate, past U+10FFFF, stray, cut short


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_state_can_still_accept(pattern):
    """The property the mask rests on: dead states are gone, so a live state is a viable prefix."""
    dfa = Dfa.from_regex(pattern)
    for state in range(len(dfa.table)):
        seen, frontier = {state}, [state]
        while frontier and not any(dfa.accepting(s) for s in frontier):
            frontier = [t for s in frontier for t in set(dfa.table[s]) if t >= 0 and t not in seen]
            seen.update(frontier)
        assert frontier, (pattern, state)


def test_minimized_sizes():
    """One state per distinct future: "." needs its start, the accepting state and 7 UTF-8 continuations."""
    assert len(Dfa.from_regex(".").table) == 9
    assert len(Dfa.from_regex("(a|b)*abb").table) == 4  # the dragon book's example


@pytest.mark.parametrize("pattern, construct", [
    (r"(a)\1", "\\1"), (r"(?=a)a", "(?="), (r"\bword", "\\b"), (r"a*?", "lazy"), (r"a{", "'{'"),
    (r"a{3,2}", "{3,2}"), (r"[]", "empty class"), (r"(ab", "ends too early"), (r"a)", "')'"),
    (r"a^b", "'^'"), (r"*a", "nothing to repeat"), (r"(?P<n>a)", "named groups")])
def test_regex_outside_the_subset_is_refused(pattern, construct):
    with pytest.raises(ConfigError, match=re.escape(construct)) as info:
        Dfa.from_regex(pattern)
    assert "guided_regex" in str(info.value) and "llguidance" in str(info.value)


def test_empty_language_is_refused():
    with pytest.raises(ConfigError, match="matches no string"):
        Dfa.from_regex(r"[^\s\S]")


# --- The mask: exact on enumerated languages -----------------------------------------------------------

TOY_TOKENS = [b"a", b"b", b"c", b"x", b"ab", b"bc", b"abc", b"ca", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xc3\xa9x",
              b"\xc3\xbc", b"{", b"}", b'"', b"{\"", b'": ', b", ", b'", "', b"true", b"tr", b"ue", b"false}",
              b"null", b"1", b"12", b"2", b"[", b"]", b"[1", b", 2]", b":", b" ", b"zz", b"\xe2\x82\xac"]
TOY_REGEXES = [r"(ab|a)(c|bc)?", r"[abé]{1,2}x?", r"(é|ü|€)b?", r"a(bc)?a",
               r"a(bc)?|c[^\s\S]"]  # the empty class leaves a dead end after "c": the pruning removes it
def closed(schema):
    """The schema with "additionalProperties": false on every object that does not say it (the subset's rule)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: closed(sub) for name, sub in out["properties"].items()}
    if "items" in out:
        out["items"] = closed(out["items"])
    if out.get("type") == "object":
        out.setdefault("additionalProperties", False)
    return out


TOY_SCHEMAS = [closed(schema) for schema in [
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, "x", None]}},
     "required": ["a"]},
    {"type": "object", "properties": {"x": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
     "required": []},
    {"type": "array", "items": {"type": "string", "enum": ["é", "ab"]}, "minItems": 1, "maxItems": 2},
]]


def regex_language(pattern: str, alphabet: str, length: int) -> set[bytes]:
    """Every string over `alphabet` up to `length` characters that re.fullmatch accepts."""
    return {"".join(w).encode() for n in range(length + 1) for w in itertools.product(alphabet, repeat=n)
            if re.fullmatch(pattern, "".join(w))}


def schema_language(schema: dict) -> set[bytes]:
    """The JSON texts valid under a small schema, by brute force: every object over the property names
    (in schema order) or array with values from a pool, kept when jsonschema validates it."""
    pool = [True, False, None, 1, 2, "x", "é", "ab"]
    values = pool + [list(v) for n in range(3) for v in itertools.product(pool, repeat=n)]
    names = list(schema.get("properties", {}))
    if schema["type"] == "object":
        candidates = [dict(zip(keys, vals)) for n in range(len(names) + 1) for keys in itertools.combinations(names, n)
                      for vals in itertools.product(values, repeat=n)]
    else:
        candidates = values
    valid = [c for c in candidates if isinstance(c, (dict, list)) and jsonschema.Draft202012Validator(schema).is_valid(c)]
    return {json.dumps(c, ensure_ascii=False, separators=(", ", ": ")).encode() for c in valid}


def check_mask_exact(guide: OwnGuide, language: set[bytes], vocabulary: list[bytes | None]):
    """At every prefix of every string of `language`, fed byte by byte (single-byte toy tokens), the mask
    is exactly {t : some string of the language starts with prefix + t}, plus the stop id 0 exactly
    when the prefix itself is in the language."""
    single = {data: i for i, data in enumerate(vocabulary) if data is not None and len(data) == 1}
    prefixes = {w[:n] for w in language for n in range(len(w) + 1)}
    assert language and len(prefixes) > 3
    for prefix in prefixes:
        matcher = guide.matcher()
        for byte in prefix:
            matcher.advance(single[bytes([byte])])
        expected = torch.tensor([data is not None and any(w.startswith(prefix + data) for w in language)
                                 for data in vocabulary])
        expected[0] = prefix in language
        assert torch.equal(matcher.allowed(), expected), (prefix, [vocabulary[i] for i in
                                                                   (matcher.allowed() ^ expected).nonzero().flatten()])
        assert matcher.is_complete() == (prefix in language)


@pytest.mark.parametrize("pattern", TOY_REGEXES)
def test_mask_is_exact_on_finite_regexes(pattern):
    toy = ToyTokenizer(TOY_TOKENS + [bytes([b]) for b in sorted(set("abcxéü€".encode()))])
    guide = OwnGuide(GuideSpec("regex", pattern), toy, len(toy), stop_ids=[0])
    check_mask_exact(guide, regex_language(pattern, "abcxéü€", 4), token_bytes(toy))


@pytest.mark.parametrize("schema", TOY_SCHEMAS, ids=["object", "array-in-object", "array"])
def test_mask_is_exact_on_finite_schemas(schema):
    toy = ToyTokenizer(TOY_TOKENS + [bytes([b]) for b in sorted(set('"abxnulfsetr{}[]:, 12é'.encode()))])
    guide = OwnGuide(GuideSpec.json_schema(schema), toy, len(toy), stop_ids=[0])
    check_mask_exact(guide, schema_language(schema), token_bytes(toy))


# --- The mask on SmolLM2's vocabulary -------------------------------------------------------------------

SCHEMAS = [closed(schema) for schema in [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "pet": {"type": ["boolean", "null"]},
        "kind": {"enum": ["cat", "dog", 3, None]}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "ok": {"type": "boolean"}, "note": {"const": "hé \"q\""}},
        "required": ["id", "ok", "note"]}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["c"]}}, "required": ["b"]},
        "z": {"type": "null"}}, "required": ["a"]},
]]


def viable(pattern: str, data: bytes) -> bool:
    """The `regex` package's partial match: some text that fullmatches starts with `data`. An
    incomplete UTF-8 character at the end is completed with the smallest continuation bytes that
    make it a character (a lead byte E0 needs A0..BF next, F0 needs 90..BF)."""
    for cut in range(4):
        head, tail = data[:len(data) - cut], data[len(data) - cut:]
        try:
            text = head.decode()
        except UnicodeDecodeError:
            continue
        if not tail:
            return regex.fullmatch(pattern, text, partial=True) is not None
        for second in (0x80, 0x90, 0xA0):
            completed = tail + bytes([second]) + b"\x80" * 2
            for length in range(len(tail) + 1, 5):
                try:
                    char = completed[:length].decode()
                except UnicodeDecodeError:
                    continue
                if len(char) == 1 and completed[:len(tail)] == tail:
                    return regex.fullmatch(pattern, text + char, partial=True) is not None
        return False
    return False


def random_text(guide: OwnGuide, rng: random.Random, stop_ids, wander: int = 30) -> tuple[bytes, list[int]]:
    """A random walk: uniform over allowed tokens for `wander` steps, then the allowed token of at most
    two bytes that leads closest to acceptance (fewest DFA steps), then the stop id. Returns (text, ids)."""
    dfa, vocabulary = guide.dfa, guide.trie.vocabulary
    distance = {s: 0 for s in range(len(dfa.table)) if dfa.accepting(s)}  # DFA steps to a whole match
    while len(distance) < len(dfa.table):
        distance.update({s: 1 + min(distance[t] for t in set(row) if t in distance)
                         for s, row in enumerate(dfa.table) if s not in distance and any(t in distance for t in row)})
    matcher, text, ids = guide.matcher(), b"", []
    for step in range(400):
        allowed = matcher.allowed().numpy().nonzero()[0].tolist()
        assert allowed, text
        if matcher.is_complete() and (step >= wander or rng.random() < 0.1):
            matcher.advance(stop_ids[0])
            return text, ids
        if step < wander:
            token = rng.choice(allowed)
            if token in stop_ids:
                matcher.advance(token)
                return text, ids
        else:
            token = min((t for t in allowed if t not in stop_ids and len(vocabulary[t]) <= 2),  # every byte is a token
                        key=lambda t: (distance[dfa.walk(matcher.state, vocabulary[t])], rng.random()))
        matcher.advance(token)
        text += vocabulary[token]
        ids.append(token)
    raise AssertionError(f"no whole match after 400 tokens: {text!r}")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_random_walks_parse_and_validate(smollm2_tokenizer, index):
    tok, schema = smollm2_tokenizer, SCHEMAS[index]
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    guide = OwnGuide(GuideSpec.json_schema(schema), tok, 49152, stop_ids)
    rng = random.Random(index)
    for _ in range(4):
        text, _ = random_text(guide, rng, stop_ids)
        jsonschema.validate(json.loads(text.decode()), schema)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_mask_equals_partial_matching_on_smollm2(smollm2_tokenizer, index):
    """At prefixes of a random walk, the mask equals a per-token check with another regex engine."""
    tok, schema = smollm2_tokenizer, SCHEMAS[index]
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>")]
    guide = OwnGuide(GuideSpec.json_schema(schema), tok, 49152, stop_ids)
    pattern, vocabulary = schema_to_regex(GuideSpec.json_schema(schema).schema()), guide.trie.vocabulary
    text, ids = random_text(guide, random.Random(100 + index), stop_ids, wander=8)
    rng = random.Random(index)
    for n in sorted(rng.sample(range(len(ids) + 1), min(4, len(ids) + 1))):
        matcher = guide.matcher()
        for token in ids[:n]:
            matcher.advance(token)
        prefix = b"".join(vocabulary[t] for t in ids[:n])
        expected = torch.tensor([data is not None and viable(pattern, prefix + data) for data in vocabulary])
        expected[stop_ids] = regex.fullmatch(pattern, prefix.decode()) is not None
        assert torch.equal(matcher.allowed(), expected), (prefix, (matcher.allowed() ^ expected).nonzero()[:5])


@pytest.mark.parametrize("pattern", [r'"([^"\\]|\\.)*"', r"-?(0|[1-9][0-9]*)(\.[0-9]+)?", r"(é|Hello|[ \n]+)+\{?"])
def test_trie_walk_equals_walking_each_token(smollm2_tokenizer, pattern):
    """The breadth-first trie walk against the plain definition, in every DFA state, on 49152 tokens."""
    guide = OwnGuide(GuideSpec("regex", pattern), smollm2_tokenizer, 49152, stop_ids=[2])
    for state in range(len(guide.dfa.table)):
        expected = allowed_reference(guide.dfa, state, guide.trie.vocabulary)
        assert guide.trie.allowed(guide.table, state).tolist() == expected, state


def test_special_and_padding_ids_are_never_allowed(smollm2_tokenizer):
    """Special tokens only as stop ids, once the text is whole; ids past the tokenizer's never."""
    tok = smollm2_tokenizer
    guide = OwnGuide(GuideSpec("regex", r"[^0-9]*"), tok, len(tok) + 64, stop_ids=[2])
    mask = guide.matcher().allowed()
    assert mask.shape == (len(tok) + 64,) and not mask[len(tok):].any()
    assert mask[2] and not mask[[0, 1] + list(range(3, 17))].any()  # <|im_end|> is the stop; the rest special
    assert mask[tok.convert_tokens_to_ids("Hello")] and not mask[tok.convert_tokens_to_ids("1")]


def test_matcher_state_stop_and_copy(smollm2_tokenizer):
    tok = smollm2_tokenizer
    guide = OwnGuide(GuideSpec("regex", r"ab(cd)?"), tok, len(tok), stop_ids=[2])
    ab, cd = tok.convert_tokens_to_ids("ab"), tok.convert_tokens_to_ids("cd")
    matcher = guide.matcher()
    assert not matcher.allowed()[2] and not matcher.is_complete()
    with pytest.raises(ValueError, match="stop token"):
        matcher.copy().advance(2)
    matcher.advance(ab)
    fork = matcher.copy()
    fork.advance(cd)
    assert matcher.is_complete() and matcher.allowed()[cd] and fork.is_complete() and not fork.allowed()[cd]
    with pytest.raises(ValueError, match="cannot follow"):
        fork.advance(ab)
    fork.advance(2)
    assert fork.is_complete() and fork.allowed().nonzero().flatten().tolist() == [2]
    assert matcher.allowed()[cd]  # the original kept its own state


# --- Refusals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("keyword, schema", [
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}),
    ("$ref", closed({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}})),
    ("patternProperties", {"type": "object", "patternProperties": {"a": {"type": "string"}}}),
    ("additionalProperties", {"type": "object", "properties": {}, "additionalProperties": True}),
    ("additionalProperties", {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}),
    ("format", {"type": "string", "format": "date"}),
    ("pattern", {"type": "string", "pattern": "a+"}),
    ("minimum", {"type": "integer", "minimum": 3}),
    ("without 'properties'", {"type": "object"}),
    ("without 'items'", {"type": "array"}),
    ("type None", {"properties": {"a": {"type": "string"}}}),
    ("required 'b'", closed({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]})),
    ("maxLength=1", {"type": "string", "minLength": 2, "maxLength": 1}),
])
def test_schema_outside_the_subset_is_refused(keyword, schema):
    with pytest.raises(ConfigError, match=re.escape(keyword)) as info:
        schema_to_regex(schema)
    assert 'guided_backend="llguidance"' in str(info.value)


def test_an_object_must_close_its_properties():
    """JSON Schema lets any other property appear where additionalProperties is absent (llguidance
    follows it); the subset writes none, so it asks for false rather than narrow the language."""
    with pytest.raises(ConfigError, match='without "additionalProperties": false') as info:
        schema_to_regex({"type": "object", "properties": {"a": {"type": "string"}}})
    assert 'guided_backend="llguidance"' in str(info.value)


@pytest.mark.parametrize("spec, names", [(GuideSpec("json_object", "{}"), "json_object"),
                                         (GuideSpec("grammar", "start: /a+/"), "guided_grammar")])
def test_json_object_and_grammar_need_llguidance(spec, names):
    with pytest.raises(ConfigError, match=names) as info:
        OwnGuide(spec, ToyTokenizer([b"a"]), 2, stop_ids=[0])
    assert "llguidance" in str(info.value)


def test_schema_regex_layout():
    """The exact layout: ": " after a key, ", " between items, schema order, optional ones skippable."""
    schema = closed({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "array", "items": {
        "type": "boolean"}}, "c": {"type": "null"}}, "required": ["a"]})
    dfa = Dfa.from_regex(schema_to_regex(schema))
    assert dfa.matches('{"b": -10, "a": [true, false]}') and dfa.matches('{"a": [], "c": null}')
    for bad in ('{"a": [true,false]}', '{"a":[]}', '{"a": [], "b": 1}', '{ "a": []}', '{"b": 01, "a": []}', '{}'):
        assert not dfa.matches(bad), bad


def test_string_layout_is_llguidances():
    """A \\u escape only for a control or DEL, no \\/, no raw control or DEL (llguidance 1.9's JSON strings)."""
    dfa = Dfa.from_regex(schema_to_regex({"type": "string"}))
    for good in ('"é😀 \\" \\\\"', '"\\u001f\\u001F\\u007f\\n\\b"', '""'):
        assert dfa.matches(good), good
    for bad in ('"\\u00e9"', '"\\/"', '"\x7f"', '"\t"', '"\\u0020"', '"a'):
        assert not dfa.matches(bad), bad
