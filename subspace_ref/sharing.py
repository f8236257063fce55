"""Key bases under grouped-query attention: per KV head or per query head (spec/sharing.md;
seed 001 §11 "per-head vs per-group (MQA/GQA) bases", seed 003 "Compatibility").

A plain state has one key basis per KV head, shared by the g query heads reading it. The
logit error of query head i against an orthogonal rank-r projection P of its KV head's keys is
(spec/sharing.md S1)

    f_i(P) = E[(q_i^T (I - P) k)^2] = tr(Sigma_q,i (I - P) Sigma_k (I - P))

for independent q_i and k. :func:`query_aware_key_basis` minimises one f_i (a basis per query
head), :func:`shared_query_aware_key_basis` the group's sum (one basis per KV head, plain bytes).
:func:`calibrate_query_heads` builds the :class:`~subspace_ref.StaticBasis` with H_q heads that
``SubspaceState.static(..., query_group=g)`` takes (spec/sharing.md A2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg

from subspace_ref import _checks
from subspace_ref.arrays import array_family, namespace


# ----------------------------------------------------------------------------- the objective
def second_moment(X: Any) -> np.ndarray:
    """E[x x^T] of rows X (..., N, d) in float64: (..., d, d)."""
    X = np.asarray(X, dtype=np.float64)
    return np.einsum("...nd,...ne->...de", X, X) / X.shape[-2]


def logit_error(B: Any, Sigma_q: Any, Sigma_k: Any) -> float:
    """Spec/sharing.md S1: f(P) = tr(Sigma_q (I-P) Sigma_k (I-P)) for P = B^T B, B (r, d) with
    orthonormal rows (zero padding rows allowed)."""
    B = np.asarray(B, dtype=np.float64)
    Q = np.eye(B.shape[-1]) - B.T @ B
    return float(np.trace(np.asarray(Sigma_q) @ Q @ np.asarray(Sigma_k) @ Q))


def _psd_sqrt(S: np.ndarray) -> np.ndarray:
    w, V = scipy.linalg.eigh(S)
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T


def _top_eigvecs(S: np.ndarray, r: int) -> np.ndarray:
    """(r, d) rows: eigenvectors of the r largest eigenvalues of symmetric S, largest first."""
    d = S.shape[0]
    _, V = scipy.linalg.eigh(S, subset_by_index=[d - r, d - 1])
    return V[:, ::-1].T.copy()


def _orthonormal_rows(W: np.ndarray) -> np.ndarray:
    Q, _ = np.linalg.qr(W.T)
    return Q.T.copy()


def _check_moments(Sigma_q: Any, Sigma_k: Any, r: Any) -> tuple[np.ndarray, np.ndarray, int]:
    A = np.asarray(_checks.as_array("Sigma_q", Sigma_q), dtype=np.float64)
    K = np.asarray(_checks.as_array("Sigma_k", Sigma_k), dtype=np.float64)
    _checks.shape("Sigma_k", K, (None, None))
    d = K.shape[0]
    _checks.shape("Sigma_k", K, (d, d))
    _checks.shape("Sigma_q", A, (d, d))
    for name, S in (("Sigma_q", A), ("Sigma_k", K)):
        _checks.finite(name, S)
        if np.abs(S - S.T).max(initial=0.0) > 1e-8 * max(np.abs(S).max(initial=0.0), 1e-300):
            raise ValueError(f"{name} must be symmetric (a second moment E[x x^T])")
    r = _checks.integer("r", r)
    if not 1 <= r <= d:
        raise ValueError(f"r must lie in [1, {d}] (the head size), got {r}")
    return (A + A.T) / 2, (K + K.T) / 2, r


# ----------------------------------------------------------------------------- calibration
def query_aware_key_basis(Sigma_q: Any, Sigma_k: Any, r: int, *, iterations: int = 100, start: Any = None) -> np.ndarray:
    """Spec/sharing.md A1: an orthonormal (r, d) key basis minimising f(P) = tr(Sigma_q (I-P)
    Sigma_k (I-P)) (S1) for one query head.

    Step 1: candidates, the shared PCA basis (top-r eigenvectors of Sigma_k), the top-r
    eigenvectors v of Sigma_k^{1/2} Sigma_q Sigma_k^{1/2} mapped back to key space (Sigma_k^{1/2} v,
    orthonormalised), and ``start`` (r, d) if given; the one of least f is kept.
    Step 2: Riemannian gradient descent on the Grassmannian (S3) with backtracking, a step taken
    only when f decreases (Armijo), so the result is never worse on f than any candidate (S4).
    Cost: O(iterations x d^3) (eigh and d x d products)."""
    A, K, r = _check_moments(Sigma_q, Sigma_k, r)
    d = K.shape[0]
    candidates = [_top_eigvecs(K, r)]
    root = _psd_sqrt(K)
    mapped = _top_eigvecs(root @ A @ root, r) @ root  # rows (Sigma_k^{1/2} v)^T
    if np.linalg.matrix_rank(mapped) == r:
        candidates.append(_orthonormal_rows(mapped))
    if start is not None:
        S = np.asarray(start, dtype=np.float64)
        _checks.shape("start", S, (r, d))
        candidates.append(_orthonormal_rows(S))
    U = min(candidates, key=lambda B: logit_error(B, A, K)).T  # (d, r)
    f = logit_error(U.T, A, K)
    step = 1.0 / max(np.linalg.norm(A, 2) * np.linalg.norm(K, 2), 1e-300)
    for _ in range(iterations):
        Q = np.eye(d) - U @ U.T
        G = -(K @ Q @ A + A @ Q @ K)  # S2: Euclidean gradient in P
        grad = Q @ (2.0 * G @ U)  # S3: projected onto the tangent space at span(U)
        g2 = float(np.sum(grad * grad))
        if g2 <= 1e-28 * max(f, 1e-300) ** 2:
            break
        t = 4.0 * step
        while t > 1e-12 * step:
            trial, _ = np.linalg.qr(U - t * grad)  # QR retraction
            f_trial = logit_error(trial.T, A, K)
            if f_trial <= f - 1e-4 * t * g2:
                break
            t /= 2
        else:
            break
        if not f_trial < f:  # never accept an increase (S4)
            break
        U, f, step = trial, f_trial, t
    return U.T.copy()


def shared_query_aware_key_basis(Sigma_qs: Any, Sigma_k: Any, r: int, *, iterations: int = 100) -> np.ndarray:
    """Spec/sharing.md A1': one (r, d) key basis for a KV head minimising the group's summed
    logit error sum_i f_i(P). f is linear in Sigma_q (S5), so this is :func:`query_aware_key_basis`
    of sum_i Sigma_q,i. ``Sigma_qs`` (g, d, d). Same bytes as the plain PCA basis."""
    S = np.asarray(_checks.as_array("Sigma_qs", Sigma_qs), dtype=np.float64)
    _checks.shape("Sigma_qs", S, (None, None, None))
    return query_aware_key_basis(S.sum(0), Sigma_k, r, iterations=iterations)


def group_of(query_heads: int, kv_heads: int) -> int:
    """g = H_q / H: ValueError unless the KV heads divide the query heads."""
    if query_heads % kv_heads:
        raise ValueError(f"queries have {query_heads} heads; expected a multiple of the {kv_heads} KV heads")
    return query_heads // kv_heads


def calibrate_query_heads(Sigma_q: Any, Sigma_k: Any, E: Any, rank_k: int, *, share: str = "query_head", iterations: int = 100):
    """Spec/sharing.md A2: a :class:`~subspace_ref.StaticBasis` from per-query-head second moments
    ``Sigma_q`` (H_q, d, d), per-KV-head ``Sigma_k`` (H, d, d) and value bases ``E`` (H, r_v, d_v).

    ``share="query_head"``: H_q heads, key basis of query head i fitted to its own f_i
    (:func:`query_aware_key_basis`, started also from the group's shared query-aware basis, so
    each f_i is at most the shared one's: S6); the value basis of KV head h // ... repeated for
    its g query heads. For ``SubspaceState.static(..., query_group=g)``.
    ``share="kv_head"``: H heads, the group's shared query-aware key basis (plain layout)."""
    A = np.asarray(_checks.as_array("Sigma_q", Sigma_q), dtype=np.float64)
    K = np.asarray(_checks.as_array("Sigma_k", Sigma_k), dtype=np.float64)
    E = np.asarray(_checks.as_array("E", E))
    _checks.shape("Sigma_k", K, (None, None, None))
    H, d = K.shape[0], K.shape[1]
    _checks.shape("Sigma_q", A, (None, d, d))
    _checks.shape("E", E, (H, None, None))
    g = group_of(A.shape[0], H)
    if share not in ("query_head", "kv_head"):
        raise ValueError(f'share must be "query_head" or "kv_head", got {share!r}')
    from subspace_ref.calibration import StaticBasis

    shared = [shared_query_aware_key_basis(A[h * g : (h + 1) * g], K[h], rank_k, iterations=iterations) for h in range(H)]
    if share == "kv_head":
        B = np.stack(shared)
    else:
        B = np.stack([query_aware_key_basis(A[i], K[i // g], rank_k, iterations=iterations, start=shared[i // g]) for i in range(A.shape[0])])
        E = np.repeat(E, g, axis=0)
    rank_v = tuple(int(x) for x in (np.linalg.norm(E, axis=-1) > 0).sum(-1))
    heads = B.shape[0]
    return StaticBasis(B=B.astype(E.dtype), E=E, gamma=np.ones(heads, dtype=E.dtype), rank_k=(int(rank_k),) * heads, rank_v=rank_v)


# ----------------------------------------------------------------------------- the state side
def repeat_kv_heads(x: Any, group: int) -> Any:
    """x (N, H, n, d) -> (N, g H, n, d), KV head h repeated for query heads g h .. g h + g - 1
    (the GQA map h_q -> h_q // g of spec A3): what a per-query-head state projects (A3)."""
    if group == 1:
        return x
    if array_family(x) == "torch":
        return x.repeat_interleave(group, dim=1)
    return namespace(x).repeat(x, group, axis=1)


__all__ = ["calibrate_query_heads", "group_of", "logit_error", "query_aware_key_basis", "repeat_kv_heads", "second_moment",
           "shared_query_aware_key_basis"]
