"""The course's table of contents: `book.toml` read into two small typed dataclasses.

`book.toml` is the one list of chapters. The README's chapter list (`scripts/update_readme.py`),
the static book (`scripts/build_book.py`) and the notebook test run (`make test`) are all
generated from it, so a chapter is added in one place. The book's two generated pages are here too:
`article_page` (the source article and its claims) and `ledger_page` (the claims ledger), both
rendered from minigen/course/claims.toml when the book is built.

This module is course tooling: the core (model, cache, generate) never imports it.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli before it joined the standard library
    import tomli as tomllib

from ..errors import MinigenError
from .ledger import VERDICTS, Claim

# book.toml at the repository root: the folder above the package (an editable install or a checkout)
DEFAULT_BOOK = Path(__file__).resolve().parents[2] / "book.toml"


class BookError(MinigenError, ValueError):
    """book.toml is missing, malformed, or has a key of the wrong type."""


@dataclass(frozen=True)
class Chapter:
    notebook: str  # path of the .ipynb, relative to the folder that holds book.toml
    title: str  # the title shown in the README and the book's contents
    learn: list[str]  # what a reader will learn, one line each
    minutes: float  # time to run the whole notebook on a two-core CPU, in minutes
    gpu: bool  # True: some sections need CUDA (without it they print a notice and skip)

    @property
    def number(self) -> str:
        """The two digits that start the notebook's name, and the letter of a chapter placed between two
        ("06" for notebooks/06_kv_quantization.ipynb; "02b" would name one placed between 02 and 03), as the
        claims ledger cites chapters; "" for a notebook not named that way."""
        match = re.match(r"(\d\d[a-z]?)_", Path(self.notebook).name)
        return match.group(1) if match else ""

    @property
    def label(self) -> str:
        """The chapter's number as the README and prose say it: "4" for "04", "2b" for "02b"."""
        return self.number.lstrip("0") or ("0" if self.number else "")

    @property
    def doc(self) -> str:
        """The chapter's Sphinx document name in the static book: "notebooks/06_kv_quantization"."""
        return Path(self.notebook).with_suffix("").as_posix()


@dataclass(frozen=True)
class Book:
    title: str  # the course's title
    authors: list[str]  # names, in the order they are credited
    description: str  # one or two sentences for the book's front page
    chapters: list[Chapter]  # in reading order
    root: Path = Path(".")  # folder that holds book.toml; chapter notebooks are relative to it

    def notebook_paths(self) -> list[Path]:
        """The chapters' notebooks as absolute paths, in reading order."""
        return [(self.root / c.notebook).resolve() for c in self.chapters]


_BOOK_KEYS = {"title": str, "authors": list, "description": str}
_CHAPTER_KEYS = {"notebook": str, "title": str, "learn": list, "minutes": float, "gpu": bool}


def _check_keys(table: dict[str, Any], allowed: dict[str, type], where: str) -> None:
    # Unknown keys are errors too: a typo such as `minute = 1` must not silently fall back.
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise BookError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
    missing = [k for k in allowed if k not in table]
    if missing:
        raise BookError(f"{where}: missing key {missing[0]!r}")


def _text(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise BookError(f"{where}: key {key!r} must be a non-empty string, got {value!r}")
    return value.strip()


def _texts(value: Any, key: str, where: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise BookError(f"{where}: key {key!r} must be a non-empty list of strings, got {value!r}")
    return [_text(v, key, where) for v in value]


def _chapter(table: Any, index: int) -> Chapter:
    where = f"[[chapter]] #{index + 1}"
    if not isinstance(table, dict):
        raise BookError(f"{where}: must be a table, got {table!r}")
    _check_keys(table, _CHAPTER_KEYS, where)
    notebook = _text(table["notebook"], "notebook", where)
    where = f"[[chapter]] #{index + 1} ({notebook})"
    if not notebook.endswith(".ipynb"):
        raise BookError(f"{where}: key 'notebook' must name a .ipynb file, got {notebook!r}")
    minutes = table["minutes"]
    # bool is an int in Python; `minutes = true` is a typo, not a duration
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
        raise BookError(f"{where}: key 'minutes' must be a number > 0, got {minutes!r}")
    if not isinstance(table["gpu"], bool):
        raise BookError(f"{where}: key 'gpu' must be true or false, got {table['gpu']!r}")
    return Chapter(
        notebook=notebook,
        title=_text(table["title"], "title", where),
        learn=_texts(table["learn"], "learn", where),
        minutes=float(minutes),
        gpu=table["gpu"],
    )


def parse_book(data: dict[str, Any], root: Path = Path(".")) -> Book:
    """Validate the parsed TOML of a book.toml; `root` is the folder that holds it."""
    _check_keys(data, {"book": dict, "chapter": list}, "book.toml")
    meta = data["book"]
    if not isinstance(meta, dict):
        raise BookError(f"book.toml: [book] must be a table, got {meta!r}")
    _check_keys(meta, _BOOK_KEYS, "[book]")
    if not isinstance(data["chapter"], list) or not data["chapter"]:
        raise BookError("book.toml: key 'chapter' must be one or more [[chapter]] tables")
    chapters = [_chapter(t, i) for i, t in enumerate(data["chapter"])]
    seen: set[str] = set()
    for c in chapters:
        if c.notebook in seen:
            raise BookError(f"book.toml: notebook {c.notebook!r} is listed twice")
        seen.add(c.notebook)
    return Book(
        title=_text(meta["title"], "title", "[book]"),
        authors=_texts(meta["authors"], "authors", "[book]"),
        description=_text(meta["description"], "description", "[book]"),
        chapters=chapters,
        root=root,
    )


def load_book(path: str | Path | None = None) -> Book:
    """Read and validate book.toml; `None` reads the one at the repository root."""
    path = Path(path) if path is not None else DEFAULT_BOOK
    if not path.is_file():
        raise BookError(f"{path}: no such file (book.toml lives at the repository root)")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise BookError(f"{path}: not valid TOML: {e}") from e
    try:
        return parse_book(data, root=path.resolve().parent)
    except BookError as e:
        raise BookError(f"{path}: {e}") from None


def readme_chapter_list(book: Book) -> str:
    """The README's chapter list as Markdown: one item per chapter, led by the number of its notebook
    (a bullet list, since a chapter placed between two, "2b", would break a numbered one)."""
    lines = []
    for c in book.chapters:
        cost = f"about {c.minutes:g} min on a two-core CPU"
        if c.gpu:
            cost += "; some sections need a CUDA GPU"
        number = f"- **{c.label}.** " if c.number else "- "
        lines.append(f"{number}[{c.title}]({c.notebook}) ({cost})")
        lines += [f"  - {item}" for item in c.learn]  # nested under the chapter's item
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the static book's generated pages
_MARKDOWN_SPECIAL = set("\\`*_[]<>$|#{}")  # escaped in claim texts: `$..$` would be read as math


def _md(text: str) -> str:
    """Plain text made safe inside MyST Markdown (a table cell, a list item): specials escaped."""
    return "".join("\\" + ch if ch in _MARKDOWN_SPECIAL else ch for ch in " ".join(text.split()))


def claim_label(claim: Claim) -> str:
    """The Sphinx label of a claim's entry on the ledger page: "claim-c5a"."""
    return f"claim-{claim.id.lower()}"


def _chapter_ref(book: Book, number: str, title: bool = True) -> str:
    chapters = {c.number: c for c in book.chapters if c.number}
    if not number:
        return "no chapter yet"
    if number not in chapters:  # the ledger may cite a chapter that book.toml does not list yet
        return f"chapter {number}"
    text = f"chapter {number}: {chapters[number].title}" if title else f"chapter {number}"
    return f"{{doc}}`{text} </{chapters[number].doc}>`"


def article_page(intro: str, claims: list[Claim]) -> str:
    """The book's first page: `intro` (docs/article.md: what the article is, its language, what it
    covers), then every claim of the ledger, each linked to its entry on the ledger page."""
    lines = [intro.rstrip(), "",
             f"The article makes {len(claims)} quantitative claims (C: its sections 1 to 8; T: its "
             "troubleshooting; A: its advice). Each links to its entry in {doc}`the claims ledger </ledger>`, "
             "with what we measured and the verdict.", ""]
    lines += [f"- {{ref}}`{c.id} <{claim_label(c)}>`: {_md(c.claim)} (**{c.verdict}**)" for c in claims]
    return "\n".join(lines) + "\n"


def ledger_page(book: Book, claims: list[Claim]) -> str:
    """The claims ledger as a MyST page: a summary table, then one labelled section per claim."""
    counts = ", ".join(f"{sum(c.verdict == v for c in claims)} {v}" for v in VERDICTS)
    lines = ["# The claims ledger", "",
             "Every quantitative claim of {doc}`the source article </article>`, what this course measured, "
             "on which machine, and the verdict. This page is rendered from `minigen/course/claims.toml` when the "
             "book is built; `python -m minigen ledger` prints the same file, and each chapter's closing "
             "cell asserts its measurements against it.", "",
             f"**{len(claims)} claims:** {counts}.", "",
             "| Claim | Verdict | Measured in |", "|---|---|---|"]
    lines += [f"| {{ref}}`{c.id} <{claim_label(c)}>`: {_md(c.claim)} | {c.verdict} | {_chapter_ref(book, c.chapter, title=False)} |"
              for c in claims]
    for c in claims:
        machine = {"counted": "counted (bytes or FLOPs, no timing)"}.get(c.machine, c.machine)
        lines += ["", f"({claim_label(c)})=", f"## {c.id}: {_md(c.claim)}", "",
                  f"- **Reported by the article:** {_md(c.article_value)}",
                  f"- **Measured:** {_md(c.measured) if c.measured else 'not yet'}"
                  + (f" ({_md(machine)})" if machine else ""),
                  f"- **Verdict:** {c.verdict}",
                  f"- **Measured in:** {_chapter_ref(book, c.chapter)}"
                  + (f"; {_md(c.source)}" if c.source else "")]
    return "\n".join(lines) + "\n"
