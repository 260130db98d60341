"""Every file, folder and `minigen.x.y` name the course's prose mentions exists (issue 46, guard 1).

A chapter that names `minigen.exercises.ch01` after the exercises moved to minigen.course.exercises,
or `cache.py` after the cache became a folder, sends the reader to nothing. The checks read each
chapter's markdown cells and its code cells' comments, and every Markdown page (README, docs/, deploy/); what counts as a
reference and how it resolves is minigen/course/references.py. All failures are reported at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from minigen.course.references import (Prose, Reference, missing_reference, path_references,
                                       prose_of_notebook, repo_paths)

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# the README, CONTRIBUTING.md, docs/ and deploy/README.md: every Markdown page a reader opens
# (not docs/CHANGELOG.md: history names files as they were on its dates)
DOCS = [p for p in (*sorted(ROOT.glob("*.md")), *sorted((ROOT / "docs").rglob("*.md")),
                    *sorted((ROOT / "deploy").rglob("*.md"))) if p.name != "CHANGELOG.md"]


@pytest.fixture(scope="module")
def paths() -> tuple[set[str], set[str]]:
    return repo_paths(ROOT)


def unresolved(prose: list[Prose], paths: tuple[set[str], set[str]]) -> list[str]:
    return [f"{p.where}: `{ref.text}`: {why}" for p in prose for ref in path_references(p.text)
            if (why := missing_reference(ref, *paths))]


def test_every_reference_in_a_chapter_exists(paths):
    bad = unresolved([p for path in CHAPTERS for p in prose_of_notebook(path, ROOT)], paths)
    assert not bad, (f"{len(bad)} references in the chapters name nothing that exists; fix the name "
                     "(or, for a file outside the repository, add it to references.EXTERNAL_FILES):\n  "
                     + "\n  ".join(bad))


def test_every_reference_in_the_readme_docs_and_deploy_pages_exists(paths):
    prose = [Prose(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in DOCS]
    bad = unresolved(prose, paths)
    assert not bad, f"{len(bad)} references in the Markdown pages name nothing that exists:\n  " + "\n  ".join(bad)


def test_what_counts_as_a_reference():
    text = ("`minigen/caches/contiguous.py`, `csrc/rows_s8.c`, `model.py`, `deploy/`, `minigen.generate`, "
            "`minigen.load(\"smollm2-135m\", tp_size=N)`, and not: `minigen serve`, `/metrics`, `max_new_tokens`, "
            "`nvidia.com/gpu`, `HuggingFaceTB/SmolLM2-135M`, `~/.cache/minigen/`, `figures/gpu/<device>.json`, "
            "`block_size / 2`, `x.y`, `exercises/chNN.py`, `figures/NAME.json`, `minigen::matvec`, `Qwen/Qwen2.5-0.5B`")
    assert path_references(text) == [
        Reference("file", "minigen/caches/contiguous.py"), Reference("file", "csrc/rows_s8.c"),
        Reference("file", "model.py"), Reference("folder", "deploy/"), Reference("name", "minigen.generate"),
        Reference("name", "minigen.load")]
    plain = ("see minigen/caches/paged.py and minigen.evaluate.score, [the README](../README.md#layout), "
             "[docs](https://example.com/a/b.py); not: and/or, 2.5/3.0, model.py, e.g. a.b")
    assert path_references(plain) == [Reference("file", "minigen/caches/paged.py"),
                                      Reference("name", "minigen.evaluate.score"), Reference("file", "README.md")]


@pytest.mark.parametrize("ref, ok", [
    (Reference("file", "csrc/rows_s8.c"), True),  # a path's tail: minigen/kernels/csrc/rows_s8.c
    (Reference("file", "minigen/caches/contiguous.py"), True),
    (Reference("file", "model.py"), True),  # a bare name: some file has it
    (Reference("file", "config.json"), True),  # a checkpoint's file, outside the repository by design
    (Reference("file", "minigen/cache.py"), False),
    (Reference("file", "ws/rows_s8.c"), False),  # a tail must end at a folder boundary
    (Reference("folder", "minigen/decoding/"), True),
    (Reference("folder", "minigen/nothing/"), False),
    (Reference("name", "minigen.generate"), True),  # the function the package re-exports
    (Reference("name", "minigen.course.exercises.ch06"), True),  # a module, imported to look
    (Reference("name", "minigen.evaluate.attention_entropy"), True),  # an attribute of a module
    (Reference("name", "minigen.exercises.ch01"), False),
    (Reference("name", "minigen.generate.no_such_name"), False),
])
def test_references_resolve_against_the_repository_and_the_package(ref, ok, paths):
    assert (missing_reference(ref, *paths) == "") is ok
