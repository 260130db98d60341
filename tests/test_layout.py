"""The package's layout: no import cycles, no imports hidden in functions to dodge one, the core
never imports the course layer, and the modules stay readable in size (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minigen"
COURSE = {"plots", "widgets", "simulation", "book", "exercises", "bench", "serve_bench", "__main__"}  # may import anything


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__") or "__init__"


def minigen_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported minigen module, whether the import sits inside a function) for every import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = module_name(path).split(".")
    out = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level:  # from .x import y / from ..x import y
                base = here[:len(here) - child.level] if path.name != "__init__.py" else here[:len(here) - child.level + 1]
                target = ".".join(base + ([child.module] if child.module else []))
                names = [target] if child.module else [".".join(base + [a.name]) for a in child.names]
                out.extend((n.removeprefix("__init__.").strip("."), inside) for n in names)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("minigen"):
                out.append((child.module.removeprefix("minigen").strip("."), inside))
            visit(child, inside)

    visit(tree, False)
    return [(name.split(".")[0] if name else "__init__", inside) for name, inside in out]


MODULES = {module_name(p).split(".")[0]: p for p in sorted(PACKAGE.glob("*.py"))}


def test_no_import_cycles():
    graph = {name: {m for m, inside in minigen_imports(path) if not inside and m in MODULES and m != name}
             for name, path in MODULES.items() if name != "__init__"}
    assert {"kv_cache", "paged", "quant"} <= graph["cache"] and "paged" in graph["quant"]  # the parser sees imports
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(node, path):
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                walk(nxt, path + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            walk(name, [])


@pytest.mark.parametrize("name", sorted(set(MODULES) - COURSE - {"__init__"}))
def test_the_core_imports_at_the_top_and_never_the_course_layer(name):
    for module, inside in minigen_imports(MODULES[name]):
        assert not inside, f"{name}.py imports {module} inside a function: import it at the top"
        assert module not in COURSE, f"{name}.py imports the course layer ({module})"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= 420, f"{name}.py has {lines} lines: split it by concept (STYLE.md: past ~400)"


def test_einops_is_used_where_it_is_declared():
    users = [p.name for p in PACKAGE.rglob("*.py") if "from einops import" in p.read_text(encoding="utf-8")]
    assert users, "pyproject.toml declares einops: use it or remove it"
