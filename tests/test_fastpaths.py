"""Fast paths measured where they run (kernels/fastpaths.py, kernels/probes.py): a planted slow path
stands aside on "auto" with a notice naming its ratio, a demanded one runs with a warning, and the
measurements are kept per machine in the model cache, atomically, damaged files measured again."""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch

import minigen
from minigen.kernels import build, cpu, fastpaths, probes
from minigen.kernels.probes import FLOOR, Measurement, Probe, Shapes
from minigen.steps import choose, fused
from minigen.steps.eager import EagerStep
from minigen.steps.fused import FusedStep

needs_c = pytest.mark.skipif(not build.available(), reason="minigen's C kernels are not built here")
SHAPES = Shapes(**FLOOR)


def renew() -> None:
    """Forget this process's measurements and remove the cache file: the next call measures again."""
    fastpaths.forget()
    fastpaths.cache_file().unlink(missing_ok=True)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty model cache and no measurement in this process: what a new machine sees."""
    monkeypatch.setenv("MINIGEN_CACHE", str(tmp_path))
    fastpaths.forget()
    yield tmp_path
    fastpaths.forget()  # the next test reads the real cache's measurements again


class FakeLibrary:
    """The C kernels' library with a matrix-vector product that sleeps `delay` seconds and then runs the
    real one, or (delay None) returns at once without computing anything; it counts its calls."""

    def __init__(self, real, delay: float | None):
        self.real, self.delay, self.calls = real, delay, 0

    def gemv_f32(self, *args):
        self.calls += 1
        if self.delay is not None:
            time.sleep(self.delay)
            return self.real.gemv_f32(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _tiny(tiny_llama):
    model = tiny_llama[1]
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    return model, ids


C_MATVEC = next(p for p in probes.PROBES if p.path == "c_matvec")


@needs_c
def test_a_planted_slow_product_stands_aside_on_auto_with_a_notice(tiny_llama, fresh, monkeypatch):
    """A library whose one-row product sleeps 5 ms measures far slower than F.linear: the eager step's
    one-row products then run on torch (the fake is never called) with one notice naming the ratio.
    A library whose product returns at once measures faster, and is called: the test can fail."""
    model, ids = _tiny(tiny_llama)
    real = build.library()
    for delay, expect_aside in ((None, False), (0.005, True)):
        renew()
        fake = FakeLibrary(real, delay)
        monkeypatch.setattr(build, "_lib", fake)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paths = fastpaths.measured(SHAPES, (C_MATVEC,))
            m = paths.get("c_matvec")
            assert m is not None and m.stands_aside == expect_aside, m
            for p in probes.PROBES:  # the other paths as ties: nothing else is measured (or calls the fake)
                paths.measured.setdefault(p.path, Measurement(p.path, p.fast, p.reference, 1.0, 1.0))
            fake.calls = 0
            out = minigen.generate(model, ids, max_new_tokens=6, stop_token_ids=[], fused_decode=False)
        notices = [str(w.message) for w in caught if issubclass(w.category, fastpaths.FastPathNotice)]
        if expect_aside:
            assert fake.calls == 0  # "auto" left the slow product aside
            assert len(notices) == 1 and f"{m.ratio:.2f}x" in notices[0] and "stands aside" in notices[0], notices
            assert m.ratio < 0.5
        else:
            assert fake.calls > 0 and not notices
    monkeypatch.setattr(build, "_lib", real)
    with build.enabled(False):  # torch's ops: the same tokens as the run that left the product aside
        ref = minigen.generate(model, ids, max_new_tokens=6, stop_token_ids=[], fused_decode=False)
    assert torch.equal(out.tokens, ref.tokens)


def _planted(path: str, ratio: float) -> Probe:
    """A probe whose fast call takes 1/ratio times as long as its reference (both sleep)."""
    ref_s = 0.002
    return Probe(path, f"planted {path}", "its reference",
                 lambda s, rows: ((lambda: time.sleep(ref_s / ratio) or 0), (lambda: time.sleep(ref_s))))


@needs_c
def test_a_slow_fused_step_stands_aside_on_auto_and_runs_with_a_warning_when_demanded(tiny_llama, fresh, monkeypatch):
    model, _ = _tiny(tiny_llama)
    config = minigen.GenerationConfig()
    monkeypatch.setattr(fused, "PROBES", (_planted("fused_step", 2.0), _planted("fused_verify", 2.0)))
    assert isinstance(choose.choose_step(model, config, 1), FusedStep)  # faster: auto runs it
    renew()
    monkeypatch.setattr(fused, "PROBES", (_planted("fused_step", 0.25), _planted("fused_verify", 2.0)))
    with pytest.warns(fastpaths.FastPathNotice, match=r"fused C step|planted fused_step.*stands aside"):
        step = choose.choose_step(model, config, 1)
    assert type(step) is EagerStep
    with pytest.warns(fastpaths.FastPathNotice, match=r"fused_decode=True runs planted fused_step, which measured 0\.\d\dx"):
        step = choose.choose_step(model, config.replace(fused_decode=True), 1)
    assert isinstance(step, FusedStep)
    renew()
    monkeypatch.setattr(fused, "PROBES", (_planted("fused_step", 2.0), _planted("fused_verify", 0.25)))
    step = choose.choose_step(model, config, 1)
    assert isinstance(step, FusedStep) and not step.verify_in_c  # the verify chunk goes through torch


def test_a_demanded_prompt_format_slower_than_fp32_runs_with_the_ratio(tiny_llama, fresh):
    model, ids = _tiny(tiny_llama)
    paths = choose.measurements(model)
    paths.measured["bf16_prompt"] = Measurement("bf16_prompt", "oneDNN's bf16 GEMM (a prompt)", "the fp32 product",
                                                0.004, 0.001)
    if not cpu.bf16_dot_products():
        pytest.skip("this CPU has no bf16 dot products: prefill_precision='bfloat16' is refused before")
    with pytest.warns(fastpaths.FastPathNotice, match=r"prefill_precision='bfloat16' runs .* 0\.25x"):
        minigen.generate(model, ids, max_new_tokens=2, prefill_precision="bfloat16")


def test_measurements_are_kept_per_machine_and_read_back(fresh, monkeypatch):
    planted = (_planted("fast_one", 3.0), _planted("slow_one", 0.2))
    paths = fastpaths.measured(SHAPES, planted)
    assert not paths.get("fast_one").stands_aside and paths.get("slow_one").stands_aside
    assert paths.allowed("fast_one") and paths.allowed("not measured")
    with pytest.warns(fastpaths.FastPathNotice, match="stands aside"):
        assert not paths.allowed("slow_one")
    file = fastpaths.cache_file()
    assert file.parent.parent == fresh and file.exists()
    saved = json.loads(file.read_text())
    assert saved["machine"] == fastpaths.machine() and saved["torch"] == torch.__version__
    entry = saved["entries"][f"{SHAPES.key()}@1"]
    assert entry["slow_one"]["fast_s"] > entry["slow_one"]["reference_s"]
    fastpaths.forget()

    def never(*a, **k):
        raise AssertionError("measured again: the cached file was not read")
    monkeypatch.setattr(fastpaths, "run_probe", never)
    again = fastpaths.measured(SHAPES, planted)
    assert again.get("slow_one") == paths.get("slow_one")
    assert not list(file.parent.glob(".*.tmp"))  # written atomically: no temporary file left


@pytest.mark.parametrize("damage", ["", "{not json", '{"entries": 3}', '[1, 2]'])
def test_a_damaged_measurement_file_is_measured_again_and_rewritten(fresh, damage):
    file = fastpaths.cache_file()
    file.parent.mkdir(parents=True)
    file.write_text(damage)
    paths = fastpaths.measured(SHAPES, (_planted("one", 2.0),))
    assert paths.get("one") is not None
    assert "one" in json.loads(file.read_text())["entries"][f"{SHAPES.key()}@1"]


def test_an_unwritable_cache_keeps_the_measurements_for_the_process(fresh, monkeypatch):
    (fresh / "fastpaths").write_text("a file where the folder goes")
    with pytest.warns(fastpaths.FastPathNotice, match="could not keep the fast paths' measurements"):
        paths = fastpaths.measured(SHAPES, (_planted("one", 2.0),))
    assert paths.get("one") is not None


def test_the_cache_key_names_the_cpu_torch_and_minigen(monkeypatch, fresh):
    first = fastpaths.cache_file()
    monkeypatch.setattr(build, "cpu_fingerprint", lambda: "another CPU")
    assert fastpaths.cache_file() != first
    monkeypatch.undo()
    monkeypatch.setenv("MINIGEN_CACHE", str(fresh))
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert fastpaths.cache_file() != first


def test_a_tiny_model_is_measured_at_smollm2s_shapes_and_a_large_one_at_its_own():
    from minigen.checkpoints.model_config import ModelConfig
    tiny = ModelConfig(arch="llama", vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                       hidden_dim=64, max_seq_len=128)
    big = ModelConfig(arch="llama", vocab_size=1000, dim=2048, n_layers=2, n_heads=32, n_kv_heads=8, head_dim=64,
                      hidden_dim=8192, max_seq_len=128)
    assert Shapes.of(tiny) == SHAPES
    assert Shapes.of(big) == Shapes(2048, 8192, 32, 8, 64)
    w = probes._weights(Shapes.of(big))  # cut to MAX_ELEMENTS: a probe stays small at any shape
    assert all(t.numel() <= probes.MAX_ELEMENTS for t in w.values()) and w["down"].shape[1] == 8192


@needs_c
def test_every_probe_runs_here_and_a_first_try_far_slower_is_not_run_longer(fresh):
    paths = fastpaths.measured(SHAPES, probes.PROBES + fused.PROBES)
    for name in ("c_matvec", "c_rows", "gemm_q", "c_attention", "c_rms_norm", "fused_step", "fused_verify"):
        m = paths.get(name)
        assert m is not None and m.fast_s > 0 and m.reference_s > 0, name
    calls = []

    def make(s, rows):
        return (lambda: calls.append(rows) or time.sleep(0.05) or 0), (lambda: 0)
    m = probes.run_probe(Probe("very_slow", "a very slow path", "nothing", make, prompt=True), SHAPES)
    assert m.stands_aside and m.ratio < 1 / probes.GIVE_UP
    assert set(calls) == {probes.FIRST_ROWS} and len(calls) <= 1 + 2 * probes.FIRST_TRY[0]  # never the PROMPT_ROWS-row product


def test_a_first_try_stalled_by_a_neighbour_does_not_set_a_fast_path_aside_for_good():
    """A busy neighbour can stall a short call: a first try that looks far slower gets a second one, and
    only a path slow in every pair of both stops there (a Zen 1 next to a build: oneDNN 0.21x, quiet 0.99x)."""
    calls = []

    def make(s, rows):
        def fast():
            calls.append(rows)
            time.sleep(0.02 if len(calls) <= 1 + probes.FIRST_TRY[0] else 0.001)  # stalled, then itself
            return 0
        return fast, (lambda: time.sleep(0.005) or 0)  # 5x the path's own 1 ms: room for a busy machine
    m = probes.run_probe(Probe("stalled", "a stalled path", "nothing", make, prompt=True), SHAPES, repeats=4)
    assert probes.PROMPT_ROWS in calls  # measured in full, past its first try
    assert not m.stands_aside


def test_bench_prints_the_measurements(capsys):
    from minigen.measure.bench_report import print_report
    m = Measurement("c_matvec", "C's one-row loop", "F.linear", 0.002, 0.001)
    result = {"hardware": {"cpu": "x", "threads": 2, "torch": "2", "gpu": None,
                           "fastpaths": {"machine": "x", "threads": 1, "measured": [m.__dict__]}},
              "model": "m", "dtype": "float32", "prompt_len": 8, "new_tokens": 8, "repeats": 1, "engines": {}}
    with pytest.raises(Exception):  # the rest of the report needs a real run; the header comes first
        print_report(result)
    out = capsys.readouterr().out
    assert "c_matvec" in out and "0.50x" in out and "stands aside" in out


def test_the_triton_probe_times_the_kernel_against_the_torch_path_it_replaces():
    """On a GPU, attention_backend='triton' is measured against attention.attend_blocks (a demanded backend:
    a warning where it is slower). Here, in Triton's interpreter: the two calls give the same attention."""
    from minigen.kernels import triton_attention
    if not triton_attention.AVAILABLE:
        pytest.skip("triton is not installed")
    probe = choose._triton_probe(48)
    fast, ref = probe.make(SHAPES, 1, device="cpu", dtype=torch.float32)
    a, b = fast(), ref()
    assert a.shape == b.shape == (1, SHAPES.heads, SHAPES.head_dim)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert probe.path == "triton_decode_48" and choose.TRITON_PROBES[0].path == "triton_decode_4096"


def test_a_bf16_prompt_keeps_its_attention_in_fp32_where_bf16_sdpa_measured_slower(tiny_llama, fresh):
    from minigen.numerics.precision import prompt_format
    model, _ = _tiny(tiny_llama)
    config = minigen.GenerationConfig(prefill_precision="bfloat16")
    paths = choose.measurements(model)
    for ratio, bf16 in ((2.0, True), (0.5, False)):
        paths.measured["bf16_attention"] = Measurement("bf16_attention", "a prompt's attention in bf16 (SDPA)",
                                                       "SDPA in fp32", 1.0, ratio)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fastpaths.FastPathNotice)
            assert choose.prompt_attention_bf16(model, config) is bf16
        fmt = choose.ops_for(model, config, prompt=True).prompt
        assert fmt == prompt_format("bfloat16", model, bf16) and fmt.attention_bf16 is bf16
        assert fmt.dtype(100) == torch.bfloat16  # the products stay bf16 either way
        assert fmt.attention_dtype(100) == (torch.bfloat16 if bf16 else torch.float32)
        assert fmt.attention_dtype(16) == torch.float32  # a short prompt: fp32, as its products
    assert choose.prompt_attention_bf16(model, config.replace(prefill_precision="float32"))
