"""The import graph of subspace_ref (docs/architecture.md), read from the source: every import,
function-level and ``TYPE_CHECKING`` ones included.

* No module of subspace_ref, core or not, is on an import cycle.
* The core (everything outside :data:`OUTSIDE_CORE`) imports nothing from hf/, vllm/, models/,
  the lab or the command line.
* The library (the core, hf/, vllm/, models/) and the torch/triton/cupy backends import nothing
  from the lab (``subspace_ref.lab``: experiments, tasks, baselines, bounds, training, demo); only
  the lab itself and the command line (``cli``, ``cli_*``) do.
* Above the core, packages import only downwards in :data:`LAYERS_ABOVE_CORE`, with the one
  documented exception of :data:`UPWARD`.
* The modules of the operations/data layers import at module level only (no import placed
  inside a function to dodge a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "subspace_ref"
#: The out-of-tree backend packages (subspace_ref_torch, ...): library code, never importing the lab.
BACKENDS = Path(__file__).resolve().parents[1] / "backends"
#: The lab: the research harness, one package the library never imports.
LAB = "lab"
#: The layers above the core, top first: a package may import its own layer, lower ones and the
#: core. Entries are module paths under subspace_ref (the longest match names a module's group);
#: ``cli`` also covers ``cli_*`` modules. The command line is above both the lab and the library;
#: the lab is above the library's adapters.
LAYERS_ABOVE_CORE = (
    ("cli",),
    ("lab.experiments", "lab.demo", "lab.roofline_report", "lab.train_default_model"),
    ("lab.baselines", "lab.bounds", "lab.tasks", "lab.corpus", "lab"),
    ("vllm",),
    ("hf", "models"),
)
#: Packages and modules above the core (adapters, the lab, the command line); the core never imports them.
OUTSIDE_CORE = tuple(g for layer in LAYERS_ABOVE_CORE for g in layer)
#: The upward imports kept, each with why (docs/architecture.md).
UPWARD = {("subspace_ref.lab.experiments.__main__", "subspace_ref.cli"): "`python -m subspace_ref.lab.experiments` is the command line"}
#: Modules of the layers docs/architecture.md draws that must import at module level only.
MODULE_LEVEL_ONLY = ("attention", "operations", "capabilities", "registry", "backend", "state", "layout", "persistence", "_persistence_header", "_persistence_arrays", "arrays", "_checks", "window")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules) -> dict[str, set[str]]:
    """Imported subspace_ref modules -> how ("module", "function", "type_checking")."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: dict[str, set[str]] = {}

    def visit(node, where: str) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, "type_checking")
            for child in node.orelse:
                visit(child, where)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and where == "module":
            where = "function"
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            if t in modules and t != name:
                found.setdefault(t, set()).add(where)
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text()), "module")
    return found


def _graph() -> dict[str, dict[str, set[str]]]:
    modules = _modules()
    return {n: _imports(n, modules[n], modules) for n in modules}


def _group(name: str) -> str | None:
    """The entry of OUTSIDE_CORE a module belongs to (the longest that matches); None for the core."""
    rel = name.split(".")[1:]

    def matches(entry: str) -> bool:
        parts = entry.split(".")
        head, last = rel[: len(parts)], parts[-1]
        return len(head) == len(parts) and head[:-1] == parts[:-1] and (head[-1] == last or head[-1].startswith(f"{last}_"))

    return max((o for o in OUTSIDE_CORE if matches(o)), key=lambda o: o.count("."), default=None)


def _in_lab(name: str) -> bool:
    return name == f"subspace_ref.{LAB}" or name.startswith(f"subspace_ref.{LAB}.")


def _backend_graph() -> dict[str, dict[str, set[str]]]:
    """The backend packages' imports of subspace_ref modules."""
    modules = _modules()
    out = {}
    for path in BACKENDS.rglob("*.py"):
        parts = path.relative_to(BACKENDS).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = _imports(name, path, modules)
    return out


def _into_lab(graph) -> list[str]:
    """Imports of the lab by any module outside the lab and the command line."""
    return [f"{n} -> {m} ({', '.join(sorted(how))})" for n in sorted(graph) if not _in_lab(n) and _group(n) != "cli"
            for m, how in sorted(graph[n].items()) if _in_lab(m)]


def _cycles(graph) -> list[str]:
    state: dict[str, int] = {}
    cycles = []

    def walk(n, stack):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m) :] + [m]))
            elif m not in state:
                walk(m, stack)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            walk(n, [])
    return cycles


def _core_to_outside(graph) -> list[str]:
    return [f"{n} -> {m} ({', '.join(sorted(how))})" for n in sorted(graph) if _group(n) is None for m, how in sorted(graph[n].items()) if _group(m)]


def _upward(graph) -> list[str]:
    level = {g: i for i, layer in enumerate(LAYERS_ABOVE_CORE) for g in layer}
    return [f"{n} -> {m}" for n in sorted(graph) if _group(n) for m in sorted(graph[n])
            if _group(m) and level[_group(m)] < level[_group(n)] and (n, m) not in UPWARD]


def test_import_graph_has_no_cycle():
    graph = _graph()
    assert "subspace_ref.operations" in graph["subspace_ref.state"] and "subspace_ref.registry" in graph["subspace_ref.operations"]
    assert _cycles(graph) == []


def test_core_imports_nothing_above_it():
    assert _core_to_outside(_graph()) == []


def test_library_never_imports_the_lab():
    """Only the lab and the command line import ``subspace_ref.lab``: not the core, hf/, vllm/,
    models/, nor the backend packages, not even inside a function or for annotations."""
    graph = _graph()
    assert any(_in_lab(m) for m in graph["subspace_ref.cli"]), "the command line runs the lab's subcommands"
    assert _into_lab(graph) == []
    backends = _backend_graph()
    assert backends, f"no backend package found under {BACKENDS}"
    assert _into_lab(backends) == []


def test_packages_above_the_core_import_downwards():
    assert len(set(OUTSIDE_CORE)) == len(OUTSIDE_CORE)
    assert all(_group(f"subspace_ref.{g}") == g for g in OUTSIDE_CORE)
    graph = _graph()
    assert all(m in graph[n] for n, m in UPWARD), "an allowed upward import is gone: drop it from UPWARD and docs/architecture.md"
    assert _upward(graph) == []


def test_layers_import_at_module_level():
    graph = _graph()
    late = {n: sorted(m for m, how in graph[n].items() if "function" in how) for n in graph if n.removeprefix("subspace_ref.") in MODULE_LEVEL_ONLY}
    assert {n: ms for n, ms in late.items() if ms} == {}


def test_backends_read_states_through_the_view():
    """The backend protocol is typed against :class:`~subspace_ref.backend.StateView`, which a
    state satisfies, so backend.py and registry.py need no import of state.py."""
    import numpy as np

    import subspace_ref as sr
    from subspace_ref.backend import StateView

    basis = sr.StaticBasis.from_bases(np.eye(4)[None, :2], np.eye(4)[None, :2])
    assert isinstance(sr.SubspaceState.static(basis), StateView)


def test_the_checks_fail_on_a_bad_graph(tmp_path, monkeypatch):
    """A cycle through a function-level or a TYPE_CHECKING import, a core module importing the lab
    (even for annotations only), a library adapter importing the lab (even inside a function), and
    an upward import are all reported (a graph check that cannot fail proves nothing)."""
    import sys

    pkg = tmp_path / "subspace_ref"
    for d in ("lab/baselines", "lab/tasks", "hf"):
        (pkg / d).mkdir(parents=True)
    for init in ("__init__.py", "lab/__init__.py", "lab/baselines/__init__.py", "lab/tasks/__init__.py", "hf/__init__.py"):
        (pkg / init).write_text("")
    (pkg / "state.py").write_text("from subspace_ref import operations\n")
    (pkg / "operations.py").write_text("def f():\n    from subspace_ref.state import x\n")
    (pkg / "backend.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from subspace_ref.lab.baselines.budget import Geometry\n")
    (pkg / "lab" / "baselines" / "budget.py").write_text("from subspace_ref import backend\n")
    (pkg / "lab" / "tasks" / "bootstrap.py").write_text("from subspace_ref.lab.baselines import budget\n")
    (pkg / "hf" / "cache.py").write_text("def f():\n    from subspace_ref.lab.tasks import bootstrap\n")
    (pkg / "cli.py").write_text("from subspace_ref.lab.tasks import bootstrap\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = _graph()
    assert graph["subspace_ref.operations"] == {"subspace_ref.state": {"function"}}
    assert graph["subspace_ref.backend"] == {"subspace_ref.lab.baselines.budget": {"type_checking"}}
    assert _cycles(graph) == ["subspace_ref.backend -> subspace_ref.lab.baselines.budget -> subspace_ref.backend",
                              "subspace_ref.operations -> subspace_ref.state -> subspace_ref.operations"]
    assert _core_to_outside(graph) == ["subspace_ref.backend -> subspace_ref.lab.baselines.budget (type_checking)"]
    assert _into_lab(graph) == ["subspace_ref.backend -> subspace_ref.lab.baselines.budget (type_checking)",
                                "subspace_ref.hf.cache -> subspace_ref.lab.tasks.bootstrap (function)"]  # cli may
    assert _upward(graph) == ["subspace_ref.hf.cache -> subspace_ref.lab.tasks.bootstrap"]  # baselines and tasks share a layer
    (pkg / "lab" / "baselines" / "budget.py").write_text("from subspace_ref import backend, cli\n")
    assert _upward(_graph()) == ["subspace_ref.hf.cache -> subspace_ref.lab.tasks.bootstrap", "subspace_ref.lab.baselines.budget -> subspace_ref.cli"]
