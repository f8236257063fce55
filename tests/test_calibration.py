"""Spec A5: calibrated static bases, energy ranks, gamma."""

import numpy as np
import pytest

from subspace_ref import StaticBasis, calibrate
from subspace_ref.calibration import energy_rank

from conftest import low_rank_stream


def test_fixed_ranks_give_top_singular_vectors(rng):
    K = low_rank_stream(rng, 2, 200, 16, 3, noise=1e-3)
    V = rng.standard_normal((2, 200, 8))
    basis = calibrate(K, V, rank_k=3, rank_v=8)
    assert basis.B.shape == (2, 3, 16) and basis.E.shape == (2, 8, 8)
    for h in range(2):
        _, _, wt = np.linalg.svd(K[h], full_matrices=False)
        np.testing.assert_allclose(np.abs(basis.B[h] @ wt[:3].T), np.eye(3), atol=1e-8)
    np.testing.assert_array_equal(basis.gamma, [1.0, 1.0])


def test_energy_ranks_per_head_are_padded_with_zero_rows(rng):
    K = np.concatenate([low_rank_stream(rng, 1, 300, 16, 2), low_rank_stream(rng, 1, 300, 16, 6)])
    basis = calibrate(K, K, energy=0.999999)
    assert basis.rank_k == (2, 6)
    assert basis.B.shape == (2, 6, 16)
    assert not basis.B[0, 2:].any()


def test_energy_rank_definition():
    sigma = np.array([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert energy_rank(sigma, 9 / 14) == 1
    assert energy_rank(sigma, 0.9) == 2
    assert energy_rank(sigma, 1.0) == 3


def test_gamma_options(rng):
    K, V = rng.standard_normal((2, 100, 16)), rng.standard_normal((2, 100, 16))
    assert np.allclose(calibrate(K, V, rank_k=4, rank_v=4, gamma="paper").gamma, np.sqrt(4 / 16))
    assert np.allclose(calibrate(K, V, rank_k=4, rank_v=4, gamma=0.7).gamma, 0.7)


def test_mse_gamma_minimises_logit_error(rng):
    K, V, Q = rng.standard_normal((1, 300, 16)), rng.standard_normal((1, 300, 16)), rng.standard_normal((2, 50, 16))
    basis = calibrate(K, V, rank_k=6, rank_v=6, queries=Q, gamma="mse")
    Qg = Q.reshape(1, 100, 16)
    exact = Qg[0] @ K[0].T
    proj = (Qg[0] @ basis.B[0].T) @ (K[0] @ basis.B[0].T).T

    def loss(g):
        return ((exact - g * proj) ** 2).sum()

    g = basis.gamma[0]
    assert loss(g) <= min(loss(g * 1.01), loss(g * 0.99), loss(1.0))


def test_full_rank_projection_makes_mse_gamma_one(rng):
    K, V, Q = rng.standard_normal((1, 64, 8)), rng.standard_normal((1, 64, 8)), rng.standard_normal((1, 20, 8))
    assert calibrate(K, V, rank_k=8, rank_v=8, queries=Q, gamma="mse").gamma[0] == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank_k=17, rank_v=2), r"rank_k must lie in \[1, 16\]"),
        (dict(rank_v=2), "give rank_k or energy"),
        (dict(energy=1.5), r"energy must lie in \(0, 1\]"),
        (dict(rank_k=2, rank_v=2, gamma="mse"), "needs queries"),
        (dict(rank_k=2, rank_v=2, gamma="fancy"), "gamma must be"),
        (dict(rank_k=2, rank_v=2, gamma=-1.0), "gamma must be positive"),
    ],
)
def test_bad_input(rng, kwargs, message):
    with pytest.raises(ValueError, match=message):
        calibrate(rng.standard_normal((2, 40, 16)), rng.standard_normal((2, 40, 16)), **kwargs)


def test_from_bases_rejects_non_orthonormal(rng):
    B = rng.standard_normal((1, 2, 4))
    with pytest.raises(ValueError, match="not orthonormal"):
        StaticBasis.from_bases(B, np.eye(4)[None, :2])
