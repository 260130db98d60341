"""The form every chapter keeps (issue 46's findings 7 and 1, guarded so they cannot come back):
- the setup cell calls minigen.course.setup() instead of repeating why one thread;
- the closing checks are one held() table whose code the book hides (tag hide-input);
- teaching cells carry no history: what changed, and in which issue, lives in docs/CHANGELOG.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minigen.course.book import load_book

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = load_book(ROOT / "book.toml").notebook_paths()

# A changelog's words: an issue or stop number, or a sentence about what a chapter said or did before.
HISTORY = re.compile(r"\b(issue \d+|stop \d+|used to (?:be|say|read|print)|a previous version|an earlier "
                     r"(?:run|version)|before the fix|after the fix|we changed|was changed|in an earlier)\b", re.I)
# The one-thread rationale, said once in minigen.course.setup: a setup cell that says it again drifts from it.
THREAD_RATIONALE = re.compile(r"waits? for (?:a|its|the) (?:busy )?neighbour|each parallel region waits", re.I)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def history_in(markdown: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(markdown)]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_setup_cell_calls_setup_and_does_not_repeat_why_one_thread(path):
    code = [source(c) for c in cells(path) if c["cell_type"] == "code"]
    first = code[0]
    assert re.search(r"\bsetup\(", first), f"{path.name}: the first code cell does not call minigen.course.setup()"
    assert "set_num_threads" not in first, f"{path.name}: the setup cell sets threads itself; call setup(threads=...)"
    assert not THREAD_RATIONALE.search(first), f"{path.name}: the setup cell repeats the one-thread reason"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_closing_checks_are_one_hidden_held_table(path):
    closing = [c for c in cells(path) if c["cell_type"] == "code" and re.search(r"\bheld\(", source(c))]
    assert len(closing) == 1, f"{path.name}: {len(closing)} cells call held(); the chapter's checks belong in one"
    assert "hide-input" in closing[0]["metadata"].get("tags", []), f"{path.name}: the held() cell is not tagged hide-input"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_no_teaching_cell_carries_history(path):
    found = [(i, words) for i, c in enumerate(cells(path)) if c["cell_type"] == "markdown"
             for words in history_in(source(c))]
    assert not found, f"{path.name}: history in teaching cells (move it to docs/CHANGELOG.md): {found}"


def test_the_history_guard_catches_a_changelog_sentence():
    assert history_in("Issue 25 made the scales fp32; an earlier run ranked them in another order.") == \
        ["Issue 25", "an earlier run"]
    assert history_in("the units no longer cancel; section 10 used to draw its pictures") == []


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_committed_chapter_holds_no_run(path):
    """Outputs and widget state come from the reader's run (and the book's): a committed one would go
    stale, and a saved widget state makes the book load the widget manager from the network."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    ran = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not ran and "widgets" not in nb["metadata"], f"{path.name}: outputs in cells {ran} or widget state saved"
