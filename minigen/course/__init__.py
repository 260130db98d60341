"""The course's layer: what every chapter calls at its top and its end (the core never imports this).

    setup(threads=1, seed=0)   -> torch's thread count and seeds, one printed line saying why
    held(rows)                 -> the "what held on this run" table; raises naming each row that failed
"""

from __future__ import annotations

import random

import numpy as np
import torch
from IPython.display import Markdown, display

# Why the chapters default to one thread, said once here rather than in every setup cell: on a shared
# two-core CPU next to one busy process, a second thread waits for its neighbour's core at every
# parallel region, and cached decoding ran 6x slower on two threads than on one (chapter 0 measures
# it on this machine). On a machine of your own, pass the number of cores.
WHY_ONE_THREAD = ("one thread: on a shared two-core CPU a second thread waits for a busy neighbour's core at "
                  "every parallel region (chapter 0); pass threads=<cores> on a machine of your own")


def setup(threads: int = 1, seed: int = 0) -> None:
    """Set torch's (and the C kernels') thread count and seed torch, numpy and random, then say so."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"setup(threads={threads!r}): threads must be a whole number >= 1")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    why = WHY_ONE_THREAD if threads == 1 else f"{threads} threads"
    print(f"minigen.course.setup: {why}; seed {seed}")


def held(rows) -> None:
    """Render the chapter's closing checks as one table, then fail naming every row that did not hold.

    rows: (what was claimed, held: bool, what this run measured) triples. The chapters hide the cell's
    code in the book (tag hide-input) and show the table; under nbval a row that fails fails the cell."""
    rows = [(str(claim), bool(ok), str(measured)) for claim, ok, measured in rows]
    if not rows:
        raise ValueError("held(rows): no rows; a closing check that checks nothing cannot fail")
    lines = ["| what the chapter claims | held on this run | measured |", "|---|---|---|"]
    lines += [f"| {claim} | {'yes' if ok else '**no**'} | {measured} |" for claim, ok, measured in rows]
    display(Markdown("\n".join(lines)))
    failed = [f"{claim} (measured: {measured})" for claim, ok, measured in rows if not ok]
    if failed:
        raise AssertionError("did not hold on this run: " + "; ".join(failed))
