"""Spec A7.3: the byte ceiling of adaptive states (statement A7.3.1 and its proof's cases)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import subspace_ref as sr
from subspace_ref.layout import BY_NAME, FIXED, counted_nbytes
from subspace_ref.policies import byte_ceiling


def growing_nbytes(state) -> int:
    """nbytes without the fixed-size arrays (sketches, gamma, windows)."""
    fixed = [name for name, a in BY_NAME.items() if a.axis == FIXED]
    return state.nbytes - counted_nbytes(state, fixed)


def one_chunk_nbytes(state) -> float:
    """The bytes of the smallest state of the policy at this length: one chunk per head, its
    fixed arrays (F of spec A7.3) and the tokens' coefficients."""
    per_chunk, per_token, _ = byte_ceiling.rates(state)
    pairs = state.batch * state.heads
    return pairs * (byte_ceiling.fixed_bytes(state) + per_chunk + state.num_tokens * per_token)


def allowance(state) -> float:
    """A7.3.1: nbytes <= max(c x the full cache, a one-chunk state's bytes)."""
    return max(state.policy.byte_ceiling * state.full_cache_nbytes, one_chunk_nbytes(state))


def t_0(state) -> float:
    """A7.3.1's t_0 = (F + B_c) / (beta - T_c): from there on nbytes <= c x the full cache."""
    per_chunk, per_token, beta = byte_ceiling.rates(state)
    return (byte_ceiling.fixed_bytes(state) + per_chunk) / (beta - per_token) if per_token < beta else math.inf


def make(H, d, r, tau, max_chunk, trigger, coefficients, ceiling, batch=None):
    return sr.SubspaceState.adaptive(
        H, d, rank_k=r, rank_v=r, tau_k=tau, tau_v=tau, max_chunk=max_chunk, trigger=trigger, coefficients=coefficients, byte_ceiling=ceiling, batch=batch
    )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.sampled_from([8, 16]),
    r=st.integers(1, 6),
    tau=st.sampled_from([1e-6, 0.05, 0.3]),
    max_chunk=st.integers(1, 9),
    trigger=st.sampled_from(["paper", "reproject"]),
    coefficients=st.sampled_from(["float", "int8", "int4"]),
    ceiling=st.sampled_from([1.0, 0.75, 2.0]),
    cuts=st.lists(st.integers(1, 40), min_size=1, max_size=5),
)
def test_growing_bytes_never_exceed_the_allowance_on_adversarial_streams(seed, d, r, tau, max_chunk, trigger, coefficients, ceiling, cuts):
    """A7.3.1 on full-rank random values (nothing is low-rank) with tau down to 1e-6 (every token
    fires), in random blocks: after every append nbytes <= max(c x full cache, a one-chunk
    state's bytes), so past t_0 the state is within ``ceiling`` times the full cache."""
    rng = np.random.default_rng(seed)
    H = 2
    try:
        state = make(H, d, r, tau, max_chunk, trigger, coefficients, ceiling)
    except ValueError as err:  # the ceiling is below one token's coefficients: refused up front
        assert "byte_ceiling" in str(err)
        return
    for n in cuts:
        state.append(rng.standard_normal((H, n, d)), rng.standard_normal((H, n, d)))
        assert state.nbytes <= allowance(state)
        if state.num_tokens >= t_0(state):
            assert state.nbytes <= ceiling * state.full_cache_nbytes


@pytest.mark.parametrize("track, factor", [(False, 3), (True, 2)])
def test_counterexample_without_a_ceiling_the_state_outgrows_the_full_cache(rng, track, factor):
    """Issue 19's failure, kept: random values, tau small, no ceiling (seed 001's policy) open a
    chunk on nearly every token (every r tokens under tracking, whose growth fills each chunk) and
    hold several times the full cache; the ceiling holds it, its sketches included."""
    K, V = rng.standard_normal((2, 400, 16)), rng.standard_normal((2, 400, 16))
    kw = dict(rank_k=4, rank_v=4, tau_k=0.05, tau_v=0.05, max_chunk=64, track=track)
    free = sr.SubspaceState.adaptive(2, 16, byte_ceiling=math.inf, **kw).append(K, V)
    capped = sr.SubspaceState.adaptive(2, 16, byte_ceiling=1.0, **kw).append(K, V)
    assert growing_nbytes(free) > factor * free.full_cache_nbytes
    assert capped.nbytes <= capped.full_cache_nbytes
    assert 1 < int(np.asarray(capped.layout.num_chunks).max()) < int(np.asarray(free.layout.num_chunks).max())
    assert capped.tokens_over_tau > 0 and free.tokens_over_tau == 0  # what the ceiling gave up, counted


def test_issue_40_full_rank_random_case_stays_under_the_ceiling_at_every_block(rng):
    """Issue 40's ceiling case: 2 heads, d = 32, rank 8, tau = 0.05, full-rank random keys and
    values in blocks of 50 tokens. Before: nbytes over the full cache at every step (1.53x at 50
    tokens, 1.05x at 600: the sketches were not charged). Now, after every block, nbytes <=
    max(c x full, one-chunk state) (A7.3.1), <= c x full from t_0 (54 tokens here) on, and the
    counter is exactly the number of (token, head) pairs stored above tau."""
    H, d, tau = 2, 32, 0.05
    state = sr.SubspaceState.adaptive(H, d, d, rank_k=8, rank_v=8, tau_k=tau, tau_v=tau)
    assert 50 < t_0(state) < 60
    K, V = rng.standard_normal((H, 600, d)), rng.standard_normal((H, 600, d))
    for a in range(0, 600, 50):
        state.append(K[:, a : a + 50], V[:, a : a + 50])
        assert state.nbytes <= allowance(state)
        assert state.nbytes <= state.full_cache_nbytes or state.num_tokens < t_0(state)
        if state.num_tokens < t_0(state):  # before t_0 the overshoot is the one-chunk state's
            assert state.nbytes <= one_chunk_nbytes(state)
    K_hat, V_hat = state.reconstruct()
    over = (np.linalg.norm(K - K_hat, axis=-1) > tau * np.linalg.norm(K, axis=-1) * (1 + 1e-9)) | (
        np.linalg.norm(V - V_hat, axis=-1) > tau * np.linalg.norm(V, axis=-1) * (1 + 1e-9)
    )
    assert state.tokens_over_tau == int(over.sum()) > 0


@pytest.mark.parametrize("trigger", ["paper", "reproject"])
def test_full_rank_under_the_ceiling_is_one_exact_chunk(rng, trigger):
    """A7.3.1's corollary: at full rank a chunk never pays (T_c = beta), so one chunk, exact."""
    K, V = rng.standard_normal((2, 60, 8)), rng.standard_normal((2, 60, 8))
    state = make(2, 8, 8, 1e-6, 5, trigger, "float", 1.0).append(K, V)
    assert int(np.asarray(state.layout.num_chunks).max()) == 1
    q = rng.standard_normal((2, 8))
    np.testing.assert_allclose(sr.attend(q, state), sr.exact_attention(q, K, V), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("trigger", ["paper", "reproject"])
def test_torch_opens_the_same_chunks_as_the_oracle(rng, trigger):
    torch = pytest.importorskip("torch")
    K, V = rng.standard_normal((2, 2, 300, 16)), rng.standard_normal((2, 2, 300, 16))
    oracle = make(2, 16, 3, 0.05, 12, trigger, "float", 1.0, batch=2)
    fast = make(2, 16, 3, 0.05, 12, trigger, "float", 1.0, batch=2).to("torch")
    for a, b in ((0, 1), (1, 40), (40, 300)):
        oracle.append(K[:, :, a:b], V[:, :, a:b])
        fast.append(torch.from_numpy(K[:, :, a:b]), torch.from_numpy(V[:, :, a:b]))
    np.testing.assert_array_equal(fast.layout.num_chunks.numpy(), np.asarray(oracle.layout.num_chunks))
    np.testing.assert_array_equal(fast.layout.chunk_starts.numpy()[..., :8], np.asarray(oracle.layout.chunk_starts)[..., :8])
    assert fast.nbytes == oracle.nbytes
    assert fast.tokens_over_tau == oracle.tokens_over_tau > 0


@pytest.mark.parametrize("bad", [0, -1.0, "x", float("nan")])
def test_bad_ceilings_are_refused_naming_the_argument(bad):
    with pytest.raises((ValueError, TypeError), match="byte_ceiling"):
        make(2, 16, 4, 0.2, 8, "paper", "float", bad)


def test_a_ceiling_below_a_token_s_coefficients_is_refused():
    with pytest.raises(ValueError, match="byte_ceiling=0.1 .* below"):
        make(2, 16, 4, 0.2, 8, "paper", "float", 0.1)


def test_the_ceiling_is_saved_and_loaded(rng, tmp_path):
    state = make(2, 16, 4, 0.05, 8, "reproject", "int8", 1.0).append(rng.standard_normal((2, 50, 16)), rng.standard_normal((2, 50, 16)))
    state.save(tmp_path / "s.safetensors")
    loaded = sr.SubspaceState.load(tmp_path / "s.safetensors")
    assert loaded.policy.byte_ceiling == 1.0
    assert loaded.tokens_over_tau == state.tokens_over_tau > 0 and loaded.policy.track  # spec A7.4, saved
    K, V = rng.standard_normal((2, 80, 16)), rng.standard_normal((2, 80, 16))
    state.append(K, V)
    loaded.append(K, V)
    np.testing.assert_array_equal(np.asarray(loaded.layout.num_chunks), np.asarray(state.layout.num_chunks))


def test_tracking_and_its_counter_in_files(rng, tmp_path):
    """Spec A7.4 in files (spec/persistence.md): ``track`` and a non-zero ``tokens_over_tau`` are
    written (version 2) and read back; a file without them, as every file written before issue
    40, loads with ``track=False`` and a counter of 0 and keeps appending as it was written."""
    import json

    import safetensors

    K, V = rng.standard_normal((2, 120, 16)), rng.standard_normal((2, 120, 16))
    tracked = make(2, 16, 4, 0.05, 8, "reproject", "float", 1.0).append(K[:, :80], V[:, :80])
    tracked.save(tmp_path / "t.safetensors")
    with safetensors.safe_open(tmp_path / "t.safetensors", "np") as f:
        meta = f.metadata()
    header = json.loads(meta["state"])
    assert meta["format_version"] == "2" and header["policy"]["track"] is True
    assert header["sketch"]["tokens_over_tau"] == tracked.tokens_over_tau > 0
    loaded = sr.SubspaceState.load(tmp_path / "t.safetensors")
    for state in (tracked, loaded):
        state.append(K[:, 80:], V[:, 80:])
    assert loaded.tokens_over_tau == tracked.tokens_over_tau
    np.testing.assert_array_equal(np.asarray(loaded.layout.num_chunks), np.asarray(tracked.layout.num_chunks))

    old = sr.SubspaceState.adaptive(2, 16, rank_k=4, rank_v=4, trigger="paper", byte_ceiling=math.inf).append(K[:, :80], V[:, :80])
    old.save(tmp_path / "old.safetensors")
    with safetensors.safe_open(tmp_path / "old.safetensors", "np") as f:
        header = json.loads(f.metadata()["state"])
    assert "track" not in header["policy"] and "tokens_over_tau" not in header["sketch"]  # the file as before
    back = sr.SubspaceState.load(tmp_path / "old.safetensors")
    assert back.policy.track is False and back.tokens_over_tau == 0
    old.append(K[:, 80:], V[:, 80:])
    back.append(K[:, 80:], V[:, 80:])
    np.testing.assert_array_equal(np.asarray(back.layout.key_coef), np.asarray(old.layout.key_coef))
