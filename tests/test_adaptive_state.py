"""Spec A7: residual-triggered chunking, exact residuals, causality, warm-up."""

import math

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.policies import AdaptivePolicy

from conftest import low_rank_stream

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def drifting_stream(rng, T, d, rank, every):
    """Rows from a rank-``rank`` subspace that is redrawn every ``every`` tokens, plus noise."""
    out = np.empty((T, d))
    for start in range(0, T, every):
        n = min(every, T - start)
        out[start : start + n] = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, d))
    return out + 0.05 * rng.standard_normal((T, d))


def replay(state, K, V):
    """For every head and token: the open chunk's bases and the chunk boundary that followed."""
    policy = state.policy
    for h in range(state.heads):
        bounds = state.chunk_bounds(h)
        ends = {b for _, b in bounds[:-1]}
        for j, (a, b) in enumerate(bounds):
            B, E = state.layout.key_bases[0, h, j], state.layout.value_bases[0, h, j]
            for t in range(a, b):
                rho_k = np.linalg.norm(K[h, t] - B.T @ (B @ K[h, t])) / np.linalg.norm(K[h, t])
                rho_v = np.linalg.norm(V[h, t] - E.T @ (E @ V[h, t])) / np.linalg.norm(V[h, t])
                should_close = t >= min(policy.warmup, *policy.rank_k, *policy.rank_v) and (
                    rho_k > policy.tau_k or rho_v > policy.tau_v or t + 1 - a >= policy.max_chunk
                )
                yield h, t, rho_k, rho_v, should_close, (t + 1) in ends


@pytest.mark.parametrize("warmup", [0, None])
def test_chunk_closes_exactly_on_the_rule(rng, warmup):
    H, T, d = 2, 400, 12
    K = np.stack([drifting_stream(rng, T, d, 3, 97) for _ in range(H)])
    V = np.stack([drifting_stream(rng, T, d, 2, 131) for _ in range(H)])
    state = sr.SubspaceState.adaptive(
        H, d, rank_k=3, rank_v=2, tau_k=0.3, tau_v=0.35, max_chunk=60, warmup=warmup, trigger="paper", byte_ceiling=math.inf
    ).append(K, V)
    checked = 0
    for h, t, rho_k, rho_v, should_close, closed in replay(state, K, V):
        margin = min(abs(rho_k - state.policy.tau_k), abs(rho_v - state.policy.tau_v))
        if margin > 1e-9:  # ties within rounding could go either way
            assert should_close == closed, (h, t, rho_k, rho_v)
            checked += 1
    assert checked > 0.99 * H * T
    assert (state.num_chunks > 4).all()


def test_counterexample_paper_sketches_thrash_under_drift(rng):
    """Statement A7.1: with never-forgetting sketches (the paper verbatim) a subspace switch makes
    the trigger fire on most tokens; restarting the sketch per chunk (step 3b) keeps J small."""
    T, d = 400, 12
    K = drifting_stream(rng, T, d, 3, 100)[None]
    kwargs = dict(rank_k=3, rank_v=3, tau_k=0.3, tau_v=0.3, max_chunk=128)
    paper = sr.SubspaceState.adaptive(1, d, **kwargs, **PAPER).append(K, K)
    reset = sr.SubspaceState.adaptive(1, d, sketch_reset=True, **kwargs, **PAPER).append(K, K)
    assert paper.num_chunks[0] > T / 3
    assert reset.num_chunks[0] < T / 10


def test_residuals_equal_direct_projection_residuals(rng):
    from subspace_ref.policies.online_run import relative_residual

    B = np.linalg.qr(rng.standard_normal((10, 4)))[0].T
    k = rng.standard_normal((50, 10))
    direct = np.linalg.norm(k - (k @ B.T) @ B, axis=-1) / np.linalg.norm(k, axis=-1)
    np.testing.assert_allclose(relative_residual(k, k @ B.T), direct, rtol=1e-10, atol=1e-12)
    assert relative_residual(np.zeros((1, 10)), np.zeros((1, 4)))[0] == 0.0


@pytest.mark.parametrize("trigger", ["paper", "reproject"])
def test_causality_prefix_stability(rng, trigger):
    """No token's coefficients depend on later tokens: a prefix's state is unchanged by what follows.
    (With reproject a chunk starting at t has a basis built from tokens <= t.) Without tracking;
    tracking's growth: test_tracking_causality_the_prefix_state_is_a_prefix."""
    K, V = rng.standard_normal((2, 120, 8)), rng.standard_normal((2, 120, 8))
    kwargs = dict(rank_k=3, rank_v=3, tau_k=0.4, tau_v=0.4, max_chunk=17, trigger=trigger, track=False)
    full = sr.SubspaceState.adaptive(2, 8, **kwargs).append(K, V)
    for t in (1, 5, 40, 119):
        other_K, other_V = K.copy(), V.copy()
        other_K[:, t:] = rng.standard_normal(other_K[:, t:].shape)
        other_V[:, t:] = rng.standard_normal(other_V[:, t:].shape)
        changed = sr.SubspaceState.adaptive(2, 8, **kwargs).append(other_K, other_V)
        np.testing.assert_array_equal(full.layout.key_coef[:, :, :t], changed.layout.key_coef[:, :, :t])
        np.testing.assert_array_equal(full.layout.value_coef[:, :, :t], changed.layout.value_coef[:, :, :t])
        for h in range(2):
            # a chunk starting at 1..t has a basis built from tokens before its start; chunk 0's
            # warm-up row s is built from token s
            for j, (a, _) in enumerate(full.chunk_bounds(h)):
                rows = slice(0, min(t, full.policy.warmup)) if j == 0 else slice(None)
                if a < t or (a == t and trigger == "paper"):
                    np.testing.assert_array_equal(full.layout.key_bases[0, h, j, rows], changed.layout.key_bases[0, h, j, rows])


@pytest.mark.parametrize("cuts", [(), (1, 5, 33, 70)])
def test_tracking_causality_the_prefix_state_is_a_prefix(rng, cuts):
    """Spec A7.4: growth writes only rows that were free, so the state after t tokens is a prefix
    of the state after T: the same coefficients, chunk starts and sketch-independent bases, every
    row in use at t unchanged, and each chunk's rows in use at t a subset of its rows at T."""
    H, T = 2, 120
    K = np.stack([drifting_stream(rng, T, 8, 3, 40) for _ in range(H)])
    V = np.stack([drifting_stream(rng, T, 8, 2, 50) for _ in range(H)])
    kwargs = dict(rank_k=3, rank_v=3, tau_k=0.3, tau_v=0.3, max_chunk=30, byte_ceiling=math.inf)
    full = sr.SubspaceState.adaptive(H, 8, **kwargs)
    for a, b in zip((0, *cuts), (*cuts, T)):
        full.append(K[:, a:b], V[:, a:b])
    grown = 0
    for t in (1, 9, 40, 77, 119):
        prefix = sr.SubspaceState.adaptive(H, 8, **kwargs).append(K[:, :t], V[:, :t])
        np.testing.assert_array_equal(full.layout.key_coef[:, :, :t], prefix.layout.key_coef[:, :, :t])
        np.testing.assert_array_equal(full.layout.value_coef[:, :, :t], prefix.layout.value_coef[:, :, :t])
        for h in range(H):
            J = len(prefix.chunk_bounds(h))
            assert [a for a, _ in full.chunk_bounds(h)][:J] == [a for a, _ in prefix.chunk_bounds(h)]
            for which in ("key_bases", "value_bases"):
                then, now = getattr(prefix.layout, which)[0, h, :J], getattr(full.layout, which)[0, h, :J]
                used = np.linalg.norm(then, axis=-1) > 0
                np.testing.assert_array_equal(now[used], then[used])
                grown += int((np.linalg.norm(now, axis=-1)[~used] > 0).sum())
        np.testing.assert_allclose(full.reconstruct()[0][:, :t], prefix.reconstruct()[0], atol=1e-12)
    assert grown > 0  # rows did grow after earlier tokens were stored


def test_tracking_defaults_and_bad_options():
    """Spec A7.4: track defaults to True under reproject (warm-up 0) and False under the paper
    order; True with the paper order, or a non-bool, is refused naming ``track``."""
    state = sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=3)
    assert state.policy.track and state.policy.warmup == 0
    paper = sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=3, trigger="paper")
    assert not paper.policy.track and paper.policy.warmup == 3
    assert sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=3, track=False).policy.warmup == 3
    assert sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=3, warmup=2).policy.warmup == 2
    with pytest.raises(ValueError, match="track=True needs trigger"):
        sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=2, trigger="paper", track=True)
    with pytest.raises(TypeError, match="track must be"):
        sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=2, track="yes")
    with pytest.raises(ValueError, match="track=True needs trigger"):
        AdaptivePolicy((2,), (2,), 4, 4, 0.2, 0.2, 8, 0, track=True)  # as a file with both would load


def test_warmup_stores_first_tokens_exactly(rng):
    K, V = rng.standard_normal((2, 10, 16)), rng.standard_normal((2, 10, 16))
    state = sr.SubspaceState.adaptive(2, 16, rank_k=6, rank_v=4, tau_k=0.5, tau_v=0.5, trigger="reproject", track=False).append(K, V)
    assert state.policy.warmup == 6  # issue 19: per side, keys warm up to rank_k (was min(rank_k, rank_v) = 4)
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_allclose(K_hat[:, :6], K[:, :6], atol=1e-12)
    np.testing.assert_allclose(V_hat[:, :4], V[:, :4], atol=1e-12)


def test_paper_verbatim_without_warmup_starts_with_short_chunks(rng):
    K = low_rank_stream(rng, 1, 50, 8, 2)
    state = sr.SubspaceState.adaptive(1, 8, rank_k=2, rank_v=2, tau_k=0.1, tau_v=0.1, warmup=0, trigger="paper", byte_ceiling=math.inf).append(K, K)
    first = state.chunk_bounds(0)[0]
    assert first == (0, 1)  # the empty sketch gives a zero basis, so token 0 fires the trigger


def test_chunks_bounded_by_max_chunk(rng):
    K = low_rank_stream(rng, 1, 300, 8, 2)
    state = sr.SubspaceState.adaptive(1, 8, rank_k=2, rank_v=2, tau_k=0.99, tau_v=0.99, max_chunk=32, **PAPER).append(K, K)
    lengths = [b - a for a, b in state.chunk_bounds(0)]
    assert max(lengths) <= 32
    assert state.num_chunks[0] == -(-300 // 32) + (300 % 32 == 0)


def test_rank_deficient_stream_stays_exact(rng):
    K = np.tile(rng.standard_normal((1, 1, 8)), (1, 100, 1))
    state = sr.SubspaceState.adaptive(1, 8, rank_k=3, rank_v=3, tau_k=0.1, tau_v=0.1, **PAPER).append(K, K)
    np.testing.assert_allclose(state.reconstruct()[0], K, atol=1e-12)
    assert state.num_chunks[0] == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank_k=9, rank_v=2), r"rank_k must lie in \[1, 8\]"),
        (dict(rank_k=2, rank_v=9), r"rank_v must lie in \[1, 8\]"),
        (dict(rank_k=2, rank_v=2, tau_k=-0.1), r"tau_k must lie in the open interval \(0, 1\)"),
        (dict(rank_k=2, rank_v=2, tau_v=1.5), r"tau_v must lie in the open interval \(0, 1\)"),
        (dict(rank_k=2, rank_v=2, byte_ceiling=0.0), "byte_ceiling must be > 0"),
        (dict(rank_k=2, rank_v=2, byte_ceiling=-2), "byte_ceiling must be > 0"),
        (dict(rank_k=2, rank_v=2, ell_k=2), "ell_k = 2 must be > rank_k = 2"),
        (dict(rank_k=2, rank_v=2, tau_k=1.0), r"tau_k must lie in the open interval \(0, 1\)"),
        (dict(rank_k=2, rank_v=2, tau_v=0.0), r"tau_v must lie in the open interval \(0, 1\)"),
        (dict(rank_k=2, rank_v=2, max_chunk=0), "max_chunk must be >= 1"),
        (dict(rank_k=2, rank_v=2, warmup=3), r"warmup must be an int in \[0, 2\]"),
        (dict(rank_k=(2, 3, 4), rank_v=2), "one int or 2 ints"),
        (dict(rank_k=2, rank_v=2, gamma="mse"), "needs calibration queries"),
    ],
)
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        sr.SubspaceState.adaptive(2, 8, **kwargs)


def test_policy_is_a_small_dataclass():
    state = sr.SubspaceState.adaptive(2, 8, rank_k=2, rank_v=3)
    assert isinstance(state.policy, AdaptivePolicy)
    assert (state.policy.ell_k, state.policy.ell_v) == (4, 6)
