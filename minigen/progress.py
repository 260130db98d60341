"""Progress bars for long work (prepare's conversion, bench, serve-bench, profile, the book): on a
terminal only, on stderr.

A bar is drawn only when stderr is a terminal: piped or captured output (a test, a notebook's
cell, a CI log, `--json` redirected) stays free of carriage returns and half-drawn bars, and stdout,
where results and JSON go, never has one.
"""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bar(iterable: Iterable[T] | None = None, **kwargs) -> tqdm:
    """tqdm over `iterable` (or with total=... and .update()), drawn on stderr when it is a terminal."""
    # tqdm.auto would draw a widget in a notebook, where the chapters' outputs are asserted and stored
    return tqdm(iterable, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False, **kwargs)
