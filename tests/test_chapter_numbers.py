"""Chapter numbers and titles said in prose match book.toml (issue 46, guard 3).

Each chapter's title line is "# N · Title" with its notebook's number and book.toml's title; every
"chapter N", "chapters N and M", "ch NN" and "chNN" in the chapters, the Markdown pages, the
package and scripts/ names a chapter that exists; where the prose gives a title or links a notebook beside the
number, they agree. (The README's generated chapter list is checked against book.toml by
tests/test_packaging.py; its links are checked here too.) The checks are in
minigen/course/references.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minigen.course.book import Book, Chapter, load_book
from minigen.course.references import (Prose, chapter_number_refs, chapter_ref_problems, prose_of_notebook,
                                       title_problem)

ROOT = Path(__file__).resolve().parent.parent
# docs/CHANGELOG.md is history: it names chapters by the numbers they had on its dates
DOCS = [p for p in (*sorted(ROOT.glob("*.md")), *sorted((ROOT / "docs").rglob("*.md")),
                    *sorted((ROOT / "deploy").rglob("*.md"))) if p.name != "CHANGELOG.md"]
PACKAGE = [*sorted((ROOT / "minigen").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py"))]


@pytest.fixture(scope="module")
def book() -> Book:
    return load_book(ROOT / "book.toml")


def first_cell(path: Path) -> str:
    source = json.loads(path.read_text(encoding="utf-8"))["cells"][0]["source"]
    return "".join(source) if isinstance(source, list) else source


def test_every_notebook_is_a_chapter_of_book_toml(book):
    listed = {Path(c.notebook).name for c in book.chapters}
    assert {p.name for p in (ROOT / "notebooks").glob("*.ipynb")} == listed


def test_each_title_line_is_its_number_and_book_toml_title(book):
    bad = [f"{c.notebook}: {why}" for c, path in zip(book.chapters, book.notebook_paths())
           if (why := title_problem(c, first_cell(path)))]
    assert not bad, "title lines that disagree with book.toml:\n  " + "\n  ".join(bad)


def test_chapter_numbers_in_the_chapters_name_chapters_that_exist(book):
    prose = [p for path in book.notebook_paths() for p in prose_of_notebook(path, ROOT, whole_code=True)]
    bad = [f"{p.where}: {problem}" for p in prose for problem in chapter_ref_problems(p.text, book)]
    assert not bad, f"{len(bad)} chapter references in the chapters disagree with book.toml:\n  " + "\n  ".join(bad)


def test_chapter_numbers_in_the_readme_docs_and_package_name_chapters_that_exist(book):
    prose = [Prose(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in DOCS + PACKAGE]
    bad = [f"{p.where}: {problem}" for p in prose for problem in chapter_ref_problems(p.text, book)]
    assert not bad, f"{len(bad)} chapter references disagree with book.toml:\n  " + "\n  ".join(bad)


def test_chapter_number_refs_finds_each_number_and_its_digits():
    text = ("chapter 3, Chapter 2b, chapters 5 and 6, chapters 3, 4 and 5, chapters 5/6, ch 12, ch04, "
            "exercises/ch09.py, test_exercise_ch17.py; not: much 5, chapter's, branch 7, chapter 100")
    refs = chapter_number_refs(text)
    assert [n for n, _ in refs] == ["03", "02b", "05", "06", "03", "04", "05", "05", "06", "12", "04", "09", "17"]
    assert [text[a:b] for _, (a, b) in refs] == ["3", "2b", "5", "6", "3", "4", "5", "5", "6", "12", "04", "09", "17"]
    assert [n for n, _ in chapter_number_refs("chapter 4 and 12 layers")] == ["04"]  # a list needs "chapters"


def fake_book() -> Book:
    chapter = lambda n, name, title, learn: Chapter(f"notebooks/{n}_{name}.ipynb", title, [learn], 1.0, False)  # noqa: E731
    return Book("b", ["a"], "d", [chapter("02", "kv_cache", "The KV cache", "keep keys and values"),
                                  chapter("03", "paged_cache", "The paged (chunked) KV cache", "blocks on demand"),
                                  chapter("12", "profiling", "Profiling and the benchmark", "a roofline"),
                                  chapter("14", "weight_quantization", "Quantizing the weights", "int4 weights")])


@pytest.mark.parametrize("text, problem", [
    ("as chapter 3 showed", ""),
    ("chapter 3, The paged (chunked) KV cache, showed", ""),
    ("chapter 3 (the paged cache)", ""),
    ("chapter 3 (claim C4)", ""),  # a description that is no chapter's title: not judged
    ("[chapter 3](03_paged_cache.ipynb)", ""),
    ("[The paged (chunked) KV cache](../notebooks/03_paged_cache.ipynb#section)", ""),
    ("chapter 7 showed", "no chapter 07"),
    ("chapters 3 and 9", "no chapter 09"),
    ("chapter 12, Quantizing the weights", "not 'Quantizing the weights' (chapter 14)"),
    ("chapter 12 (quantizing weights)", "describes chapter 14"),
    ("[chapter 12](03_paged_cache.ipynb)", "the link text says chapter 12, the notebook is chapter 3"),
    ("[Quantizing the weights](03_paged_cache.ipynb)", "(chapter 14)"),
    ("see [it](09_triton.ipynb)", "book.toml lists no such notebook"),
])
def test_chapter_ref_problems_on_a_small_book(text, problem):
    problems = chapter_ref_problems(text, fake_book())
    assert (problem in problems[0]) if problem else not problems, problems
