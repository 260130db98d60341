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


def test_sliding_window_caps_the_context():
    """Regression: a Mistral window of 8 gave logits off by ~5 past position 8 (window ignored).

    Within the window sliding attention equals full attention, so the context is capped there.
    """
    hf = tiny_hf("mistral", sliding_window=8)
    model = minigen.from_hf(hf)
    assert model.config.max_seq_len == 8
    ids = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert torch.equal(minigen.generate(model, ids, max_new_tokens=3, stop_token_ids=[]).tokens, want)
    with pytest.raises(minigen.PromptError, match="exceeds the context of 8"):
        minigen.generate(model, ids, max_new_tokens=4)
    # Qwen2 only slides when use_sliding_window is set
    assert minigen.from_hf(tiny_hf("qwen2", sliding_window=8)).config.max_seq_len == 128
    qwen = tiny_hf("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert minigen.from_hf(qwen).config.max_seq_len == 8


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
