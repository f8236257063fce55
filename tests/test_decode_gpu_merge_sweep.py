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
def test_merge_sweep_rows_run_on_the_interpreter(monkeypatch, tmp_path, coef):
    dg = _decode_gpu()
    monkeypatch.setattr(dg, "SMOKE", True)
    gen = torch.Generator().manual_seed(0)
    N, T = 1, 96
    K = torch.randn(N, dg.H_KV, T, dg.D, generator=gen, dtype=torch.bfloat16)
    V = torch.randn(N, dg.H_KV, T, dg.D, generator=gen, dtype=torch.bfloat16)
    q = torch.randn(N, dg.H_Q, dg.D, generator=gen, dtype=torch.bfloat16)
    state, _ = dg.build_states(N, T, K, V, 64, False, gen, torch.device("cpu"), coef)
    rows = []
    scale = 1.0 / math.sqrt(dg.D)
    dg.time_merge_shapes(rows, state, q, scale, "" if coef == "float" else f"-{coef}", split_counts=[2, 1, 2])
    # --merge-splits: the same shapes again at 2 splits, after those at the default (1 split at 96 tokens here); each count once
    assert len(rows) == 2 * len(dg.MERGE_SWEEP) and {r["method"].rsplit("S=", 1)[1] for r in rows[len(dg.MERGE_SWEEP):]} == {"2"}, rows
    rows = rows[: len(dg.MERGE_SWEEP)]
    label = "attend-graph" + ("" if coef == "float" else f"-{coef}")
    assert all(r["method"].startswith(label + " cols=") and "error" not in r["skipped"] for r in rows), rows
    from subspace_ref_triton import decode

    # the default shape's row (MERGE_SWEEP's (None, None)) names the default launch's shape
    S = int(rows[0]["method"].rsplit("S=", 1)[1])
    default = rows[dg.MERGE_SWEEP.index((None, None))]["method"]
    assert f" cols={decode.MERGE_COLUMNS} splits/step={min(decode.MERGE_TILE // decode.MERGE_COLUMNS, 1 << (S - 1).bit_length())} " in default
    # every shape merges the same float32 partials (within the merge's float32 rounding, far below a
    # bfloat16 step) before the bfloat16 output: each row's error against torch is the default's
    # within one bfloat16 ulp of the output's largest magnitude (2^-7 of it: 8 significant bits)
    want = dg.get_torch_attend(state, state.layout, q, scale, T)
    ulp = 2.0**-7 * float(want.abs().max())
    base = rows[dg.MERGE_SWEEP.index((None, None))]["max_abs_diff_vs_torch"]
    assert all(abs(r["max_abs_diff_vs_torch"] - base) <= ulp for r in rows), (ulp, [r["max_abs_diff_vs_torch"] for r in rows])
    # as a GPU run would print and write them: a timed merge row takes no ratio to SDPA
    timed = [dict(N=1, T=T, method="merge-graph cols=32 splits/step=128 S=99", ms=0.0069, part=True),
             dict(N=1, T=T, method="attend-graph cols=32 splits/step=128 S=99", ms=0.0257, speedup_vs_sdpa=1.95, max_abs_diff_vs_torch=1e-7)]
    assert "vs SDPA" not in dg.format_row(timed[0]) and "x  1.95 vs SDPA" in dg.format_row(timed[1])
    dg.write_results(tmp_path, dict(device="test", date="now", git_commit="x", torch="t", triton="t", cuda="c", copy_bandwidth_GBps=1.0), timed)
    (table,) = tmp_path.glob("decode_gpu_*.md")
    assert "| 1 | 96 | merge-graph cols=32 splits/step=128 S=99 |  | 6.9 |  |  |  |  |  |" in table.read_text()
