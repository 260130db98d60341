"""The chapters' plotting helpers: plot_bench on a synthetic bench result, the power-law fit, and
the package map, all without the model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import minigen  # noqa: E402
from minigen.course import plots  # noqa: E402


def bench_result(engines: dict[str, float], roofline: float = 31.5) -> dict:
    """The JSON of `python -m minigen bench --json`, with made-up numbers."""
    engine = lambda rate: {"decode_tokens_per_s": rate, "ttft_s": 0.05, "peak_memory_bytes": 600_000_000,  # noqa: E731
                           "kv_cache_bytes": 6_000_000}
    return {"hardware": {"cpu": "Test CPU 9000", "threads": 2, "torch": "2.13.0", "gpu": None,
                         "memory_read_gb_s": 17.0},
            "model": "smollm2-135m", "prompt_len": 64, "new_tokens": 128,
            "engines": {name: engine(rate) for name, rate in engines.items()},
            "bytes_per_token": 540_000_000, "roofline_tokens_per_s": roofline, "speedup": 1.3}


@pytest.mark.parametrize("engines", [{"minigen": 21.0, "transformers": 16.0},
                                     {"minigen": 21.0, "transformers": 16.0, "minigen-int4": 9.0}])
def test_plot_bench_draws_one_bar_per_engine_and_the_roofline(engines):
    ax = plots.plot_bench(bench_result(engines, roofline=31.5))
    assert isinstance(ax, plt.Axes) and isinstance(ax.figure, plt.Figure)
    heights = [bar.get_height() for bar in ax.patches]
    assert heights == list(engines.values())
    assert [t.get_text() for t in ax.get_xticklabels()] == list(engines)
    flat = [line for line in ax.lines if np.allclose(line.get_ydata(), 31.5)]
    assert len(flat) == 1, "the roofline is one horizontal line at roofline_tokens_per_s"
    assert "Test CPU 9000" in ax.get_title() and "smollm2-135m" in ax.get_title()
    assert ax.get_ylim()[1] > max(31.5, *engines.values()), "bars and roofline must be inside the axes"
    plt.close(ax.figure)


def test_plot_bench_draws_into_a_given_axes_and_names_the_gpu():
    fig, (left, right) = plt.subplots(1, 2)
    result = bench_result({"minigen": 900.0})
    result["hardware"]["gpu"] = "NVIDIA H100"
    assert plots.plot_bench(result, ax=right) is right
    assert len(right.patches) == 1 and len(left.patches) == 0
    assert "NVIDIA H100" in right.get_title()
    plt.close(fig)


def test_fit_power_law_recovers_the_exponent():
    n = np.array([8, 16, 32, 64, 128])
    p, c = plots.fit_power_law(n, 3e-4 * n ** 2.0)
    assert p == pytest.approx(2.0, abs=1e-9) and c == pytest.approx(3e-4, rel=1e-9)
    rng = np.random.default_rng(0)  # 5% multiplicative noise moves the exponent by far less than 0.1
    p_noisy, _ = plots.fit_power_law(n, n ** 1.5 * np.exp(rng.normal(0, 0.05, n.size)))
    assert abs(p_noisy - 1.5) < 0.1
    with pytest.raises(ValueError):
        plots.fit_power_law([1, 2], [1, 0])


def test_save_figure_writes_a_png(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "figures_dir", lambda: tmp_path)
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    path = plots.save_figure(fig, "99_test")
    assert path == tmp_path / "99_test.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plt.close(fig)


def test_figures_go_to_the_build_folder_unless_asked(tmp_path, monkeypatch):
    """A chapter run (make test) must leave the committed figures/ alone: by default figures go to
    _build/figures/, which git ignores; MINIGEN_FIGURES (make figures) chooses another folder."""
    root = Path(plots.__file__).resolve().parents[2]  # the checkout: minigen/course/plots.py
    monkeypatch.delenv("MINIGEN_FIGURES", raising=False)
    default = plots.figures_dir()
    assert default == root / "_build" / "figures" and default.is_dir()
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default / "99_test.png")], cwd=root)
    if ignored.returncode != 128:  # 128: not a git checkout (an installed package), nothing to ignore
        assert ignored.returncode == 0, "_build/figures/ must be ignored by git (.gitignore)"
    monkeypatch.setenv("MINIGEN_FIGURES", str(tmp_path / "chosen"))
    assert plots.figures_dir() == tmp_path / "chosen" and (tmp_path / "chosen").is_dir()
    monkeypatch.chdir(tmp_path)  # a relative folder is taken from the working directory
    monkeypatch.setenv("MINIGEN_FIGURES", "relative")
    assert plots.figures_dir() == tmp_path / "relative"


def test_package_map_lists_the_core_modules():
    table = plots.package_map(minigen)
    rows = {line.split("|")[1].strip().split()[0].strip("`"): line for line in table.splitlines()[2:]}
    for module in ("model", "generate", "caches", "config", "loading"):
        assert module in rows
    assert "(package)" in rows["caches"] and "`GenerationConfig`" in rows["config"]
    caches = plots.package_map(minigen.caches)  # a room of the house, mapped the same way
    assert "`KVCache`" in next(line for line in caches.splitlines() if line.startswith("| `contiguous`"))


def test_show_source_prints_the_selected_lines(capsys):
    from minigen.steps.eager import decode_step
    plots.show_source(decode_step, start="def decode_step", stop="return")
    out = capsys.readouterr().out
    assert out.startswith("# eager.py, line ") and "def decode_step" in out  # the step functions: steps/eager.py
    assert out.rstrip().splitlines()[-1].strip().startswith("return")
    with pytest.raises(ValueError):
        plots.show_source(plots.fit_power_law, start="no such line")


def test_show_source_refuses_a_stop_it_cannot_find(capsys):
    # a missing stop must not print the rest of the source as if it were the excerpt asked for
    with pytest.raises(ValueError, match=r"'no such line' is not in the source of fit_power_law"):
        plots.show_source(plots.fit_power_law, start="def fit_power_law", stop="no such line")
    with pytest.raises(ValueError, match="no such line"):
        plots.show_source(plots.fit_power_law, stop="no such line")
    assert capsys.readouterr().out == ""


def test_roofline_labels_never_stack_on_coincident_points():
    """Chapter 17's roofline wrote "B=1B=1B=1" where three models' decode at batch 1 coincide (issue 26):
    coincident points share one label, each batch named once, and labels stand apart on the axis."""
    import matplotlib.pyplot as plt
    from minigen.measure import roofline
    points = roofline.roofline_points(batches=(1, 8, 64), context=1024, prompt=512)
    labels = plots.point_labels([p for _, p in points])
    assert all(len(set(text.split(", "))) == len(text.split(", ")) for text, _ in labels), labels
    assert any(text == "B=1" for text, _ in labels)  # the batch-1 decodes of all three models: one label
    xs = sorted(x for _, x in labels)
    assert all(b / a > 1.2 for a, b in zip(xs, xs[1:])), xs
    ax = plots.plot_roofline(list(roofline.GPUS), points, roofline.A100_80GB)
    drawn = [t.get_text() for t in ax.texts]
    assert sorted(drawn) == sorted(t for t, _ in labels) and not any("B=1B=1" in t for t in drawn)
    plt.close(ax.figure)
