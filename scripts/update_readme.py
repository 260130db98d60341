"""Rewrite the README's chapter list from book.toml.

    python scripts/update_readme.py          # rewrite the block between the markers
    python scripts/update_readme.py --check  # exit 1 if the block is out of date

The list sits between `<!-- chapters:start -->` and `<!-- chapters:end -->`; everything else in
the README is left as it is. tests/test_packaging.py fails when the two disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a plain checkout works too, not only an installed minigen

from minigen.book import load_book, readme_chapter_list  # noqa: E402

START, END = "<!-- chapters:start -->", "<!-- chapters:end -->"


def replace_block(readme: str, block: str) -> str:
    """The README text with the part between the markers replaced by `block`."""
    head, start, rest = readme.partition(START)
    body, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"README.md: markers {START} and {END} not found (start first, then end)")
    return f"{head}{START}\n{block}{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", type=Path, default=ROOT / "book.toml", help="book.toml to read")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README to rewrite")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if out of date")
    args = parser.parse_args()

    old = args.readme.read_text(encoding="utf-8")
    new = replace_block(old, readme_chapter_list(load_book(args.book)))
    if new == old:
        print(f"{args.readme.name}: chapter list is up to date")
    elif args.check:
        raise SystemExit(f"{args.readme.name}: chapter list is out of date; "
                         "run python scripts/update_readme.py")
    else:
        args.readme.write_text(new, encoding="utf-8")
        print(f"{args.readme.name}: chapter list rewritten from {args.book.name}")


if __name__ == "__main__":
    main()
