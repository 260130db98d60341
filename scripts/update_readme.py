"""Rewrite the README's generated blocks: the chapter list from book.toml, and the table of which
cache features combine from minigen/config.py.

    python scripts/update_readme.py          # rewrite the blocks between the markers
    python scripts/update_readme.py --check  # exit 1 if a block is out of date

The list sits between `<!-- chapters:start -->` and `<!-- chapters:end -->`, the table between
`<!-- combinations:start -->` and `<!-- combinations:end -->`; everything else in the README is
left as it is. tests/test_packaging.py and tests/test_combinations.py fail when they disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a plain checkout works too, not only an installed minigen

from minigen.course.book import load_book, readme_chapter_list  # noqa: E402
from minigen.course.table import combination_table  # noqa: E402

START, END = "<!-- chapters:start -->", "<!-- chapters:end -->"
TABLE = ("<!-- combinations:start -->", "<!-- combinations:end -->")


def replace_block(readme: str, block: str, markers: tuple[str, str] = (START, END)) -> str:
    """The README text with the part between the markers replaced by `block`."""
    head, start, rest = readme.partition(markers[0])
    body, end, tail = rest.partition(markers[1])
    if not start or not end:
        raise SystemExit(f"README.md: markers {markers[0]} and {markers[1]} not found (start first, then end)")
    return f"{head}{markers[0]}\n{block}{markers[1]}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", type=Path, default=ROOT / "book.toml", help="book.toml to read")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="README to rewrite")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if out of date")
    args = parser.parse_args()

    old = args.readme.read_text(encoding="utf-8")
    new = replace_block(old, readme_chapter_list(load_book(args.book)))
    new = replace_block(new, combination_table() + "\n", TABLE)
    if new == old:
        print(f"{args.readme.name}: chapter list and combination table are up to date")
    elif args.check:
        raise SystemExit(f"{args.readme.name}: a generated block is out of date; "
                         "run python scripts/update_readme.py")
    else:
        args.readme.write_text(new, encoding="utf-8")
        print(f"{args.readme.name}: chapter list and combination table rewritten")


if __name__ == "__main__":
    main()
