"""The package's layout (README, "Layout"; docs/architecture.md): the folders are the course's
layers, and the imports keep to them. The rules are stated as concepts, in LAYER_RULES: what each
layer may import and why. Beside them: no import cycles, no imports hidden in functions to dodge
one, no private name crossing a module, every room at the top named in the README's map, and the
modules readable in size (CONTRIBUTING.md, "Modules and imports")."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minigen"
# The layers, inside out. The core: the generator and everything it runs on.
CORE_PACKAGES = {"caches", "numerics", "kernels", "steps", "checkpoints", "decoding", "parallel"}
# The outer layers: they may import the core, never the other way round.
OUTER_PACKAGES = {"serving", "measure", "course", "production"}
FACES = {"__init__", "__main__"}  # the public face and the CLI: they may import anything
# Everything else at the top of minigen/ is the core, by concept rather than by list: model,
# attention, config, combinations, sampling, generate, loading, evaluate, errors, paths ... and the
# run plan (minigen/run_plan.py) with the where-axis of its rule table (minigen/places.py).


def module_name(path: Path) -> str:
    """minigen/caches/paged.py -> 'caches.paged'; minigen/caches/__init__.py -> 'caches'."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__") or "__init__"


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(imported minigen module, names imported from it, whether the import sits inside a function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    out = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and (child.level or (child.module or "").startswith("minigen")):
                if child.level:
                    base = package[:len(package) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module.removeprefix("minigen").strip(".")
                names = [a.name for a in child.names]
                submodules = [f"{target}.{n}".strip(".") for n in names if f"{target}.{n}".strip(".") in MODULES]
                if submodules:  # from .caches import paged, window: each a module
                    out.extend((m, [], inside) for m in submodules)
                    names = [n for n in names if f"{target}.{n}".strip(".") not in MODULES]
                if names or not submodules:
                    out.append((target or "__init__", names, inside))
            elif isinstance(child, ast.Import):
                out.extend((a.name.removeprefix("minigen").strip(".") or "__init__", [], inside)
                           for a in child.names if a.name.startswith("minigen"))
            visit(child, inside)

    visit(tree, False)
    return out


def layer(module: str) -> str:
    """'caches.paged' -> 'caches'; 'model' -> 'model' (a top-level module is its own room)."""
    return module.split(".")[0]


def is_core(module: str) -> bool:
    return layer(module) not in OUTER_PACKAGES | FACES


@dataclass(frozen=True)
class LayerRule:
    """One import rule: a module that `applies_to` may import no module that is `refused`."""
    says: str  # the rule, as docs/architecture.md states it
    applies_to: Callable[[str], bool]  # the importing module's name ('steps.fused')
    refused: Callable[[str], bool]  # the imported module's name
    why: str
    breaks: tuple[str, str]  # an import that breaks it (importer, imported): the rule's self-check
    keeps: tuple[str, str]  # a nearby import that keeps it


def in_layers(*names: str) -> Callable[[str], bool]:
    return lambda module: layer(module) in names


# What below the model means: numbers, tensors, the named errors, the machine's files, and the
# cache contract's views (what an attention kernel reads).
BELOW_THE_MODEL = {"kernels", "numerics", "errors", "paths"}

LAYER_RULES = (
    LayerRule("the core never imports an outer layer", is_core, in_layers(*OUTER_PACKAGES),
              "the generator runs without its harnesses: serving, measure, course and production are "
              "built on the core, so an import the other way would drag a bench or a server into generate()",
              breaks=("caches.paged", "serving.scheduler"), keeps=("serving.scheduler", "caches.blocks")),
    LayerRule("nothing but the faces imports a face", lambda m: not in_layers(*FACES)(m), in_layers(*FACES),
              "the public face gathers names; a module that imported it would import the whole package "
              "(and itself), so every module imports a name from where it lives",
              breaks=("generate", "__init__"), keeps=("__main__", "__init__")),
    LayerRule("kernels sit below the model", in_layers("kernels"),
              lambda m: not (layer(m) in BELOW_THE_MODEL or m == "caches.contract"),
              "an op kernel knows only numbers, tensors and the cache contract's views; the model, the "
              "steps and the plan choose kernels, never the other way round",
              breaks=("kernels.dispatch", "model"), keeps=("kernels.triton_prefill", "caches.contract")),
    LayerRule("model.py imports no kernel, no step and no plan", lambda m: m == "model",
              in_layers("kernels", "steps", "run_plan"),
              "the model is the math: which implementation runs an op is decided in kernels/dispatch.py "
              "and installed from outside (loading.py), and the plan is built from the model, not in it",
              breaks=("model", "kernels.cpu"), keeps=("model", "numerics.precision")),
    LayerRule("steps drive the model, and the loop drives the steps", in_layers("steps"),
              in_layers("generate", "serving", "measure"),
              "a step runs one prompt or decode step of the model; the loop (generate.py) and the Engine "
              "run steps, and the benches time them from outside",
              breaks=("steps.fused", "measure.bench"), keeps=("steps.fused", "model")),
    LayerRule("serving imports no measurement and no chapter tool", in_layers("serving"),
              in_layers("measure", "course"),
              "the Engine is what a server runs; benches time it and chapters draw it from outside",
              breaks=("serving.engine", "measure.machine"), keeps=("measure.serve_bench", "serving.engine")),
    LayerRule("only the faces import the course", lambda m: not in_layers("course", *FACES)(m),
              in_layers("course"),
              "plots, widgets, exercises and the ledger sit on top of everything; the library runs "
              "without them (the course itself may import anything)",
              breaks=("measure.bench", "course.plots"), keeps=("__main__", "course.ledger")),
    LayerRule("the run plan is core: it imports no outer layer and no face", in_layers("run_plan", "places"),
              in_layers(*OUTER_PACKAGES, *FACES),
              "the plan is built once from (model, config, batch shape, where it runs) and chooses among "
              "steps, caches, kernels and numerics; what runs cannot depend on a bench, a server or the CLI",
              breaks=("run_plan", "measure.machine"), keeps=("run_plan", "kernels.fastpaths")),
)


def layer_violations(graph: dict[str, set[str]], rules=LAYER_RULES) -> list[str]:
    """Every import in `graph` (module -> the modules it imports) that a rule refuses, in words."""
    return [f"{importer} imports {imported}: {rule.says} ({rule.why})"
            for importer, targets in sorted(graph.items()) for imported in sorted(targets)
            for rule in rules if rule.applies_to(importer) and rule.refused(imported)]


def import_graph() -> dict[str, set[str]]:
    """The package's imports, module -> the minigen modules it imports (at the top or in a function)."""
    return {name: {m for m, _, _ in imports(path)} for name, path in MODULES.items()}


def test_the_parser_sees_the_imports():
    graph = {m for m, _, _ in imports(MODULES["caches.make"])}
    assert {"caches.contiguous", "caches.paged", "caches.quantized", "config"} <= graph
    assert "kernels.cpu" in {m for m, _, _ in imports(MODULES["kernels.dispatch"])}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `graph` (module -> imported modules) as a path, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (cycle := walk(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := walk(name, [])):
            return cycle
    return None


def test_no_import_cycles():
    graph = {name: {m for m, _, inside in imports(path) if not inside and m in MODULES and m != name}
             for name, path in MODULES.items() if name != "__init__"}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def readme_layout() -> str:
    """The README's "Layout" section: the map of the tree."""
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    return readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]


def unmapped(layout: str, folders: set[str], top: set[str]) -> list[str]:
    """The layer folders and top-level modules that the README's map does not name."""
    return ([f"{f}/" for f in sorted(folders) if f"{f}/" not in layout]
            + [f"{m}.py" for m in sorted(top) if not re.search(rf"\b{m}\.py\b", layout)])


def test_the_tree_has_the_course_layers_and_the_map_names_every_room():
    """The folders are the course's layers, and the top of minigen/ is the generator itself: every
    folder and every module there is a room the README's map names (a new one joins the map)."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == CORE_PACKAGES | OUTER_PACKAGES
    top = {p.stem for p in PACKAGE.glob("*.py")} - FACES
    missing = unmapped(readme_layout(), folders, top)
    assert not missing, f"README.md's Layout section does not name {missing}: add each to the map"
    assert unmapped("  model.py  caches/", {"caches", "serving"}, {"model", "run_plan"}) == ["serving/", "run_plan.py"]


@pytest.mark.parametrize("name", sorted(m for m in MODULES if is_core(m)))
def test_the_core_imports_at_the_top(name):
    for module, _, inside in imports(MODULES[name]):
        assert not inside, f"{name} imports {module} inside a function: import it at the top"


def test_every_import_keeps_to_the_layers():
    violations = layer_violations(import_graph())
    assert not violations, "\n".join(violations)


@pytest.mark.parametrize("rule", LAYER_RULES, ids=lambda r: r.says)
def test_each_layer_rule_can_fail(rule):
    """Each rule refuses its own example of a broken import and lets a nearby allowed one pass, so
    none of them holds only because it can never fire."""
    importer, imported = rule.breaks
    assert layer_violations({importer: {imported}}, [rule]), f"{rule.says} lets {importer} import {imported}"
    assert not layer_violations({rule.keeps[0]: {rule.keeps[1]}}), f"{rule.keeps} is refused"


def test_the_plan_rule_judges_the_run_plan_and_its_table():
    """minigen/run_plan.py and places.py are judged by their concept; measure/plan.py (the memory
    planner) is an outer layer's."""
    assert layer_violations({"run_plan": {"steps.choose", "caches.make", "kernels.fastpaths", "places"}}) == []
    assert layer_violations({"places": {"serving.engine"}}), "the where-table may not import serving"
    assert layer_violations({"generate": {"measure.plan"}}), "the memory planner is measure's, not the core's plan"


def test_the_model_is_the_math():
    """model.py reaches no kernel by itself either (LAYER_RULES keeps it from importing one)."""
    text = MODULES["model"].read_text(encoding="utf-8")
    for kernel_code in ("import ctypes", "torch.ops.minigen", "import triton", "mkldnn"):
        assert kernel_code not in text, f"model.py reaches a kernel itself ({kernel_code})"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_crosses_a_module(name):
    for module, names, _ in imports(MODULES[name]):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{name} imports private {private} from {module}: make it public or keep it at home"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_readable(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= 420, f"{name} has {lines} lines: split it by concept (CONTRIBUTING.md: past ~400)"


def test_no_reexport_shims():
    """A name is imported where it lives: no `# noqa: F401` re-exports outside the public face."""
    for name, path in MODULES.items():
        if name not in FACES and not name.endswith("__init__"):
            assert "noqa: F401" not in path.read_text(encoding="utf-8"), f"{name} re-exports a name"


def test_einops_is_used_where_it_is_declared():
    users = [p.name for p in PACKAGE.rglob("*.py") if "from einops import" in p.read_text(encoding="utf-8")]
    assert users, "pyproject.toml declares einops: use it or remove it"


def defined(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, a fallback for
    an optional import)."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text(encoding="utf-8")).body)
    for node in body:
        if isinstance(node, ast.Try):  # an optional import and its fallback (triton = tl = None)
            body += node.body + [n for h in node.handlers for n in h.body]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in FACES))
def test_a_name_is_imported_from_where_it_lives(name):
    """No module passes on a name it imported: a caller imports it from the module that defines it
    (the public face, minigen/__init__.py, is the one place that gathers names)."""
    for target, names, _ in imports(MODULES[name]):
        if target in MODULES and target != "__init__" and not target.endswith("__init__"):
            passed_on = [n for n in names if n not in defined(MODULES[target]) and n != "*"]
            assert not passed_on, f"{name} imports {passed_on} from {target}, which only imports them"


def test_the_rules_are_declared_data():
    """combinations.py, the one table of rules, builds its tables as expressions: no loop, no item
    assignment and no mutating call at its top level (nothing changes after import)."""
    tree = ast.parse(MODULES["combinations"].read_text(encoding="utf-8"))
    for node in tree.body:
        assert not isinstance(node, (ast.For, ast.While, ast.AugAssign)), f"line {node.lineno}: a loop at import"
        if isinstance(node, ast.Assign):
            assert all(isinstance(t, ast.Name) for t in node.targets), f"line {node.lineno}: item assignment"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            func = node.value.func
            assert isinstance(func, ast.Name), f"line {node.lineno}: a method call at import (a mutation?)"


# Private attributes read across modules that this rule lets stand, as (module, "value.attr"), each
# with its reason. Modules another change rewrites keep theirs until then.
PRIVATE_READS_ALLOWED = {
    # torch keeps a tensor's in-place version counter as _version, with no public name: a weight's
    # bf16 copy remembers it, so that a copy of a weight changed in place is never read
    ("numerics.copies", "(w.codes if isinstance(w, QuantizedWeight) else w)._version"),
    # torch's nn.Module keeps its children, parameters and buffers in these tables, with no public
    # way to give a shallow copy of a Module tables of its own (a draft that shares the target's layers)
    ("drafts", "draft._modules"), ("drafts", "draft._parameters"), ("drafts", "draft._buffers"),
    ("drafts", "model._modules"), ("drafts", "model._parameters"), ("drafts", "model._buffers"),
}


def private_reads(path: Path) -> list[str]:
    """`value._name` attribute reads in a module whose value is not the module's own: not self or cls,
    not super(), not a class the module defines, and not rooted in a library it imports (torch._C is
    torch's business) -> "value.attr" of each, by line."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)} | {"self", "cls"}
    libraries = set()  # names bound to modules outside minigen
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            libraries |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("minigen")}
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("minigen"):
            libraries |= {a.asname or a.name for a in node.names}

    def root(value) -> str | None:
        while isinstance(value, ast.Attribute):
            value = value.value
        return value.id if isinstance(value, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in own:
            continue
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
            continue
        if root(value) in libraries:
            continue
        found.append(ast.unparse(node))
    return found


def test_the_private_reader_sees_private_reads(tmp_path):
    code = ("import torch\nfrom .paged import PagedKVCache\nclass A:\n    def f(self, cache):\n"
            "        return self._x, A._y, super()._z, torch._C, cache._plan, cache.allocator._take()\n")
    (tmp_path / "m.py").write_text(code)
    assert private_reads(tmp_path / "m.py") == ["cache._plan", "cache.allocator._take"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reads_another_modules_private_attribute(name):
    """A module uses another module's objects through their public names (the cache contract, for a
    cache): `cache._plan` or `alloc._take` from outside reaches into state its owner may change."""
    reads = [r for r in private_reads(MODULES[name]) if (name, r) not in PRIVATE_READS_ALLOWED]
    assert not reads, f"{name} reads private attributes of objects it does not own: {reads}"
