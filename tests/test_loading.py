"""Loading: saved Hugging Face folders and live models become the same minigen model.

Oracle: the `transformers` model that wrote the folder, run on the same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import loading

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = RTOL = 1e-4  # fp32 against transformers; derivation in test_equivalence.py


def save_tiny_tokenizer(folder) -> None:
    """A 97-word word-level tokenizer, so a tiny folder loads like a real checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(97)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(folder))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_saved_folder_loads_and_matches_transformers(tmp_path, kind):
    hf = tiny_hf(kind, seed=3)
    hf.save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    model, tok = minigen.load(tmp_path)
    assert tok.convert_tokens_to_ids("w17") == 17  # the folder's own tokenizer came with it
    ids = torch.tensor([[5, 17, 3, 96, 40]])
    with torch.no_grad():
        want = hf(ids).logits
    torch.testing.assert_close(model(ids, torch.arange(5)), want, atol=ATOL, rtol=RTOL)


def test_dtype_argument(tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    model, _ = minigen.load(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.head.dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2]]), torch.arange(2)).dtype == torch.float32  # logits stay fp32


def test_tied_embeddings_share_the_embedding(tmp_path):
    hf = tiny_hf("llama", tie_word_embeddings=True)
    model = minigen.from_hf(hf)
    assert model.config.tie_embeddings
    assert model.lm_head is None and model.head is model.embed  # one tensor, not a copy
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(6)), hf(ids).logits, atol=ATOL, rtol=RTOL)


def test_old_style_rope_scaling_is_read():
    """Configs written before transformers 5 keep rope_theta and rope_scaling {"type": ...}."""
    hf = json.loads(tiny_hf("llama").config.to_json_string())
    hf.pop("rope_parameters", None)
    hf.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    cfg = loading.config_from_hf(hf)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def applied_layer_types(hf) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) that the transformers model applies, read from its modelling
    code's inputs: Qwen2 masks layer i by config.layer_types[i] (modeling_qwen2.py); Mistral slides in
    every layer when config.sliding_window is set and ignores layer_types (modeling_mistral.py);
    Llama never slides. (None, None) when every layer is full, as minigen writes it."""
    c, n = hf.config, hf.config.num_hidden_layers
    if c.model_type == "qwen2":
        types = tuple(c.layer_types)
    elif c.model_type == "mistral":
        types = ("sliding_attention",) * n if c.sliding_window is not None else ("full_attention",) * n
    else:
        types = ("full_attention",) * n
    return (types, c.sliding_window) if "sliding_attention" in types else (None, None)


SLIDING_CONFIGS = {  # kind, overrides: every way a config.json says (or does not say) which layers slide
    "mistral window": ("mistral", dict(sliding_window=8)),
    "mistral no window": ("mistral", dict(sliding_window=None)),
    "mistral layer_types ignored": ("mistral", dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"])),
    "qwen2 use_sliding_window false": ("qwen2", dict(sliding_window=8)),
    "qwen2 max_window_layers 0": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                                num_hidden_layers=3)),
    "qwen2 max_window_layers 1": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                                num_hidden_layers=3)),
    "qwen2 max_window_layers n": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=3,
                                                num_hidden_layers=3)),
    "qwen2 layer_types": ("qwen2", dict(use_sliding_window=True, sliding_window=8, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "llama": ("llama", {}),
}


@pytest.mark.parametrize("name", SLIDING_CONFIGS)
def test_layer_types_are_derived_as_transformers_derives_them(name):
    """Regression: a Mistral window of 8 capped the context at 8. Now config.json's window is each
    layer's own, derived from the saved config dict as transformers' model applies it, and the
    context is max_position_embeddings."""
    kind, overrides = SLIDING_CONFIGS[name]
    hf = tiny_hf(kind, **overrides)
    cfg = loading.config_from_hf(json.loads(hf.config.to_json_string()))
    assert (cfg.layer_types, cfg.sliding_window) == applied_layer_types(hf)
    assert cfg.max_seq_len == 128


def test_the_derivation_check_sees_each_kind_of_layer():
    """applied_layer_types above is not trivially None: the cases cover all-sliding, mixed and full."""
    seen = {applied_layer_types(tiny_hf(kind, **kw))[0] for kind, kw in SLIDING_CONFIGS.values()}
    assert None in seen and ("sliding_attention",) * 2 in seen
    assert ("full_attention", "sliding_attention", "sliding_attention") in seen
    assert ("sliding_attention", "full_attention", "sliding_attention") in seen


def test_a_llama_config_with_layer_types_stays_full():
    """Regression: attention_layers read layer_types for any model_type, and slid a Llama layer that
    transformers' Llama (no sliding window in its attention) runs in full: logits off by 4.4."""
    hf = tiny_hf("llama", sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    cfg = loading.config_from_hf(json.loads(hf.config.to_json_string()))
    assert (cfg.layer_types, cfg.sliding_window) == applied_layer_types(hf) == (None, None)


@pytest.mark.parametrize("kind, tied", [("llama", False), ("llama", True), ("qwen2", False), ("gpt2", True)])
def test_from_hf_shares_no_tensor_with_the_transformers_model(kind, tied):
    """Regression: the embedding, o_proj and the norms were shared and the rest copied, so an
    in-place change to one model changed the other's logits."""
    hf = tiny_hf(kind, tie_word_embeddings=tied) if kind != "gpt2" else tiny_hf(kind)
    model = minigen.from_hf(hf)
    theirs = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    assert not any(p.untyped_storage().data_ptr() in theirs for p in model.parameters())
    assert (model.head is model.embed) == tied  # minigen's own tie survives the copy


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16)])
def test_dtype_by_name(tmp_path, name, dtype):
    """Regression: dtype="bfloat16" failed with "Invalid device string"."""
    tiny_hf("llama").save_pretrained(tmp_path)
    save_tiny_tokenizer(tmp_path)
    assert minigen.load(tmp_path, dtype=name)[0].dtype == dtype
    assert minigen.from_hf(tiny_hf("llama"), dtype=name).dtype == dtype


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "int8", "bf16", None])
def test_other_dtypes_are_refused_before_loading(tmp_path, dtype):
    """Regression: dtype=torch.int8 loaded every weight as 0 without a word."""
    with pytest.raises(minigen.ConfigError, match="dtype=.* is not supported: use torch.float32"):
        minigen.load(tmp_path / "not-even-there", dtype=dtype)
