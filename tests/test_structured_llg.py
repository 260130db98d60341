"""llguidance's structured output (decoding/guidance.py) on SmolLM2's real tokenizer (49152 tokens).

Random walks: from the start of a text, take a random allowed token (seeded) until the text is
complete and a stop is drawn, or a length cap. Every completed text must parse and validate with
`jsonschema` (the 30 schemas of tests/data/schemas/) or fullmatch with Python's `re` (regexes); the
mask is never empty on the way, and the stop id is allowed exactly when the text is complete. A walk
that only took uniform draws would write strings forever (most tokens are string content), so half
of the draws pick among the allowed tokens that close something (`"`, `]`, `}`).
"""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from minigen.decoding.guidance import LlgGuide, ll_tokenizer, unpack_bits
from minigen.decoding.guide import GuideSpec
from minigen.errors import ConfigError

SCHEMAS = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))
V = 49152  # SmolLM2's vocabulary
EOS = 2  # <|im_end|>, SmolLM2-Instruct's eos
MAX_TOKENS = 160  # a walk's length cap


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2[1]


@pytest.fixture(scope="module")
def closing(tok) -> torch.Tensor:
    """bool [V]: tokens whose text holds a closing character. Byte-level BPE writes printable ASCII
    as itself in a token's name."""
    return torch.tensor([any(c in piece for c in '"]}') for piece in tok.convert_ids_to_tokens(list(range(V)))])


def walk(guide, closing, seed: int, stop_ids=(EOS,)) -> tuple[list[int], bool]:
    """One random walk: (tokens without the stop, whether the text was completed and stopped)."""
    rng = random.Random(seed)
    matcher, tokens = guide.matcher(), []
    for _ in range(MAX_TOKENS):
        allowed = matcher.allowed()
        assert allowed.shape == (V,) and allowed.dtype == torch.bool
        assert allowed.any(), f"empty mask after {tokens}"
        complete = matcher.is_complete()
        assert all(bool(allowed[i]) == complete for i in stop_ids)
        if complete and rng.random() < 0.4:
            matcher.advance(stop_ids[0])
            return tokens, True
        allowed[list(stop_ids)] = False
        pool = allowed & closing
        pool = pool if pool.any() and rng.random() < 0.5 else allowed
        if not pool.any():  # only a stop was allowed, and the draw above passed it by
            continue
        ids = pool.nonzero().flatten()
        token = int(ids[rng.randrange(len(ids))])
        matcher.advance(token)
        tokens.append(token)
    return tokens, False


def compile_schema(schema: dict, tok, stop_ids=(EOS,)) -> LlgGuide:
    return LlgGuide(GuideSpec.json_schema(schema), tok, V, stop_ids)


def test_schema_corpus_is_thirty_valid_schemas_each_marked():
    """30 files, each a valid JSON Schema (draft 2020-12) that says whether it is in minigen's
    subset; a subset file states additionalProperties false on every object (its README's rule)."""
    assert len(SCHEMAS) == 30
    for path in SCHEMAS:
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        comment = schema["$comment"]
        assert comment.startswith(("In minigen's subset.", "Outside minigen's subset (")), path.name
        if comment.startswith("In minigen's subset."):
            for sub in objects_in(schema):
                assert sub.get("additionalProperties") is False, (path.name, sub)


def objects_in(schema):
    """Every object schema inside `schema` (properties, items, nested)."""
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            yield schema
        for key in ("properties", "$defs"):
            for sub in schema.get(key, {}).values():
                yield from objects_in(sub)
        if isinstance(schema.get("items"), dict):
            yield from objects_in(schema["items"])


@pytest.mark.parametrize("path", SCHEMAS, ids=[p.stem for p in SCHEMAS])
def test_random_walks_parse_and_validate(path, tok, closing):
    schema = json.loads(path.read_text())
    guide = compile_schema(schema, tok)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    completed = 0
    for seed in range(4):
        tokens, done = walk(guide, closing, seed)
        if done:
            completed += 1
            text = tok.decode(tokens)
            validator.validate(json.loads(text))
    assert completed >= 2, f"{path.name}: only {completed} of 4 walks completed within {MAX_TOKENS} tokens"


@pytest.mark.slow
@pytest.mark.parametrize("path", SCHEMAS, ids=[p.stem for p in SCHEMAS])
def test_many_random_walks_parse_and_validate(path, tok, closing):
    schema = json.loads(path.read_text())
    guide = compile_schema(schema, tok)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    for seed in range(100, 120):
        tokens, done = walk(guide, closing, seed)
        if done:
            validator.validate(json.loads(tok.decode(tokens)))


REGEXES = [r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)",
           r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?", r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}",
           r"\([0-9]{1,2}, [0-9]{1,2}\)", r"[0-9]{2}/[0-9]{2}"]  # a slash: Lark writes regexes in /.../


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_walks_fullmatch(regex, tok, closing):
    guide = LlgGuide(GuideSpec("regex", regex), tok, V, (EOS,))
    completed = 0
    for seed in range(6):
        tokens, done = walk(guide, closing, seed)
        if done:
            completed += 1
            assert re.fullmatch(regex, tok.decode(tokens)), (regex, tok.decode(tokens))
    assert completed >= 3


ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""


def test_grammar_walks_are_arithmetic(tok, closing):
    """A Lark grammar (guided_grammar): every completed text is a sum of numbers and brackets."""
    guide = LlgGuide(GuideSpec("grammar", ARITHMETIC), tok, V, (EOS,))
    completed = 0
    for seed in range(8):
        tokens, done = walk(guide, closing, seed)
        if done:
            completed += 1
            text = tok.decode(tokens)
            tree = ast.parse(text, mode="eval")  # SyntaxError: not an expression
            allowed_nodes = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Constant)
            assert all(isinstance(n, allowed_nodes) for n in ast.walk(tree)), text
            assert re.fullmatch(r"[0-9+\-()]+", text), text
    assert completed >= 4


def test_json_object_walks_are_objects(tok, closing):
    guide = LlgGuide(GuideSpec("json_object", ""), tok, V, (EOS,))
    for seed in range(4):
        tokens, done = walk(guide, closing, seed)
        if done:
            assert isinstance(json.loads(tok.decode(tokens)), dict)


def accepts(guide, tok, text: str) -> bool:
    """Whether `text`, tokenized as the tokenizer does, is a whole match: each token allowed in turn."""
    matcher = guide.matcher()
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.allowed()[token]:
            return False
        matcher.advance(token)
    return matcher.is_complete()


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.mark.parametrize("text, valid", [
    ('{"name": "a", "age": 1}', True),
    ('{"name":"a","age":1}', False),  # no free whitespace: exactly ": " and ", "
    ('{"name": "a" , "age": 1}', False),
    ('{ "name": "a", "age": 1 }', False),
    ('{"age": 1, "name": "a"}', False),  # properties in the schema's order, whatever required says
    ('{"name": "a", "age": 1, "x": [true]}', True),  # additionalProperties absent: true
    ('{"x": 2, "name": "a", "age": 1}', False),  # ... but only after the listed properties
    ('{"name": "a", "name": "b", "age": 1}', False),
    ('{"name": "\\u00e9", "age": 1}', False),  # \u only for control characters
    ('{"name": "é\\n\\t\\"", "age": -0}', True),
    ('{"name": "\\/", "age": 1}', False),
    ('{"name": "a", "age": 01}', False),
])
def test_json_layout_order_and_additional_properties(text, valid, tok):
    """What the module docstring says llguidance does with a JSON schema."""
    assert accepts(compile_schema(PERSON, tok), tok, text) == valid


def test_enum_strings_take_any_escape_spelling(tok):
    """Unlike minigen's own backend (json.dumps' one spelling): the module docstring says so."""
    guide = compile_schema({"enum": ["foo\nbar"]}, tok)
    assert accepts(guide, tok, '"foo\\nbar"') and accepts(guide, tok, '"foo\\u000abar"')


def test_forced_text_allows_every_tokenization(tok):
    """Where the schema forces `{"name": "`, every token that spells a piece of it is allowed ('{'
    as well as '{"'), not only the tokenizer's own tokenization (llguidance's default, which
    guidance.NO_FORCING turns off): the mask is exactly the tokens that keep a valid prefix."""
    forced = '{"name": "'
    allowed = compile_schema(PERSON, tok).matcher().allowed()
    pieces = tok.batch_decode([[i] for i in range(V)])
    prefixes = {i for i, piece in enumerate(pieces) if piece and forced.startswith(piece)}
    assert len(prefixes) >= 2 and all(allowed[i] for i in prefixes)  # "{" and "{\"" in SmolLM2
    assert all(forced.startswith(pieces[i]) or pieces[i].startswith(forced) for i in allowed.nonzero().flatten().tolist())


def test_a_grammar_cannot_turn_forcing_back_on(tok):
    grammar = '%llguidance {"no_forcing": false}\nstart: "April"'
    allowed = LlgGuide(GuideSpec("grammar", grammar), tok, V, (EOS,)).matcher().allowed()
    assert {tok.decode([i]) for i in allowed.nonzero().flatten().tolist()} >= {"A", "Ap", "April"}


def test_additional_properties_false_refuses_others(tok):
    guide = compile_schema({**PERSON, "additionalProperties": False}, tok)
    assert accepts(guide, tok, '{"name": "a", "age": 1}')
    assert not accepts(guide, tok, '{"name": "a", "age": 1, "x": 2}')


def test_schema_key_order_survives_the_spec(tok):
    """GuideSpec keeps the order of "properties": "z" before "a" here."""
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"}},
              "required": ["a", "z"], "additionalProperties": False}
    guide = compile_schema(schema, tok)
    assert accepts(guide, tok, '{"z": 1, "a": 2}')
    assert not accepts(guide, tok, '{"a": 2, "z": 1}')


def test_stop_ids_replace_llguidance_eos(tok):
    """A config's own stop ids (here 13 and 7) are allowed exactly at completion; the tokenizer's
    eos is then an ordinary special token, never allowed."""
    guide = compile_schema({"enum": ["ab"]}, tok, stop_ids=(13, 7))
    matcher = guide.matcher()
    assert not matcher.allowed()[[13, 7, EOS]].any()
    for token in tok.encode('"ab"', add_special_tokens=False):
        matcher.advance(token)
    allowed = matcher.allowed()
    assert matcher.is_complete() and allowed[13] and allowed[7] and not allowed[EOS]
    assert allowed.sum() == 2  # "ab" is over: nothing else may follow
    matcher.advance(7)
    allowed = matcher.allowed()  # a finished row: only more stops
    assert matcher.is_complete() and allowed[13] and allowed[7] and allowed.sum() == 2
    matcher.advance(13)
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(tok.encode("a", add_special_tokens=False)[0])


def test_no_stop_ids_end_at_the_tokenizers_eos(tok):
    """stop_token_ids=[]: a text nothing may extend still has an allowed token, the eos."""
    matcher = compile_schema({"enum": ["ab"]}, tok, stop_ids=()).matcher()
    for token in tok.encode('"ab"', add_special_tokens=False):
        matcher.advance(token)
    assert matcher.allowed().nonzero().flatten().tolist() == [EOS]


def test_padding_rows_of_the_vocabulary_are_never_allowed(tok):
    """A model's vocabulary may be larger than its tokenizer's (padded embedding rows)."""
    guide = LlgGuide(GuideSpec("regex", "[a-z]+"), tok, V + 64, (EOS,))
    allowed = guide.matcher().allowed()
    assert allowed.shape == (V + 64,) and allowed[:V].any() and not allowed[V:].any()


def test_copy_is_independent(tok):
    guide = compile_schema(PERSON, tok)
    matcher = guide.matcher()
    for token in tok.encode('{"name": "', add_special_tokens=False):
        matcher.advance(token)
    twin = matcher.copy()
    before = matcher.allowed()
    for token in tok.encode('a", "age": 5}', add_special_tokens=False):
        twin.advance(token)
    assert twin.is_complete() and not matcher.is_complete()
    assert torch.equal(matcher.allowed(), before)


def test_a_token_the_mask_refuses_raises(tok):
    matcher = compile_schema(PERSON, tok).matcher()
    token = tok.encode("hello", add_special_tokens=False)[0]
    assert not matcher.allowed()[token]
    with pytest.raises(ValueError, match=f"token {token} is not allowed"):
        matcher.advance(token)


@pytest.mark.parametrize("spec, setting, message", [
    (GuideSpec.json_schema({"type": "bogus"}), "response_format", "bogus"),
    (GuideSpec.json_schema({"type": "integer", "not": {"const": 3}}), "response_format", "Unimplemented keys"),
    (GuideSpec.json_schema({"type": "string", "pattern": "(("}), "response_format", "unclosed group"),
    (GuideSpec("json_schema", "[1, 2]"), "response_format", "schema"),
    (GuideSpec("regex", "a(b"), "guided_regex", "unclosed group"),
    (GuideSpec("grammar", "start: foo"), "guided_grammar", "foo"),
    (GuideSpec("grammar", "start: /a(/"), "guided_grammar", "regex"),
])
def test_bad_specs_are_config_errors_naming_the_setting(spec, setting, message, tok):
    with pytest.raises(ConfigError, match=setting) as info:
        LlgGuide(spec, tok, V, (EOS,))
    assert message in str(info.value)


def test_the_ll_tokenizer_is_built_once_per_tokenizer(tok):
    assert ll_tokenizer(tok) is ll_tokenizer(tok)
    assert ll_tokenizer(tok).vocab_size == V and ll_tokenizer(tok).eos_tokens == [EOS]


def test_unpack_bits_equals_the_bit_by_bit_reading():
    """Bit j of int32 word i is token 32*i + j (llguidance's layout, little-endian)."""
    words = np.random.default_rng(0).integers(-2**31, 2**31, size=5, dtype=np.int64).astype(np.int32)
    expected = np.array([bool((int(words[t // 32]) >> (t % 32)) & 1) for t in range(160)] + [False] * 10)
    assert np.array_equal(unpack_bits(words, 170), expected)  # tokens past the bitmask: never allowed
    assert np.array_equal(unpack_bits(words, 100), expected[:100])
