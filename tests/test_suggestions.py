"""Every error that suggests a value suggests one that works: the test takes the value out of the
message and tries it. Regression: with head dim 16, quant_bits=4 said "use a divisor of 16 (e.g. 32)"."""

from __future__ import annotations

import re

import pytest
import torch

import minigen
from conftest import tiny_hf
from minigen import ConfigError, GenerationConfig, PromptError
from minigen.run_rules import Run, check_run
from minigen.checkpoints.model_config import ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def suggested(message: str, key: str) -> int:
    """The value the message proposes: after "e.g.", or the last `key=N` (the first names the bad one)."""
    found = re.search(rf"e\.g\. (?:{key}=)?(\d+)", message) or list(re.finditer(rf"{key}=(\d+)", message))[1:2]
    assert found, f"no value suggested for {key} in: {message}"
    return int(found[0].group(1) if isinstance(found, list) else found.group(1))


def shapes(head_dim: int) -> Run:
    return Run.of_shapes(ModelConfig(arch="llama", vocab_size=100, dim=4 * head_dim, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=head_dim, hidden_dim=8, max_seq_len=64))


@pytest.mark.parametrize("head_dim", [8, 12, 16, 24, 40, 64, 80, 96, 128])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_suggested_group_size_fits_the_model(head_dim, bits):
    for G in range(1, 130):
        try:
            config = GenerationConfig(quant_bits=bits, quant_group_size=G)
        except ConfigError as e:  # codes would not fill whole bytes
            config = GenerationConfig(quant_bits=bits, quant_group_size=suggested(str(e), "quant_group_size"))
        try:
            check_run(config, shapes(head_dim))
        except ConfigError as e:
            msg = str(e)
            fixed = (config.replace(quant_bits=8, quant_group_size=32 if head_dim % 32 == 0 else 1)
                     if "use quant_bits=8" in msg else config.replace(quant_group_size=suggested(msg, "quant_group_size")))
            check_run(fixed, shapes(head_dim))  # raises if the suggestion was wrong


@pytest.mark.parametrize("block_size", [1, 5, 16, 24, 33, 100])
@pytest.mark.parametrize("group_size", [4, 8, 32])
def test_a_suggested_block_size_holds_whole_groups(block_size, group_size):
    try:  # refused when the config is built: the rule reads no model
        config = GenerationConfig(quant_bits=4, quant_group_size=group_size, cache_chunk_size=block_size)
    except ConfigError as e:
        config = GenerationConfig(quant_bits=4, quant_group_size=group_size,
                                  cache_chunk_size=suggested(str(e), "cache_chunk_size"))  # raises if it was wrong
    check_run(config, shapes(64))


def test_a_suggested_sink_count_and_residual_build():
    with pytest.raises(ConfigError) as e:
        GenerationConfig(window_size=3, sink_tokens=4)
    assert "sink_tokens in [0, 3]" in str(e.value)
    GenerationConfig(window_size=3, sink_tokens=3)
    with pytest.raises(ConfigError) as e:
        GenerationConfig(quant_bits=4, quant_group_size=16, quant_residual=8)
    GenerationConfig(quant_bits=4, quant_group_size=16, quant_residual=16)  # ">= quant_group_size=16"
    assert ">= quant_group_size=16" in str(e.value)


def test_a_suggested_max_new_tokens_fits_the_context():
    model = minigen.from_hf(tiny_hf("llama"))  # a 128-token context
    prompt = torch.zeros(1, 100, dtype=torch.long)
    with pytest.raises(PromptError) as e:
        minigen.generate(model, prompt, max_new_tokens=40)
    n = int(re.search(r"lower max_new_tokens to (\d+)", str(e.value)).group(1))
    assert minigen.generate(model, prompt, max_new_tokens=n, stop_token_ids=[]).tokens.shape == (1, 128)
