"""benchmarks/decode_gpu.py's merge sweep (``--merge-sweep``, the rows of docs/gpu.md "The merge
at N = 1") runs on the CPU interpreter: a broken row would otherwise surface only on a lent GPU."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.test_triton_kernels import (  # noqa: E402
    _interpreter_environment,  # noqa: F401 - the autouse fixture: the kernels on the interpreter
    pytestmark,  # noqa: F401 - skipped where the Triton backend is unavailable
)


def _decode_gpu():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_gpu.py"
    spec = importlib.util.spec_from_file_location("decode_gpu_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("coef", ["float", "int4"])
def test_merge_sweep_rows_run_on_the_interpreter(monkeypatch, coef):
    dg = _decode_gpu()
    monkeypatch.setattr(dg, "SMOKE", True)
    gen = torch.Generator().manual_seed(0)
    N, T = 1, 96
    K = torch.randn(N, dg.H_KV, T, dg.D, generator=gen, dtype=torch.bfloat16)
    V = torch.randn(N, dg.H_KV, T, dg.D, generator=gen, dtype=torch.bfloat16)
    q = torch.randn(N, dg.H_Q, dg.D, generator=gen, dtype=torch.bfloat16)
    state, _ = dg.build_states(N, T, K, V, 64, False, gen, torch.device("cpu"), coef)
    rows = []
    dg.time_merge_shapes(rows, state, q, 1.0 / math.sqrt(dg.D), "" if coef == "float" else f"-{coef}")
    assert len(rows) == len(dg.MERGE_SWEEP), rows
    label = "attend-graph" + ("" if coef == "float" else f"-{coef}")
    # the default shape's row names the default launch's columns; every row ran both launches
    from subspace_ref_triton import decode

    assert any(f"cols={decode.MERGE_COLUMNS} " in r["method"] for r in rows) and all(r["method"].startswith(label + " cols=") for r in rows), rows
    assert all("error" not in r["skipped"] and math.isfinite(r["max_abs_diff_vs_torch"]) for r in rows), rows
