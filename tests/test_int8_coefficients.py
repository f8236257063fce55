"""Spec A10: INT8 coefficients with per-token scales in the oracle."""

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.quantization import dequantize_rows, quantize_rows

from conftest import low_rank_stream


def test_rounding_bound(rng):
    """Statement A10.1: every entry within s/2 of the original; zero rows stay zero."""
    x = rng.standard_normal((50, 7)) * rng.lognormal(0, 3, (50, 1))
    x[3] = 0.0
    q, s = quantize_rows(x)
    assert q.dtype == np.int8 and s.dtype == np.float32
    x_hat = dequantize_rows(q, s, np.float64)
    assert np.all(np.abs(x - x_hat) <= s[:, None] / 2 * (1 + 1e-6) + 1e-30)
    assert not x_hat[3].any()
    assert np.abs(q).max() == 127


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_int8_state_matches_float_state_within_rounding(rng, kind):
    K = low_rank_stream(rng, 2, 300, 16, 4, noise=0.1)
    V = low_rank_stream(rng, 2, 300, 16, 4, noise=0.1)
    make = {
        "static": lambda c: sr.SubspaceState.static(sr.calibrate(K, V, rank_k=4, rank_v=4), coefficients=c),
        "adaptive": lambda c: sr.SubspaceState.adaptive(2, 16, rank_k=4, rank_v=4, tau_k=0.4, tau_v=0.4, max_chunk=64, coefficients=c),
        "rotating": lambda c: sr.SubspaceState.rotating(2, 16, rank_k=4, rank_v=4, refresh_every=50, coefficients=c),
    }[kind]
    exact, quant = make("float").append(K, V), make("int8").append(K, V)
    assert quant.layout.key_coef.dtype == np.int8
    np.testing.assert_array_equal(exact.num_chunks, quant.num_chunks)  # triggers use unquantised residuals
    K_f, V_f = exact.reconstruct()
    K_q, V_q = quant.reconstruct()
    refreshes = 1 + (300 // 50 if kind == "rotating" else 0)
    bound = refreshes * np.sqrt(4) * np.abs(K_f).max() / 254 * 2
    assert np.abs(K_f - K_q).max() <= bound
    q = rng.standard_normal((2, 16))
    out_f, out_q = sr.attend(q, exact), sr.attend(q, quant)
    assert np.abs(out_f - out_q).max() < 0.05 * np.abs(out_f).max()


def test_int8_nbytes(rng):
    H, T, d, r = 2, 100, 16, 4
    K = rng.standard_normal((H, T, d))
    state = sr.SubspaceState.static(sr.calibrate(K, K, rank_k=r, rank_v=r), coefficients="int8").append(K, K)
    assert state.nbytes == H * T * (2 * r * 1 + 2 * 4) + state.basis_nbytes


def test_bad_coefficient_format():
    with pytest.raises(ValueError, match="coefficients must be one of 'float', 'int8', 'int4', 'int2'"):
        sr.SubspaceState.adaptive(1, 4, rank_k=2, rank_v=2, coefficients="int3")
