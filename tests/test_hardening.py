"""Issue 25's hardening, one case per reproducer: what hostile input found, and what it gets now.

Each `@case` here is a row of docs/bad_inputs.md, run by `test_row` in tests/test_bad_inputs.py
(which imports this module), exactly as that module's own cases are: an error row must raise its
named `MinigenError` with the quoted text, a behaviour row asserts the behaviour itself. Case
functions take pytest fixtures by name (tiny_model, tmp_path, monkeypatch, ...). The tests below
the cases (the Engine's property tests) run here.
"""

from __future__ import annotations

import pytest
import torch

import minigen
from test_bad_inputs import case
# config (6-8)
from minigen import ConfigError, GenerationConfig
from minigen.combinations import RUN_RULES
from minigen.numerics.weight_quant import check_weight_bits, quantize_weights, quantized
from conftest import tiny_hf
from test_bad_inputs import cli

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes


# ---------------------------------------------------------------- 4-9: config, CLI integers, sizes, argument types
# config (6-8)
_CONFIG_DEEP = 100_000  # levels of nesting: far past Python's recursion limit (1,000)


@case("config-typo-assigned")
def _():
    cfg = GenerationConfig()
    try:
        cfg.max_new_token = 3
    finally:
        assert "max_new_token" not in vars(cfg)  # the typo was not stored
        cfg.max_new_tokens = 3  # a field is still assigned (and checked)
        assert cfg.max_new_tokens == 3


@case("config-unknown-keyword")
def _():
    GenerationConfig(max_new_token=3)


@case("config-weight-bits-in-config")
def _():
    GenerationConfig(weight_bits=8)


@case("config-engine-key-in-config")
def _():
    GenerationConfig(max_batch_size=8)


@case("config-transformers-key")
def _():
    GenerationConfig(repetition_penalty=1.2)


@case("config-override-misplaced")
def _(tiny_model):
    minigen.generate(tiny_model, torch.tensor([[1, 2, 3]]), weight_bits=8)


@case("config-file-duplicate-key")
def _(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3, "max_new_tokens": 5}')
    GenerationConfig.from_json(tmp_path / "generation_config.json")


@case("config-file-nested-deep")
def _(tmp_path):
    (tmp_path / "generation_config.json").write_text("[" * _CONFIG_DEEP + "]" * _CONFIG_DEEP)
    GenerationConfig.from_json(tmp_path / "generation_config.json")


@case("config-set-nested-deep")
def _():
    cli("generate", "hello", "--set", "stop_token_ids=" + "[" * _CONFIG_DEEP + "]" * _CONFIG_DEEP)


@case("config-quant-block-splits-groups")
def _():
    GenerationConfig(quant_bits=4, quant_group_size=8, cache_chunk_size=4)  # no model: refused when built


@case("load-weight-bits-float")
def _(tiny_folder):
    minigen.load(tiny_folder, weight_bits=8.0)


@case("quantize-weights-float-bits")
def _():
    model = minigen.from_hf(tiny_hf("llama"))  # its own copy: a case must not quantize the shared tiny_model
    try:
        quantize_weights(model, 4.0)
    finally:
        assert not quantized(model), "refused, yet the weights were quantized"


def test_config_every_run_rule_reads_the_model_or_machine():
    """A rule that reads only the config belongs to the config's own checks, when it is built
    (regression: cache_chunk_size % quant_group_size waited for generate)."""
    assert all(reads for _, reads, _, _ in RUN_RULES), [f for f, reads, _, _ in RUN_RULES if not reads]


@pytest.mark.parametrize("bits", [8.0, 4.0, True])
def test_config_bit_counts_are_integers(bits):
    """quantize_weights and load take the int 8 or 4 (8.0 == 8 in Python; a bool is no count)."""
    with pytest.raises(ConfigError, match="use the integer 8 or 4"):
        check_weight_bits(bits)


# ---------------------------------------------------------------- 10-12: output files and what is cached


# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum


# ---------------------------------------------------------------- 14: the 4-bit cache's scales


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
