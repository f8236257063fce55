"""``attend`` on the oracle: full-rank exactness, agreement with reconstruct(), dtypes, bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import subspace_ref as sr

from conftest import low_rank_stream, random_orthonormal, state_from_chunks


@settings(max_examples=40, deadline=None)
@given(
    H=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    T=st.integers(1, 70),
    d=st.integers(1, 9),
    cuts=st.lists(st.integers(1, 69), max_size=6),
    logit_size=st.sampled_from([1.0, 100.0, 1e4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_full_rank_is_exact(H, group, T, d, cuts, logit_size, seed):
    """r = d, r_v = d_v, any orthonormal bases, any chunk boundaries, gamma = 1: exact up to rounding.

    Each logit passes through a change of basis (a sum of d <= 9 products, and the basis products
    themselves), so it carries an error of a few eps x max|logit|; the softmax turns a logit error
    delta into a relative weight error delta, so the output's relative error is O(eps (1 + max|logit|)):
    bound 64 eps (1 + logit_size) (hypothesis found 1.2e-12 at logits 1e4, above a flat 1e-12)."""
    rng = np.random.default_rng(seed)
    starts = sorted({0, *[c for c in cuts if c < T]})
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d + 1))
    q = rng.standard_normal((H * group, d))
    q *= logit_size * np.sqrt(d) / (np.linalg.norm(q, axis=-1, keepdims=True) * np.abs(K).max() * np.sqrt(d))
    J = len(starts)
    state = state_from_chunks(K, V, starts, random_orthonormal(rng, H, J, r=d, d=d), random_orthonormal(rng, H, J, r=d + 1, d=d + 1))
    out = sr.attend(q, state)
    expected = sr.exact_attention(q, K, V)
    assert np.isfinite(out).all()
    rel = np.linalg.norm(out - expected, axis=-1) / np.maximum(np.linalg.norm(expected, axis=-1), 1e-300)
    assert rel.max() <= 64 * np.finfo(np.float64).eps * (1 + logit_size)


def test_attend_equals_exact_attention_over_reconstruction(rng):
    """attend == exact attention over (K_hat, V_hat) with gamma-scaled logits, per head."""
    K = low_rank_stream(rng, 2, 400, 16, 5, noise=0.3)
    V = low_rank_stream(rng, 2, 400, 12, 4, noise=0.3)
    for state in (
        sr.SubspaceState.static(sr.calibrate(K[:, :200], V[:, :200], rank_k=4, rank_v=3, gamma="paper")),
        sr.SubspaceState.adaptive(2, 16, 12, rank_k=4, rank_v=3, tau_k=0.3, tau_v=0.4, max_chunk=50, gamma=0.8),
        sr.SubspaceState.rotating(2, 16, 12, rank_k=4, rank_v=3, refresh_every=32, gamma="paper"),
    ):
        state.append(K, V)
        K_hat, V_hat = state.reconstruct()
        q = rng.standard_normal((4, 16))
        out = sr.attend(q, state)
        gamma = state.layout.gamma
        for hq in range(4):
            h = hq // 2
            ref = sr.exact_attention(q[hq : hq + 1], K_hat[h : h + 1], V_hat[h : h + 1], scale=gamma[h] / 4.0)
            np.testing.assert_allclose(out[hq], ref[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_dtype_follows_input(rng, dtype):
    K, V = rng.standard_normal((2, 30, 8)), rng.standard_normal((2, 30, 8))
    state = sr.SubspaceState.static(sr.calibrate(K, V, rank_k=4, rank_v=4), dtype=dtype)
    state.append(K.astype(dtype), V.astype(dtype))
    out = sr.attend(rng.standard_normal((2, 8)).astype(dtype), state)
    assert out.dtype == dtype and out.shape == (2, 8)
    ref = sr.attend(rng.standard_normal((2, 8)), sr.SubspaceState.static(sr.calibrate(K, V, rank_k=4, rank_v=4)).append(K, V))
    assert ref.dtype == np.float64


def test_batched_state_matches_one_state_per_sequence(rng):
    K = rng.standard_normal((3, 2, 40, 8))
    V = rng.standard_normal((3, 2, 40, 6))
    q = rng.standard_normal((3, 4, 8))
    batched = sr.SubspaceState.adaptive(2, 8, 6, rank_k=3, rank_v=2, tau_k=0.5, tau_v=0.5, max_chunk=9, batch=3)
    batched.append(K, V)
    out = sr.attend(q, batched)
    assert out.shape == (3, 4, 6)
    for n in range(3):
        single = sr.SubspaceState.adaptive(2, 8, 6, rank_k=3, rank_v=2, tau_k=0.5, tau_v=0.5, max_chunk=9).append(K[n], V[n])
        np.testing.assert_allclose(out[n], sr.attend(q[n], single), rtol=1e-12)
        np.testing.assert_array_equal(batched.num_chunks[n], single.num_chunks)


def test_unknown_backend_lists_registered(rng):
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(np.eye(4)[None], np.eye(4)[None])).append(np.ones((1, 4)), np.ones((1, 4)))
    with pytest.raises(ValueError, match="registered backends: .*numpy"):
        sr.attend(np.ones((1, 4)), state, backend="nope")


@pytest.mark.parametrize(
    "q, message",
    [
        (np.ones((1, 5)), r"q has shape \(1, 5\); expected \(\*, 4\)"),
        (np.ones((3, 4)), "multiple of the state's 2 KV heads"),
        (np.full((2, 4), np.nan), "NaN or Inf"),
        (np.ones((2, 4), dtype=np.int64), "expected float16"),
    ],
)
def test_bad_queries(q, message):
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(np.tile(np.eye(4)[None], (2, 1, 1)), np.tile(np.eye(4)[None], (2, 1, 1))))
    state.append(np.ones((2, 4)), np.ones((2, 4)))
    with pytest.raises((ValueError, TypeError), match=message):
        sr.attend(q, state)


def test_empty_state_cannot_be_attended():
    state = sr.SubspaceState.adaptive(1, 4, rank_k=2, rank_v=2)
    with pytest.raises(ValueError, match="holds no tokens"):
        sr.attend(np.ones((1, 4)), state)


class _UnhashableDevice:
    """Like ``cupy.cuda.Device``: defines __eq__ without __hash__."""

    def __eq__(self, other):
        return isinstance(other, _UnhashableDevice)

    __hash__ = None

    def __str__(self):
        return "<device 0>"


class _ArrayOnUnhashableDevice(np.ndarray):
    @property
    def device(self):
        return _UnhashableDevice()


def test_attend_takes_queries_whose_device_is_unhashable(rng):
    """attend remembers each admitted (backend, query kind) in a set: a query whose ``device`` is
    unhashable (every CuPy array's is) must be admitted by the device's name, not hashed (an
    H100 run failed every CuPy attend with "unhashable type: 'cupy.cuda.device.Device'")."""
    H, d, r, T = 2, 8, 3, 20
    state = sr.SubspaceState.static(sr.calibrate(rng.standard_normal((H, 40, d)), rng.standard_normal((H, 40, d)), rank_k=r, rank_v=r))
    state.append(rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d)))
    q = rng.standard_normal((H, d))
    want = sr.attend(q, state)
    got = sr.attend(q.view(_ArrayOnUnhashableDevice), state)
    np.testing.assert_array_equal(np.asarray(got), want)
