"""Structured output and stop strings through generate and the Engine, on SmolLM2 itself (issue 44).

The decoding tests walk the masks alone (test_structured_own.py, test_structured_llg.py); here the
model writes. A chat prompt asks for JSON following each of the 30 schemas of tests/data/schemas/;
every reply, greedy and sampled, must end (a stop token, which the mask allows only once the JSON
is complete), parse with json.loads and validate with jsonschema. On minigen's subset both backends
give the same greedy tokens. The corpus's runs are requests of one Engine (Corpus: each writes what
generate writes alone, and together they share the prompts' few-shot blocks and each step's weights).
Then: rows of different schemas never influence each other (the Engine, a ragged batch); every step
kind (fused, eager, speculative, paged) writes the same greedy tokens under a mask; stop strings cut
the text across token boundaries.

The prompt shows the model two answered requests first (an object and a bare number): without them
SmolLM2-135M, asked for a bare number, writes digits until max_new_tokens (the mask allows the stop
token after every digit, but the model would rather write another; test_a_model_may_not_stop pins
that). Three schemas get a sentence of task too (TASKS): without one, greedy writes
`{"id": 1234567890123...` (23) and `{"foo": {"foo": {"foo": ...` (29) forever, and the first
sampled row of 08 a number of hundreds of digits (measured, 256 new tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

import minigen
from conftest import skip_where_aside
from minigen.decoding.guidance import LlgGuide
from minigen.decoding.guide import GuideSpec
from minigen.serving.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMAS = sorted((Path(__file__).parent / "data" / "schemas").glob("*.json"))
SUBSET = [p for p in SCHEMAS if json.loads(p.read_text())["$comment"].startswith("In minigen's subset")]
# Unmarked: a representative few (an object, a bare number; prefixItems and $ref for llguidance only);
# the other schemas are slow (all of them: the corpus's Engine takes minutes on a two-core CPU)
FAST = {"01_person.json", "17_top_scalar.json", "30_jsts_prefix_items_ref.json"}
MAX_NEW = 256  # the longest reply measured needs 73 tokens (29, sampled; 26_pattern_format's UUID: 70)
EOS = 2  # <|im_end|>: SmolLM2-Instruct's eos, the row's stop token
SEED = 0
SHOTS = [({"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
           "required": ["city", "population"]}, '{"city": "Paris", "population": 2100000}'),
         ({"type": "number"}, "4.5")]
TASKS = {"08_array_bounds.json": "List three test scores.", "23_anyof.json": "Give the id of order 417.",
         "29_jsts_ref_root.json": 'The value of foo is the string "bar".'}


def params(paths):
    return [pytest.param(p, id=p.stem, marks=() if p.name in FAST else pytest.mark.slow) for p in paths]


def schema_of(path: Path) -> dict:
    return json.loads(path.read_text())


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


def ask(schema: dict, task: str = "") -> str:
    shown = {k: v for k, v in schema.items() if k != "$comment"}  # the test's note is not the model's business
    return (task + " " if task else "") + "Reply with JSON only, following this JSON schema: " + json.dumps(shown)


def chat_ids(tok, schema: dict, task: str = "") -> torch.Tensor:
    """[1, T]: the two answered requests, then this schema's request, in SmolLM2's chat template."""
    messages = []
    for shot, answer in SHOTS:
        messages += [{"role": "user", "content": ask(shot)}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": ask(schema, task)})
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return ids if isinstance(ids, torch.Tensor) else ids["input_ids"]


def reply_lengths(tokens: torch.Tensor, prompt_len: int) -> list[int]:
    """Each row's new tokens up to and including its stop; MAX_NEW + 1 for a row that never stopped."""
    out = []
    for row in tokens[:, prompt_len:].tolist():
        out.append(row.index(EOS) + 1 if EOS in row else MAX_NEW + 1)
    return out


def check_replies(out, prompt_len: int, schema: dict, label: str) -> list[int]:
    """Every row ended with the stop (not cut by MAX_NEW), and its text parses and validates."""
    lengths = reply_lengths(out.tokens, prompt_len)
    for r, (n, text) in enumerate(zip(lengths, out.texts)):
        assert n <= MAX_NEW, f"{label} row {r}: cut by max_new_tokens={MAX_NEW}, no stop: {text[:120]!r}..."
        jsonschema.validate(json.loads(text), schema)
    return lengths


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2


CORPUS_TESTS = {  # the corpus's tests -> the backends each reads
    "test_llguidance_replies_parse_and_validate": ("llguidance",),
    "test_minigen_replies_parse_and_validate": ("minigen",),
    "test_backends_write_the_same_greedy_tokens": ("minigen", "llguidance"),
}
CORPUS_BATCH = 16  # rows of the corpus's Engine a step
CORPUS_CHUNK = 256  # prompt tokens a step (max_num_batched_tokens): later prompts find the few-shot blocks cached
# The first corpus test to run sets the Engine up for all of them, inside its time limit (pytest-timeout
# counts fixture setup): 268-284 s on one thread of a two-core AMD EPYC Zen 1, 442-485 s with both cores busy
CORPUS_TIMEOUT = 1200


def corpus_keys(items) -> list[tuple[str, str, bool]]:
    """(schema file, backend, sampled) of every corpus run that the session's selected items of this module
    read (the backends' comparison: both greedy runs), in a fixed order: -m "not slow" runs only FAST's."""
    keys = set()
    for item in items:
        backends = CORPUS_TESTS.get(getattr(item, "originalname", ""))
        if backends is None or item.module.__name__ != __name__:
            continue
        params = item.callspec.params
        keys |= {(params["path"].name, b, params.get("sampled", False)) for b in backends}
    return sorted(keys)


class Corpus:
    """The corpus's runs, all in one Engine on first use (continuous batching, the prompts' shared few-shot
    blocks from its prefix cache): run r of a sampled request is its own request with seed SEED + r, as
    generate's three rows with seed=SEED are, and the Engine writes each request's tokens as generate does
    alone (tests/test_engine.py; for these prompts the same tokens were checked on 01, 08, 23 and 29, greedy
    and sampled)."""

    def __init__(self, model, tok, keys):
        self.done = {}
        engine = Engine(model, tokenizer=tok, max_batch_size=CORPUS_BATCH, max_num_batched_tokens=CORPUS_CHUNK)
        ids = {}
        for name, backend, sampled in keys:
            schema = schema_of(Path(__file__).parent / "data" / "schemas" / name)
            prompt = chat_ids(tok, schema, TASKS.get(name, ""))[0]
            settings = dict(response_format=response_format(schema), guided_backend=backend, max_new_tokens=MAX_NEW)
            seeds = [dict(do_sample=True, seed=SEED + r) for r in range(3)] if sampled else [{}]  # three samples
            ids[name, backend, sampled] = (prompt.numel(), [engine.add_request(prompt, **settings, **s) for s in seeds])
        out = engine.run()
        for key, (T, requests) in ids.items():
            self.done[key] = [out[i][T:].tolist() for i in requests]

    def __call__(self, path: Path, backend: str, sampled: bool) -> list[list[int]]:
        """The run's new tokens, a list per row (up to and including the stop)."""
        return self.done[path.name, backend, sampled]


@pytest.fixture(scope="module")
def runs(smol, request):
    return Corpus(*smol, corpus_keys(request.session.items))


def check_rows(tok, rows: list[list[int]], schema: dict, label: str) -> None:
    """Every row of new tokens ended with the stop (not cut by MAX_NEW), and its text parses and validates."""
    for r, new in enumerate(rows):
        text = tok.decode(new, skip_special_tokens=True)
        assert new[-1:] == [EOS], f"{label} row {r}: cut by max_new_tokens={MAX_NEW}, no stop: {text[:120]!r}..."
        jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------- every schema, both backends
@pytest.mark.timeout(CORPUS_TIMEOUT)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("path", params(SCHEMAS))
def test_llguidance_replies_parse_and_validate(smol, runs, path, sampled):
    check_rows(smol[1], runs(path, "llguidance", sampled), schema_of(path),
               f"{path.stem} llguidance {'sampled' if sampled else 'greedy'}")


@pytest.mark.timeout(CORPUS_TIMEOUT)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("path", params(SUBSET))
def test_minigen_replies_parse_and_validate(smol, runs, path, sampled):
    check_rows(smol[1], runs(path, "minigen", sampled), schema_of(path),
               f"{path.stem} minigen {'sampled' if sampled else 'greedy'}")


@pytest.mark.timeout(CORPUS_TIMEOUT)
@pytest.mark.parametrize("path", params(SUBSET))
def test_backends_write_the_same_greedy_tokens(runs, path):
    """On the subset the two masks are equal (test_structured_own.py compares them token by token),
    so the model's argmax under them is too."""
    assert runs(path, "minigen", False) == runs(path, "llguidance", False)


def test_the_corpus_is_thirty_schemas_and_its_subset_twenty_two():
    assert len(SCHEMAS) == 30 and len(SUBSET) == 22
    assert all(name in {p.name for p in SCHEMAS} for name in FAST | set(TASKS))


def test_a_model_may_not_stop(smol):
    """What the mask cannot do: make the model stop. Asked for a bare number with no example,
    SmolLM2 writes digits as long as it may: every prefix is valid, the stop token is allowed after
    each digit, and the text, cut by max_new_tokens, is a number nobody asked for. Why the prompts
    above carry two answered requests."""
    model, tok = smol
    messages = [{"role": "user", "content": ask({"type": "number"})}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    n = 24
    out = minigen.generate(model, ids, tokenizer=tok, response_format=response_format({"type": "number"}),
                           max_new_tokens=n)
    new = out.tokens[0, ids.shape[1]:].tolist()
    assert len(new) == n and EOS not in new and out.texts[0].isdigit()  # cut, not stopped
    guide = LlgGuide(GuideSpec.json_schema({"type": "number"}), tok, model.config.vocab_size, (EOS,))
    matcher = guide.matcher()
    for t in new:
        matcher.advance(t)
    assert matcher.is_complete() and bool(matcher.allowed()[EOS])  # the stop was allowed all along


# ---------------------------------------------------------------- rows never influence each other
def test_engine_requests_of_different_schemas_equal_each_alone(smol):
    """Four requests in one Engine, each with its own structure (two schemas, one on minigen's own
    backend; one free, sampled): each equals the same request run alone."""
    model, tok = smol
    person, matrix = schema_of(SCHEMAS[0]), schema_of(SCHEMAS[17])
    requests = [
        (chat_ids(tok, person)[0], dict(response_format=response_format(person))),
        (chat_ids(tok, matrix)[0], dict(response_format=response_format(matrix), guided_backend="minigen")),
        (chat_ids(tok, person)[0], dict(response_format=response_format(person), do_sample=True, seed=3)),
        (chat_ids(tok, matrix)[0], dict(max_new_tokens=24)),  # no structure: free text, cut at 24
    ]

    def run(batch):
        engine = Engine(model, tokenizer=tok, max_batch_size=4)
        ids = [engine.add_request(p, **{"max_new_tokens": 64, **kw}) for p, kw in batch]
        done = engine.run()
        return [done[i][len(p):] for i, (p, _) in zip(ids, batch)]

    together = run(requests)
    alone = [run([r])[0] for r in requests]
    for r, (a, b) in enumerate(zip(together, alone)):
        assert torch.equal(a, b), f"request {r}: {tok.decode(a)!r} batched, {tok.decode(b)!r} alone"
    for new, schema in ((together[0], person), (together[1], matrix), (together[2], person)):
        assert new[-1] == EOS
        jsonschema.validate(json.loads(tok.decode(new, skip_special_tokens=True)), schema)
    assert together[0].tolist() != together[2].tolist()  # the sampled one wrote its own


@pytest.mark.parametrize("sampled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["greedy", "sampled"])
def test_ragged_rows_under_one_schema_equal_each_alone(smol, sampled):
    """A ragged batch (prompts of different lengths, each at its own positions) with one schema:
    row r equals its prompt generated alone (sampled: alone with seed + r)."""
    model, tok = smol
    schema = schema_of(SCHEMAS[1])  # 02_optional: optional properties, so the rows may differ in length
    prompts = [chat_ids(tok, schema)[0], chat_ids(tok, schema, "Describe a new user.")[0],
               chat_ids(tok, schema, "Make up an inactive user called Bo.")[0]]
    assert len({p.numel() for p in prompts}) == 3
    settings = dict(tokenizer=tok, response_format=response_format(schema), max_new_tokens=64,
                    **(dict(do_sample=True, seed=5) if sampled else {}))
    out = minigen.generate(model, prompts, **settings)
    for r, p in enumerate(prompts):
        alone = minigen.generate(model, p[None], **{**settings, **(dict(seed=5 + r) if sampled else {})})
        n = reply_lengths(alone.tokens, p.numel())[0]
        assert n <= 64 and torch.equal(out.tokens[r], alone.tokens[0, :p.numel() + n]), f"row {r}"
        assert out.texts[r] == alone.texts[0]
        jsonschema.validate(json.loads(out.texts[r]), schema)


# ---------------------------------------------------------------- every step kind
STEP_KINDS = {"eager": dict(fused_decode=False), "speculative": dict(speculative_method="ngram"),
              "paged": dict(cache_chunk_size=16)}


@pytest.fixture(scope="module")
def array_of_objects(smol):
    """09_array_of_objects (repetitive, so prompt lookup's proposals get accepted) and its greedy
    reply on the default step, the fused C step at batch 1 on a CPU where it measured faster."""
    model, tok = smol
    schema = schema_of(SCHEMAS[8])
    ids = chat_ids(tok, schema)
    out = minigen.generate(model, ids, tokenizer=tok, response_format=response_format(schema), max_new_tokens=96)
    return schema, ids, out


def test_the_fused_step_applies_the_mask(smol, array_of_objects):
    model, _ = smol
    schema, ids, out = array_of_objects
    if "fused C step" not in out.stats.plan:
        skip_where_aside("fused_step", model)
        pytest.skip(f"the fused C step does not run here: {out.stats.plan.splitlines()[0]}")
    check_replies(out, ids.shape[1], schema, "fused")


@pytest.mark.parametrize("kind", list(STEP_KINDS))
def test_every_step_kind_writes_the_same_greedy_tokens(smol, array_of_objects, kind):
    """The eager step, speculative decoding (greedy: the argmax of each position's processed logits,
    so exactly the tokens without it) and the paged cache: the same tokens as the default step."""
    model, tok = smol
    schema, ids, reference = array_of_objects
    out = minigen.generate(model, ids, tokenizer=tok, response_format=response_format(schema), max_new_tokens=96,
                           **STEP_KINDS[kind])
    assert (kind == "speculative") == out.stats.step.startswith("speculative"), out.stats.step
    check_replies(out, ids.shape[1], schema, kind)
    assert torch.equal(out.tokens, reference.tokens), f"{kind}: {out.texts[0]!r} vs {reference.texts[0]!r}"


def test_speculative_sampling_stays_valid(smol, array_of_objects):
    """Sampled speculation draws proposals from the processed draft distribution and accepts against the
    target's processed one: every reply still parses and validates (exactness: test_processors.py)."""
    model, tok = smol
    schema, ids, _ = array_of_objects
    out = minigen.generate(model, ids.expand(2, -1), tokenizer=tok, response_format=response_format(schema),
                           max_new_tokens=96, speculative_method="ngram", do_sample=True, seed=SEED)
    assert out.stats.step.startswith("speculative")
    check_replies(out, ids.shape[1], schema, "speculative sampled")


# ---------------------------------------------------------------- stop strings
@pytest.fixture(scope="module")
def counting(smol):
    """A prompt SmolLM2 answers `1. 1\\n2. 2\\n3. 3\\n...` (one token a digit, '.', ' ', '\\n'), and its
    greedy reply without stop strings."""
    model, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    free = minigen.generate(model, ids, tokenizer=tok, max_new_tokens=32)
    return ids, free


def completes(tok, new: list[int], stop: str) -> int:
    """The number of new tokens up to the one whose text completes the first occurrence of `stop`."""
    return next(k for k in range(1, len(new) + 1) if stop in tok.decode(new[:k]))


def test_a_stop_string_across_tokens_cuts_the_text(smol, counting):
    """"3\\n4" is three tokens ('3', '\\n', '4'): the text ends right before it, the tokens at the '4'."""
    model, tok = smol
    ids, free = counting
    new, stop = free.tokens[0, ids.shape[1]:].tolist(), "3\n4"
    assert stop in free.texts[0] and len(tok.encode(stop, add_special_tokens=False)) == 3
    out = minigen.generate(model, ids, tokenizer=tok, max_new_tokens=32, stop=[stop, "never there"])
    k = completes(tok, new, stop)
    assert out.texts[0] == free.texts[0].split(stop)[0] == "1. 1\n2. 2\n3. "
    assert out.tokens[0, ids.shape[1]:].tolist() == new[:k]


def test_a_ragged_row_that_meets_its_stop_stops_and_the_others_go_on(smol, counting):
    model, tok = smol
    ids, free = counting
    other = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                    return_tensors="pt")
    other = (other if isinstance(other, torch.Tensor) else other["input_ids"])[0]
    alone = minigen.generate(model, other[None], tokenizer=tok, max_new_tokens=32)
    stop = "2\n3"
    assert stop not in alone.texts[0]
    out = minigen.generate(model, [ids[0], other], tokenizer=tok, max_new_tokens=32, stop=[stop])
    new = free.tokens[0, ids.shape[1]:].tolist()
    assert out.tokens[0][ids.shape[1]:].tolist() == new[:completes(tok, new, stop)]
    assert out.texts[0] == "1. 1\n2. "
    assert torch.equal(out.tokens[1], alone.tokens[0]) and out.texts[1] == alone.texts[0]  # on to its own end
    assert out.tokens[1].numel() - other.numel() > out.tokens[0].numel() - ids.shape[1]
