"""The committed GPU report (figures/gpu/NVIDIA_H200.json) read by minigen.course.gpu_report: the
tables have the rows and labels the chapters render, every rendering names where and when it was
measured from the file, and a missing or malformed report is refused in one line."""

from __future__ import annotations

import json

import matplotlib
import pytest

from minigen.course import gpu_report

matplotlib.use("Agg")
WHERE_WHEN = "measured on one NVIDIA H200 on 2026-12-04 at commit d5c2631, torch 2.11.0+cu130"


@pytest.fixture(scope="module")
def report():
    return gpu_report.load()


def test_the_committed_report_says_where_and_when(report):
    assert gpu_report.DEFAULT_PATH.parts[-3:] == ("figures", "gpu", "NVIDIA_H200.json")
    assert (report.gpu, report.date, report.commit, report.torch) == ("NVIDIA H200", "2026-12-04", "d5c2631",
                                                                      "2.11.0+cu130")
    assert report.where_when == WHERE_WHEN
    assert gpu_report.spec_sheet(report).name == "H200 SXM"


def test_decode_rows(report):
    rows = gpu_report.decode_rows(report)
    assert len(rows) == 12  # three shapes x eager, compile, cuda_graphs, reduce-overhead
    assert [r["model"] for r in rows[::4]] == ["SmolLM2-135M", "Llama-3.2-1B", "Llama-3.1-8B"]
    assert [r["mode"] for r in rows[:4]] == list(gpu_report.MODES)
    for r in rows:  # the share recomputed from tok/s, bytes and bandwidth is the one gpu_check recorded (within
        # 1%: the 8B shape was a run of its own, with its own copy measurement; the merged report keeps one)
        recorded = report.data["checks"]["decode"]["models"][r["model"]]["modes"][r["mode"]]["bandwidth_fraction"]
        assert r["roofline_share"] == pytest.approx(recorded, rel=0.01)
        assert r["spec_share"] < r["roofline_share"]  # 4.8 TB/s on the sheet, less measured
    graphs = [r for r in rows if r["mode"] == "cuda_graphs"]
    assert all(r["tokens_equal_eager"] for r in graphs)
    assert all(g["tok_s"] > e["tok_s"] for g, e in zip(graphs, rows[::4]))
    table = gpu_report.decode_table(report)
    assert WHERE_WHEN in table and table.count("\n| ") == 13  # the header and 12 rows


def test_the_fixed_time_per_token_is_the_intercept(report):
    intercept, slope = gpu_report.fixed_ms_per_token(report)
    assert 1.0 < intercept < 2.5 and slope > 0  # ms; ms per GB
    text = gpu_report.decode_findings(report)
    assert f"{intercept:.2f} ms" in text and WHERE_WHEN in text and "no transformers row" in text


def test_kernel_rows(report):
    rows = gpu_report.kernel_rows(report)
    assert len(rows) == 9
    assert sorted({r["context"] for r in rows}) == [1024, 4096, 16384]
    assert {r["format"] for r in rows} == {"bf16", "int8", "int4"}
    assert all(r["speedup"] < 1 for r in rows if r["format"] == "bf16")
    assert "slower than gather + SDPA at every context" in gpu_report.kernel_findings(report)
    assert WHERE_WHEN in gpu_report.kernel_table(report)


def test_prefill_rows(report):
    rows = gpu_report.prefill_rows(report)
    assert len(rows) == 12
    assert sum(r["sdpa"] for r in rows) == 3 and sum(not r["default_tile"] for r in rows) == 3
    assert all(r["close"] for r in rows)
    assert WHERE_WHEN in gpu_report.prefill_table(report) and WHERE_WHEN in gpu_report.prefill_findings(report)


def test_roofline_rows(report):
    rows = gpu_report.roofline_rows(report)
    assert len(rows) == 12 + 9 + 6  # decode steps, decode attention, bf16 prompt attention (SDPA and Triton)
    ceiling = gpu_report.gpu_ceiling(report)
    assert ceiling.bandwidth == pytest.approx(report.data["checks"]["decode"]["bandwidth_gb_s"] * 1e9)
    assert all(r["flop_s"] <= ceiling.attainable(r["intensity"]) for r in rows)
    decode = [r for r in rows if r["kind"] == "decode step"]
    assert all(0.9 < r["intensity"] <= 1 for r in decode)  # 2 FLOPs per 2-byte weight, plus the KV bytes
    assert WHERE_WHEN in gpu_report.roofline_table(report)


@pytest.mark.parametrize("plot", ["plot_decode", "plot_kernel", "plot_prefill", "plot_roofline"])
def test_every_figure_names_where_and_when(report, plot):
    fig = getattr(gpu_report, plot)(report)
    titles = [fig._suptitle.get_text()] if fig._suptitle else []
    titles += [ax.get_title() for ax in fig.axes]
    assert any(WHERE_WHEN in t for t in titles), titles
    matplotlib.pyplot.close(fig)


def _write(tmp_path, data) -> str:
    path = tmp_path / "report.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("damage, says", [
    (lambda d: "{ not json", "invalid JSON"),
    (lambda d: {k: v for k, v in d.items() if k != "runs"}, "the report lacks runs"),
    (lambda d: dict(d, runs="three runs, merged"), "names no commit"),
    (lambda d: dict(d, hardware={"gpu": None, "torch": "2"}, smoke=True), "smoke run"),
    (lambda d: dict(d, checks={"decode": {"models": {}}}), "checks.decode lacks bandwidth_gb_s"),
    (lambda d: dict(d, checks=[]), "checks is list"),
])
def test_a_malformed_report_is_refused_in_one_line(tmp_path, damage, says):
    good = json.loads(gpu_report.DEFAULT_PATH.read_text())
    with pytest.raises(gpu_report.GPUReportError) as err:
        gpu_report.load(_write(tmp_path, damage(good)))
    assert says in str(err.value) and "\n" not in str(err.value) and "report.json" in str(err.value)


def test_a_missing_report_or_check_is_named(tmp_path):
    with pytest.raises(gpu_report.GPUReportError, match="no GPU report at .*absent.json"):
        gpu_report.load(tmp_path / "absent.json")
    good = json.loads(gpu_report.DEFAULT_PATH.read_text())
    only_decode = gpu_report.load(_write(tmp_path, dict(good, checks={"decode": good["checks"]["decode"]})))
    assert len(gpu_report.roofline_rows(only_decode)) == 12
    with pytest.raises(gpu_report.GPUReportError, match="holds no 'kernel' check .*--only kernel"):
        gpu_report.kernel_rows(only_decode)
