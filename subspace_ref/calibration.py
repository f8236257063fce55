"""Static bases calibrated offline from recorded keys and values (spec A5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from subspace_ref import _checks
from subspace_ref.linalg import svd


@dataclass(frozen=True)
class StaticBasis:
    """Per-head bases of one layer (spec A5).

    ``B`` (H, r, d) and ``E`` (H, r_v, d_v) have orthonormal rows up to each head's rank
    (``rank_k[h]``, ``rank_v[h]``); heads of lower rank are padded with zero rows so every head
    has the same array shape. ``gamma`` (H,) is the logit scale per head. Built by
    :func:`~subspace_ref.calibrate` or :meth:`from_bases`.

    Parameters
    ----------
    B : numpy.ndarray
        Key bases (H, r, d).
    E : numpy.ndarray
        Value bases (H, r_v, d_v).
    gamma : numpy.ndarray
        Logit scale per head (H,).
    rank_k, rank_v : tuple of int
        Each head's ranks.

    Examples
    --------
    >>> import numpy as np
    >>> from subspace_ref import StaticBasis
    >>> basis = StaticBasis.from_bases(np.eye(4)[None, :2], np.eye(4)[None, :3])
    >>> basis.rank_k, basis.rank_v
    ((2,), (3,))
    """

    B: np.ndarray
    E: np.ndarray
    gamma: np.ndarray
    rank_k: tuple[int, ...]
    rank_v: tuple[int, ...]

    def __post_init__(self):
        _checks.shape("B", self.B, (None, None, None))
        _checks.shape("E", self.E, (self.B.shape[0], None, None))
        _checks.shape("gamma", self.gamma, (self.B.shape[0],))
        for name, basis, ranks in (("B", self.B, self.rank_k), ("E", self.E, self.rank_v)):
            check_padded_orthonormal(name, basis, ranks)

    @property
    def heads(self) -> int:
        return self.B.shape[0]

    @classmethod
    def from_bases(cls, B: Any, E: Any, gamma: Any = 1.0) -> "StaticBasis":
        """Bases given by hand: (H, r, d) and (H, r_v, d_v), zero rows as padding, checked for
        orthonormality (ValueError otherwise)."""
        B, E = np.asarray(_checks.as_array("B", B)), np.asarray(_checks.as_array("E", E))
        _checks.shape("B", B, (None, None, None))
        _checks.shape("E", E, (B.shape[0], None, None))
        for name, x in (("B", B), ("E", E)):
            _checks.float_dtype(name, x)
            _checks.finite(name, x)
        rank_k = tuple(int(x) for x in (np.linalg.norm(B, axis=-1) > 0).sum(-1))
        rank_v = tuple(int(x) for x in (np.linalg.norm(E, axis=-1) > 0).sum(-1))
        g = resolve_gamma(gamma, rank_k, B.shape[2], B.dtype)
        return cls(B=B, E=E, gamma=g, rank_k=rank_k, rank_v=rank_v)


def check_padded_orthonormal(name: str, basis: np.ndarray, ranks: tuple[int, ...]) -> None:
    """ValueError unless each head's first rank rows are orthonormal and the rest are zero."""
    tol = 1e-5 if basis.dtype == np.float32 else 1e-10
    for h, r in enumerate(ranks):
        rows = basis[h, :r]
        if basis[h, r:].any():
            raise ValueError(f"{name}[{h}] has non-zero rows after its rank {r}; padding rows must be zero")
        err = np.abs(rows @ rows.T - np.eye(r)).max(initial=0.0)
        if err > tol:
            raise ValueError(f"{name}[{h}] rows are not orthonormal (max |B B^T - I| = {err:.2e} > {tol:g})")


def energy_rank(sigma: np.ndarray, energy: float) -> int:
    """Least r with sum_{i<=r} sigma_i^2 >= energy * sum_i sigma_i^2 (spec A5 step 2), at least 1."""
    power = np.cumsum(sigma.astype(np.float64) ** 2)
    if power[-1] == 0:
        return 1
    return int(min(np.searchsorted(power, energy * power[-1] * (1 - 1e-12)) + 1, len(sigma)))


def _bases(X: np.ndarray, rank: int | None, energy: float | None, name: str) -> tuple[np.ndarray, list[int]]:
    H, _, dim = X.shape
    ranks, rows = [], []
    for h in range(H):
        _, sigma, wt = svd(X[h], full_matrices=False)
        r = rank if rank is not None else energy_rank(sigma, energy)
        if r > min(dim, wt.shape[0]):
            raise ValueError(f"{name} = {r} exceeds the available rank {min(dim, wt.shape[0])} of head {h}")
        ranks.append(r)
        rows.append(wt[:r])
    out = np.zeros((H, max(ranks), dim), dtype=X.dtype)
    for h, w in enumerate(rows):
        out[h, : w.shape[0]] = w
    return out, ranks


def resolve_gamma(gamma: Any, ranks: list[int] | tuple[int, ...], d: int, dtype: Any) -> np.ndarray:
    """gamma as one number per head from "unit", "paper" (sqrt(r/d), seed 001 §4), a number or
    a per-head sequence (spec A5 step 4). "mse" needs calibration queries and is handled by calibrate."""
    H = len(ranks)
    if isinstance(gamma, str):
        if gamma == "unit":
            return np.ones(H, dtype=dtype)
        if gamma == "paper":
            return np.sqrt(np.asarray(ranks, dtype=np.float64) / d).astype(dtype)
        if gamma == "mse":
            raise ValueError('gamma="mse" needs calibration queries: use calibrate(..., queries=Q, gamma="mse") and pass its .gamma')
        raise ValueError(f'gamma must be "unit", "paper", "mse", a number or one number per head; got {gamma!r}')
    try:
        g = np.asarray(gamma, dtype=dtype)
    except (TypeError, ValueError):
        raise ValueError(f'gamma must be "unit", "paper", "mse", a number or one number per head; got {gamma!r}') from None
    if g.ndim == 0:
        g = np.full(H, g, dtype=dtype)
    if g.shape != (H,) or not np.all(np.isfinite(g)) or np.any(g <= 0):
        raise ValueError(f"gamma must be positive and finite, one number or {H} (one per head); got {gamma!r}")
    return g


def mse_gamma(queries: np.ndarray, keys: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Closed-form least-squares gamma per head (spec A5 step 4): sum(l*l0) / sum(l0^2)."""
    gammas = []
    for h in range(keys.shape[0]):
        exact = queries[h] @ keys[h].T
        projected = (queries[h] @ B[h].T) @ (keys[h] @ B[h].T).T
        denom = float(np.sum(projected * projected))
        gammas.append(float(np.sum(exact * projected)) / denom if denom > 0 else 1.0)
    return np.asarray(gammas)


def calibrate(
    keys: Any,
    values: Any,
    *,
    rank_k: int | None = None,
    rank_v: int | None = None,
    energy: float | None = None,
    queries: Any = None,
    gamma: Any = "unit",
) -> StaticBasis:
    """Per-head key and value bases from calibration keys and values (spec A5).

    Heads of lower rank are padded with zero rows, so ``B`` is (H, max rank, d).

    Parameters
    ----------
    keys, values : array_like
        Calibration keys (H, N, d) and values (H, N, d_v), floating and finite.
    rank_k, rank_v : int, optional
        Fixed ranks; a rank left out is chosen per head from ``energy``.
    energy : float, optional
        In (0, 1]: the least rank retaining this fraction of the squared singular values.
    queries : array_like, optional
        Calibration queries (H_q, N_q, d), H_q a multiple of H; needed by ``gamma="mse"``.
    gamma : str, float or sequence of float
        The logit correction: "unit" (1, the default), "paper" (sqrt(r/d)), "mse" (spec A5
        step 4), a number, or one number per head.

    Returns
    -------
    StaticBasis
        The bases ``B`` (H, r, d) and ``E`` (H, r_v, d_v), the per-head ranks and ``gamma``.

    Examples
    --------
    >>> import numpy as np, subspace_ref as sr
    >>> K, V = np.random.default_rng(0).standard_normal((2, 2, 64, 16))
    >>> basis = sr.calibrate(K, V, rank_k=4, energy=0.9)
    >>> basis.B.shape[:2], basis.rank_k
    ((2, 4), (4, 4))
    """
    K, V = np.asarray(_checks.as_array("keys", keys)), np.asarray(_checks.as_array("values", values))
    _checks.shape("keys", K, (None, None, None))
    _checks.shape("values", V, (K.shape[0], K.shape[1], None))
    _checks.float_dtype("keys", K)
    _checks.float_dtype("values", V)
    _checks.finite("keys", K)
    _checks.finite("values", V)
    if energy is not None and not 0.0 < float(energy) <= 1.0:
        raise ValueError(f"energy must lie in (0, 1], got {energy}")
    for name, rank, dim in (("rank_k", rank_k, K.shape[2]), ("rank_v", rank_v, V.shape[2])):
        if rank is None and energy is None:
            raise ValueError(f"give {name} or energy: one of them chooses the rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, np.integer))):
            raise ValueError(f"{name} must be a whole number of directions (an int), got {rank!r}")
        if rank is not None and not 1 <= int(rank) <= dim:
            raise ValueError(f"{name} must lie in [1, {dim}], got {rank}")
    B, ranks_k = _bases(K, rank_k, energy, "rank_k")
    E, ranks_v = _bases(V, rank_v, energy, "rank_v")
    if isinstance(gamma, str) and gamma == "mse":
        if queries is None:
            raise ValueError('gamma="mse" needs queries (H_q, N_q, d) to fit the logits')
        Q = np.asarray(_checks.as_array("queries", queries))
        _checks.shape("queries", Q, (None, None, K.shape[2]))
        _checks.float_dtype("queries", Q)
        _checks.finite("queries", Q)
        if Q.shape[0] % K.shape[0]:
            raise ValueError(f"queries has {Q.shape[0]} heads; expected a multiple of the {K.shape[0]} key heads")
        group = Q.shape[0] // K.shape[0]
        # every query head of a GQA group reads the same key head, so they share one gamma fit
        Qg = Q.reshape(K.shape[0], group * Q.shape[1], Q.shape[2])
        g = mse_gamma(Qg, K, B).astype(K.dtype)
    else:
        g = resolve_gamma(gamma, ranks_k, K.shape[2], K.dtype)
    return StaticBasis(B=B, E=E, gamma=g, rank_k=tuple(ranks_k), rank_v=tuple(ranks_v))
