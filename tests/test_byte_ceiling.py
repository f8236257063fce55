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
    """nbytes without the fixed-size arrays (sketches, gamma, windows): G of A7.3.1, all heads."""
    fixed = [name for name, a in BY_NAME.items() if a.axis == FIXED]
    return state.nbytes - counted_nbytes(state, fixed)


def allowance(state) -> float:
    """A7.3.1's bound for every (sequence, head): max(beta t, B_c + t T_c)."""
    per_chunk, per_token, beta = byte_ceiling.rates(state)
    t = state.num_tokens
    return state.batch * state.heads * max(beta * t, per_chunk + t * per_token)


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
    fires), in random blocks: after every append G <= max(beta t, B_c + t T_c) per head, so past
    t_0 the state is within ``ceiling`` times the full cache."""
    rng = np.random.default_rng(seed)
    H = 2
    try:
        state = make(H, d, r, tau, max_chunk, trigger, coefficients, ceiling)
    except ValueError as err:  # the ceiling is below one token's coefficients: refused up front
        assert "byte_ceiling" in str(err)
        return
    for n in cuts:
        state.append(rng.standard_normal((H, n, d)), rng.standard_normal((H, n, d)))
        assert growing_nbytes(state) <= allowance(state)
        per_chunk, per_token, beta = byte_ceiling.rates(state)
        if per_token < beta and state.num_tokens >= per_chunk / (beta - per_token):
            assert growing_nbytes(state) <= ceiling * state.full_cache_nbytes


def test_counterexample_without_a_ceiling_the_state_outgrows_the_full_cache(rng):
    """Issue 19's failure, kept: random values, tau small, no ceiling (seed 001's policy) open a
    chunk on nearly every token and hold several times the full cache; the ceiling holds it."""
    K, V = rng.standard_normal((2, 400, 16)), rng.standard_normal((2, 400, 16))
    free = make(2, 16, 4, 0.05, 64, "reproject", "float", math.inf).append(K, V)
    capped = make(2, 16, 4, 0.05, 64, "reproject", "float", 1.0).append(K, V)
    assert growing_nbytes(free) > 3 * free.full_cache_nbytes
    assert growing_nbytes(capped) <= capped.full_cache_nbytes
    assert 1 < int(np.asarray(capped.layout.num_chunks).max()) < int(np.asarray(free.layout.num_chunks).max())


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
    K, V = rng.standard_normal((2, 80, 16)), rng.standard_normal((2, 80, 16))
    state.append(K, V)
    loaded.append(K, V)
    np.testing.assert_array_equal(np.asarray(loaded.layout.num_chunks), np.asarray(state.layout.num_chunks))
