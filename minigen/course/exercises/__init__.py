"""Exercise checkers for the chapters, with worked solutions (the core never imports this package).

Each chapter's module `chNN.py` holds `check_<name>(your_function)` and `solution_<name>(...)`.
A checker calls your function on several cases and compares it with the package's own formula: it
prints one line and returns True when every case agrees, and raises `ExerciseFailed` naming the
case, the expected value and yours (with a hint when the mistake is a common one) otherwise.

    from minigen.course.exercises import ch01
    ch01.check_naive_step_flops(my_flops)            # your answer
    ch01.check_naive_step_flops(ch01.solution_naive_step_flops)   # the worked solution
"""

from __future__ import annotations

from typing import Callable, Sequence


class ExerciseFailed(AssertionError):
    """Your function disagrees with the package on some case; the message says which and why."""


def compare(name: str, cases: Sequence[tuple[str, tuple, object]], fn: Callable,
            hints: Callable[[tuple, object], str] | None = None, rel_tol: float = 0.0) -> bool:
    """Call fn(*args) for each (label, args, expected); raise ExerciseFailed on the first mismatch.

    rel_tol: allowed relative difference (0: exact). hints(args, got) may return a hint or "".
    """
    for label, args, expected in cases:
        got = fn(*args)
        ok = got is not None and abs(float(got) - float(expected)) <= rel_tol * abs(float(expected))
        if not ok:
            hint = hints(args, got) if hints is not None and got is not None else ""
            raise ExerciseFailed(f"{name}: for {label} expected {expected:,}, got "
                                 f"{got if got is None else format(got, ',')}" + (f". Hint: {hint}" if hint else ""))
    print(f"✓ {name}: all {len(cases)} cases agree with the package")
    return True


def known_mistake(got, mistakes: Sequence[tuple[object, str]]) -> str:
    """The hints of every (wrong value, hint) pair that `got` equals, joined; "" when none does."""
    hits = [hint for value, hint in mistakes if got == value]
    return "; or ".join(dict.fromkeys(hits))
