"""The core import graph of subspace_ref (docs/architecture.md): every import a core module makes,
function-level ones included, forms no cycle, and the modules of the operations/data layers
import nothing inside functions from subspace_ref (no imports placed to dodge a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "subspace_ref"
#: Packages above the core (models, experiments, adapters) may import anything from it.
OUTSIDE_CORE = ("hf", "experiments", "tasks", "baselines", "bounds", "models", "cli", "roofline_report")
#: Modules of the layers docs/architecture.md draws that must import at module level only.
MODULE_LEVEL_ONLY = ("attention", "operations", "capabilities", "registry", "backend", "state", "layout", "persistence", "arrays", "_checks", "window")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules) -> dict[str, bool]:
    """Imported subspace_ref modules -> whether some import of it is inside a function."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: dict[str, bool] = {}

    def visit(node, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return  # annotations only: never executed
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function = True
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
                found[t] = found.get(t, False) or in_function
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(ast.parse(path.read_text()), False)
    return found


def _core_graph():
    modules = _modules()
    core = {
        n
        for n in modules
        if not any(n == f"subspace_ref.{o}" or n.startswith(f"subspace_ref.{o}.") or n.startswith(f"subspace_ref.{o}_") for o in OUTSIDE_CORE)
    }
    return {n: {m: f for m, f in _imports(n, modules[n], modules).items() if m in core} for n in core}


def _cycles(graph) -> list[str]:
    state: dict[str, int] = {}
    cycles = []

    def walk(n, stack):
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
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


def test_core_import_graph_is_acyclic():
    graph = _core_graph()
    assert "subspace_ref.state" in graph and "subspace_ref.operations" in graph["subspace_ref.state"]
    assert _cycles(graph) == []


def test_layers_import_at_module_level():
    graph = _core_graph()
    late = {n: sorted(m for m, f in graph[n].items() if f) for n in graph if n.removeprefix("subspace_ref.") in MODULE_LEVEL_ONLY}
    assert {n: ms for n, ms in late.items() if ms} == {}


def test_the_cycle_detector_sees_a_cycle(tmp_path, monkeypatch):
    """The walk above reports a cycle when there is one (a graph check that cannot fail proves nothing)."""
    import sys

    pkg = tmp_path / "subspace_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "state.py").write_text("from subspace_ref import operations\n")
    (pkg / "operations.py").write_text("def f():\n    from subspace_ref.state import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    graph = _core_graph()
    assert graph["subspace_ref.operations"] == {"subspace_ref.state": True}
    assert graph["subspace_ref.state"] == {"subspace_ref.operations": False}
    assert _cycles(graph) == ["subspace_ref.operations -> subspace_ref.state -> subspace_ref.operations"]
