"""The project's lists agree with each other: dependencies, chapters, README.

pyproject.toml and environment.yml must name the same packages; book.toml, notebooks/ and the
README's chapter list must name the same chapters in the same order.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from minigen.course.book import Book, BookError, load_book, parse_book, readme_chapter_list

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- chapters:start -->", "<!-- chapters:end -->"

# conda-forge names that differ from PyPI's, for the same software
CONDA_TO_PYPI = {"pytorch": "torch", "matplotlib-base": "matplotlib"}
# the interpreter and the installer, not dependencies
NOT_PACKAGES = {"python", "pip"}


def normalize(name: str) -> str:
    """PEP 503: case and runs of -, _ and . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_spec(spec: str) -> tuple[str, str]:
    """'torch==2.13.0; marker' or 'pytorch=2.13.0' -> (normalized name, version part)."""
    spec = spec.split(";")[0].split("::")[-1].strip()  # drop a marker and a conda channel prefix
    m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", spec)
    assert m, f"cannot read a package name from {spec!r}"
    return normalize(m.group(1)), m.group(3).strip()


def pyproject_deps() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return dict(split_spec(s) for s in data["project"]["dependencies"])


def environment_yml_deps(text: str) -> tuple[list[str], list[str]]:
    """The conda and pip entries under `dependencies:` of an environment.yml.

    A tiny reader for the one shape environment.yml has (a list of strings, and one `- pip:` list
    nested in it), so the tests need no YAML library that the project does not declare.
    """
    conda: list[str] = []
    pip: list[str] = []
    section, pip_indent = None, None
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).rstrip()  # YAML comments start at '#' after a space
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            section = line.split(":")[0].strip()
            pip_indent = None
            continue
        if section != "dependencies":
            continue
        item = line.strip()
        assert item.startswith("- "), f"environment.yml: expected a '- ' list item, got {raw!r}"
        item = item[2:].strip()
        if item == "pip:":
            pip_indent = indent
        elif pip_indent is not None and indent > pip_indent:
            pip.append(item)
        else:
            pip_indent = None
            conda.append(item)
    return conda, pip


def environment_deps() -> dict[str, str]:
    conda, pip = environment_yml_deps((ROOT / "environment.yml").read_text(encoding="utf-8"))
    deps = {}
    for spec in conda:
        name, version = split_spec(spec)
        deps[CONDA_TO_PYPI.get(name, name)] = version
    for spec in pip:
        if not spec.startswith("-"):  # `-e .` installs minigen itself
            deps.update([split_spec(spec)])
    return {k: v for k, v in deps.items() if k not in NOT_PACKAGES}


def test_environment_yml_reader_on_a_known_file():
    # the reader itself must see every entry, or the comparison below could pass on nothing
    text = ("name: x  # comment\ndependencies:\n  - python=3.11\n  - pytorch=2.13.0  # torch\n"
            "  - pip\n  - pip:\n      - gguf\n      - -e .\n  - numpy\nchannels:\n  - conda-forge\n")
    assert environment_yml_deps(text) == (["python=3.11", "pytorch=2.13.0", "pip", "numpy"],
                                          ["gguf", "-e ."])


def test_pyproject_and_environment_yml_name_the_same_packages():
    py, env = pyproject_deps(), environment_deps()
    only_py, only_env = sorted(set(py) - set(env)), sorted(set(env) - set(py))
    assert not only_py and not only_env, (
        "pyproject.toml and environment.yml disagree (names compared case- and -/_-blind; "
        f"conda-forge aliases {CONDA_TO_PYPI}):\n"
        f"  only in pyproject.toml:  {', '.join(only_py) or '-'}\n"
        f"  only in environment.yml: {', '.join(only_env) or '-'}")


def test_exact_pins_agree():
    # torch==2.13.0 is pinned on purpose (see the Makefile); conda must ask for the same release
    py, env = pyproject_deps(), environment_deps()
    pins = {n: v.removeprefix("==") for n, v in py.items() if v.startswith("==")}
    assert "torch" in pins, "pyproject.toml must pin torch with =="
    wrong = {n: (v, env.get(n, "")) for n, v in pins.items()
             if re.sub(r"^=+", "", env.get(n, "")) != v}
    assert not wrong, f"environment.yml does not pin the same versions (pyproject, conda): {wrong}"


@pytest.fixture(scope="module")
def book() -> Book:
    return load_book(ROOT / "book.toml")


def test_book_lists_exactly_the_notebooks(book):
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb")}
    listed = [c.notebook for c in book.chapters]
    unlisted = sorted(on_disk - set(listed))
    missing = [n for n in listed if not (ROOT / n).is_file()]
    assert not unlisted and not missing, (
        "book.toml and notebooks/ disagree:\n"
        f"  notebooks not listed in book.toml: {', '.join(unlisted) or '-'}\n"
        f"  listed in book.toml but missing:   {', '.join(missing) or '-'}")


def readme_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count(START) == 1 and readme.count(END) == 1, \
        f"README.md must hold {START} and {END} once each"
    start, end = readme.index(START) + len(START), readme.index(END)
    assert start <= end, f"README.md: {END} comes before {START}"
    return readme[start:end]


def test_readme_lists_the_chapters_in_book_order(book):
    block, pos = readme_block(), 0
    for c in book.chapters:
        found = block.find(c.title, pos)
        assert found >= 0, (f"README.md's chapter list lacks {c.title!r} after position {pos} "
                            "(missing or out of order); run python scripts/update_readme.py")
        pos = found + len(c.title)


def test_readme_chapter_list_is_generated_from_book_toml(book):
    assert readme_block().strip() == readme_chapter_list(book).strip(), \
        "README.md's chapter list is out of date; run python scripts/update_readme.py"


GOOD_CHAPTER = {"notebook": "notebooks/00_x.ipynb", "title": "X", "learn": ["a"], "minutes": 1,
                "gpu": False}


@pytest.mark.parametrize("change, key", [
    ({"minute": 1}, "minute"),  # a typo: an unknown key
    ({"minutes": "1"}, "minutes"),
    ({"minutes": True}, "minutes"),
    ({"gpu": "no"}, "gpu"),
    ({"learn": []}, "learn"),
    ({"notebook": "notebooks/00_x.py"}, "notebook"),
])
def test_book_errors_name_the_key(change, key):
    chapter = {**GOOD_CHAPTER, **change}
    data = {"book": {"title": "T", "authors": ["A"], "description": "D"}, "chapter": [chapter]}
    with pytest.raises(BookError, match=repr(key)):
        parse_book(data)
    assert parse_book({**data, "chapter": [GOOD_CHAPTER]}).chapters[0].minutes == 1.0


# ---------------------------------------------------------------- time limits (pytest-timeout)
def test_every_test_has_a_time_limit_of_120_s_by_default(pytestconfig):
    # a test stuck in a slow path must fail, named, instead of running past CI's limit; the few
    # longer tests carry their own @pytest.mark.timeout(N)
    import pytest_timeout  # noqa: F401  (a declared dependency; without it `timeout` is no setting)
    assert "pytest-timeout" in pyproject_deps()
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
    assert ini.get("timeout") == 120, "pyproject.toml's [tool.pytest.ini_options] must set timeout = 120"
    assert float(pytestconfig.getini("timeout")) == 120  # the setting this run of pytest read


def test_the_makefiles_chapter_runs_have_a_time_limit():
    # make test and make figures run the chapters with $(NBVAL): a cell gets 300 s from nbval, and
    # pytest-timeout (whose default of 120 s would otherwise apply to each cell too) gets longer, so
    # that nbval's timeout fires first and interrupts the kernel; pytest-timeout's would leave the
    # kernel busy and every later cell of the chapter timing out behind it
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    nbval = re.search(r"^NBVAL\s*:?=(.*)$", makefile, re.M)
    assert nbval, "the Makefile must define NBVAL, the options of its nbval runs"
    options = dict(o.split("=", 1) for o in nbval.group(1).split() if o.startswith("--") and "=" in o)
    assert float(options.get("--nbval-cell-timeout", "inf")) == 300, nbval.group(1)
    assert 300 < float(options.get("--timeout", "0")) <= 600, nbval.group(1)
    runs = [line for line in makefile.splitlines() if "-m pytest" in line and "$$notebooks" in line]
    assert len(runs) == 3 and all("$(NBVAL)" in line for line in runs), runs  # test (echo, run), figures
