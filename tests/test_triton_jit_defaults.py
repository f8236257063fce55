"""Every ``@triton.jit`` function of the Triton backend compiles under the Triton the GPU image
ships (3.6) as under CI's: no parameter takes a string default. Triton 3.6 hands an omitted string
default to the callee unwrapped (not as a constexpr), and the merge kernel failed to compile on an
H200 that way while CI's Triton compiled it (docs/gpu.md, "Fifth-pass kernels timed")."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

triton = pytest.importorskip("triton")

import subspace_ref_triton  # noqa: E402


def _jit_functions():
    """(name, Python function) of every jit function the backend defines (interpreted ones too:
    where there is no GPU, the tests import the kernels under TRITON_INTERPRET)."""
    from triton.runtime.interpreter import InterpretedFunction

    for info in pkgutil.iter_modules(subspace_ref_triton.__path__):
        module = importlib.import_module(f"subspace_ref_triton.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)) and fn is not None and fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", fn


def test_jit_functions_are_found():
    names = {name for name, _ in _jit_functions()}
    assert "subspace_ref_triton.decode._merge_row" in names and len(names) > 20, sorted(names)


def test_no_jit_parameter_has_a_string_default():
    bad = [f"{name}({p.name}={p.default!r})" for name, fn in _jit_functions()
           for p in inspect.signature(fn).parameters.values() if isinstance(p.default, str)]
    assert not bad, f"string defaults of @triton.jit parameters (pass them at every call): {bad}"
