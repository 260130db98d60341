"""Issue 25's hardening, one case per reproducer: what hostile input found, and what it gets now.

Each `@case` here is a row of docs/bad_inputs.md, run by `test_row` in tests/test_bad_inputs.py
(which imports this module), exactly as that module's own cases are: an error row must raise its
named `MinigenError` with the quoted text, a behaviour row asserts the behaviour itself. Case
functions take pytest fixtures by name (tiny_model, tmp_path, monkeypatch, ...). The tests below
the cases (the Engine's property tests) run here.
"""

from __future__ import annotations

import argparse
import collections
import ctypes.util
import errno
import functools
import itertools
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import minigen
from minigen import ConfigError, GenerationConfig, errors, loading, paths
from minigen.__main__ import build_parser, main
from minigen.caches.quantized import QuantizedKVCache
from minigen.run_rules import RUN_RULES
from minigen.measure import plan as cli_plan_module, serve_bench as cli_serve_bench
from minigen.numerics.weight_quant import check_weight_bits, quantize_weights, quantized
from conftest import tiny_hf
from test_bad_inputs import case, cli
from test_loading import save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures
_SAMPLING = dict(max_new_tokens=12, do_sample=True, temperature=1.0, stop_token_ids=[])


def _sampling_prompts() -> list[torch.Tensor]:
    return [torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6]), torch.tensor([5, 3, 5, 8, 9, 7, 9])]


def _sampling_alone(model, prompt: torch.Tensor, seed: int, **config) -> list[int]:
    """The new tokens of `prompt` generated on its own with `seed`."""
    out = minigen.generate(model, prompt[None], seed=seed, **(_SAMPLING | config)).tokens[0]
    return out[prompt.numel():].tolist()


@case("sampling-ragged-rows-independent")
def _(tiny_model):
    prompts = _sampling_prompts()
    out = minigen.generate(tiny_model, prompts, seed=11, **_SAMPLING).tokens
    rows = [o[p.numel():].tolist() for o, p in zip(out, prompts)]
    assert rows == [_sampling_alone(tiny_model, p, 11 + r) for r, p in enumerate(prompts)]
    assert rows[0] != _sampling_alone(tiny_model, prompts[0], 12)  # the seed matters: this can fail


@case("sampling-tensor-rows-independent")
def _(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]])
    out = minigen.generate(tiny_model, ids, seed=2**64 - 2, **_SAMPLING).tokens[:, 5:]
    # row r's seed is (seed + r) mod 2**64: the third row wraps round to 0
    assert [row.tolist() for row in out] == [_sampling_alone(tiny_model, p, s)
                                             for p, s in zip(ids, (2**64 - 2, 2**64 - 1, 0))]


@case("sampling-stream-rows-independent")
def _(tiny_model):
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    out = torch.stack(list(minigen.stream(tiny_model, ids, seed=11, **_SAMPLING)), dim=1)
    assert [row.tolist() for row in out] == [_sampling_alone(tiny_model, p, 11 + r) for r, p in enumerate(ids)]


@case("sampling-parallel-rows-independent")
def _(tiny_model):
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = minigen.parallel_sample(tiny_model, prompt, 3, seed=11, **_SAMPLING).tokens[:, 5:]
    rows = [row.tolist() for row in out]
    assert rows == [_sampling_alone(tiny_model, prompt[0], 11 + r) for r in range(3)]
    assert len({tuple(r) for r in rows}) == 3  # the n samples still differ from each other


@case("sampling-engine-row-zero")
def _(tiny_model):
    prompts = _sampling_prompts()
    engine = minigen.Engine(tiny_model, {"cache_chunk_size": 4})
    for r, p in enumerate(prompts):
        engine.add_request(p, seed=11 + r, **_SAMPLING)
    served = engine.run()
    batch = minigen.generate(tiny_model, prompts, seed=11, **_SAMPLING).tokens
    for r, p in enumerate(prompts):  # request r (seed 11 + r) == row r of a batch seeded 11 == alone
        assert served[r].tolist() == batch[r].tolist() == p.tolist() + _sampling_alone(tiny_model, p, 11 + r)


@case("sampling-speculative-rows-independent")
def _(tiny_model):
    prompts = [torch.tensor([3, 1, 4, 3, 1, 4, 3, 1]), torch.tensor([9, 2, 9, 2, 9])]
    spec = _SAMPLING | dict(speculative_method="ngram", num_speculative_tokens=3)
    out = minigen.generate(tiny_model, prompts, seed=11, **spec).tokens
    rows = [o[p.numel():].tolist() for o, p in zip(out, prompts)]
    assert rows == [_sampling_alone(tiny_model, p, 11 + r, **spec) for r, p in enumerate(prompts)]


@case("config-temperature-denormal")
def _(tiny_model):
    prompts = _sampling_prompts()
    greedy = minigen.generate(tiny_model, prompts, max_new_tokens=8, stop_token_ids=[]).tokens
    for temperature in (5e-324, 1e-40):  # 0.0 in float32, and a float32 subnormal
        tiny = minigen.generate(tiny_model, prompts, max_new_tokens=8, stop_token_ids=[], do_sample=True,
                                temperature=temperature, seed=0).tokens
        assert [t.tolist() for t in tiny] == [g.tolist() for g in greedy]
    assert any(g[-8:].tolist() != [0] * 8 for g in greedy)  # greedy is not the NaN's argmax, token 0


@case("parallel-sample-n-bool")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([[3, 1, 4]]), True)


@case("parallel-sample-list-prompt")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, [1, 2, 3], 2)


@case("parallel-sample-1d-prompt")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([1, 2, 3]), 2)


@case("parallel-sample-float-prompt")
def _(tiny_model):
    minigen.parallel_sample(tiny_model, torch.tensor([[1.0, 2.0]]), 2)


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes
# 3 (engine): add_request's prompts and arrival_s, cancel's ids. Each refused call is made on an engine
# that is already serving; the case checks that the call left it as it was, then lets the error out.
_ENGINE_SERVING = (([5, 6, 7], 3), ([8, 9], 2))  # (prompt, max_new_tokens) of requests 0 and 1


def _engine_serving(model) -> minigen.Engine:
    """An engine in mid-work: requests 0 and 1 added, one step run (both hold blocks)."""
    engine = minigen.Engine(model, {"cache_chunk_size": 4, "stop_token_ids": []}, num_blocks=8)
    for prompt, n in _ENGINE_SERVING:
        engine.add_request(prompt, max_new_tokens=n)
    engine.step()
    return engine


def _engine_state(engine) -> tuple:
    return ([(r.id, r.status, list(r.tokens)) for r in engine.requests.values()], [r.id for r in engine.waiting],
            [r.id for r in engine.running], list(engine.alloc.free), len(engine.steps))


def _engine_refuses(model, call) -> None:
    """Make the refused `call` on a serving engine, check that nothing changed (no id used, no block
    taken or freed), that the next request gets id 2 and every request equals generating it alone;
    then raise the call's error for the row to check."""
    engine = _engine_serving(model)
    before = _engine_state(engine)
    try:
        call(engine)
    except minigen.errors.MinigenError:
        assert _engine_state(engine) == before, "the refused call changed the engine"
        requests = (*_ENGINE_SERVING, ([10, 11, 12, 13], 2))
        assert engine.add_request(requests[2][0], max_new_tokens=requests[2][1]) == 2
        out = engine.run()
        assert sorted(out) == [0, 1, 2] and engine.alloc.n_used == 0
        for rid, (prompt, n) in enumerate(requests):
            alone = minigen.generate(model, torch.tensor([prompt]), max_new_tokens=n, stop_token_ids=[]).tokens[0]
            assert out[rid].tolist() == alone.tolist(), f"request {rid}"
        raise
    pytest.fail("the call was not refused")


@case("engine-prompt-floats")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([1.5, 2.7], max_new_tokens=2))


@case("engine-prompt-bools")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([True, False], max_new_tokens=2))


@case("engine-prompt-float-tensor")
def _(tiny_model):
    for bad in (torch.tensor([True, False]), torch.tensor([[1, 2], [3, 4]]), torch.tensor(3)):  # refused too
        with pytest.raises(minigen.errors.PromptError, match="tensor of shape"):
            _engine_refuses(tiny_model, lambda e: e.add_request(bad, max_new_tokens=2))
    _engine_refuses(tiny_model, lambda e: e.add_request(torch.tensor([1.5, 2.7]), max_new_tokens=2))


@case("engine-prompt-text")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request("hello", max_new_tokens=2))


@case("engine-prompt-none")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request(None, max_new_tokens=2))


@case("engine-prompt-ragged")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([[1, 2], [3]], max_new_tokens=2))


@case("engine-prompt-dict")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request({1: 2}, max_new_tokens=2))


@case("engine-prompt-past-int64")
def _(tiny_model):
    with pytest.raises(minigen.errors.PromptError, match=r"token id -1 \(item 1\)"):  # below 0, refused too
        _engine_refuses(tiny_model, lambda e: e.add_request([3, -1], max_new_tokens=2))
    _engine_refuses(tiny_model, lambda e: e.add_request([3, 2**70], max_new_tokens=2))


@case("engine-prompt-accepted")
def _(tiny_model):
    import numpy as np
    engine = minigen.Engine(tiny_model, {"cache_chunk_size": 4, "stop_token_ids": []}, num_blocks=16)
    forms = ([4, 5, 6], (4, 5, 6), [np.int64(4), np.int32(5), 6], torch.tensor([4, 5, 6]),
             torch.tensor([[4, 5, 6]], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.uint8))
    assert [engine.add_request(f, max_new_tokens=2) for f in forms] == list(range(len(forms)))
    out = engine.run()
    alone = minigen.generate(tiny_model, torch.tensor([[4, 5, 6]]), max_new_tokens=2, stop_token_ids=[]).tokens[0]
    assert all(out[i].tolist() == alone.tolist() for i in range(len(forms)))


@case("engine-arrival-text")
def _(tiny_model):
    with pytest.raises(minigen.errors.ConfigError, match=r"arrival_s=\[1\] is invalid"):  # the row's other value
        _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=[1]))
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s="soon"))


@case("engine-arrival-nan")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=float("nan")))


@case("engine-arrival-inf")
def _(tiny_model):
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=float("inf")))


@case("engine-arrival-negative")
def _(tiny_model):
    with pytest.raises(minigen.errors.ConfigError, match="arrival_s=True is invalid"):  # the row's other value
        _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=True))
    _engine_refuses(tiny_model, lambda e: e.add_request([1, 2], max_new_tokens=2, arrival_s=-1))


@case("engine-arrival-far")
def _(tiny_model, monkeypatch):
    engine = minigen.Engine(tiny_model, {"cache_chunk_size": 4}, num_blocks=8)
    engine.add_request([1, 2], max_new_tokens=2, arrival_s=1e12)  # past what time.sleep takes at once
    naps = []

    class Woke(Exception):
        pass

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            raise Woke
    monkeypatch.setattr(time, "sleep", nap)
    with pytest.raises(Woke):
        engine.run()
    assert all(0 < s <= 3600 for s in naps) and engine.steps == [], naps  # waiting, in naps of at most an hour
    engine.cancel(0)


@case("engine-cancel-not-an-id")
def _(tiny_model):
    for bad in (1.0, "1", None):  # the row's other values, refused as well
        with pytest.raises(minigen.errors.RequestError, match=f"unknown request id {bad!r}"):
            _engine_refuses(tiny_model, lambda e: e.cancel(bad))
    _engine_refuses(tiny_model, lambda e: e.cancel(True))  # True was taken for request 1



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
    GenerationConfig(no_repeat_ngram_size=3)


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
    # --rate inf parses (with --url it sends every request at once); in-process it is refused before
    # the model loads, with the reason
    assert main(["serve-bench", "--rate", "inf"]) == 2
    assert "--rate inf sends every request at once to a server (--url): give a finite rate" in capsys.readouterr().err


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
@case("checkpoint-config-nested-deep")
def _(saved):
    (saved / "config.json").write_text("[" * 100_000 + "]" * 100_000)  # json.loads recursed past the limit
    minigen.load(saved)


@case("profile-trace-missing-folder")
def _(tiny_folder, monkeypatch):
    # it used to run for a minute, fail inside torch's exporter silently, exit 0 and say "Chrome trace: ..."
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("loaded the model before checking --trace"))
    cli("profile", "--model", str(tiny_folder), "--trace", "/nonexistent/dir/t.json")


@case("profile-trace-is-a-folder")
def _(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(minigen, "load", lambda *a, **k: pytest.fail("loaded the model before checking --trace"))
    cli("profile", "--model", str(tiny_folder), "--trace", str(tmp_path))


@case("ledger-json-dev-full")
def _(tmp_path):
    # As root, os.replace swapped /dev/full for a regular file holding the ledger. The case uses its
    # own node of the same device (char 1, 7), so that a regression cannot remove the machine's.
    full = tmp_path / "full"
    try:
        os.mknod(full, stat.S_IFCHR | 0o666, os.stat("/dev/full").st_rdev)
    except (OSError, AttributeError):  # not root: no one but root could replace /dev/full either
        full = Path("/dev/full")
    before = os.stat(full)
    assert stat.S_ISCHR(before.st_mode)
    try:
        cli("ledger", "--json", str(full))
    finally:
        after = os.stat(full)
        assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev, f"{full} was replaced"


@case("ledger-json-fifo")
def _(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    try:
        cli("ledger", "--json", str(fifo))
    finally:
        assert stat.S_ISFIFO(fifo.stat().st_mode)


def _files_full_disk(monkeypatch, after: int = 100) -> None:
    """Every file that minigen.paths opens for writing takes `after` bytes, then the disk is full."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:after])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode else f
    monkeypatch.setattr(paths, "open", full_open, raising=False)


@case("ledger-json-disk-full")
def _(tmp_path, monkeypatch):
    target = tmp_path / "claims.json"
    target.write_text("the previous ledger")
    _files_full_disk(monkeypatch)
    try:
        cli("ledger", "--json", str(target))
    finally:
        assert target.read_text() == "the previous ledger"  # whole or not at all
        assert [p.name for p in tmp_path.iterdir()] == ["claims.json"], "a temporary file was left"


@case("bench-json-disk-full")
def _(tmp_path, monkeypatch):
    from minigen.__main__ import write_json
    _files_full_disk(monkeypatch)
    try:
        write_json({"decode_tok_s": 1.0}, tmp_path / "bench.json", errors.BenchError)
    finally:
        assert list(tmp_path.iterdir()) == [], "a temporary file was left"


def _files_no_leftovers(cache: Path) -> None:
    assert not list(cache.glob(".convert-*")), "a conversion's temporary folder was left"
    assert not (cache / loading.DEFAULT_MODEL).exists(), "a partial model folder was left"


@case("prepare-disk-too-small")
def _(empty_cache, monkeypatch):
    # the bundled GGUF's tensors in fp32 (538 MB) against 200 MB free; empty_cache fails the test
    # if the GGUF is dequantized (read_gguf) before the check
    try:
        loading.default_gguf_path()
    except errors.ModelLoadError as e:
        pytest.skip(str(e))
    empty_cache.mkdir()
    usage = shutil.disk_usage(empty_cache)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=200_000_000))
    try:
        cli("prepare")
    finally:
        _files_no_leftovers(empty_cache)


@case("prepare-disk-fills-up")
def _(files_tiny_cache, monkeypatch):
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    cache = files_tiny_cache.cache
    shutil.rmtree(cache / loading.DEFAULT_MODEL)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    try:
        cli("prepare")
    finally:
        _files_no_leftovers(cache)


def _files_damage(weights: Path, offset: int, data: bytes) -> None:
    with open(weights, "r+b") as f:
        f.seek(offset)
        f.write(data)


@case("cache-weights-overwritten")
def _(files_tiny_cache):
    weights = files_tiny_cache.weights
    size = weights.stat().st_size
    assert size > 65536 + 4096, size  # the damage lies inside the tensors' bytes
    _files_damage(weights, size // 2 - 32768, b"\xff" * 65536)  # 64 KiB of 0xFF in the middle
    minigen.load("smollm2-135m")


@case("cache-weights-bit-flip")
def _(files_tiny_cache):
    weights = files_tiny_cache.weights
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of one weight
    weights.write_bytes(bytes(data))
    minigen.load("smollm2-135m")


@case("cache-weights-truncated")
def _(files_tiny_cache):
    weights = files_tiny_cache.weights
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    minigen.load("smollm2-135m")


@case("prepare-repairs-the-cache")
def _(files_tiny_cache, capsys):
    weights = files_tiny_cache.weights
    good = weights.read_bytes()
    prompt = torch.tensor([[1, 2, 3]])
    expected = minigen.generate(minigen.load("smollm2-135m")[0], prompt, max_new_tokens=4).tokens
    for damage, forget_digest in (("cut", False), ("flip", False), ("cut", True)):
        bad = good[: len(good) // 2] if damage == "cut" else good[:5000] + bytes([good[5000] ^ 1]) + good[5001:]
        weights.write_bytes(bad)
        if forget_digest:  # a cache converted by a minigen older than digests
            paths.digest_path(weights).unlink()
        with pytest.raises(errors.ModelLoadError, match="python -m minigen prepare") if not forget_digest \
                else pytest.raises(errors.ModelLoadError, match="truncated or corrupt"):
            minigen.load("smollm2-135m")
        files_tiny_cache.conversions.clear()
        cli("prepare")
        assert files_tiny_cache.conversions, f"prepare did not convert the {damage} file again"
        assert weights.read_bytes() == good and paths.read_digest(weights) is not None
        model, tok = minigen.load("smollm2-135m")
        assert torch.equal(minigen.generate(model, prompt, max_new_tokens=4).tokens, expected)
    assert "is corrupt" in capsys.readouterr().err
    cli("prepare")  # a sound cache is not converted again
    files_tiny_cache.conversions.clear()
    cli("prepare")
    assert files_tiny_cache.conversions == []


@case("cache-weights-without-digest")
def _(files_tiny_cache):
    # a cache converted before digests: checked by the size its header implies, then given a digest
    weights = files_tiny_cache.weights
    paths.digest_path(weights).unlink()
    minigen.load("smollm2-135m")
    assert paths.read_digest(weights) == {"size": weights.stat().st_size, "sha256": paths.file_sha256(weights)}
    cli("prepare")
    assert files_tiny_cache.conversions == []


def _files_kernel_replaced(kernels: Path, tmp_path: Path, damage) -> None:
    """Copy a built kernel into a fresh cache, damage the library with `damage(bytes) -> bytes`,
    and load it in a subprocess (a SIGBUS there cannot kill pytest): it must rebuild and compute."""
    cache = tmp_path / "cache" / "kernels"
    cache.mkdir(parents=True)
    [built] = kernels.glob("gemv-*.so")
    (cache / built.name).write_bytes(damage(built.read_bytes()))
    paths.digest_path(cache / built.name).write_bytes(paths.digest_path(built).read_bytes())
    check = ("import torch, torch.nn.functional as F\n"
             "from minigen.kernels import build, cpu\n"
             "assert build.status().startswith('built'), build.status()\n"
             "w, x = torch.randn(37, 53), torch.randn(53)\n"
             "torch.testing.assert_close(cpu.matvec(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)\n")
    env = {**os.environ, "MINIGEN_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": str(Path(minigen.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode} (-7 is SIGBUS): {done.stderr[-1500:]}"
    lib = cache / built.name
    assert lib.read_bytes() != damage(built.read_bytes()), "not rebuilt"
    assert paths.digest_mismatch(lib, paths.read_digest(lib)) is None, "rebuilt without its digest"


@case("kernel-cut-to-1000-bytes", pytest.mark.slow)
def _(files_built_kernel, tmp_path):
    _files_kernel_replaced(files_built_kernel, tmp_path, lambda lib: lib[:1000])


@case("kernel-cut-to-22900-bytes", pytest.mark.slow)
def _(files_built_kernel, tmp_path):
    _files_kernel_replaced(files_built_kernel, tmp_path, lambda lib: lib[:22900])


@case("kernel-foreign-library", pytest.mark.slow)
def _(files_built_kernel, tmp_path):
    libm = Path(ctypes.util.find_library("m") or "libm.so.6")
    found = next((p for p in (libm, Path("/lib/x86_64-linux-gnu") / libm.name, Path("/usr/lib") / libm.name,
                              Path("/lib64") / libm.name) if p.is_file()), None)
    if found is None:
        pytest.skip("no libm file found to plant")
    _files_kernel_replaced(files_built_kernel, tmp_path, lambda lib: found.read_bytes())




# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum

_PROFILER_ROOT = Path(__file__).resolve().parents[1]


def _profiler_cli(cwd: Path, *argv: str) -> subprocess.Popen:
    """`python -m minigen ARGV` in a subprocess with pipes (no terminal), this checkout's package, one thread.

    SIGINT is reset to its default in the child, as a terminal's user has it: a test suite started in the
    background (`make test &`, nohup) passes SIGINT down ignored, and Python then never raises
    KeyboardInterrupt, so the ctrl-c row would test nothing."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_PROFILER_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "minigen", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@case("cli-ctrl-c")
def _profiler_ctrl_c(tmp_path):
    """SIGINT while `generate` streams: one line, exit 130, no traceback from the kernel, no file left."""
    folder = tmp_path / "tiny"
    # room for a generation of seconds, and no EOS: with transformers' default eos_token_id=2 this model
    # stops after 53 tokens, about 10 ms after the first, which a busy machine may finish before the signal
    tiny_hf("llama", max_position_embeddings=8192, eos_token_id=None).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    before = sorted(tmp_path.rglob("*"))
    proc = _profiler_cli(tmp_path, "generate", "a b", "--model", str(folder), "--max-new-tokens", "8000")
    try:
        assert proc.stdout.read(1), proc.stderr.read().decode()  # it has started printing tokens
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    err = err.decode()
    assert proc.returncode == 130 and err.splitlines() == ["interrupted"], (proc.returncode, err)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, nothing half-written




# ---------------------------------------------------------------- 14: the 4-bit cache's scales
@case("cache4-bytes")
def _():
    # An fp32 model, head dim 32, 4,096 tokens, 4-bit codes in groups of 32, a 32-token fp32 window.
    # Per quantized token, K and V each hold 32 / 2 = 16 bytes of codes and 4 of scale and zero (a
    # 2-byte pair per 32 channels for values, per channel per 32 tokens for keys: 32 x 4 / 32), 40
    # bytes for both; each of the window's 32 tokens holds 2 x 32 x 4 = 256. Total: 4,064 x 40 +
    # 32 x 256 = 170,752 bytes against fp16's 4,096 x 2 x 32 x 2 = 524,288: 3.07x smaller (fp32
    # scales and zeros gave 4,064 x 48 + 8,192 = 203,264: 2.58x).
    cache = QuantizedKVCache(1, 1, 1, 4096, 32, bits=4, group_size=32, residual=32, dtype=torch.float32,
                             device="meta")  # one layer, one head; sizes only
    assert cache.k.scales.dtype == cache.k.zeros.dtype == cache.v.scales.dtype == torch.bfloat16
    assert cache.nbytes == 4064 * 40 + 32 * 256 == 170_752
    assert 4096 * 2 * 32 * 2 / cache.nbytes > 3.07


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
# Random sequences of add_request, step, cancel and stream, valid and invalid, on the tiny Llama with a
# pool of 6..8 blocks of 4 tokens: requests of up to 23 positions, 1..3 at a time, so the pool runs out
# and sequences are preempted (and recomputed) often. Invariants, after every call: each request sits in
# exactly one of waiting / running / finished, finished exactly once, and what step/stream yielded is
# its output; a refused call raises a MinigenError and changes nothing. At the end (every request run
# out): each finished request equals generating it alone, greedy or sampled with its own seed (a lone
# prompt is row 0, whose generator is seeded by `seed`), and a cancelled one holds a prefix of that.
_ENGINE_BAD_ADDS = [  # (prompt, keyword arguments) that add_request refuses whatever the engine holds
    ([1.5, 2.7], {}), ([True, False], {}), ("hello", {}), (None, {}), ([[1, 2], [3]], {}), ({1: 2}, {}),
    ([3, 2**70], {}), ([], {}), ([3, 97], {}), ([-1], {}), (torch.tensor([1.5]), {}),
    (torch.tensor([[1, 2], [3, 4]]), {}), (torch.tensor([], dtype=torch.long), {}),
    ([1, 2], {"arrival_s": "soon"}), ([1, 2], {"arrival_s": [1]}), ([1, 2], {"arrival_s": float("nan")}),
    ([1, 2], {"arrival_s": float("inf")}), ([1, 2], {"arrival_s": -1}), ([1, 2], {"arrival_s": True}),
    ([1, 2], {"max_new_token": 3}), ([1, 2], {"window_size": 4}), ([1, 2], {"temperature": -1.0}),
    ([1, 2], {"max_new_tokens": -1}), ([1, 2], {"max_new_tokens": 2.5}), ([1, 2], {"seed": "x"}),
    ([1, 2], {"top_k": 0}), ([1, 2], {"top_p": 1.5}), ([1, 2], {"stop_token_ids": [500]}),
    ([1, 2], {"max_new_tokens": 200}),  # past the context of 128
    (list(range(40)), {"max_new_tokens": 8}),  # 47 positions: 12 blocks, more than the pool holds
]
_ENGINE_BAD_IDS = [1.0, "0", None, -1, 10**6]
_ENGINE_SAMPLING = st.one_of(st.just({}), st.fixed_dictionaries({
    "do_sample": st.just(True), "seed": st.integers(0, 2**32), "temperature": st.sampled_from([0.8, 1.3]),
    "top_k": st.sampled_from([None, 8]), "top_p": st.sampled_from([None, 0.9])}))
_engine_seen = collections.Counter()  # what the examples exercised, checked after the run


@functools.cache
def _engine_tiny():
    return minigen.from_hf(tiny_hf("llama"))


@functools.cache
def _engine_alone(prompt: tuple[int, ...], overrides: tuple) -> list[int]:
    """The new tokens of generating `prompt` alone with add_request's `overrides` (sorted key, value pairs)."""
    config = {**dict(overrides), "stop_token_ids": list(dict(overrides)["stop_token_ids"])}
    out = minigen.generate(_engine_tiny(), [torch.tensor(prompt)], **config)
    return out.tokens[0][len(prompt):].tolist()


class _EngineCounting(minigen.Engine):
    """An Engine that counts how often each request finishes (it must be once), and fails where it
    would step forever (a stalled engine: stream() and run() would never return)."""
    finishes: collections.Counter
    steps_taken = 0

    def _finish(self, req, reason: str) -> None:
        self.finishes[req.id] += 1
        super()._finish(req, reason)

    def step(self) -> dict[int, list[int]]:
        self.steps_taken += 1  # an example adds at most 90 requests of at most 24 tokens: far fewer steps
        assert self.steps_taken <= 5000, f"the engine stalled: {len(self.waiting)} waiting, {len(self.running)} running"
        return super().step()


class _EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 8), max_batch_size=st.integers(1, 3),
                budget=st.sampled_from([None, 3, 8]))
    def make(self, num_blocks: int, max_batch_size: int, budget: int | None) -> None:
        self.engine = _EngineCounting(_engine_tiny(), {"cache_chunk_size": 4}, num_blocks=num_blocks,
                                      max_batch_size=max_batch_size, max_num_batched_tokens=budget)
        self.engine.finishes = collections.Counter()
        self.added: list[tuple[tuple[int, ...], tuple]] = []  # per id: prompt, settings
        self.cancelled: set[int] = set()
        self.yielded: dict[int, list[int]] = {}  # per id: the tokens step/stream gave, in order

    def _unfinished(self) -> list[int]:
        return [r.id for r in self.engine.requests.values() if r.status != "finished"]

    def _refused(self, call) -> None:
        before = _engine_state(self.engine)
        with pytest.raises(minigen.errors.MinigenError):
            call()
        assert _engine_state(self.engine) == before, "a refused call changed the engine"
        _engine_seen["refused"] += 1

    @rule(requests=st.lists(st.tuples(
        st.lists(st.integers(0, 96), min_size=1, max_size=12),  # the prompt
        st.sampled_from("ltTr"),  # as a list, tuple, [T] tensor or [1, T] tensor
        st.integers(0, 12),  # max_new_tokens: a request takes up to 23 positions, 6 blocks
        _ENGINE_SAMPLING,
        st.one_of(st.just([]), st.lists(st.integers(0, 96), min_size=2, max_size=8)),  # stop ids: some stop early
        st.sampled_from([None, 0.0])), min_size=1, max_size=3))  # arrival_s
    def add(self, requests) -> None:
        for prompt, form, n, sampling, stop, arrival in requests:
            given = {"l": prompt, "t": tuple(prompt), "T": torch.tensor(prompt), "r": torch.tensor([prompt])}[form]
            overrides = {"max_new_tokens": n, "stop_token_ids": stop, **sampling}
            assert self.engine.add_request(given, arrival_s=arrival, **overrides) == len(self.added)
            self.added.append((tuple(prompt), tuple(sorted({**overrides, "stop_token_ids": tuple(stop)}.items()))))
            self.yielded[len(self.added) - 1] = []

    @rule(bad=st.sampled_from(_ENGINE_BAD_ADDS))
    def add_invalid(self, bad) -> None:
        self._refused(lambda: self.engine.add_request(bad[0], **bad[1]))

    @rule()
    def step(self) -> None:
        for rid, tokens in self.engine.step().items():
            self.yielded[rid] += tokens
        assert all(self.yielded[r.id] == r.output for r in self.engine.requests.values())  # a step yields every new token

    @rule(k=st.integers(1, 10))
    def stream_some(self, k: int) -> None:
        """Take k tokens from stream(), then drop it: the rest of its last step's tokens are never yielded."""
        tokens = self.engine.stream()
        for rid, token in itertools.islice(tokens, k):
            self.yielded[rid].append(token)
        tokens.close()
        for r in self.engine.requests.values():
            assert r.output[:len(self.yielded[r.id])] == self.yielded[r.id], "stream yielded a token out of order"
            self.yielded[r.id] = list(r.output)

    @precondition(lambda self: self._unfinished())
    @rule(data=st.data())
    def cancel(self, data) -> None:
        rid = data.draw(st.sampled_from(self._unfinished()))
        self.engine.cancel(rid)
        self.cancelled.add(rid)

    @rule(data=st.data())
    def cancel_invalid(self, data) -> None:
        finished = [r.id for r in self.engine.requests.values() if r.status == "finished"]
        bad = data.draw(st.one_of(st.sampled_from([True, False]),  # Python's 1 and 0: often live ids
                                  st.sampled_from(_ENGINE_BAD_IDS + finished + [len(self.added)])))
        self._refused(lambda: self.engine.cancel(bad))

    @invariant()
    def each_request_once(self) -> None:
        e = self.engine
        queued = [r.id for r in e.waiting] + [r.id for r in e.running]
        assert len(set(queued)) == len(queued), f"a request is queued twice: {queued}"
        assert [r.id for r in e.requests.values()] == list(range(len(self.added)))
        for r in e.requests.values():
            assert (r.status == "finished") == (r.id not in queued), f"request {r.id}: {r.status}, queued {queued}"
            assert e.finishes[r.id] == (r.status == "finished"), f"request {r.id} finished {e.finishes[r.id]} times"
            assert (r.finish_reason == "cancelled") == (r.id in self.cancelled)
        assert e.alloc.n_used <= e.num_blocks

    def teardown(self) -> None:
        e = self.engine
        out = e.run()  # every request to its end
        self.each_request_once()
        assert sorted(out) == list(range(len(self.added))) and e.alloc.n_used == 0
        for rid, (prompt, overrides) in enumerate(self.added):
            alone, new = _engine_alone(prompt, overrides), out[rid][len(prompt):].tolist()
            assert out[rid][:len(prompt)].tolist() == list(prompt)
            if rid in self.cancelled:
                assert new == alone[:len(new)], f"cancelled request {rid}: {new} is not a prefix of {alone}"
            else:
                assert new == alone, f"request {rid} {overrides}: {new}, alone {alone}"
                _engine_seen["sampled" if dict(overrides).get("do_sample") else "greedy"] += 1
            _engine_seen["stopped"] += e.requests[rid].finish_reason == "stop"
        _engine_seen["cancelled"] += len(self.cancelled)
        _engine_seen["preemptions"] += e.preemptions
        _engine_seen["chunked"] += e.max_num_batched_tokens is not None


def test_engine_api_properties():
    """Random sequences of the Engine's calls keep every invariant (see _EngineMachine)."""
    _engine_seen.clear()
    run_state_machine_as_test(_EngineMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    # the examples reached what the invariants are about (a derandomized run: the same every time)
    for what in ("refused", "sampled", "greedy", "stopped", "cancelled", "preemptions", "chunked"):
        assert _engine_seen[what] > 0, f"no example had {what}: {dict(_engine_seen)}"
