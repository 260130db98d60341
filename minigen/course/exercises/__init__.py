"""Exercise checkers for the chapters, with worked solutions (the core never imports this package).

Each chapter's module `chNN.py` holds `check_<name>(your_function)` and `solution_<name>(...)`.
A checker calls your function on several cases and compares it with the package's own formula: it
prints one line and returns True when every case agrees, and raises `ExerciseFailed` naming the
case, the expected value and yours (with a hint when the mistake is a common one) otherwise.

    from minigen.course.exercises import ch01
    ch01.check_naive_step_flops(my_flops)            # your answer
    ch01.check_naive_step_flops(ch01.solution_naive_step_flops)   # the worked solution

An exercise makes you build the piece, so a checker runs your answer with minigen's own solution
patched to raise (`forbidding`): an answer that only calls the package fails, however it is wrapped.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator, Sequence


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


def _refuse(*args, **kwargs):
    raise NotImplementedError("minigen's own solution was called")  # a builtin: it runs in any module


@contextlib.contextmanager
def forbidding(*solutions: Callable) -> Iterator[None]:
    """While active, each of minigen's `solutions` raises ExerciseFailed when called, by whatever name.

    The function's code is swapped in place, so `my_pack4 = pack4`, `lambda c: pack4(c)` and a
    method reached through an instance all hit it. Compute the expected values before entering.
    Methods are given as functions (`Scheduler.can_admit`); functions with closures are not supported.
    """
    saved = []
    for f in solutions:
        f = getattr(f, "__func__", f)  # a bound or class method: its function
        if not isinstance(f, types.FunctionType) or f.__closure__:
            raise TypeError(f"forbidding: {f!r} is not a plain function without a closure")
        saved.append((f, f.__code__))
        f.__code__ = _refuse.__code__.replace(co_name=f.__name__, co_qualname=f.__qualname__)
    try:
        yield
    except NotImplementedError as error:
        if str(error) != "minigen's own solution was called":
            raise
        tb = error.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        raise ExerciseFailed(f"your answer calls minigen's own {tb.tb_frame.f_code.co_qualname}: the exercise "
                             "is to build it yourself (the cell above shows how it is used, not its code)") from None
    finally:
        for f, code in saved:
            f.__code__ = code
