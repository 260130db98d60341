"""Every row of docs/bad_inputs.md, run: the table of bad inputs is a test, not a promise.

Each row names a case (its id) defined here with `@case`. A row whose outcome starts with an error
class must raise exactly that class, with every quoted fragment in its message and no chained
trace; any other row describes a behaviour, which its case asserts itself. Case functions take
pytest fixtures by name (tmp_path, monkeypatch, tiny_model, ...), resolved when the row runs.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import minigen
import minigen.parallel
import tp_workers
from conftest import tiny_hf
from minigen import GenerationConfig, drafts, errors, loading
from minigen.checkpoints.hf_config import config_from_hf
from minigen.parallel import launch
from minigen.measure import bench, machine, profiling
from minigen.__main__ import build_parser
from minigen.serving.batching import RequestQueue, group_by_length, pad_batch
from minigen.serving.async_engine import AsyncEngine
from minigen.serving.engine import Engine
from minigen.serving.server import make_app, serve
from fastapi.testclient import TestClient
from minigen.caches.contiguous import KVCache
from minigen.caches.blocks import BlockAllocator
from minigen.caches.quantized import QuantizedKVCache
from test_loading import save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TABLE = Path(__file__).resolve().parent.parent / "docs" / "bad_inputs.md"


# ---------------------------------------------------------------- the table
def read_rows(path: Path = TABLE) -> list[dict]:
    """Rows `| `id` | bad input | what you get |` -> [{id, error, fragments, outcome}]; error is None
    for a behaviour row."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.fullmatch(r"\| `([a-z0-9-]+)` \|(.*)\|(.*)\|", line.strip())
        if not m:
            continue
        outcome = m[3].strip()
        first = re.match(r"`(\w+)`", outcome)
        error = first[1] if first and first[1].endswith("Error") else None
        rows.append({"id": m[1], "error": error, "outcome": outcome,
                     "fragments": re.findall(r'"([^"]+)"', outcome) if error else []})
    return rows


ROWS = read_rows()
CASES: dict[str, tuple] = {}  # id -> (function, pytest marks)


def case(row_id: str, *marks):
    def register(fn):
        assert row_id not in CASES, f"two cases for {row_id}"
        CASES[row_id] = (fn, marks)
        return fn
    return register


def test_the_table_is_well_formed():
    ids = [r["id"] for r in ROWS]
    assert len(ids) >= 40 and len(set(ids)) == len(ids), "ids must be unique"
    for r in ROWS:
        if r["error"] is not None:
            cls = getattr(errors, r["error"], None)
            assert isinstance(cls, type) and issubclass(cls, errors.MinigenError), f"{r['id']}: {r['error']}?"
            assert r["fragments"], f"{r['id']}: an error row quotes a fragment of the message"


def test_every_row_has_a_case_and_every_case_a_row():
    rows = {r["id"] for r in ROWS}
    assert not rows - CASES.keys(), f"rows without a case: {sorted(rows - CASES.keys())}"
    assert not CASES.keys() - rows, f"cases without a row: {sorted(CASES.keys() - rows)}"


def run_case(row_id: str, request) -> None:
    fn, _ = CASES[row_id]
    fn(*[request.getfixturevalue(name) for name in inspect.signature(fn).parameters])


# ---------------------------------------------------------------- fixtures the cases take
@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random Llama (vocabulary 97, context 128, head dim 8), converted by minigen."""
    return minigen.from_hf(tiny_hf("llama"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face folder with a 97-word tokenizer (no chat template)."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_hf("llama").save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def saved(tmp_path):
    """A fresh copy of a tiny folder that a case may damage."""
    folder = tmp_path / "tiny"
    tiny_hf("llama").save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """MINIGEN_CACHE in an empty folder, and a conversion that fails the test if it starts."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINIGEN_CACHE", str(cache))
    monkeypatch.setattr(loading, "read_gguf", lambda path: pytest.fail("converted before checking the cache"))
    return cache


def cli(*argv: str) -> None:
    """Run a command as `python -m minigen` does, but let its MinigenError out for the test to see."""
    args = build_parser().parse_args(list(argv))
    args.func(args)


# ---------------------------------------------------------------- ragged batches and the serving engine
@case("ragged-empty-list")
def _(tiny_model):
    minigen.generate(tiny_model, [])


@case("ragged-empty-prompt")
def _(tiny_model):
    minigen.generate(tiny_model, [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])


@case("ragged-refused-feature")
def _(tiny_model):
    minigen.generate(tiny_model, [torch.tensor([1, 2]), torch.tensor([3])], kv_budget=8)


@case("cache-per-row-positions-refused")
def _():
    QuantizedKVCache(1, 2, 1, 8, 8, bits=8, group_size=4).prepare(torch.tensor([[0, 1], [0, -1]]))


@case("engine-batch-size")
def _(tiny_model):
    minigen.Engine(tiny_model, max_batch_size=0)


@case("engine-num-blocks")
def _(tiny_model):
    minigen.Engine(tiny_model, num_blocks=0)


@case("engine-refused-feature")
def _(tiny_model):
    minigen.Engine(tiny_model, {"quant_bits": 4, "quant_group_size": 8})


@case("engine-empty-prompt")
def _(tiny_model):
    minigen.Engine(tiny_model, num_blocks=4).add_request([])


@case("engine-request-past-pool")
def _(tiny_model):
    minigen.Engine(tiny_model, {"cache_chunk_size": 4}, num_blocks=4).add_request(list(range(10)), max_new_tokens=10)


@case("engine-unknown-override")
def _(tiny_model):
    minigen.Engine(tiny_model, num_blocks=4).add_request([1, 2], max_new_token=3)


@case("engine-cache-override")
def _(tiny_model):
    minigen.Engine(tiny_model, num_blocks=4).add_request([1, 2], window_size=4)


@case("engine-unknown-id")
def _(tiny_model):
    minigen.Engine(tiny_model, num_blocks=4).cancel(7)


@case("engine-cancel-twice")
def _(tiny_model):
    engine = minigen.Engine(tiny_model, num_blocks=4)
    engine.add_request([1, 2], max_new_tokens=2)
    engine.cancel(0)
    engine.cancel(0)


@case("engine-logprobs-out-of-range")
def _(tiny_model):
    engine = minigen.Engine(tiny_model, num_blocks=4)
    try:
        engine.add_request([1, 2], max_new_tokens=2, logprobs=21)
    finally:
        assert not engine.requests and not engine.waiting  # nothing queued


@case("engine-forget-running")
def _(tiny_model):
    engine = minigen.Engine(tiny_model, num_blocks=4)
    engine.add_request([1, 2], max_new_tokens=2)
    engine.forget(0)


# ---------------------------------------------------------------- config
@case("config-quant-bits-float")
def _():
    GenerationConfig(quant_bits=4.0)


@case("config-temperature-zero")
def _():
    GenerationConfig(do_sample=True, temperature=0)


@case("config-temperature-inf")
def _():
    GenerationConfig(do_sample=True, temperature=float("inf"))


@case("config-penalty-out-of-range")
def _():
    GenerationConfig(frequency_penalty=2.5)


@case("config-repetition-penalty-zero")
def _():
    GenerationConfig(repetition_penalty=0)


@case("config-min-p-outside")
def _():
    GenerationConfig(do_sample=True, min_p=1.5)


@case("config-min-p-without-do-sample")
def _():
    GenerationConfig(min_p=0.1)


@case("config-logit-bias-value")
def _():
    GenerationConfig(logit_bias={50: 150})


@case("config-logit-bias-key")
def _():
    assert GenerationConfig(logit_bias={"50": 1}).logit_bias == {50: 1}  # JSON's string keys are ids
    GenerationConfig(logit_bias={"the": 5})


@case("config-logit-bias-outside-vocabulary")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), logit_bias={97: -100})


@case("config-penalties-with-cuda-graphs")
def _():
    for key, value in (("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("logit_bias", {3: 1.0})):
        with pytest.raises(errors.ConfigError, match=f"{key}=.* and cuda_graphs=True do not combine"):
            GenerationConfig(cuda_graphs=True, **{key: value})
    GenerationConfig(cuda_graphs=True, do_sample=True, min_p=0.1)  # min-p runs inside sample(), in the graph too
    GenerationConfig(cuda_graphs=True, repetition_penalty=1.2)


@case("config-temperature-tiny")
def _(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    greedy = minigen.generate(tiny_model, ids, max_new_tokens=6, stop_token_ids=[]).tokens
    tiny = minigen.generate(tiny_model, ids, max_new_tokens=6, stop_token_ids=[], do_sample=True,
                            temperature=1e-45, seed=0).tokens
    assert torch.equal(tiny, greedy)


@case("config-stop-empty")
def _():
    GenerationConfig(stop=[""])


@case("config-stop-too-many")
def _():
    GenerationConfig(stop=["a", "b", "c", "d", "e"])


@case("config-response-format-shape")
def _():
    GenerationConfig(response_format={"type": "json_schema", "schema": {"type": "object"}})


@case("config-two-guides")
def _():
    GenerationConfig(guided_regex="a+", guided_grammar='start: "a"')


@case("config-guided-backend-alone")
def _():
    GenerationConfig(guided_backend="minigen")


@case("text-setting-without-tokenizer")
def _(tiny_model):
    ids = torch.tensor([[1, 2, 3]])
    for key, value in (("response_format", {"type": "json_object"}), ("guided_regex", "a+"),
                       ("guided_grammar", 'start: "a"')):
        with pytest.raises(errors.ConfigError, match=f"{key} read the text .* tokenizer=tok"):
            minigen.generate(tiny_model, ids, max_new_tokens=2, **{key: value})
    with pytest.raises(errors.ConfigError, match=r"generate\(model, prompts, config, tokenizer=tok\)"):
        minigen.generate(tiny_model, [torch.tensor([1, 2]), torch.tensor([3])], stop=["x"], max_new_tokens=2)
    minigen.generate(tiny_model, ids, stop=["\n"], max_new_tokens=2)


@case("engine-text-setting-without-tokenizer")
def _(tiny_model):
    engine = Engine(tiny_model)
    for key, value in (("stop", ["x"]), ("response_format", {"type": "json_object"})):
        with pytest.raises(errors.ConfigError, match=r"Engine\(model, config, tokenizer=tok\)"):
            engine.add_request([1, 2, 3], **{key: value})
    assert not engine.requests  # refused before anything was queued
    Engine(tiny_model, {"guided_regex": "a+"})


ANYOF = {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
         "required": ["id"], "additionalProperties": False}


@case("schema-outside-subset")
def _(smollm2):
    model, tok = smollm2
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": ANYOF}}
    minigen.generate(model, torch.tensor([[1, 2, 3]]), tokenizer=tok, response_format=fmt, max_new_tokens=2)  # llguidance
    minigen.generate(model, torch.tensor([[1, 2, 3]]), tokenizer=tok, response_format=fmt, guided_backend="minigen",
                     max_new_tokens=2)


@case("schema-llguidance-refuses")
def _(smollm2):
    model, tok = smollm2
    minigen.generate(model, torch.tensor([[1, 2, 3]]), tokenizer=tok, max_new_tokens=2,
                     response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "bogus"}}})


@case("regex-syntax-error")
def _(smollm2):
    model, tok = smollm2
    with pytest.raises(errors.ConfigError, match="outside minigen's regex subset") as own:
        minigen.generate(model, torch.tensor([[1, 2, 3]]), tokenizer=tok, guided_regex="(ab", guided_backend="minigen",
                         max_new_tokens=2)
    assert own.value.__cause__ is None and (own.value.__context__ is None or own.value.__suppress_context__)
    minigen.generate(model, torch.tensor([[1, 2, 3]]), tokenizer=tok, guided_regex="(ab", max_new_tokens=2)


@case("stop-parallel-sample")
def _(smollm2):
    model, tok = smollm2
    minigen.parallel_sample(model, torch.tensor([[1, 2, 3]]), 3, do_sample=True, stop=["x"], tokenizer=tok)


@case("config-n-below-one")
def _():
    for bad in (True, 2.0, -1):
        with pytest.raises(errors.ConfigError, match=r"n=.* is invalid: use an integer >= 1"):
            GenerationConfig(n=bad)
    GenerationConfig(n=0)


@case("config-logprobs-outside")
def _():
    for bad in (-1, True, 2.0):
        with pytest.raises(errors.ConfigError, match=r"logprobs=.* is invalid: use an integer in 0\.\.20"):
            GenerationConfig(logprobs=bad)
    GenerationConfig(logprobs=21)


@case("stream-logprobs")
def _(tiny_model):
    minigen.stream(tiny_model, torch.tensor([[1, 2, 3]]), logprobs=2)


@case("samples-with-beams")
def _():
    with pytest.raises(errors.ConfigError, match="logprobs=2 and num_beams=4 do not combine"):
        GenerationConfig(num_beams=4, logprobs=2)
    GenerationConfig(num_beams=4, n=2)


@case("logprobs-with-cuda-graphs")
def _():
    GenerationConfig(cuda_graphs=True, logprobs=2)


@case("engine-n")
def _(tiny_model):
    engine = Engine(tiny_model)
    with pytest.raises(errors.ConfigError, match="n=2 does not combine with the serving engine"):
        engine.add_request([1, 2, 3], n=2, do_sample=True)
    assert not engine.requests  # refused before anything was queued
    Engine(tiny_model, {"n": 2})


@case("samples-where-nothing-is-sampled")
def _(tiny_model):
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(errors.ConfigError, match="logprobs=2 does not combine with score"):
        minigen.score(tiny_model, ids, logprobs=2)
    with pytest.raises(errors.ConfigError, match="logprobs=2 does not combine with the profiler"):
        profiling.profile(tiny_model, ids, GenerationConfig(logprobs=2))
    with pytest.raises(errors.ConfigError, match="n=2 does not combine with parallel_sample.*with the config's n=1"):
        minigen.parallel_sample(tiny_model, ids, 3, GenerationConfig(n=2, do_sample=True))
    minigen.score(tiny_model, ids, n=2)


@case("serve-config-logprobs")
def _():
    serve("no-such-model-is-loaded", GenerationConfig(logprobs=2))


@case("text-settings-with-cuda-graphs")
def _():
    for key, value in (("response_format", {"type": "json_object"}), ("guided_regex", "a+"),
                       ("guided_grammar", 'start: "a"')):
        with pytest.raises(errors.ConfigError, match=f"{key}=.* and cuda_graphs=True do not combine.*or {key}=None"):
            GenerationConfig(cuda_graphs=True, **{key: value})
    GenerationConfig(cuda_graphs=True, stop=["x"])


@case("config-seed-past-64-bits")
def _():
    GenerationConfig(do_sample=True, seed=2**64)


@case("config-stop-id-past-int64")
def _():
    GenerationConfig(stop_token_ids=[2**63])


@case("config-assigned-later")
def _():
    cfg = GenerationConfig(do_sample=True)
    try:
        cfg.temperature = 0
    finally:
        assert cfg.temperature == 1.0  # the refused value was not stored


@case("config-backend-unknown")
def _():
    GenerationConfig(attention_backend="cuda")


@case("config-triton-without-blocks")
def _():
    GenerationConfig(attention_backend="triton")


@case("config-triton-with-sparse")
def _():
    GenerationConfig(attention_backend="triton", cache_chunk_size=16, sparse_top_k=8)


@case("triton-on-a-cpu")
def _(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    kw = dict(max_new_tokens=4, stop_token_ids=[], cache_chunk_size=16)
    assert torch.equal(minigen.generate(tiny_model, ids, attention_backend="triton", **kw).tokens,
                       minigen.generate(tiny_model, ids, **kw).tokens)


@case("config-sampling-without-do-sample")
def _():
    GenerationConfig(temperature=0.7)


@case("config-sinks-without-window")
def _():
    GenerationConfig(sink_tokens=2)


@case("config-residual-with-paging")
def _():
    GenerationConfig(quant_bits=4, cache_chunk_size=32, quant_residual=64)


@case("config-budget-with-quant")
def _():
    GenerationConfig(kv_budget=64, quant_bits=4)


@case("config-unknown-key")
def _():
    GenerationConfig.from_dict({"max_new_token": 3})


@case("config-file-not-json")
def _(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3,}')
    GenerationConfig.from_json(tmp_path / "generation_config.json")


@case("config-file-not-utf8")
def _(tmp_path):
    (tmp_path / "generation_config.json").write_bytes(b"\xff\xfe{")
    GenerationConfig.from_json(tmp_path / "generation_config.json")


# ---------------------------------------------------------------- speculative decoding
@case("speculative-k-zero")
def _():
    for bad in (-1, 2.5, True, "4"):  # the row's other values, refused as well
        with pytest.raises(errors.ConfigError, match=f"num_speculative_tokens={bad!r} is invalid"):
            GenerationConfig(speculative_method="ngram", num_speculative_tokens=bad)
    GenerationConfig(speculative_method="ngram", num_speculative_tokens=0)


@case("speculative-method-unknown")
def _():
    GenerationConfig(speculative_method="eagle")


@case("speculative-draft-without-model")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), speculative_method="draft")


@case("speculative-model-without-draft")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), draft_model=drafts.unrelated(tiny_model))


@case("speculative-draft-vocabulary")
def _(tiny_model):
    draft = minigen.from_hf(tiny_hf("llama", vocab_size=50))
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), speculative_method="draft", draft_model=draft)


@case("speculative-draft-device")
def _(tiny_model):
    draft = drafts.unrelated(tiny_model).to("meta")
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), speculative_method="draft", draft_model=draft)


@case("speculative-draft-bf16")
def _(tiny_model):
    ids, kw = torch.tensor([[3, 1, 4, 1, 5, 3, 1]]), dict(max_new_tokens=8, stop_token_ids=[])
    draft = minigen.from_hf(tiny_hf("llama"), dtype=torch.bfloat16)
    out = minigen.generate(tiny_model, ids, speculative_method="draft", draft_model=draft, **kw)
    assert out.stats.draft_tokens > 0
    assert torch.equal(out.tokens, minigen.generate(tiny_model, ids, **kw).tokens)


@case("speculative-lookup-min-above-max")
def _():
    GenerationConfig(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)


@case("speculative-lookup-without-ngram")
def _():
    GenerationConfig(speculative_method="draft", prompt_lookup_max=5)


@case("speculative-with-quant")
def _():
    for key, value in (("kv_budget", 8), ("compile", True), ("cuda_graphs", True), ("use_cache", False)):
        with pytest.raises(errors.ConfigError, match=f"{key}={value!r} and speculative_method='ngram' do not combine"):
            GenerationConfig(speculative_method="ngram", **{key: value})
    GenerationConfig(speculative_method="ngram", quant_bits=4)


@case("speculative-engine")
def _(tiny_model):
    minigen.Engine(tiny_model, GenerationConfig(speculative_method="ngram"))


@case("speculative-observers")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), speculative_method="ngram",
                     observers=(lambda layer, probs: None,))


@case("speculative-parallel-sample")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([[1, 2, 3]]), 3, do_sample=True, speculative_method="ngram")


@case("speculative-rows-offload")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3], [3, 2, 1]]), speculative_method="ngram", prefetch_depth=0)


# ---------------------------------------------------------------- beam search
@case("beam-num-beams-zero")
def _():
    for bad in (2.0, True):
        with pytest.raises(errors.ConfigError, match=f"num_beams={bad!r} is invalid"):
            GenerationConfig(num_beams=bad)
    GenerationConfig(num_beams=0)


@case("beam-length-penalty-nan")
def _():
    GenerationConfig(num_beams=4, length_penalty=float("nan"))


@case("beam-length-penalty-alone")
def _():
    GenerationConfig(length_penalty=2.0)


@case("beam-sampling")
def _():
    GenerationConfig(num_beams=4, do_sample=True)


@case("beam-with-paged")
def _():
    for other in (dict(prefetch_depth=0), dict(quant_bits=4), dict(kv_budget=8), dict(compile=True),
                  dict(cuda_graphs=True), dict(speculative_method="ngram"), dict(use_cache=False)):
        with pytest.raises(errors.ConfigError, match=r"num_beams=4 do not combine.*Fix: drop one: num_beams=1"):
            GenerationConfig(num_beams=4, **other)
    GenerationConfig(num_beams=4, cache_chunk_size=16)


@case("beam-with-processing")
def _():
    for key, value in (("frequency_penalty", 0.5), ("presence_penalty", -0.5), ("logit_bias", {3: 1.0}),
                       ("stop", ["x"]), ("response_format", {"type": "json_object"}), ("guided_regex", "a+"),
                       ("guided_grammar", 'start: "a"')):
        with pytest.raises(errors.ConfigError, match=f"{key}=.* and num_beams=2 do not combine.*Fix: num_beams=1"):
            GenerationConfig(num_beams=2, **{key: value})
    GenerationConfig(num_beams=2, repetition_penalty=1.2)


@case("beam-ragged")
def _(tiny_model):
    minigen.generate(tiny_model, [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], num_beams=2)


@case("beam-engine")
def _(tiny_model):
    minigen.Engine(tiny_model, {"num_beams": 2})


@case("beam-parallel-sample")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([[1, 2, 3]]), 3, num_beams=2)


@case("beam-stream")
def _(tiny_model):
    minigen.stream(tiny_model, torch.tensor([[1, 2, 3]]), num_beams=2)


# ---------------------------------------------------------------- prompts and texts
@case("prompt-empty")
def _(tiny_model):
    minigen.generate(tiny_model, torch.empty(1, 0, dtype=torch.long))


@case("prompt-out-of-vocab")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 97]]))


@case("prompt-past-context")
def _(tiny_model):
    minigen.generate(tiny_model, torch.zeros(1, 129, dtype=torch.long), max_new_tokens=0)


@case("perplexity-out-of-vocab")
def _(tiny_model):
    minigen.perplexity(tiny_model, torch.tensor([1, 97, 3]))


@case("perplexity-negative-id")
def _(tiny_model):
    minigen.perplexity(tiny_model, torch.tensor([1, -1, 3]))


@case("perplexity-sure-and-wrong")
def _():
    model = minigen.from_hf(tiny_hf("llama", seed=1))
    with torch.no_grad():
        model.lm_head.mul_(1e4)  # logits thousands apart: the model is sure of every prediction
    ids = [0]
    for _ in range(7):  # each next token is the one the model finds least likely
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1].argmin()))
    ids = torch.tensor(ids)
    assert minigen.score(model, ids).nll.mean() > 709  # exp of it overflows a float
    assert minigen.perplexity(model, ids) == float("inf")


@case("perplexity-quantized-default-chunk")
def _(tiny_model):
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(0))
    quantized = minigen.perplexity(tiny_model, ids, quant_bits=4, quant_group_size=8)
    assert quantized == minigen.perplexity(tiny_model, ids, quant_bits=4, quant_group_size=8, chunk_size=1)
    assert quantized != minigen.perplexity(tiny_model, ids)


# ---------------------------------------------------------------- precision and compilation
@case("precision-kv-dtype-unknown")
def _():
    GenerationConfig(kv_dtype="int8")


@case("precision-compute-dtype-unknown")
def _(tiny_model):
    tiny_model.precision.replace(compute="float64")


@case("compile-not-a-bool")
def _():
    GenerationConfig(compile=1)


@case("compile-with-paged-cache")
def _():
    GenerationConfig(compile=True, cache_chunk_size=16)


@case("compile-with-observers")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), compile=True, observers=(lambda layer, probs: None,))


@case("cuda-graphs-without-cuda", pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"))
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), cuda_graphs=True)


@case("fused-with-window")
def _():
    GenerationConfig(fused_decode=True, window_size=16)


@case("fused-batch")
def _():
    int4_model = minigen.quantize_weights(minigen.from_hf(tiny_hf("llama")), 4)
    minigen.generate(int4_model, torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=2, fused_decode=True)


@case("fused-fp16-cache")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, fused_decode=True, kv_dtype="float16")


@case("fused-gpt2")
def _():
    minigen.generate(minigen.from_hf(tiny_hf("gpt2")), torch.tensor([[1, 2, 3]]), max_new_tokens=2, fused_decode=True)


@case("fused-kernel-off")
def _(tiny_model):
    from minigen.kernels import build as kernel_build
    with kernel_build.enabled(False):
        minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, fused_decode=True)


@case("int8-activations-not-a-bool")
def _():
    GenerationConfig(int8_activations="yes")


@case("int8-activations-fp32-weights")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, int8_activations=True)


@case("int8-activations-compiled")
def _():
    GenerationConfig(int8_activations=True, compile=True)


@case("int8-activations-kernel-off")
def _():
    from minigen.kernels import build as kernel_build
    int4_model = minigen.quantize_weights(minigen.from_hf(tiny_hf("llama")), 4)
    with kernel_build.enabled(False):
        minigen.generate(int4_model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, int8_activations=True)


# ---------------------------------------------------------------- checkpoints and the model cache
@case("load-dtype-int8")
def _(tiny_folder):
    minigen.load(tiny_folder, dtype=torch.int8)


@case("model-cast-to-bf16")
def _():
    hf = tiny_hf("llama", max_position_embeddings=4096)
    cast, built = minigen.from_hf(hf).to(torch.bfloat16), minigen.from_hf(hf, dtype=torch.bfloat16)
    assert cast.inv_freq.dtype == torch.float32 and torch.equal(cast.inv_freq, built.inv_freq)
    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(4000, 4003)
    with torch.no_grad():
        assert torch.equal(cast(ids, pos), built(ids, pos))


@case("load-dtype-string")
def _(tiny_folder):
    model, _ = minigen.load(tiny_folder, dtype="bfloat16")
    assert model.dtype == torch.bfloat16


@case("checkpoint-config-array")
def _(saved):
    (saved / "config.json").write_text("[1, 2]")
    minigen.load(saved)


@case("checkpoint-config-missing-key")
def _(saved):
    cfg = json.loads((saved / "config.json").read_text())
    del cfg["hidden_size"]
    (saved / "config.json").write_text(json.dumps(cfg))
    minigen.load(saved)


@case("checkpoint-truncated-weights")
def _(saved):
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    minigen.load(saved)


@case("checkpoint-unsupported-architecture")
def _(saved):
    cfg = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    minigen.load(saved)


def sliding_qwen2(**changes) -> dict:
    """A Qwen2 config.json (as a dict) with sliding layers, 3 layers, then `changes` (None: drop the key)."""
    cfg = tiny_hf("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1,
                  num_hidden_layers=3).config.to_dict()
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


@case("checkpoint-layer-types-unknown")
def _():
    loading.config_from_hf(sliding_qwen2(layer_types=["full_attention", "global_attention", "sliding_attention"]))


@case("checkpoint-layer-types-count")
def _():
    loading.config_from_hf(sliding_qwen2(layer_types=["full_attention", "sliding_attention"]))


@case("checkpoint-layer-types-not-a-list")
def _():
    loading.config_from_hf(sliding_qwen2(layer_types="sliding_attention"))


@case("checkpoint-sliding-window-invalid")
def _():
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    for window in (None, 0, "8"):  # each refused by the same message; True (a bool, not a count) last
        with pytest.raises(errors.ModelLoadError, match=f"sliding_window={window!r}, not a positive integer"):
            loading.config_from_hf(sliding_qwen2(layer_types=types, sliding_window=window))
    loading.config_from_hf(sliding_qwen2(layer_types=types, sliding_window=True))


@case("checkpoint-gemma3-attn-softcap")
def _():
    hf = {"model_type": "gemma3_text", "vocab_size": 97, "hidden_size": 32, "num_hidden_layers": 6,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
          "sliding_window": 8, "attn_logit_softcapping": 50.0}
    loading.config_from_hf(hf)


@case("load-gemma3-not-installed")
def _(tmp_path, monkeypatch):
    from minigen.checkpoints import packaged
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(packaged.GEMMA3_PACKAGE) else real(name, *a))
    minigen.load("gemma3-270m")


@case("window-past-the-models-own")
def _():
    model = minigen.from_hf(tiny_hf("mistral", sliding_window=8))
    minigen.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, window_size=9)


@case("fused-on-a-sliding-model")
def _():
    model = minigen.from_hf(tiny_hf("mistral", sliding_window=8))
    minigen.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, fused_decode=True)


@case("offload-a-hybrid-cache")
def _():
    from minigen.caches.hybrid import HybridKVCache
    from minigen.caches.offload import OffloadedKVCache
    # two full layers and two sliding ones: the full part has prefetch_depth + 1 = 2 layers, so the
    # depth check passes, and the tier would move the rings' tensors as if they were layers
    kinds = ("full_attention", "full_attention", "sliding_attention", "sliding_attention")
    OffloadedKVCache(HybridKVCache(kinds, 1, 2, 32, 8, sliding_window=8), n_layers=4, prefetch_depth=1)


@case("from-hf-in-place-change")
def _():
    hf = tiny_hf("llama", seed=2)
    model = minigen.from_hf(hf)
    ids = torch.tensor([[5, 17, 3, 96, 40]])
    with torch.no_grad():
        before = model(ids, torch.arange(5))
        for p in hf.parameters():  # every tensor, the embedding, o_proj and norms included
            p.mul_(-0.5)
        assert torch.equal(model(ids, torch.arange(5)), before)


@case("cache-dir-read-only")
def _(empty_cache, monkeypatch):
    # A chmod would not stop root (CI runs as root), so the refusal that a read-only or foreign
    # folder gives is simulated where minigen asks for it.
    empty_cache.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == empty_cache
                        else real(path, mode, **kw))
    try:
        minigen.load("smollm2-135m")
    finally:
        assert list(empty_cache.iterdir()) == []  # not even a lock file


@case("cache-dir-is-a-file")
def _(empty_cache):
    empty_cache.write_text("notes")
    minigen.load("smollm2-135m")


@case("cache-dir-under-a-file")
def _(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("notes")
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path / "notes.txt" / "cache"))
    monkeypatch.setattr(loading, "read_gguf", lambda path: pytest.fail("converted before checking the cache"))
    minigen.load("smollm2-135m")


def dead_pid() -> int:
    """The pid of a process that has exited (reused by another only after the pid space wraps)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@case("cache-killed-conversion")
def _(empty_cache):
    done = empty_cache / loading.DEFAULT_MODEL
    done.mkdir(parents=True)
    (done / "model.safetensors").write_bytes(b"")  # a finished conversion: nothing to convert
    killed = empty_cache / f".convert-{dead_pid()}-k1ll3d"
    older = empty_cache / ".convert-x7q2"  # named before conversions carried their pid
    live = empty_cache / f".convert-{os.getpid()}-busy"
    for folder in (killed, older, live):
        (folder / loading.DEFAULT_MODEL).mkdir(parents=True)
        (folder / loading.DEFAULT_MODEL / "model.safetensors").write_bytes(b"\0" * 1024)
    assert loading.prepare_default() == done
    assert not killed.exists() and not older.exists() and live.exists()


@case("cache-concurrent-prepare", pytest.mark.slow)
def _(tmp_path, monkeypatch):
    # Converts the real bundled GGUF once (~7 s); two threads take the lock as two processes would
    # (flock locks belong to each open file, not to the process).
    try:
        loading.default_gguf_path()
    except errors.ModelLoadError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    conversions, real = [], loading._convert
    monkeypatch.setattr(loading, "_convert", lambda *a: conversions.append(a) or real(*a))
    start, results = threading.Barrier(2), []

    def prepare():
        start.wait()
        try:
            results.append(loading.prepare_default())
        except Exception as e:  # shown by the assert below
            results.append(e)
    threads = [threading.Thread(target=prepare) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    folder = tmp_path / loading.DEFAULT_MODEL
    assert results == [folder, folder] and len(conversions) == 1
    assert (folder / "model.safetensors").exists() and not list(tmp_path.glob(".convert-*"))


# ---------------------------------------------------------------- generation and caches
@case("generate-stop-id-outside-vocab")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), stop_token_ids=[97])


@case("generate-group-size-vs-head-dim")
def _(tiny_model):
    assert tiny_model.config.head_dim == 8
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), quant_bits=4, quant_group_size=32)


@case("generate-past-context")
def _(tiny_model):
    minigen.generate(tiny_model, torch.zeros(1, 100, dtype=torch.long), max_new_tokens=40)


@case("kv-cache-write-past-end")
def _():
    KVCache(n_layers=1, batch=1, n_kv_heads=1, max_len=4, head_dim=8).prepare(torch.tensor([4]))


@case("paged-pool-full")
def _():
    pool = BlockAllocator(n_blocks=1, block_size=2)
    seq = pool.add_sequence()
    try:
        pool.write(seq, 0, 5)
    finally:
        assert pool.tables[seq] == [] and len(pool.free) == 1  # refused before anything changed


@case("paged-write-freed-position")
def _():
    pool = BlockAllocator(n_blocks=4, block_size=2)
    seq = pool.add_sequence()
    pool.write(seq, 0, 4)
    pool.free_block(seq, 0)
    pool.write(seq, 0, 1)


# ---------------------------------------------------------------- bench and the command line
def no_run(monkeypatch) -> None:
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("the bench ran before the check"))


@case("bench-json-missing-folder")
def _(tmp_path, monkeypatch):
    no_run(monkeypatch)
    try:
        cli("bench", "--json", str(tmp_path / "no" / "such" / "folder" / "bench.json"))
    finally:
        assert list(tmp_path.iterdir()) == []


@case("bench-json-is-a-folder")
def _(tmp_path, monkeypatch):
    no_run(monkeypatch)
    cli("bench", "--json", str(tmp_path))


@case("bench-json-read-only")
def _(tmp_path, monkeypatch):
    no_run(monkeypatch)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == tmp_path
                        else real(path, mode, **kw))
    try:
        cli("bench", "--json", str(tmp_path / "bench.json"))
    finally:
        assert list(tmp_path.iterdir()) == []


@case("bench-new-tokens-too-few")
def _(monkeypatch):
    no_run(monkeypatch)
    cli("bench", "--new-tokens", "4")


@case("bench-new-tokens-zero")
def _(monkeypatch):
    no_run(monkeypatch)
    cli("bench", "--new-tokens", "0")


@case("bench-repeats-zero")
def _(monkeypatch):
    no_run(monkeypatch)
    cli("bench", "--repeats", "0")


def no_weights(monkeypatch) -> None:
    monkeypatch.setattr(loading, "read_safetensors", lambda folder: pytest.fail("loaded the weights first"))


@case("bench-prompt-past-context")
def _(tiny_folder, monkeypatch):
    no_weights(monkeypatch)
    cli("bench", "--model", str(tiny_folder), "--prompt-len", "200", "--new-tokens", "8")


@case("bench-prompt-past-text")
def _(tmp_path, monkeypatch):
    tiny_hf("llama", max_position_embeddings=8192).save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    no_weights(monkeypatch)
    cli("bench", "--model", str(tmp_path), "--prompt-len", "5000")


@case("bench-sampling")
def _(tiny_folder, monkeypatch):
    no_weights(monkeypatch)
    cli("bench", "--model", str(tiny_folder), "--set", "do_sample=true")


@case("bench-n")
def _(tiny_folder, monkeypatch):
    no_weights(monkeypatch)
    cli("bench", "--model", str(tiny_folder), "--set", "n=2")


@case("cli-generate-n")
def _(monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    cli("generate", "hello", "--set", "n=2")


@case("bench-decode-not-measurable")
def _():
    def run(n: int):  # a 1-token run slower than the N-token one: a clock or a machine gone wrong
        time.sleep(0.01 if n == 1 else 0)
        return torch.zeros(1, n, dtype=torch.long), 0  # the tokens, and the KV cache's bytes
    from tqdm.auto import tqdm
    bench._time_engines({"minigen": run}, new_tokens=8, repeats=1, progress=tqdm(disable=True))


@case("bench-without-proc")
def _(monkeypatch, tmp_path):
    import builtins
    import io

    import psutil
    import psutil._common
    from minigen.kernels import build as kernel_build
    real_open = builtins.open

    def no_proc(file, *args, **kwargs):
        if str(file).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(io, "open", no_proc)  # what pathlib calls
    # psutil reads /proc on Linux only; on macOS it asks the kernel, so let it stand for that
    monkeypatch.setattr(psutil._common, "open", real_open, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU paths, on a GPU machine too
    # hardware_info reports the C kernel: build it afresh, without /proc, in a cache of its own
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_build, "_lib", None)
    monkeypatch.setattr(kernel_build, "_reason", "not built yet")
    with machine.PeakRSS() as mem:  # psutil polls
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, then freed
        holding = psutil.Process().memory_info().rss  # the RSS with the block (another test's garbage may go meanwhile)
        deadline = time.monotonic() + 5  # held until the polling thread has seen it: a busy machine may delay it
        while mem.peak < holding - 8 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.01)
        del block
    assert mem._source == "poll" and mem.peak >= holding - 8 * 2**20 and mem.added > 0
    monkeypatch.setitem(sys.modules, "psutil", None)  # psutil not installed: getrusage's peak
    with machine.PeakRSS() as mem:
        torch.ones(64 * 2**20 // 4)
    assert mem._source == "rusage" and mem.peak >= mem.start > 0 and mem.added >= 0
    info = machine.hardware_info()
    assert info["cpu"] and info["memory_read_gb_s"] > 0 and info["cpu_kernel"]
    assert machine.memory_read_bandwidth(nbytes=16 * 2**20, repeats=2) > 0


@case("cli-chat-without-template")
def _(tiny_folder):
    cli("generate", "w1 w2 w3", "--model", str(tiny_folder), "--chat", "--max-new-tokens", "2")


# ---------------------------------------------------------------- batching and the request queue
def _full_queue():
    queue = RequestQueue(2)
    queue.put("a")
    queue.put("b")
    return queue


@case("queue-full-refuses")
def _():
    queue = _full_queue()
    try:
        queue.put("c")
    finally:
        assert queue.peek() == ["a", "b"], "a refused put changed the queue"


@case("queue-full-block-timeout")
def _():
    queue = _full_queue()
    start = time.monotonic()
    try:
        queue.put("c", block=True, timeout=0.05)
    finally:
        assert time.monotonic() - start >= 0.05 and queue.peek() == ["a", "b"]


@case("queue-capacity-zero")
def _():
    RequestQueue(0)


@case("batch-prompt-past-pad-cap")
def _():
    pad_batch([list(range(1, 301)), list(range(1, 11))])


@case("batch-empty-prompt")
def _():
    with pytest.raises(errors.PromptError, match="prompt 1 is empty"):
        group_by_length([2, 0], 4)
    pad_batch([[1, 2], []])


# ---------------------------------------------------------------- the C kernel
# The same checks as the two tests in test_cpu_kernel.py, which hold them with the kernel's others.
def needs_compiler() -> None:
    from minigen.kernels import build as kernel_build
    if kernel_build.compiler() is None:
        pytest.skip("no C compiler on this machine")


@case("profile-unknown-key")
def _(monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    cli("profile", "--set", "quant_bit=4")


@case("profile-fused")
def _(monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    cli("profile", "--set", "fused_decode=true")


@case("profile-cli-without-cache")
def _(monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    cli("profile", "--set", "use_cache=false")


@case("profile-without-cache")
def _(tiny_model):
    from minigen.measure import profiling
    profiling.profile(tiny_model, torch.tensor([[1, 2, 3]]), GenerationConfig(use_cache=False))


@case("profile-group-size-vs-head-dim")
def _(tiny_model, monkeypatch):
    from minigen.measure import profiling
    monkeypatch.setattr(profiling, "torch_profile", lambda *a, **k: pytest.fail("profiled before the check"))
    profiling.profile(tiny_model, torch.tensor([[1, 2, 3]]), GenerationConfig(quant_bits=4, quant_group_size=32))


@case("plan-budget-below-weights")
def _(tiny_model):
    minigen.plan(tiny_model.config, context=100, budget_bytes=1000)


@case("plan-context-past-model")
def _(tiny_model, monkeypatch):
    monkeypatch.setattr(sys.modules["minigen.measure.plan"], "model_config", lambda name: tiny_model.config)
    cli("plan", "--model", "tiny", "--context", "200", "--budget-bytes", "10000000")


@case("ledger-not-toml")
def _(tmp_path):
    (tmp_path / "notes.txt").write_text("some notes, not TOML", encoding="utf-8")
    cli("ledger", "--file", str(tmp_path / "notes.txt"))


@case("ledger-bad-verdict")
def _(tmp_path):
    from minigen.course.ledger import load_claims
    (tmp_path / "claims.toml").write_text(
        '[[claim]]\nid = "C1"\nclaim = "x"\narticle_value = "2.3x"\nmeasured = "4x"\nmachine = "2-core CPU"\n'
        'verdict = "true"\nchapter = "01"\nsource = "chapter 01"\n', encoding="utf-8")
    load_claims(tmp_path / "claims.toml")


@case("kernel-corrupt-cache")
def _(monkeypatch, tmp_path):
    from test_cpu_kernel import test_a_corrupt_cached_kernel_is_rebuilt
    needs_compiler()
    test_a_corrupt_cached_kernel_is_rebuilt(monkeypatch, tmp_path)


@case("kernel-no-openmp")
def _(monkeypatch, tmp_path):
    from test_cpu_kernel import test_a_build_without_openmp_is_single_threaded_with_a_notice
    needs_compiler()
    if sys.platform != "linux":
        pytest.skip("the forced build without OpenMP is checked on Linux")
    test_a_build_without_openmp_is_single_threaded_with_a_notice(monkeypatch, tmp_path)


# ---------------------------------------------------------------- prefill
@case("prefill-precision-unknown")
def _():
    GenerationConfig(prefill_precision="int4")


@case("engine-step-budget-below-batch")
def _(tiny_model):
    for bad in (0, 4.0, True, "256"):  # the row's other values, refused as well
        with pytest.raises(errors.ConfigError, match=f"max_num_batched_tokens={bad!r} is invalid"):
            minigen.Engine(tiny_model, max_batch_size=8, max_num_batched_tokens=bad)
    minigen.Engine(tiny_model, max_batch_size=8, max_num_batched_tokens=4)


@case("prefill-chunk-size-invalid")
def _():
    for bad in (-1, 2.5, True, "512"):  # the row's other values, refused as well
        with pytest.raises(errors.ConfigError, match=f"prefill_chunk_size={bad!r} is invalid"):
            GenerationConfig(prefill_chunk_size=bad)
    GenerationConfig(prefill_chunk_size=0)


@case("prefill-chunk-with-heavy-hitters")
def _():
    GenerationConfig(prefill_chunk_size=256, kv_budget=64)


@case("engine-prefill-chunk-size")
def _(tiny_model):
    minigen.Engine(tiny_model, GenerationConfig(prefill_chunk_size=256))


@case("prefill-bf16-without-bf16-dot")
def _(tiny_model, monkeypatch):
    from minigen.kernels import cpu
    monkeypatch.setattr(cpu, "bf16_dot_products", lambda: False)
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), prefill_precision="bfloat16")


@case("prefill-int8-without-int8-dot")
def _(tiny_model, monkeypatch):
    from minigen.kernels import cpu
    monkeypatch.setattr(cpu, "int8_dot_products", lambda: False)
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), prefill_precision="int8")


@case("prefill-int8-slower-than-fp32")
def _(tiny_model, tmp_path, monkeypatch):
    from minigen.kernels import cpu, fastpaths
    from minigen.kernels.probes import Measurement
    from minigen.steps.choose import measurements
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "int8_dot_products", lambda: True)
    fastpaths.forget()
    try:
        paths = measurements(tiny_model)
        for backend in ("c", "onednn", "int_mm"):  # every int8 product 4x slower than fp32's
            paths.measured[f"int8_{backend}"] = Measurement(f"int8_{backend}", f"the {backend} product", "the fp32 product",
                                                            0.004, 0.001)
        with pytest.warns(fastpaths.FastPathNotice, match=r"prefill_precision='int8' runs .* 0\.25x its reference"):
            out = minigen.generate(tiny_model, torch.randint(0, 97, (1, 24)), max_new_tokens=2, stop_token_ids=[],
                                   prefill_precision="int8")
        assert out.tokens.shape == (1, 26)
    finally:
        fastpaths.forget()


def _fastpaths_case(tiny_model, tmp_path, monkeypatch, damage):
    """Run a generation over a fast paths' cache damaged by `damage(path)`; the number of warnings it gave."""
    import warnings
    from minigen.kernels import fastpaths
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    fastpaths.forget()
    try:
        damage(fastpaths.cache_file())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = minigen.generate(tiny_model, torch.randint(0, 97, (1, 24)), max_new_tokens=3, stop_token_ids=[])
        assert out.tokens.shape == (1, 27)
        return [str(w.message) for w in caught if issubclass(w.category, fastpaths.FastPathNotice)]
    finally:
        fastpaths.forget()


@case("fastpaths-file-damaged")
def _(tiny_model, tmp_path, monkeypatch):
    for text in ("", '{"machine": "x", "entr', "[1, 2]", '{"entries": {"D576-F1536-H9-3x64@1": {"c_matvec": 7}}}'):
        def damage(path, text=text):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        _fastpaths_case(tiny_model, tmp_path, monkeypatch, damage)
        from minigen.kernels import fastpaths
        saved = json.loads(fastpaths.cache_file().read_text())  # rewritten whole
        assert "c_matvec" in saved["entries"]["D576-F1536-H9-3x64@1"], text


@case("fastpaths-cache-unwritable")
def _(tiny_model, tmp_path, monkeypatch):
    def damage(path):
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        path.parent.write_text("a file where the folder goes")
    notices = _fastpaths_case(tiny_model, tmp_path, monkeypatch, damage)
    assert any("could not keep the fast paths' measurements" in n for n in notices), notices


# ---------------------------------------------------------------- parallelism
TP_SPLITTABLE = dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=6, intermediate_size=96)


def tiny_shard():
    """Rank 0's shard of a tiny Llama split over 2 (no forward runs, so no process group is needed)."""
    return minigen.parallel.shard_model(minigen.from_hf(tiny_hf("llama", **TP_SPLITTABLE)), 0, 2)


@case("tp-size-does-not-divide")
def _(smollm2, monkeypatch):
    monkeypatch.setattr(loading, "read_safetensors", lambda *a, **k: pytest.fail("read the weights before the check"))
    minigen.load("smollm2-135m", tp_size=2)


@case("tp-outside-a-group")
def _(smollm2):
    minigen.load("smollm2-135m", tp_size=3)


@case("tp-fused")
def _():
    sharded = tiny_shard()
    for key in ("compile",):
        with pytest.raises(errors.ConfigError, match=rf"{key}=True .*tensor-parallel model \(tp_size=2\)"):
            minigen.make_plan(sharded, GenerationConfig(**{key: True}))
    minigen.make_plan(sharded, GenerationConfig(fused_decode=True))


@case("tp-engine")
def _():
    Engine(tiny_shard())


@case("tp-rank-dies")
def _():
    hf = tiny_hf("llama", **TP_SPLITTABLE)
    cfg, state = config_from_hf(hf.config.to_dict()), {k: v.clone() for k, v in hf.state_dict().items()}
    start = time.monotonic()
    try:
        minigen.parallel.run_ranks(tp_workers.dies_mid_generation, 2, args=(cfg, state, torch.tensor([[1, 2, 3]]), 8, 1, 5),
                                   timeout=60)
    finally:
        assert time.monotonic() - start < 60


@case("cli-tp-not-dividing")
def _(monkeypatch):
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("ranks started before the check"))
    cli("generate", "hello", "--tp", "2")


@case("cli-tp-with-draft")
def _(monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("the model loaded before the check"))
    cli("generate", "hello", "--tp", "3", "--draft", "layers:20")


# issue 25's cases live in their own module; importing it registers them before the rows run
import test_hardening  # noqa: E402,F401


# ---------------------------------------------------------------- every row, run
@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"], marks=CASES[r["id"]][1] if r["id"] in CASES else ())
                                 for r in ROWS])
def test_row(row, request):
    if row["id"] not in CASES:
        pytest.fail(f"no case for row {row['id']}")
    if row["error"] is None:  # a behaviour: the case asserts it, and raises nothing
        run_case(row["id"], request)
        return
    with pytest.raises(errors.MinigenError) as excinfo:
        run_case(row["id"], request)
    e = excinfo.value
    assert type(e).__name__ == row["error"], f"raised {type(e).__name__}: {e}"
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), \
        f"{type(e).__name__} carries a chained trace: {e.__context__!r}"
    assert "\n" not in str(e).strip(), "the message is one line"
    for fragment in row["fragments"]:
        assert fragment in str(e), f"{fragment!r} not in: {e}"


# ---------------------------------------------------------------- the run plan
@case("plan-beside-a-config")
def _(tiny_model):
    ids = torch.tensor([[1, 2, 3]])
    plan = minigen.make_plan(tiny_model, GenerationConfig(max_new_tokens=3), 1, max_len=6)
    with pytest.raises(errors.ConfigError, match="give a plan or a config, not both"):
        minigen.generate(tiny_model, ids, plan=plan, max_new_tokens=3)
    minigen.generate(tiny_model, ids, GenerationConfig(max_new_tokens=3), plan=plan)


@case("plan-for-another-batch")
def _(tiny_model):
    plan = minigen.make_plan(tiny_model, GenerationConfig(max_new_tokens=3), 1, max_len=10)
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3], [4, 5, 6]]), plan=plan)


@case("plan-for-another-place")
def _(tiny_model):
    plan = minigen.make_plan(tiny_model, GenerationConfig(max_new_tokens=3), 2, max_len=10)
    minigen.generate(tiny_model, [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], plan=plan)


@case("plan-where-unknown")
def _(tiny_model):
    minigen.make_plan(tiny_model, GenerationConfig(), 1, where="server")


@case("plan-not-a-plan")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), plan="fused")


# ---------------------------------------------------------------- the server
def serve_tiny(model, folder, **kw) -> tuple[TestClient, AsyncEngine]:
    """The app over the tiny model named 'tiny', called in-process (no lifespan: these requests are
    refused before the engine would step)."""
    engine = AsyncEngine(Engine(model, max_batch_size=2, num_blocks=16), max_waiting=kw.pop("max_waiting", 8))
    app = make_app(engine, loading.load_tokenizer(folder), "tiny", max_context=128, **kw)
    return TestClient(app), engine


def openai_error(r, status: int, *fragments: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    assert err["param"] == param
    for fragment in fragments:
        assert fragment in err["message"], (fragment, err["message"])
    return err


@case("serve-bad-field")
def _(tiny_model, tiny_folder):
    http, _ = serve_tiny(tiny_model, tiny_folder)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "temperature": 3})
    openai_error(r, 400, "invalid 'temperature': Input should be less than or equal to 2", param="temperature")
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": "ten"})
    openai_error(r, 400, "invalid 'max_tokens'", "valid integer", param="max_tokens")


@case("serve-context-overflow")
def _(tiny_model, tiny_folder):
    http, _ = serve_tiny(tiny_model, tiny_folder)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 120, "max_tokens": 20})
    openai_error(r, 400, "this request has 120 prompt tokens + max_tokens=20 = 140 tokens, and the model's context "
                 "is 128 tokens", "lower max_tokens to at most 8", param="max_tokens")


@case("serve-unknown-model")
def _(tiny_model, tiny_folder):
    http, _ = serve_tiny(tiny_model, tiny_folder)
    err = openai_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "w1"}), 404,
                       "the model 'gpt-4' does not exist: this server serves 'tiny'", param="model")
    assert err["code"] == "model_not_found"


@case("serve-missing-key")
def _(tiny_model, tiny_folder):
    http, _ = serve_tiny(tiny_model, tiny_folder, api_key="sesame")
    for path in ("/v1/models", "/metrics"):
        openai_error(http.get(path), 401, "a missing or wrong API key")
        openai_error(http.get(path, headers={"Authorization": "Bearer nope"}), 401, "a missing or wrong API key")
    assert http.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert http.get("/health").status_code == 200


@case("serve-queue-full")
def _(tiny_model, tiny_folder):
    http, engine = serve_tiny(tiny_model, tiny_folder, max_waiting=1)
    engine.engine.add_request([1, 2, 3], max_new_tokens=2, arrival_s=3600.0)  # waits an hour to be admitted
    try:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 2})
        openai_error(r, 429, "the server is busy", "max_waiting=1")
        assert r.headers["retry-after"] == "1"
        assert len(engine.engine.waiting) == 1  # nothing was queued
    finally:
        engine.close()


@case("serve-bad-json")
def _(tiny_model, tiny_folder):
    http, _ = serve_tiny(tiny_model, tiny_folder)
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    openai_error(r, 400, "the request body is not valid JSON")


@case("serve-unsupported-field")
def _(tiny_model, tiny_folder):
    http, _ = serve_tiny(tiny_model, tiny_folder)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "echo": True})
    openai_error(r, 400, "'echo' is one of OpenAI's fields that minigen serve does not implement",
                 "so it would be ignored: drop it", param="echo")
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "echo": False})
    assert ok.status_code == 200  # its no-op value asks for nothing
