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
# cli (4, 5, 9)
import argparse
import tracemalloc
from minigen.__main__ import build_parser, main
from minigen.measure import plan as cli_plan_module, serve_bench as cli_serve_bench
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


# cli (4, 5, 9)
@case("engine-num-blocks-past-memory")
def _(tiny_model):
    minigen.Engine(tiny_model, num_blocks=10**12)  # was a bare MemoryError from the allocator's list


@case("plan-batch-past-memory")
def _(tiny_model):
    tracemalloc.start()
    try:
        p = minigen.plan(tiny_model.config, batch=10**12, context=100, budget_bytes=10**9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not p.fits and p.smallest_budget > 10**15  # it says "does not fit", with the bytes
    assert peak < 50 * 2**20, f"the plan allocated {peak:,} bytes"  # was a MemoryError building 10**12 rows


@case("plan-cli-batch-past-memory")
def _(tiny_model, monkeypatch, capsys):
    monkeypatch.setattr(cli_plan_module, "model_config", lambda name: tiny_model.config)
    status = main(["plan", "--model", "tiny", "--batch", "1000000000000", "--context", "100",
                   "--budget-bytes", "1000000000"])
    out = capsys.readouterr().out
    assert status == 0 and "nothing fits: the smallest option needs" in out, out


@case("plan-model-not-a-name")
def _():
    minigen.plan(42)


@case("serve-bench-requests-past-memory")
def _(monkeypatch):
    monkeypatch.setattr(cli_serve_bench, "load_tokenizer", lambda folder: pytest.fail("loaded before refusing"))
    cli("serve-bench", "--requests", "1000000000000")  # was numpy's _ArrayMemoryError


def _cli_refused(capsys, *argv: str) -> str:
    """Run the command line on argv; assert it exits 2 with argparse's usage -> its message."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@case("cli-serve-bench-negative-seed")
def _(capsys, monkeypatch):
    monkeypatch.setattr(cli_serve_bench, "serve_bench_cli", lambda *a, **k: pytest.fail("ran"))
    assert _cli_refused(capsys, "serve-bench", "--seed", "-1").endswith(
        "argument --seed: -1 is out of range: use an integer >= 0 and < 2**64")
    assert "2**64" in _cli_refused(capsys, "serve-bench", "--seed", str(2**64))


@case("cli-profile-negative-prompt-len")
def _(capsys, monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("loaded"))
    assert _cli_refused(capsys, "profile", "--prompt-len", "-5").endswith(
        "argument --prompt-len: -5 is out of range: use an integer >= 1")  # was a 2,272-token profile, exit 0


@case("cli-numbers-out-of-range")
def _(capsys):
    for command, flag, bad, fragment in [
            ("serve-bench", "--requests", "0", "use an integer >= 1"),
            ("serve-bench", "--rate", "nan", "use a finite number > 0"),
            ("serve-bench", "--rate", "inf", "use a finite number > 0"),
            ("serve-bench", "--max-batch-size", "-3", "use an integer >= 1"),
            ("serve-bench", "--prompt-median", "0", "use a finite number > 0"),
            ("serve-bench", "--output-median", "-1", "use a finite number > 0"),
            ("serve-bench", "--requests", "1e3", "'1e3' is not an integer"),
            ("profile", "--steps", "0", "use an integer >= 1"),
            ("plan", "--batch", "0", "use an integer >= 1"),
            ("plan", "--context", "-1", "use an integer >= 1"),
            ("plan", "--budget-bytes", "-5", "use an integer >= 1"),
            ("plan", "--cache-chunk-size", "0", "use an integer >= 1")]:
        extra = ["--budget-bytes", "1000"] if command == "plan" and flag != "--budget-bytes" else []
        message = _cli_refused(capsys, command, flag, bad, *extra)
        assert f"argument {flag}: " in message and fragment in message, message


@case("load-device-missing")
def _(tiny_folder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU-only machine, wherever this runs
    minigen.load(tiny_folder, device="cuda")  # was torch's AssertionError


@case("load-device-unknown")
def _(tiny_folder):
    with pytest.raises(minigen.errors.ConfigError, match="device=5 is invalid"):
        minigen.load(tiny_folder, device=5)  # the row's other value, refused as well
    minigen.load(tiny_folder, device="banana")


@case("load-name-not-a-path")
def _():
    with pytest.raises(minigen.errors.ConfigError, match="name_or_path=None is invalid"):
        minigen.load(None)  # the row's other value, refused as well
    minigen.load(123)


# Generate's numeric flags are GenerationConfig fields (the config checks them before the model
# loads) and bench's sizes are check_bench_args's: every other int or float flag has a checked type.
_CLI_CHECKED_ELSEWHERE = {("generate", "--max-new-tokens"), ("generate", "--temperature"), ("generate", "--top-k"),
                          ("generate", "--top-p"), ("generate", "--seed"), ("bench", "--prompt-len"),
                          ("bench", "--new-tokens"), ("bench", "--repeats")}


def test_cli_every_number_flag_is_checked():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    unchecked = [(command, action.option_strings[-1]) for command, parser in sub.choices.items()
                 for action in parser._actions if action.type in (int, float) and not action.choices]
    assert sorted(unchecked) == sorted(_CLI_CHECKED_ELSEWHERE), "give the flag a checked type (__main__.py)"


def test_cli_plan_cache_bytes_are_affine_in_rows(tiny_llama):
    """kv_cache_bytes builds each cache for 1 and 2 rows and extrapolates (a plan for 10**12 rows
    cannot build it): exact while a cache's bytes are affine in its rows. Held against the cache
    built whole for 3 and 5 rows, for every option the planner offers, contiguous and paged."""
    from minigen.caches.make import make_cache
    cfg, context = tiny_llama[1].config, 100
    stub = cli_plan_module._meta_model(cfg, "float32")
    checked = 0
    for chunk in (None, 16):
        for fields, *_ in cli_plan_module.options(cfg, 1, context, cache_chunk_size=chunk):
            config = minigen.GenerationConfig(**fields)
            one, two = (make_cache(stub, config, rows, context).nbytes for rows in (1, 2))
            for batch in (3, 5):
                assert make_cache(stub, config, batch, context).nbytes == one + (batch - 1) * (two - one), fields
                checked += 1
    assert checked >= 32  # 8 storage x window options at context 100, each contiguous and paged, 2 batches


# ---------------------------------------------------------------- 10-12: output files and what is cached


# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum


# ---------------------------------------------------------------- 14: the 4-bit cache's scales


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
