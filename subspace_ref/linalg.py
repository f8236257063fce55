"""Dense linear algebra the oracle relies on, in one place."""

from __future__ import annotations

import numpy as np
import scipy.linalg


def svd(X: np.ndarray, full_matrices: bool = False):
    """``scipy.linalg.svd`` (LAPACK gesdd), falling back to gesvd when gesdd fails to converge:
    it does on some ordinary finite matrices (seen: one layer-0 value head of the shipped model
    over a held-out window, 1024 x 64 float64), where gesvd succeeds."""
    try:
        return scipy.linalg.svd(X, full_matrices=full_matrices)
    except np.linalg.LinAlgError:
        return scipy.linalg.svd(X, full_matrices=full_matrices, lapack_driver="gesvd")
