"""Spec A6 and the byte accounting of spec A9 for static states."""

import numpy as np
import pytest

import subspace_ref as sr

from conftest import low_rank_stream


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nbytes_is_coefficients_plus_bases(rng, dtype):
    H, T, d, d_v, r, r_v = 4, 1000, 32, 24, 8, 6
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d_v))
    state = sr.SubspaceState.static(sr.calibrate(K, V, rank_k=r, rank_v=r_v), dtype=dtype).append(K, V)
    item = np.dtype(dtype).itemsize
    assert state.basis_nbytes == H * (r * d + r_v * d_v) * item + H * item
    assert state.nbytes == H * T * (r + r_v) * item + state.basis_nbytes
    assert state.full_cache_nbytes == H * T * (d + d_v) * item


def test_token_by_token_equals_one_block(rng):
    K, V = rng.standard_normal((2, 70, 8)), rng.standard_normal((2, 70, 8))
    basis = sr.calibrate(K, V, rank_k=3, rank_v=5)
    one = sr.SubspaceState.static(basis).append(K, V)
    many = sr.SubspaceState.static(basis)
    for t in range(70):
        many.append(K[:, t], V[:, t])
    for a, b in zip(one.reconstruct(), many.reconstruct()):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)


def test_static_coefficients_are_projections(rng):
    K = low_rank_stream(rng, 2, 50, 10, 3)
    basis = sr.calibrate(K, K, rank_k=3, rank_v=3)
    state = sr.SubspaceState.static(basis).append(K, K)
    np.testing.assert_allclose(state.layout.key_coef[0, :, :50], np.einsum("htd,hrd->htr", K, basis.B), atol=1e-12)
    K_hat, _ = state.reconstruct()
    np.testing.assert_allclose(K_hat, K, atol=1e-10)  # rank-3 stream, rank-3 basis: lossless


def test_rejected_append_leaves_state_unchanged(rng):
    K, V = rng.standard_normal((2, 20, 8)), rng.standard_normal((2, 20, 8))
    state = sr.SubspaceState.static(sr.calibrate(K, V, rank_k=3, rank_v=3)).append(K[:, :10], V[:, :10])
    before = [x.copy() for x in state.reconstruct()]
    bad = K[:, 10:].copy()
    bad[1, 3, 2] = np.nan
    for keys, values in ((bad, V[:, 10:]), (K[:, 10:], V[:, 10:12]), (K[:1, 10:], V[:1, 10:]), (K[:, 10:, :5], V[:, 10:])):
        with pytest.raises(ValueError):
            state.append(keys, values)
    assert state.num_tokens == 10
    for a, b in zip(before, state.reconstruct()):
        np.testing.assert_array_equal(a, b)
