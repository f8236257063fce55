"""Spec A4 below capacity: a Frequent Directions sketch of n <= ell rows has lost nothing, so
S^T S = A^T A (to rounding), for the public sketch and for the stacked helper the states use.
The edge n = ell is the one that matters: compacting a buffer holding exactly ell rows would
shrink every direction by sigma_ell^2 and drop the weakest (issue 18 item 6, surviving mutant)."""

import numpy as np
import pytest

from subspace_ref import frequent_directions as fd


@pytest.mark.parametrize("ell,n", [(1, 1), (4, 1), (4, 3), (4, 4), (6, 6), (8, 5)])
@pytest.mark.parametrize("blocks", [1, "rows"])
def test_sketch_of_at_most_ell_rows_is_exact(rng, ell, n, blocks):
    d = 10
    A = rng.standard_normal((n, d)) * rng.uniform(0.1, 3.0, (n, 1))  # distinct singular values
    sk = fd.FrequentDirections(d, ell)
    if blocks == 1:
        sk.update(A)
    else:
        for row in A:
            sk.update(row[None])
    S = sk.sketch
    assert S.shape == (ell, d)
    np.testing.assert_allclose(S.T @ S, A.T @ A, rtol=0, atol=1e-12 * np.abs(A.T @ A).max())


@pytest.mark.parametrize("ell", [2, 5])
def test_stacked_sketch_of_ell_rows_is_exact(rng, ell):
    """fd.sketch over a stack (N, H, 2 ell, d) with exactly ell rows filled."""
    d = 7
    A = rng.standard_normal((2, 3, ell, d))
    buffer, filled = fd.insert(np.zeros((2, 3, 2 * ell, d)), 0, A, ell)
    assert filled == ell
    S = fd.sketch(buffer, filled, ell)
    gram = np.swapaxes(S, -1, -2) @ S
    np.testing.assert_allclose(gram, np.swapaxes(A, -1, -2) @ A, rtol=0, atol=1e-12 * np.abs(gram).max())


def test_sketch_past_ell_rows_obeys_the_fd_bound(rng):
    """The other side of the edge: with ell + 1 rows the sketch compacts, and stays within the
    FD guarantee 0 <= x^T (A^T A - S^T S) x <= |A|_F^2 / ell for unit x (spec A4)."""
    d, ell = 9, 4
    A = rng.standard_normal((ell + 1, d))
    S = fd.FrequentDirections(d, ell).update(A).sketch
    gap = np.linalg.eigvalsh(A.T @ A - S.T @ S)
    assert gap.min() >= -1e-10 and gap.max() <= (A**2).sum() / ell + 1e-10
    assert gap.max() > 1e-6  # it did compact: something was shrunk
