"""The data behind the chapters' figures (issue 46, guard 2): save_figure writes each figure's
fingerprint beside its PNG, and a chapter run that draws something else than the committed
figures/NAME.json fails naming the figure and the first difference. See minigen/course/figure_data.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from minigen.course import plots  # noqa: E402
from minigen.course.figure_data import (MACHINE_NAMES, FigureDataError, compare, fingerprint, masked,  # noqa: E402
                                        rounded)

ROOT = Path(__file__).resolve().parent.parent


def ledger_like(counts=(3, 4, 17), ylabel="claims", legend="C2b 5/4/17", line=(1.0, 2.0)):
    """A small figure with what chapters draw: named bars, a line, a legend, a text."""
    fig, ax = plt.subplots()
    ax.bar(["verified", "reframed", "refuted", "argued"][:len(counts)], counts, label=legend)
    ax.plot([0, 1], line, label="measured")
    ax.text(0, 1, f"total {sum(counts)}")
    ax.set_ylabel(ylabel)
    ax.set_title("the ledger")
    ax.legend()
    fig.canvas.draw()  # as savefig does: tick labels exist once drawn
    return fig


def prints(exact=False, **kwargs) -> dict:
    fig = ledger_like(**kwargs)
    data = json.loads(json.dumps(fingerprint(fig, exact)))  # as the sidecar holds it
    plt.close(fig)
    return data


def test_the_same_data_gives_the_same_fingerprint():
    assert prints() == prints()
    assert compare(prints(exact=True), prints(exact=True)) == ""


def test_the_fingerprint_holds_labels_categories_counts_and_data():
    data = prints(exact=True)
    axes = data["structure"]["axes"][0]
    assert axes["xticks"] == ["verified", "reframed", "refuted"] and axes["ylabel"] == "claims"
    assert axes["patches"] == 3 and axes["lines"] == 1 and axes["legend"] == ["measured", "C#b #/#/#"]
    values = data["values"]["axes"][0]
    assert [p[3] for p in values["patches"]] == [3, 4, 17] and values["texts"] == ["total 24"]
    assert values["lines"][0]["y"] == [1.0, 2.0]


def test_a_changed_count_is_caught_in_an_exact_figure():
    assert compare(prints(exact=True), prints(exact=True, counts=(4, 4, 18))) == "values.axes[0].patches[0][3]: 3.0 -> 4.0"
    assert compare(prints(), prints(counts=(4, 4, 18))) == ""  # the same figure, not exact: structure only


def test_a_measured_value_that_moved_is_ignored_unless_the_figure_is_exact():
    assert compare(prints(), prints(line=(1.1, 2.2), legend="C2b 6/4/17")) == ""
    assert "lines[0].y[0]: 1.0 -> 1.1" in compare(prints(exact=True), prints(exact=True, line=(1.1, 2.2)))


def test_a_changed_axis_is_caught_in_every_figure():
    assert compare(prints(), prints(ylabel="verdicts")) == "axes[0].ylabel: 'claims' -> 'verdicts'"
    assert compare(prints(exact=True), prints(exact=True, ylabel="verdicts")) == \
        "structure.axes[0].ylabel: 'claims' -> 'verdicts'"


def test_a_changed_number_of_bars_is_caught_in_an_exact_figure_only():
    """A figure of measurements may draw a bar more on a CPU with another kernel: only its axes must hold."""
    assert compare(prints(exact=True), prints(exact=True, counts=(3, 4, 17, 1))) == \
        "structure.axes[0].xticks: 3 items -> 4"
    assert compare(prints(), prints(counts=(3, 4, 17, 1))) == ""


def test_labels_keep_their_words_without_numbers_or_this_machines_name():
    assert masked("fit: ∝ N^2.01, p50 0.123 s, C2b") == "fit: ∝ N^#, p# # s, C#b"
    for name in MACHINE_NAMES:  # "measured on <CPU>" is the same figure drawn on another machine
        assert masked(f"measured on {name}, 1 thread") == "measured on <cpu>, # thread"


def test_floats_keep_three_significant_digits():
    assert [rounded(v) for v in (0.123456, 12345.0, 7, float("nan"), float("inf"), "x")] == \
        [0.123, 12300.0, 7, None, "inf", "x"]


def test_a_long_line_is_kept_as_its_length_and_digest():
    fig, ax = plt.subplots()
    ax.plot(range(1000), [i * 0.5 for i in range(1000)])
    line = fingerprint(fig)["values"]["axes"][0]["lines"][0]
    assert line["y"]["n"] == 1000 and len(line["y"]["sha1"]) == 40
    plt.close(fig)


@pytest.fixture
def folders(tmp_path, monkeypatch):
    committed, build = tmp_path / "figures", tmp_path / "build"
    committed.mkdir()
    monkeypatch.setattr(plots, "COMMITTED_FIGURES", committed)
    monkeypatch.setenv("MINIGEN_FIGURES", str(build))
    return committed, build


def test_save_figure_writes_the_sidecar_and_passes_without_a_committed_one(folders):
    committed, build = folders
    fig = ledger_like()
    path = plots.save_figure(fig, "18_ledger", exact=True)
    assert path == build / "18_ledger.png" and (build / "18_ledger.json").is_file()
    assert json.loads((build / "18_ledger.json").read_text())["exact"] is True
    plt.close(fig)


def test_save_figure_fails_naming_the_figure_when_the_committed_data_differs(folders, monkeypatch):
    committed, build = folders
    monkeypatch.setenv("MINIGEN_FIGURES", str(committed))  # make figures: writes figures/, checks nothing
    fig = ledger_like(counts=(3, 4, 17))
    plots.save_figure(fig, "18_ledger", exact=True)
    assert (committed / "18_ledger.json").is_file()
    monkeypatch.setenv("MINIGEN_FIGURES", str(build))  # make test: checks against figures/
    plots.save_figure(fig, "18_ledger", exact=True)  # the same data passes
    plt.close(fig)
    fig = ledger_like(counts=(4, 4, 18))
    with pytest.raises(FigureDataError, match=r"figure '18_ledger' no longer matches .*make figures"):
        plots.save_figure(fig, "18_ledger", exact=True)
    plt.close(fig)


def test_every_committed_figure_has_its_data_beside_it():
    missing = [p.name for p in sorted((ROOT / "figures").glob("*.png")) if not p.with_suffix(".json").is_file()]
    assert not missing, f"figures without their NAME.json (run make figures): {missing}"


def saved_names() -> set[str]:
    """The figure names the chapters pass to save_figure as plain strings (f-strings left out)."""
    names = set()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            names.update(re.findall(r"save_figure\([^,()]+(?:\([^()]*\))?,\s*[\"']([\w.-]+)[\"']", source))
    return names


def test_every_committed_figure_is_drawn_by_a_chapter():
    orphans = sorted(p.stem for p in (ROOT / "figures").glob("*.png") if p.stem not in saved_names())
    assert not orphans, f"figures/ holds figures no chapter draws (remove them, or rename the save_figure call): {orphans}"


def test_every_figure_a_chapter_draws_is_committed():
    missing = sorted(n for n in saved_names() if not (ROOT / "figures" / f"{n}.png").is_file())
    assert not missing, f"chapters draw figures that figures/ lacks (run make figures and commit them): {missing}"


def test_an_exact_figures_floats_agree_within_one_percent_and_not_beyond():
    """17.04 and 17.06 keep 3 digits as 17.0 and 17.1 (another CPU's sums round the other way): the same
    figure. 17 against 19 is another figure."""
    assert compare(prints(exact=True, line=(1.0, 17.04)), prints(exact=True, line=(1.0, 17.06))) == ""
    assert compare(prints(exact=True, line=(1.0, 17.0)), prints(exact=True, line=(1.0, 19.0))) == \
        "values.axes[0].lines[0].y[1]: 17.0 -> 19.0"
