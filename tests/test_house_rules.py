"""House rules read from the source (issue 41's goals table; docs/architecture.md).

* **One record per coefficient format.** The core (every module of subspace_ref outside
  :data:`tests.test_import_graph.OUTSIDE_CORE`, the command line and :mod:`subspace_ref.formats`
  itself) holds no coefficient-format literal: no string ``"int8"``, ``"int4"`` or ``"int2"`` and no
  comparison of a bit width with a number. It reads names, widths and bytes from the records of
  :mod:`subspace_ref.formats`. Prose in docstrings and comments is not code and is not scanned.
  :data:`FORMAT_LITERALS_ALLOWED` lists the modules that use such a string for something else.
* **Files stay readable.** No ``.py`` file of the library (subspace_ref outside the lab, and the
  backend packages) is longer than :data:`MAX_LINES` lines, except the kernel files of
  :data:`LONG_FILES_ALLOWED`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_import_graph import _group

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "subspace_ref"
BACKENDS = REPO / "backends"

#: The coefficient formats' names and widths that only their records may spell.
FORMAT_NAMES = ("int2", "int4", "int8")
#: Modules (relative to subspace_ref/) allowed to hold such a string, each with why.
FORMAT_LITERALS_ALLOWED = {
    "formats.py": "the coefficient format records themselves",
    "basis_storage.py": "basis storage formats (spec/storage.md S1), a vocabulary apart: its 'int8' names int8 bases",
}

MAX_LINES = 550
#: Files allowed past MAX_LINES (relative to the repository root), each with why.
LONG_FILES_ALLOWED = {
    "backends/subspace_ref_triton/decode.py": "Triton kernels: each @triton.jit body is one unit the compiler sees",
    "backends/subspace_ref_triton/rope_decode.py": "Triton kernels (pre-RoPE decode)",
    "backends/subspace_ref_triton/window_decode.py": "Triton kernels (exact-window decode)",
    "backends/subspace_ref_triton/_tl.py": "Triton device helpers inlined into the kernels",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_modules() -> list[Path]:
    """The core's source files: outside the adapters, the lab and the command line."""
    return sorted(p for p in PACKAGE.rglob("*.py") if _group(_module_name(p)) is None)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _is_bits(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "bits" in name


def format_literals(source: str) -> list[tuple[int, str]]:
    """(line, what) of every coefficient-format literal in ``source``: a string constant that is
    exactly a format name, and a comparison of a ``*bits*`` name with an integer constant."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in FORMAT_NAMES and id(node) not in docs:
            found.append((node.lineno, repr(node.value)))
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            numbers = [o for o in operands if isinstance(o, ast.Constant) and type(o.value) is int]
            numbers += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts
                        if isinstance(e, ast.Constant) and type(e.value) is int]
            if numbers and any(_is_bits(o) for o in operands):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_core_holds_no_coefficient_format_literal():
    modules = core_modules()
    assert PACKAGE / "state.py" in modules and PACKAGE / "policies" / "adaptive.py" in modules
    assert not any("cli" in p.name or "/lab/" in p.as_posix() or "/hf/" in p.as_posix() for p in modules)
    bad = []
    for path in modules:
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in FORMAT_LITERALS_ALLOWED:
            continue
        bad += [f"subspace_ref/{rel}:{line}: {what}" for line, what in format_literals(path.read_text())]
    assert bad == [], "read coefficient formats from subspace_ref.formats (FORMATS, BY_BITS, of_bits, the records' fields):\n" + "\n".join(bad)


def test_allowed_format_literals_are_still_needed():
    """An entry of FORMAT_LITERALS_ALLOWED that no longer holds a literal is dropped."""
    for rel in FORMAT_LITERALS_ALLOWED:
        assert format_literals((PACKAGE / rel).read_text()), f"{rel} holds no format literal: drop it from FORMAT_LITERALS_ALLOWED"


@pytest.mark.parametrize(
    "source, hits",
    [
        ('x = "int8"', [(1, "'int8'")]),
        ('def f(c="int4"):\n    return c', [(1, "'int4'")]),
        ('if fmt.bits == 8:\n    pass', [(1, "fmt.bits == 8")]),
        ("ok = low_bits in (4, 2)", [(1, "low_bits in (4, 2)")]),
        ('def f():\n    """int8 and int4 in prose."""\n    # "int2" in a comment\n    return "int8 codes"', []),
        ("shape = (4, 2)\nx = 8 == n", []),
    ],
)
def test_the_format_scan_finds_literals(source, hits):
    """The scan is not vacuous: it flags names and width comparisons, and leaves prose alone."""
    assert format_literals(source) == hits


def library_files() -> list[Path]:
    """Every .py file of the library: subspace_ref outside the lab, and the backend packages."""
    files = [p for p in PACKAGE.rglob("*.py") if "lab" not in p.relative_to(PACKAGE).parts[:1]]
    return sorted(files + list(BACKENDS.rglob("*.py")))


def test_no_library_file_is_too_long():
    files = library_files()
    assert PACKAGE / "persistence.py" in files and BACKENDS / "subspace_ref_torch" / "attend.py" in files
    long = {p.relative_to(REPO).as_posix(): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    over = {rel: n for rel, n in long.items() if rel not in LONG_FILES_ALLOWED}
    assert over == {}, f"split these along their seams (at most {MAX_LINES} lines): {over}"


def test_long_files_allowed_exist():
    for rel in LONG_FILES_ALLOWED:
        assert (REPO / rel).is_file(), f"{rel} is gone: drop it from LONG_FILES_ALLOWED"


#: The modules defining the names of ``subspace_ref.__all__``, whose docstrings carry examples.
PUBLIC_MODULES = ("attention", "backend", "calibration", "exact", "frequent_directions", "layer_state", "registry", "state")


def test_public_names_document_parameters_and_examples():
    """Every name of ``subspace_ref.__all__`` says what it takes and returns and shows a use."""
    import subspace_ref as sr

    missing = []
    for name in sr.__all__:
        obj = getattr(sr, name)
        doc = obj.__doc__ or ""
        needed = ["Examples"] + (["Parameters"] if callable(obj) and name not in ("Backend", "backends") else [])
        needed += ["Returns"] if not isinstance(obj, type) else []
        missing += [f"{name}: {section}" for section in needed if f"{section}\n" not in doc]
        assert obj.__module__.removeprefix("subspace_ref.") in PUBLIC_MODULES, obj.__module__
    assert missing == []


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_examples_run(module, monkeypatch):
    """The examples are doctests, run here so that they stay true."""
    import doctest
    import importlib

    from subspace_ref import registry

    monkeypatch.setattr(registry, "_added", dict(registry._added))  # register_backend's example
    monkeypatch.setattr(registry, "_instances", dict(registry._instances))
    result = doctest.testmod(importlib.import_module(f"subspace_ref.{module}"), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
