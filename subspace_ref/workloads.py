"""Synthetic decode workloads shared by the roofline report and the asv suite.

Keys and values lie near a fixed ``rank``-dimensional subspace per head (a stand-in for the
post-RoPE keys of a calibrated head): static bases that span it capture the data, and adaptive
states close chunks by length only (the residual test never trips), so the chunk count of a
state of T tokens is predictable, J = ceil(T / max_chunk) + 1 with the open one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from subspace_ref.calibration import StaticBasis

#: the data's dimension per head and the isotropic noise around it
DATA_RANK = 12
NOISE = 0.01


def data_subspaces(heads: int, d: int, rank: int = DATA_RANK) -> np.ndarray:
    """(heads, rank, d) orthonormal rows: the same subspaces for every call."""
    rng = np.random.default_rng(12345)
    return np.stack([np.linalg.qr(rng.standard_normal((d, rank)))[0].T for _ in range(heads)])


def near_subspace_tokens(seed: int, heads: int, T: int, d: int, dtype: Any = np.float32) -> np.ndarray:
    """(heads, T, d) rows: Gaussian coefficients on :func:`data_subspaces` plus ``NOISE`` noise,
    generated in blocks so long streams stay within memory."""
    U = data_subspaces(heads, d)
    rng = np.random.default_rng(seed)
    out = np.empty((heads, T, d), dtype=dtype)
    for a in range(0, T, 8192):
        b = min(T, a + 8192)
        coef = rng.standard_normal((heads, b - a, DATA_RANK))
        out[:, a:b] = np.einsum("htk,hkd->htd", coef, U) + NOISE * rng.standard_normal((heads, b - a, d))
    return out


def spanning_basis(heads: int, d: int, r: int, dtype: Any = np.float32) -> StaticBasis:
    """Rank-r bases (same for keys and values) whose first DATA_RANK rows span the data's
    subspace (fewer if r is smaller), completed at random."""
    U = data_subspaces(heads, d)
    rng = np.random.default_rng(7)
    B = np.empty((heads, r, d))
    for h in range(heads):
        extra = rng.standard_normal((d, max(r - DATA_RANK, 0)))
        B[h] = np.linalg.qr(np.concatenate([U[h].T, extra], axis=1)[:, :r])[0].T
    return StaticBasis.from_bases(B.astype(dtype), B.astype(dtype))


def random_static_bases(layers: int, heads: int, d: int, rank: int, seed: int = 0, gamma: Any = 1.0) -> list[StaticBasis]:
    """One :class:`StaticBasis` per layer with random orthonormal key and value rows (heads,
    rank, d), float32, and ``gamma`` (a scalar or per head): the bases of decode benchmarks,
    whose speed does not depend on which subspace."""
    rng = np.random.default_rng(seed)

    def rows():
        return np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0][:rank] for _ in range(heads)]).astype(np.float32)

    return [StaticBasis.from_bases(rows(), rows(), gamma) for _ in range(layers)]


def grown_states(state, contexts: list[int], tokens: Callable[[int, int], tuple[Any, Any]], engine: str = "numpy") -> dict[int, Any]:
    """NumPy copies of ``state`` at each length in ``contexts``, grown by one stream of appends of
    ``tokens(start, n) -> (K, V)`` (NumPy, (H, n, d)) in blocks of at most 4096 tokens.

    With ``engine="torch"`` the appends run on the torch backend (CPU) with one thread: adaptive
    appends are thousands of tiny SVDs and matvecs, which more threads only slow down (20x seen
    on a loaded 2-core machine); the thread count is restored afterwards.
    """
    threads = None
    if engine == "torch":
        import torch

        state = state.to("torch", device="cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        out, done = {}, 0
        for T in sorted(contexts):
            while done < T:
                n = min(4096, T - done)
                K, V = tokens(done, n)
                if engine == "torch":
                    K, V = torch.from_numpy(K), torch.from_numpy(V)
                state.append(K, V)
                done += n
            out[T] = state.to("numpy") if engine == "torch" else state.copy()
    finally:
        if threads is not None:
            torch.set_num_threads(threads)
    return out
