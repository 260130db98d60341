"""llama.cpp's formats for the race (measure/gguf_formats.py, bench --llama-format, scripts/llama_cpp_race.py).

The requantized files are checked against a numpy reference written here from llama.cpp's
quantize_row_q4_0_ref / q8_0_ref (not gguf's own quantize), on a small GGUF made in tmp_path; one
test requantizes the real bundled file (a few seconds) for the tensor types llama-quantize writes.
llama-cpp-python is never needed: its engine is driven with a stand-in module."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants

from minigen.__main__ import main
from minigen.errors import BenchError
from minigen.loading import default_gguf_path
from minigen.measure import gguf_formats, llama_cpp

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "llama_cpp_race.py"


# ---------------------------------------------------------------- numpy references (llama.cpp's ggml-quants.c)
def q4_0_reference(x: np.ndarray) -> np.ndarray:
    """x [rows, n] -> its Q4_0 values: per block of 32, d = the signed max / -8, codes trunc(x/d + 8.5) in 0..15."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    at = np.abs(blocks).argmax(axis=1)
    d = blocks[np.arange(len(blocks)), at] / -8
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    codes = np.minimum(15, np.trunc(blocks * inv[:, None] + 8.5)).astype(np.int8)
    return ((codes - 8) * d.astype(np.float16).astype(np.float32)[:, None]).reshape(x.shape)


def q8_0_reference(x: np.ndarray) -> np.ndarray:
    """x [rows, n] -> its Q8_0 values: per block of 32, d = max |x| / 127, codes round(x/d) half away from zero."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=1) / 127
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inv[:, None]
    codes = np.trunc(scaled + np.copysign(0.5, scaled))
    return (codes * d.astype(np.float16).astype(np.float32)[:, None]).reshape(x.shape)


REFERENCES = {"Q4_0": (Q.Q4_0, q4_0_reference), "Q8_0": (Q.Q8_0, q8_0_reference)}


@pytest.fixture
def small_gguf(tmp_path) -> Path:
    """A llama-shaped GGUF as the bundled one is: Q4_1 matrices, a Q8_0 tied head, F32 norms, KV fields of each kind."""
    rng = np.random.default_rng(0)
    path = tmp_path / "small-Q4_1.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<|im_end|>"])
    w.add_key_value("general.file_type", 3, GGUFValueType.UINT32)  # MOSTLY_Q4_1
    w.add_tensor("token_embd.weight", quants.quantize(rng.standard_normal((96, 64), np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight"):
        w.add_tensor(name, quants.quantize(rng.standard_normal((128, 64), np.float32), Q.Q4_1), raw_dtype=Q.Q4_1)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensors(path: Path) -> dict:
    return {t.name: t for t in GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0"])
def test_requantized_types_fields_and_values(small_gguf, tmp_path, fmt):
    kind, reference = REFERENCES[fmt]
    path = gguf_formats.requantized_gguf(fmt, source=small_gguf, folder=tmp_path / "cache")
    assert path == tmp_path / "cache" / f"small-Q4_1-{fmt}.gguf"
    old, new = tensors(small_gguf), tensors(path)
    assert {n: t.tensor_type for n, t in new.items()} == {
        "token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": kind, "blk.0.ffn_up.weight": kind,
        "blk.0.attn_norm.weight": Q.F32}  # the tied head Q8_0 (rows of 64, not of 256), the norm F32
    assert np.array_equal(new["token_embd.weight"].data, old["token_embd.weight"].data)  # copied, not requantized
    assert np.array_equal(new["blk.0.attn_norm.weight"].data, old["blk.0.attn_norm.weight"].data)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight"):
        assert [int(n) for n in new[name].shape] == [int(n) for n in old[name].shape]
        expected = reference(quants.dequantize(old[name].data, Q.Q4_1))
        got = quants.dequantize(new[name].data, kind)
        np.testing.assert_array_equal(got, expected)
    before, after = GGUFReader(str(small_gguf)).fields, GGUFReader(str(path)).fields
    assert set(after) == set(before)
    for key in before:
        if key != "general.file_type":
            assert after[key].contents() == before[key].contents(), key
    assert after["general.file_type"].contents() == {"Q4_0": 2, "Q8_0": 7}[fmt]


def test_the_reference_can_fail():
    """The numpy reference tells Q4_0 from Q4_1: the check above compares something."""
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    q4_1 = quants.dequantize(quants.quantize(x, Q.Q4_1), Q.Q4_1)
    assert not np.array_equal(q4_1, q4_0_reference(x))
    np.testing.assert_array_equal(quants.dequantize(quants.quantize(x, Q.Q4_0), Q.Q4_0), q4_0_reference(x))


def test_made_once_and_a_damaged_file_is_made_again(small_gguf, tmp_path, capsys):
    folder = tmp_path / "cache"
    path = gguf_formats.requantized_gguf("Q4_0", source=small_gguf, folder=folder)
    assert "writing" in capsys.readouterr().err
    stamp = path.stat().st_mtime_ns
    assert gguf_formats.requantized_gguf("q4_0", source=small_gguf, folder=folder) == path
    assert path.stat().st_mtime_ns == stamp and capsys.readouterr().err == ""  # reused, not written again
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)  # a copy cut short
    assert gguf_formats.damaged(path)
    gguf_formats.requantized_gguf("Q4_0", source=small_gguf, folder=folder)
    assert "damaged" in capsys.readouterr().err
    assert path.stat().st_size == size and gguf_formats.damaged(path) is None
    assert tensors(path)["blk.0.attn_q.weight"].tensor_type == Q.Q4_0


def test_q4_1_is_the_source_itself_and_other_formats_are_refused(small_gguf, tmp_path):
    assert gguf_formats.requantized_gguf("Q4_1", source=small_gguf, folder=tmp_path) == small_gguf
    with pytest.raises(BenchError, match="Q4_1, Q4_0, Q8_0"):
        gguf_formats.requantized_gguf("Q5_0", source=small_gguf, folder=tmp_path)


def test_the_bundled_file_gets_llama_quantizes_types(tmp_path):
    """The real Q4_1 file -> Q4_0 as `llama-quantize --allow-requantize ... Q4_0` writes it: the tied
    head stays Q8_0 (576-long rows: its Q6_K falls back), 210 matrices Q4_0, 61 norms F32."""
    source = default_gguf_path()
    path = gguf_formats.requantized_gguf("Q4_0", source=source, folder=tmp_path)
    kinds = [t.tensor_type for t in GGUFReader(str(path)).tensors]
    assert (kinds.count(Q.Q4_0), kinds.count(Q.Q8_0), kinds.count(Q.F32), len(kinds)) == (210, 1, 61, 272)


# ---------------------------------------------------------------- bench --engine llama.cpp
def test_llama_format_needs_the_engine_and_a_known_format(capsys):
    assert main(["bench", "--llama-format", "Q4_0"]) == 2
    assert "add --engine llama.cpp" in capsys.readouterr().err
    assert main(["bench", "--engine", "llama.cpp", "--llama-format", "Q5_0"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bench_without_llama_cpp_says_how_to_install(capsys):
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here")
    assert main(["bench", "--engine", "llama.cpp", "--llama-format", "q4_0", "--no-baseline"]) == 2
    assert "pip install llama-cpp-python" in capsys.readouterr().err


def test_formats_default_to_all_three_and_each_is_an_engine(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if installed
    assert llama_cpp.check_llama_cpp("smollm2-135m") == ("Q4_1", "Q4_0", "Q8_0")
    assert llama_cpp.check_llama_cpp("smollm2-135m", ["q8_0", "Q8_0", "Q4_0"]) == ("Q8_0", "Q4_0")
    opened = []

    class Llama:  # llama-cpp-python's class, as the engine uses it
        def __init__(self, model_path, **kwargs):
            opened.append(Path(model_path).name)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=Llama))
    files = {fmt: tmp_path / f"m-{fmt}.gguf" for fmt in ("Q4_1", "Q8_0")}
    for fmt, path in files.items():
        path.write_bytes(b"x" * len(fmt) * 10)
    monkeypatch.setattr(llama_cpp, "requantized_gguf", files.__getitem__)
    engines = llama_cpp.llama_cpp_engines(torch.tensor([[1, 2, 3]]), 16, ("Q4_1", "Q8_0"))
    assert list(engines) == ["llama.cpp Q4_1", "llama.cpp Q8_0"]
    assert opened == ["m-Q4_1.gguf", "m-Q8_0.gguf"]
    assert [size for _, size in engines.values()] == [40, 40]


# ---------------------------------------------------------------- scripts/llama_cpp_race.py
def race(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "LLAMA_BENCH"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**environ, **(env or {})}, cwd=ROOT)


def test_race_refuses_a_missing_or_unrunnable_binary(tmp_path):
    done = race()
    assert done.returncode == 2 and "--llama-bench PATH or LLAMA_BENCH" in done.stderr
    done = race(env={"LLAMA_BENCH": str(tmp_path / "nowhere")})
    assert done.returncode == 2 and "no such file" in done.stderr
    plain = tmp_path / "llama-bench"
    plain.write_text("")
    done = race("--llama-bench", str(plain), "--rounds", "1")
    assert done.returncode == 2 and "not executable" in done.stderr
    assert "Traceback" not in done.stderr
    done = race("--llama-bench", str(plain), "--rounds", "0")
    assert done.returncode == 2 and "at least 1" in done.stderr


@pytest.fixture
def race_module():
    spec = importlib.util.spec_from_file_location("llama_cpp_race", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_binary(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "llama-bench"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_race_reads_llama_bench_json_and_says_when_it_fails(race_module, tmp_path):
    ok = fake_binary(tmp_path, """echo '[{"n_prompt": 512, "n_gen": 0, "avg_ts": 900.5},
{"n_prompt": 0, "n_gen": 128, "avg_ts": 210.25}]'""")
    assert race_module.llama_bench(ok, Path("m.gguf"), 2) == {"prompt": 900.5, "decode": 210.25}
    failing = fake_binary(tmp_path, "echo 'error: failed to load model' >&2; exit 3")
    with pytest.raises(race_module.RaceError, match="exit code 3:\n  error: failed to load model"):
        race_module.llama_bench(failing, Path("m.gguf"), 2)
    table = race_module.table({"llama.cpp Q4_0": [{"prompt": 900.0, "decode": 210.0}]}, "Some CPU", 2)
    assert "Some CPU, 2 threads" in table and "| llama.cpp Q4_0 | 210.0 | 900.0 |" in table
