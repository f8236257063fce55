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
    pytest.importorskip("transformers")
    from subspace_ref.lab.experiments import _common as C, calibrate

    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    out = tmp_path_factory.mktemp("tiny_calibration")
    ctx = C.make_context(p.parse_args(["--model", "tiny-random", "--profile", "tiny", "--no-progress", "--out", str(out)]))
    record, svd = calibrate.ensure_calibration(ctx)
    return ctx, record, svd
