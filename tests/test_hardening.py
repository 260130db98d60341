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
# 13, 15 (profiler): interrupts and progress bars
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import tiny_hf
from test_loading import save_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes


# ---------------------------------------------------------------- 4-9: config, CLI integers, sizes, argument types


# ---------------------------------------------------------------- 10-12: output files and what is cached


# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum

_PROFILER_ROOT = Path(__file__).resolve().parents[1]


def _profiler_cli(cwd: Path, *argv: str) -> subprocess.Popen:
    """`python -m minigen ARGV` in a subprocess with pipes (no terminal), this checkout's package, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_PROFILER_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "minigen", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@case("cli-ctrl-c")
def _profiler_ctrl_c(tmp_path):
    """SIGINT while `generate` streams: one line, exit 130, no traceback from the kernel, no file left."""
    folder = tmp_path / "tiny"
    tiny_hf("llama", max_position_embeddings=8192).save_pretrained(folder)  # room for a generation of minutes
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


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
