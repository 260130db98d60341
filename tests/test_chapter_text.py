"""Numbers in prose come from runs (issue 26). A number measured on this machine is printed by the
cell that measured it, or rendered from the run (a code cell that displays the sentence); it is
never typed into a markdown cell, where it drifts from the figures the moment a kernel changes.
Numbers from elsewhere (the article, spec sheets, papers) sit in markdown cells tagged `reported`,
which say their source.

The README follows the same rule: a measured number sits in a block generated from a committed run,
or in a section that names the date and machine of the run it quotes ("Measured on YYYY-MM-DD, ...").
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# a number followed by a unit of time, speed, bytes or a ratio: what a measurement looks like
UNITS = r"tok/s|tokens/s|ms|µs|us|ns|GB/s|TB/s|MB/s|GFLOP/s|TFLOP/s|KB|kB|KiB|MB|MiB|GB|GiB|TB"
MEASURED = re.compile(r"(?<![\w.$\\])(\d[\d,]*(?:\.\d+)?)(?:\s*(?:-|–|to)\s*\d[\d,]*(?:\.\d+)?)?"
                      rf"(?:\s?(?:{UNITS})(?![\w/])|[x×](?![\w]))")
CODE_OR_MATH = re.compile(r"```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$", re.S)  # formulas and code, not prose
STAMP = re.compile(r"[Mm]easured on \d{4}-\d{2}-\d{2}\b[^.\n]*")  # a README section's date and machine


def number(path: Path) -> str:
    """A chapter's number, its notebook's prefix: "04", or "02b" for a chapter placed between two."""
    return re.match(r"(\d\d[a-z]?)_", path.name).group(1)


def label(path: Path) -> str:
    """The number as its title says it: "4" for "04", "2b" for "02b" (book.Chapter.label's rule)."""
    return number(path).lstrip("0") or "0"


def measured_looking(text: str) -> list[str]:
    """The measured-looking numbers of a piece of prose (code spans and math are left out)."""
    prose = CODE_OR_MATH.sub(" ", text)
    return [m.group(0) for m in MEASURED.finditer(prose)]


def test_the_pattern_finds_what_it_should_and_nothing_else():
    assert measured_looking("fell from 15 to 16 ms, then 3.6 ms; 1.26x and 2×; 31 GB/s; 538 MB; 36.5 tok/s") == [
        "15 to 16 ms", "3.6 ms", "1.26x", "2×", "31 GB/s", "538 MB", "36.5 tok/s"]
    assert measured_looking("chapter 17, `x = 2x`, $4\\times$, layer 18, 0x0F, B=8, 4-bit, max 2 msgs") == []


@pytest.mark.parametrize("path", CHAPTERS, ids=number)
def test_no_measured_number_is_typed_into_a_chapters_markdown(path):
    nb = nbformat.read(path, as_version=4)
    typed = [f"cell {i}: {hit!r}" for i, cell in enumerate(nb.cells)
             if cell.cell_type == "markdown" and "reported" not in cell.metadata.get("tags", [])
             for hit in measured_looking(cell.source)]
    assert not typed, (f"{path.name}: numbers typed into markdown. Print them from the cell that measures "
                       "them (or render the sentence from the run); a number from elsewhere goes into a "
                       "markdown cell tagged 'reported' that names its source:\n  " + "\n  ".join(typed))


def test_reported_cells_say_their_source():
    for path in CHAPTERS:
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if "reported" in cell.metadata.get("tags", []):
                assert re.search(r"report|source|according|spec|paper|article|documentation|\bdocs?\b|"
                                 r"data ?sheet|published|et al\.", cell.source, re.I), \
                    f"{path.name} cell {i} is tagged 'reported' but does not say where its numbers come from"


def readme_sections(text: str) -> list[str]:
    """The README split at its headings, with the generated blocks left out."""
    text = re.sub(r"<!-- (\w+):start -->.*?<!-- \1:end -->", " ", text, flags=re.S)
    return re.split(r"^#+ ", text, flags=re.M)


def test_readme_numbers_say_the_run_they_come_from():
    unstamped = [f"{section.splitlines()[0][:60]!r}: {hit!r}"
                 for section in readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))
                 if not STAMP.search(section) for hit in measured_looking(section)]
    assert not unstamped, ("README sections quote measured numbers without the run's date and machine "
                           "(write 'Measured on YYYY-MM-DD, <machine>' in the section, or generate "
                           "the block from a committed run):\n  " + "\n  ".join(unstamped))


def headings(path: Path) -> list[str]:
    return [line for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "markdown"
            for line in cell.source.splitlines() if line.startswith("## ")]


@pytest.mark.parametrize("path", CHAPTERS, ids=number)
def test_every_chapter_has_the_same_parts_in_the_same_order(path):
    """Goals, numbered sections, what the chapter showed, exercises (issue 26)."""
    first = nbformat.read(path, as_version=4).cells[0].source
    assert re.match(rf"# {label(path)} · ", first) and "**What you will learn**" in first, \
        (f"{path.name}: the first cell is the title ('# {label(path)} · ...') and the goals "
         "('**What you will learn**')")
    hs = headings(path)
    showed = [i for i, h in enumerate(hs) if h.startswith("## What this chapter showed")]
    exercises = [i for i, h in enumerate(hs) if re.match(r"## Exercises?\b", h)]
    assert len(showed) == 1 and len(exercises) == 1, f"{path.name}: one 'What this chapter showed' and one " \
                                                     f"'Exercise(s)' heading, not {hs}"
    assert showed[0] == len(hs) - 2 and exercises[0] == len(hs) - 1, \
        f"{path.name}: the sections, then 'What this chapter showed', then the exercises last: {hs}"
    numbers = [int(m.group(1)) for h in hs[:showed[0]] if (m := re.match(r"## (\d+)\. ", h))]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) == showed[0], \
        f"{path.name}: the sections are numbered 1, 2, 3... with no gap and no unnumbered one: {hs[:showed[0]]}"
