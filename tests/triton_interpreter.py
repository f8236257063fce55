"""How the Triton test modules load the kernels: compiled for the GPU when CUDA is there, else on
Triton's CPU interpreter. Triton decides when a kernel is *decorated* (its module imported)
whether it runs interpreted, so ``TRITON_INTERPRET=1`` is set around that import only, and again
during each test of a module that imports :func:`_interpreter_environment` (an autouse fixture).
A module imports this first: it skips when torch or triton is missing."""

from __future__ import annotations

import importlib
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

#: Whether the interpreter is switched on here (no CUDA, and the caller did not set it).
SET_HERE = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ


def load_kernels(*modules: str):
    """(the backend's availability, "cpu" or "cuda", and the named ``subspace_ref_triton``
    modules, decorated for the interpreter or the GPU; None each when the backend is unavailable)."""
    if SET_HERE:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from subspace_ref_triton import TritonBackend
        from subspace_ref_triton._common import interpreting

        available = TritonBackend().availability()
        loaded = [importlib.import_module(f"subspace_ref_triton.{name}") if available else None for name in modules]
        return available, "cpu" if interpreting() else "cuda", loaded
    finally:
        if SET_HERE:
            del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def _interpreter_environment(monkeypatch):
    """TRITON_INTERPRET=1 during the tests of a module whose kernels were loaded for the interpreter."""
    if SET_HERE:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
