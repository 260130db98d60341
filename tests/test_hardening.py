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
import ctypes.util
import errno
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from minigen import errors, loading, paths
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


# ---------------------------------------------------------------- 14: the 4-bit cache's scales


# ---------------------------------------------------------------- the Engine's API, property tests (hypothesis)
