"""The claims ledger: the package's file loads, covers every claim of the article, agrees with the
code that measures it, and a malformed file gets a clear error."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from minigen.__main__ import main
from minigen.errors import LedgerError
from minigen.course.ledger import CLAIMS, VERDICTS, load_claims

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
planner = importlib.import_module("minigen.measure.plan")  # the module: `minigen.measure.plan` is the function


def by_id() -> dict:
    return {c.id: c for c in load_claims()}


def test_every_claim_of_the_article_is_in_the_ledger():
    claims = by_id()
    for n in range(1, 8):  # C1..C7, each with at least one entry
        assert any(i == f"C{n}" or (i.startswith(f"C{n}") and i[2:].isalpha()) for i in claims), f"C{n} missing"
    # the sub-claims ARTICLE.md lists, by the article's own numbers
    values = " | ".join(c.article_value for c in claims.values())
    for number in ("2.3x", "O(N^3)", "O(L·H·N²·D)", "> 20 GB", "40%", "30%", "75%", "< 0.5%", "3.05x", "1.09x", "3.01x",
                   "4.00x", "4.8x", "W = 64", "threshold 0.1", "cap at 4,096", "> 20% jitter", "capped at 256",
                   "max throughput x batch"):
        assert number in values, f"the article's {number} has no entry"
    assert {c.verdict for c in claims.values()} <= set(VERDICTS)


def test_each_chapter_named_exists():
    for c in load_claims():
        if c.chapter:
            assert list(NOTEBOOKS.glob(f"{c.chapter}_*.ipynb")), f"{c.id}: no notebook {c.chapter}_*.ipynb"


def asserted_ids(notebook: Path) -> set[str]:
    """The claim ids a notebook's code cells look up in the ledger: `ledger["C5a"]`."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return set(re.findall(r'ledger\["([A-Z][0-9][a-z]?)"\]', code))


def test_the_ledger_cannot_drift_from_the_chapters():
    """Every measured claim names the chapter that measures it, and that chapter's code asserts the
    claim's verdict (`ledger["C5a"].verdict == ...`, checked under nbval); a chapter asserts only
    claims the ledger has, and a claim some chapter asserts is not "not yet measured"."""
    claims = by_id()
    # a chapter's number is its notebook's prefix: "04", or "02b" for one placed between two
    asserted = {nb.name.split("_")[0]: asserted_ids(nb) for nb in NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")}
    for c in claims.values():
        if c.verdict == "not yet measured":
            assert not any(c.id in ids for ids in asserted.values()), f"{c.id}: asserted by a chapter, yet not measured"
            continue
        assert c.chapter, f"{c.id}: verdict {c.verdict!r} without the chapter that measures it"
        assert c.id in asserted.get(c.chapter, set()), \
            f"{c.id}: notebooks/{c.chapter}_*.ipynb never asserts ledger[{c.id!r}] against its measurement"
    for chapter, ids in asserted.items():
        assert ids <= set(claims), f"chapter {chapter} asserts claims the ledger lacks: {sorted(ids - set(claims))}"


def test_the_drift_check_catches_a_chapter_that_does_not_assert(tmp_path):
    nb = tmp_path / "04_x.ipynb"
    nb.write_text(json.dumps({"cells": [
        {"cell_type": "markdown", "source": ['ledger["C5b"] in prose does not count']},
        {"cell_type": "code", "source": ['assert ledger["C5a"].verdict == "refuted"\n']}]}), encoding="utf-8")
    assert asserted_ids(nb) == {"C5a"}


def test_the_ledger_agrees_with_the_code_that_measures(smollm2):
    """The planner's numbers (T1) and the loss it ranks by (C5b) are the ledger's."""
    model, _ = smollm2
    claims = by_id()
    freed = planner.oom_remedies(model, batch=8, context=8192)
    base = freed["baseline_bytes"]
    assert f"{freed['quant_bits=4'] / base:.1%}" in claims["T1b"].measured
    assert f"{base / 2**30:.2f} GiB" in claims["T1b"].measured
    assert f"{freed['max_length=4096'] / 2**30:.2f} of {base / 2**30:.2f} GiB" in claims["T1c"].measured
    at_8000 = planner.oom_remedies(model, batch=8, context=8000)["cache_chunk_size=16"]
    assert f"{at_8000 / 2**20:.0f} MiB" in claims["T1a"].measured
    assert f"+{planner.QUALITY_LOSS['quant_bits=4'][0]:.2f}%" in claims["C5b"].measured


GOOD = '''[[claim]]
id = "C1"
claim = "x"
article_value = "2.3x"
measured = "4x"
machine = "2-core CPU"
verdict = "reframed"
chapter = "01"
source = "chapter 01"
'''


@pytest.mark.parametrize("text, message", [
    ("[[claim]\nid = 1", "is not valid TOML"),
    ("title = 'no claims'", "has no [[claim]] entries"),
    (GOOD.replace('verdict = "reframed"', 'verdict = "true"'), "verdict='true' is invalid"),
    (GOOD.replace('source = "chapter 01"\n', ''), "missing source"),
    (GOOD.replace('chapter = "01"', 'chapter = 1'), "chapter must be strings"),
    (GOOD + GOOD, "the id 'C1' appears twice"),
    (GOOD.replace('machine = "2-core CPU"', 'machine = ""'), "needs the measured value and the machine"),
    (GOOD.replace('chapter = "01"', 'chapter = "ch1"'), "chapter='ch1' is invalid"),
])
def test_a_malformed_file_is_refused_by_name(tmp_path, text, message):
    path = tmp_path / "claims.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(LedgerError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_claims(path)


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "claims.toml"
    path.write_text(GOOD, encoding="utf-8")
    [c] = load_claims(path)
    assert (c.id, c.verdict, c.chapter) == ("C1", "reframed", "01")


def test_the_command_prints_and_writes_json(tmp_path, capsys):
    assert main(["ledger", "--json", str(tmp_path / "l.json")]) == 0
    out = capsys.readouterr().out
    assert "C5b" in out and "not yet measured" in out
    data = json.loads((tmp_path / "l.json").read_text())
    assert [d["id"] for d in data] == [c.id for c in load_claims(CLAIMS)]
    assert all({"id", "claim", "article_value", "measured", "verdict", "chapter"} <= set(d) for d in data)
    (tmp_path / "bad.toml").write_text("nope", encoding="utf-8")
    assert main(["ledger", "--file", str(tmp_path / "bad.toml")]) == 2
