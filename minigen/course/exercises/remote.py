"""A function of yours, sent to spawned processes by its source: how chapter 16's checker runs an answer
defined in a notebook cell inside each rank of a process group.

A new process started with "spawn" unpickles a function by importing its module and looking up its
name, and a notebook cell's function lives in a module (`__main__` of the kernel) that the new process
does not have. So `pack(fn)` takes what is needed to build fn again: its source (inspect.getsource: a
.py file, or the cell's text, which IPython keeps in linecache) and that of the functions of yours it
calls, the modules it names (by name: imported again in the rank, under your aliases), functions of
minigen's or of an installed library (by reference), any other global (pickled), and what cannot
travel (named, with why). `unpack(payload)` runs the sources again inside the rank, at their own line
numbers so that a traceback shows your lines, in a namespace that starts with torch, torch.distributed
as dist, torch.nn.functional as F, math and Tensor. `said(error, payload)` puts an error of the answer
in one line, with the line of yours that raised it.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import linecache
import math
import os
import pickle
import re
import sys
import sysconfig
import textwrap
import traceback
import types
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from . import ExerciseFailed


def _installed(module: types.ModuleType) -> bool:
    """True for minigen, the standard library and installed packages: their functions travel by reference."""
    if module.__name__.split(".")[0] == "minigen":
        return True
    file = getattr(module, "__file__", None)
    if file is None:
        return module.__name__ in sys.builtin_module_names
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(os.path.abspath(file).startswith(os.path.abspath(root) + os.sep) for root in roots)


def _names(code: types.CodeType) -> set[str]:
    """Every global name a function's code (and the code nested in it) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _source(fn: types.FunctionType) -> tuple[str, int, str]:
    """(file name, first line, source) of a function defined with def, in a file or a notebook cell."""
    what = fn.__name__
    if fn.__name__ == "<lambda>":
        raise ExerciseFailed("the checker sends your function's source to the ranks, and a lambda has none of "
                             "its own: define the answer with def")
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise ExerciseFailed(f"the checker sends {what}'s source to the ranks (a notebook's function cannot be "
                             f"pickled into a new process), and found none ({e}): define it with def in a "
                             "notebook cell or a .py file") from None
    return fn.__code__.co_filename, max(first, 1), textwrap.dedent("".join(lines))


def pack(fn: Callable) -> dict:
    """What a rank needs to build `fn` again: the sources of fn and of the functions of yours it calls,
    the modules it names (by name) and its other globals (pickled); those that cannot travel, why."""
    if not isinstance(fn, types.FunctionType):
        raise ExerciseFailed(f"the checker takes a function defined with def, not {type(fn).__name__}")
    payload = {"name": fn.__name__, "sources": [], "modules": {}, "values": {}, "defaults": {}, "skipped": {}}
    seen: set[int] = set()

    def add(f: types.FunctionType) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        payload["sources"].insert(0, _source(f))  # helpers first: the answer is last
        try:
            payload["defaults"][f.__name__] = pickle.dumps((f.__defaults__, f.__kwdefaults__))
        except Exception as e:
            payload["skipped"][f"{f.__name__}'s defaults"] = f"{type(e).__name__}: {e}"
        found = {name: f.__globals__[name] for name in _names(f.__code__) if name in f.__globals__}
        if f.__closure__:
            found.update({name: cell.cell_contents for name, cell in zip(f.__code__.co_freevars, f.__closure__)})
        for name, value in found.items():
            if name in payload["modules"] or name in payload["values"]:
                continue
            if isinstance(value, types.ModuleType):
                payload["modules"][name] = value.__name__
                continue
            if isinstance(value, types.FunctionType):
                module = sys.modules.get(value.__module__ or "")
                if module is None or value.__module__ == "__main__" or not _installed(module):
                    try:
                        add(value)  # a function of yours: by its source, too
                        continue
                    except ExerciseFailed:  # a lambda: it may still pickle (it does not from a notebook)
                        seen.discard(id(value))
            try:
                payload["values"][name] = pickle.dumps(value)
            except Exception as e:
                payload["skipped"][name] = f"{type(value).__name__}, {type(e).__name__}: {e}"

    add(fn)
    return payload


def _without_defaults(tree: ast.Module) -> ast.Module:
    """The top-level defs of `tree` with their defaults and annotations taken out: evaluated where the def
    ran, they may name globals that did not travel (the defaults' values travel instead, pickled)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            args.defaults = [ast.Constant(None) for _ in args.defaults]
            args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
            for arg in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                if arg is not None:
                    arg.annotation = None
            node.returns = None
    return ast.fix_missing_locations(tree)


def unpack(payload: dict) -> Callable:
    """Inside a rank: exec the sources (at their own line numbers, in linecache for tracebacks) in a
    namespace of torch, dist, F, math, Tensor and the globals that travelled -> the answer."""
    namespace = {"__name__": "__answer__", "__builtins__": builtins, "torch": torch, "dist": dist, "F": F,
                 "math": math, "Tensor": Tensor}
    for name, module in payload["modules"].items():
        namespace[name] = importlib.import_module(module)
    for name, data in payload["values"].items():
        namespace[name] = pickle.loads(data)
    known: dict[str, list[str]] = {}  # a file's lines as far as its functions that travelled show them
    for file, first, source in payload["sources"]:
        lines = known.setdefault(file, [])
        snippet = source.splitlines(True)
        lines.extend("\n" for _ in range(first - 1 + len(snippet) - len(lines)))
        lines[first - 1:first - 1 + len(snippet)] = snippet
        if not os.path.exists(file):  # a notebook cell: tracebacks in the rank show its lines
            linecache.cache[file] = (sum(map(len, lines)), None, list(lines), file)
        padded = "\n" * (first - 1) + source
        exec(compile(_without_defaults(ast.parse(padded, file)), file, "exec"), namespace)
    for name, data in payload["defaults"].items():
        f = namespace.get(name)
        if isinstance(f, types.FunctionType):
            f.__defaults__, f.__kwdefaults__ = pickle.loads(data)
    fn = namespace.get(payload["name"])
    if not isinstance(fn, types.FunctionType):
        raise ExerciseFailed(f"the source sent to the ranks did not define a function named {payload['name']}")
    return fn


def said(error: BaseException, payload: dict) -> str:
    """An exception of the answer in words: its type, message, and the answer's line that raised it."""
    files = {file for file, _, _ in payload["sources"]}
    where = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename in files]
    line = f" (line {where[-1].lineno}: {where[-1].line.strip()})" if where and where[-1].line else ""
    message = str(error).splitlines()[0] if str(error) else ""
    message = re.sub(r"\[[^\]]*\.(cc|cpp):\d+\] ", "", message).split(". This is typically")[0]  # gloo's
    return f"{type(error).__name__}: {message}{line}"
