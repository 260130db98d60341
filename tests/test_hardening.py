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
# 10-12: output files and what is cached
import errno
import os
import stat
from pathlib import Path

from minigen import errors, paths
from test_bad_inputs import cli

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- 1, 2: sampled rows and tiny temperatures


# ---------------------------------------------------------------- 3, 4: the Engine's requests and sizes


# ---------------------------------------------------------------- 4-9: config, CLI integers, sizes, argument types


# ---------------------------------------------------------------- 10-12: output files and what is cached
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



# ---------------------------------------------------------------- 13, 15: interrupts and the profiler's sum


# ---------------------------------------------------------------- 14: the 4-bit cache's scales


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
