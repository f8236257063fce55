"""Spec A8 and statement A8.1: the rotating basis of seed 003 (SubSpace-A)."""

import numpy as np

import subspace_ref as sr

from conftest import low_rank_stream


def test_refresh_projects_the_stored_reconstruction(rng):
    """After each refresh: K_hat_new = [K_hat_old; k_t B^T B] P_{B'}, from stored data only."""
    H, T, d, m = 2, 90, 10, 16
    K = low_rank_stream(rng, H, T, d, 4, noise=0.2)
    V = low_rank_stream(rng, H, T, d, 3, noise=0.2)
    state = sr.SubspaceState.rotating(H, d, rank_k=3, rank_v=3, refresh_every=m)
    refreshes = 0
    for t in range(T):
        before_K, before_V = state.reconstruct()
        old_B = state.layout.key_bases[0, :, 0].copy()
        old_E = state.layout.value_bases[0, :, 0].copy()
        state.append(K[:, t], V[:, t])
        new_B = state.layout.key_bases[0, :, 0]
        new_E = state.layout.value_bases[0, :, 0]
        after_K, after_V = state.reconstruct()
        if t >= state.policy.warmup and (t + 1 - state.policy.warmup) % m == 0:
            refreshes += 1
            for h in range(H):
                stacked_K = np.vstack([before_K[h], K[h, t] @ old_B[h].T @ old_B[h]])
                stacked_V = np.vstack([before_V[h], V[h, t] @ old_E[h].T @ old_E[h]])
                np.testing.assert_allclose(after_K[h], stacked_K @ new_B[h].T @ new_B[h], atol=1e-10)
                np.testing.assert_allclose(after_V[h], stacked_V @ new_E[h].T @ new_E[h], atol=1e-10)
        else:
            np.testing.assert_array_equal(after_K[:, :t], before_K)
    assert refreshes == (T - state.policy.warmup) // m
    assert state.num_chunks.tolist() == [1] * H


def test_counterexample_rotation_is_not_projection_of_history(rng):
    """Seed 003 says rotating 'keeps past coefficients consistent'. The reconstruction after a
    refresh is the *old reconstruction* projected, not the history projected: components dropped
    by an earlier basis are gone for good (statement A8.1)."""
    d = 4
    e = np.eye(d)
    # 8 tokens along e0/e1, then a long run along e2: the refreshed rank-2 basis turns to e2,
    # and when e1 returns it cannot come back for the tokens stored earlier
    K = np.vstack([np.tile(e[0], (4, 1)), np.tile(e[1], (4, 1)), np.tile(e[2], (40, 1)), np.tile(e[1], (40, 1))])[None]
    state = sr.SubspaceState.rotating(1, d, rank_k=2, rank_v=2, refresh_every=4, warmup=2).append(K, K)
    K_hat, _ = state.reconstruct()
    B = state.layout.key_bases[0, 0, 0]
    history_projected = K[0] @ B.T @ B
    assert np.abs(K_hat[0] - history_projected).max() > 0.5
    # the loss compounds: the tokens along e1 stored before the e2 run are lost entirely
    np.testing.assert_allclose(K_hat[0, 4:8], 0.0, atol=1e-12)
    assert np.abs(history_projected[4:8] - K[0, 4:8]).max() < 1e-12


def test_rotating_state_holds_no_full_vectors(rng):
    K = rng.standard_normal((2, 200, 16))
    state = sr.SubspaceState.rotating(2, 16, rank_k=4, rank_v=4, refresh_every=32).append(K, K)
    assert state.layout.key_coef.shape[-1] == 4
    assert state.nbytes < state.full_cache_nbytes
