"""Shared fixtures: seeded generators and synthetic KV streams."""

from __future__ import annotations

import argparse
import os
import zlib

# Small matrices on a shared 2-core machine: threaded BLAS only adds contention (measured 30x
# slower SVDs of 64 x 64 blocks under load). Set before NumPy loads its BLAS.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


def _interpret_triton_without_a_gpu() -> None:
    """Without a CUDA device, run Triton kernels on the CPU interpreter, so the differential
    harness exercises the triton backend here too. Triton reads this when a kernel is defined,
    so it is set before any test module imports the backend."""
    if "TRITON_INTERPRET" in os.environ:
        return
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_a_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from subspace_ref.registry import backends  # noqa: E402


def pytest_report_header(config):
    # the CI log shows which backends ran and why the others did not
    return ["subspace_ref backends: " + "; ".join(str(b) for b in backends())]


def pytest_configure(config):
    """Under pytest-xdist (``-n``) or a per-test limit (pytest-timeout's ``--timeout``), build the
    torch backend's C kernels once here, before any test runs: they are built at first use
    (``subspace_ref_torch.kernel_library.library``, ``-O3 -march=native``, about 90 s on a 2-core
    machine, cached per source and CPU), so otherwise every worker builds them at once in its first
    float32 torch attend, and a per-test limit fails that test and kills the build, which the next
    such test starts again. Nothing to do in the workers (the cache holds the build), when the
    kernels are cached or switched off (SUBSPACE_REF_CPU_KERNELS=0), or without torch."""
    if hasattr(config, "workerinput") or not (config.getoption("numprocesses", None) or config.getoption("timeout", None)):
        return
    try:
        from subspace_ref_torch import kernel_library
    except ImportError:
        return
    kernel_library.library()  # a build that fails is recorded there (library_status), as at first use


#: the most characters of one failure's traceback written to SUBSPACE_FAILURE_LOG (its end: the assertion)
FAILURE_LOG_CHARS = 4000


def pytest_runtest_logreport(report):
    """With SUBSPACE_FAILURE_LOG naming a file, append each failed test phase's node id and the end
    of its traceback to it as soon as the phase ends: pytest prints tracebacks only at the end of
    the run, which a time limit (benchmarks/gpu_session.sh) cuts off. One unbuffered ``write`` in
    append mode per failure, so pytest-xdist workers can share the file; under xdist the controller
    skips the reports its workers already wrote (they carry ``node``)."""
    path = os.environ.get("SUBSPACE_FAILURE_LOG")
    if not path or not report.failed or getattr(report, "node", None) is not None:
        return
    text = report.longreprtext
    if len(text) > FAILURE_LOG_CHARS:
        text = f"[... {len(text) - FAILURE_LOG_CHARS} characters cut ...]\n" + text[-FAILURE_LOG_CHARS:]
    entry = f"=== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{text}\n\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, entry.encode("utf-8", "replace"))
    finally:
        os.close(fd)


@pytest.fixture
def rng(request):
    # a fresh generator per test, reproducible across runs (str hash() is salted per process)
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def low_rank_stream(rng, heads, T, d, rank, noise=0.0, scale=1.0):
    """(heads, T, d) rows in a random rank-``rank`` subspace per head, plus isotropic noise."""
    basis = rng.standard_normal((heads, rank, d))
    coef = rng.standard_normal((heads, T, rank))
    return scale * (np.einsum("htr,hrd->htd", coef, basis) + noise * rng.standard_normal((heads, T, d)))


def random_orthonormal(rng, *lead, r, d):
    """Orthonormal (r, d) rows for each leading index."""
    g = rng.standard_normal(lead + (d, r))
    q, _ = np.linalg.qr(g)
    return np.swapaxes(q, -1, -2)


def state_from_chunks(K, V, starts, key_bases, value_bases, gamma=1.0):
    """An adaptive-kind state over given chunks (spec A9) of one sequence: chunk j starts at
    starts[j] and uses key_bases[:, j] (H, J, r, d) and value_bases[:, j]; coefficients are the
    exact projections. For tests that need arbitrary chunk boundaries and bases."""
    from subspace_ref.layout import PackedLayout
    from subspace_ref.policies import AdaptivePolicy
    from subspace_ref.state import SketchBuffers, SubspaceState

    H, T, d = K.shape
    J, r = key_bases.shape[1:3]
    r_v, d_v = value_bases.shape[2:]
    bounds = list(starts) + [T]
    key_coef = np.zeros((1, H, T, r))
    value_coef = np.zeros((1, H, T, r_v))
    for j in range(J):
        a, b = bounds[j], bounds[j + 1]
        key_coef[0, :, a:b] = np.einsum("htd,hrd->htr", K[:, a:b], key_bases[:, j])
        value_coef[0, :, a:b] = np.einsum("htd,hrd->htr", V[:, a:b], value_bases[:, j])
    layout = PackedLayout(
        key_coef=key_coef,
        value_coef=value_coef,
        key_bases=key_bases[None].copy(),
        value_bases=value_bases[None].copy(),
        chunk_starts=np.tile(np.asarray(starts, dtype=np.int64), (1, H, 1)),
        num_chunks=np.full((1, H), J, dtype=np.int64),
        gamma=np.broadcast_to(np.asarray(gamma, dtype=float), (H,)).copy(),
        num_tokens=T,
    )
    policy = AdaptivePolicy((r,) * H, (r_v,) * H, r + 1, r_v + 1, 0.5, 0.5, 10**9, 0)
    sketches = SketchBuffers(np.zeros((1, H, 2 * r + 2, d)), np.zeros((1, H, 2 * r_v + 2, d_v)), 0, 0, 0)
    return SubspaceState(policy, layout, sketches, False, "numpy")


@pytest.fixture(scope="session")
def tiny_calibration(tmp_path_factory):
    """``(ctx, record, svd)`` of the ``calibrate`` subcommand on the tiny random Llama (tiny
    profile), computed once per session for every test of the variant rows."""
    pytest.importorskip("torch")
    from subspace_ref.hf_requirements import MIN_TRANSFORMERS

    pytest.importorskip("transformers", minversion=MIN_TRANSFORMERS)  # the variant rows run SubspaceCache
    from subspace_ref.lab.experiments import _common as C, calibrate

    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    out = tmp_path_factory.mktemp("tiny_calibration")
    ctx = C.make_context(p.parse_args(["--model", "tiny-random", "--profile", "tiny", "--no-progress", "--out", str(out)]))
    record, svd = calibrate.ensure_calibration(ctx)
    return ctx, record, svd
