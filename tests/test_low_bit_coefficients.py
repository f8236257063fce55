"""int4/int2 coefficients (spec/quantization.md Q1-Q4): the quantiser's bound, the layout's
keys-per-channel-per-group / values-per-token storage, bytes, persistence and the torch backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref import quantization
from subspace_ref.exact import exact_attention
from subspace_ref.quantization import dequantize_groups, pack, quantize_groups, unpack

FORMATS = ("int4", "int2")


def _basis(rng, H=2, d=16, r=5, r_v=7):
    """Random orthonormal bases (H, r, d), (H, r_v, d)."""
    B = np.linalg.qr(rng.standard_normal((H, d, r)))[0].transpose(0, 2, 1)
    E = np.linalg.qr(rng.standard_normal((H, d, r_v)))[0].transpose(0, 2, 1)
    return sr.StaticBasis.from_bases(B, E)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("axis", [-1, -2])
def test_quantiser_error_is_at_most_half_the_stored_scale(bits, axis):
    """Q1.1: |x - x_hat| <= s/2 per element, and s exceeds (max - min)/(2^b - 1) only by the
    float16 roundings of s (up, relative 2^-10) and z (down, one float16 spacing of min)."""
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((3, 4, 32, 9)) * rng.uniform(0.01, 50, (3, 4, 1, 9))
    q, s, z = quantize_groups(x, bits, axis)
    x_hat = dequantize_groups(q, s, z, axis, np.float64)
    err = np.abs(x - x_hat)
    half = np.expand_dims(s.astype(np.float64), axis) / 2
    assert (err <= half * (1 + 1e-12)).all()
    assert err.max() > 0.25 * half.max()  # the bound is approached, not vacuous
    lo, hi = x.min(axis), x.max(axis)
    levels = 2**bits - 1
    spacing = np.spacing(np.abs(lo).astype(np.float16)).astype(np.float64)
    assert (s.astype(np.float64) <= ((hi - lo) + spacing) / levels * (1 + 2**-10) + 2**-24).all()
    assert q.max() <= levels and z.dtype == np.float16 and s.dtype == np.float16


def test_constant_slices_are_exact_and_out_of_range_input_is_refused():
    x = np.full((2, 8), 0.1)
    q, s, z = quantize_groups(x, 4, -1)
    assert np.abs(dequantize_groups(q, s, z, -1, np.float64) - x).max() <= s.max() / 2
    with pytest.raises(ValueError, match="float16"):
        quantize_groups(np.array([[1e6, 0.0]]), 4, -1)


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_round_trip(bits):
    rng = np.random.default_rng(0)
    for width in (1, 3, 8, 13):
        q = rng.integers(0, 2**bits, (5, width)).astype(np.uint8)
        packed = pack(q, bits)
        assert packed.shape == (5, -(-width * bits // 8)) and packed.dtype == np.uint8
        np.testing.assert_array_equal(unpack(packed, bits, width), q)


def _states(rng, coefficients, kind, G=8):
    H, d = 2, 16
    if kind == "static":
        low = sr.SubspaceState.static(_basis(rng, H, d), coefficients=coefficients, group_size=G)
        return low, sr.SubspaceState.static(_basis(np.random.default_rng(7), H, d))
    make = getattr(sr.SubspaceState, kind)
    opts = dict(rank_k=5, rank_v=4, **({"refresh_every": 9} if kind == "rotating" else {}))
    return make(H, d, coefficients=coefficients, group_size=G, **opts), make(H, d, **opts)


@pytest.mark.parametrize("coefficients", FORMATS)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_attention_is_exact_over_the_reconstruction(coefficients, kind):
    """Q2: the state's attention is exact attention over its own (dequantised) reconstruction,
    whatever the blocks appended (group boundaries inside blocks, single tokens, a float tail)."""
    rng = np.random.default_rng(1)
    state, _ = _states(rng, coefficients, kind)
    H, d = 2, 16
    K, V = rng.standard_normal((H, 45, d)), rng.standard_normal((H, 45, d))
    state.append(K[:, :11], V[:, :11])
    for t in range(11, 20):
        state.append(K[:, t], V[:, t])
    state.append(K[:, 20:], V[:, 20:])
    assert state.layout.coefficients == coefficients and state.num_tokens == 45
    K_hat, V_hat = state.reconstruct()
    q = rng.standard_normal((H, d))
    np.testing.assert_allclose(sr.attend(q, state), exact_attention(q, K_hat, V_hat), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("coefficients", FORMATS)
def test_keys_per_channel_per_group_values_per_token_tail_in_float(coefficients):
    """Q2: the stored coefficients are Q1 applied to the float state's coefficients, keys over
    groups of G tokens per channel, values per token, the unfinished key group exact."""
    rng = np.random.default_rng(2)
    basis = _basis(rng)
    G, T = 8, 29
    low = sr.SubspaceState.static(basis, coefficients=coefficients, group_size=G)
    ref = sr.SubspaceState.static(basis)
    K, V = rng.standard_normal((2, T, 16)), rng.standard_normal((2, T, 16))
    low.append(K, V)
    ref.append(K, V)
    bits = low.layout.low_bits
    C = ref.layout.key_coef[0, :, :T]
    D = ref.layout.value_coef[0, :, :T]
    done = (T // G) * G
    q, s, z = quantize_groups(C[:, :done].reshape(2, T // G, G, -1), bits, -2)
    want_k = np.concatenate([dequantize_groups(q, s, z, -2, np.float64).reshape(2, done, -1), C[:, done:]], axis=1)
    q, s, z = quantize_groups(D, bits, -1)
    want_v = dequantize_groups(q, s, z, -1, np.float64)
    lay = low.layout
    for h in range(2):
        np.testing.assert_array_equal(lay.coefficient_rows("key", 0, h, 0, T, np.float64), want_k[h])
        np.testing.assert_array_equal(lay.coefficient_rows("value", 0, h, 0, T, np.float64), want_v[h])
        np.testing.assert_array_equal(lay.coefficient_rows("key", 0, h, 5, 27, np.float64), want_k[h, 5:27])


@pytest.mark.parametrize("coefficients", FORMATS)
def test_bytes_by_hand_count(coefficients):
    """Q3: packed codes, float16 scale and zero per value token and per key group and channel,
    the tail buffer of G key rows in the state's dtype."""
    rng = np.random.default_rng(3)
    basis = _basis(rng, r=5, r_v=7)
    state = sr.SubspaceState.static(basis, coefficients=coefficients, group_size=8)
    state.append(rng.standard_normal((2, 29, 16)), rng.standard_normal((2, 29, 16)))
    b = 4 if coefficients == "int4" else 2
    per_head = 29 * (-(-5 * b // 8) + -(-7 * b // 8)) + 29 * 4 + 3 * 5 * 4 + 8 * 5 * 8  # the tail buffer: G = 8 rows
    assert state.nbytes == 2 * per_head + state.basis_nbytes


def test_failing_append_leaves_the_state_unchanged():
    rng = np.random.default_rng(4)
    state = sr.SubspaceState.static(_basis(rng), coefficients="int4", group_size=8)
    state.append(rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16)))
    before = {k: v.copy() for k, v in state.layout.live_arrays().items()}
    with pytest.raises(ValueError, match="float16"):
        state.append(np.full((2, 6, 16), 1e7), rng.standard_normal((2, 6, 16)))
    assert state.num_tokens == 5
    for name, x in state.layout.live_arrays().items():
        np.testing.assert_array_equal(x, before[name], err_msg=name)


def test_bad_format_and_group_are_refused():
    basis = _basis(np.random.default_rng(5))
    with pytest.raises(ValueError, match="coefficients"):
        sr.SubspaceState.static(basis, coefficients="int3")
    with pytest.raises((ValueError, TypeError), match="group_size"):
        sr.SubspaceState.static(basis, coefficients="int4", group_size=0)


@pytest.mark.parametrize("coefficients", FORMATS)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
@pytest.mark.parametrize("branch", ["numpy-views", "torch-ops"])
def test_torch_append_matches_the_oracle(coefficients, kind, branch, monkeypatch):
    """The torch backend stores the same codes, scales, zero points and float tail as the oracle
    (float64: the coefficients agree to rounding, far from a rounding boundary of the codes).
    On a CPU the quantiser runs its NumPy branch on views of the tensors; "torch-ops" runs the
    torch branch that device arrays take, here on CPU tensors, so that it is tested without a
    GPU."""
    torch = pytest.importorskip("torch")
    if branch == "torch-ops":
        monkeypatch.setattr(quantization, "_numpy_viewable", lambda *arrays: False)
    rng = np.random.default_rng(6)
    ref, _ = _states(rng, coefficients, kind)
    tst = ref.to("torch")
    K, V = rng.standard_normal((2, 37, 16)), rng.standard_normal((2, 37, 16))
    for a, b in ((0, 13), (13, 14), (14, 37)):
        ref.append(K[:, a:b], V[:, a:b])
        tst.append(torch.from_numpy(K[:, a:b]), torch.from_numpy(V[:, a:b]))
    got, want = tst.layout.live_arrays(), ref.layout.live_arrays()
    assert set(got) == set(want)
    for name in ("key_coef", "value_coef", "key_group_scale", "key_group_zero", "value_token_scale", "value_token_zero"):
        np.testing.assert_array_equal(got[name].numpy(), want[name], err_msg=name)
    np.testing.assert_allclose(got["key_tail"].numpy(), want["key_tail"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("coefficients", FORMATS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_attend_within_the_derived_tolerance(coefficients, dtype):
    """tests/differential/tolerance.py's rule: twice the oracle's own error in the dtype."""
    torch = pytest.importorskip("torch")
    from tests.differential.tolerance import reference_error, tolerance

    rng = np.random.default_rng(8)
    state, _ = _states(rng, coefficients, "adaptive")
    state.append(rng.standard_normal((2, 41, 16)) * 3, rng.standard_normal((2, 41, 16)))
    q = rng.standard_normal((1, 4, 16)) * 2  # GQA: two query heads per KV head
    batched = state.copy()
    batched.batched = True
    out64 = sr.attend(q, batched)
    got = sr.attend(torch.from_numpy(q).to(getattr(torch, dtype)), batched.to("torch", dtype=getattr(torch, dtype)), backend="torch")
    err = float(np.abs(got.double().numpy() - out64).max())
    assert err <= tolerance(reference_error(batched, q, None, out64, dtype), out64, dtype)


def test_persistence_round_trip(tmp_path):
    rng = np.random.default_rng(9)
    for coefficients in FORMATS:
        state, _ = _states(rng, coefficients, "adaptive")
        state.append(rng.standard_normal((2, 27, 16)), rng.standard_normal((2, 27, 16)))
        state.save(tmp_path / f"{coefficients}.safetensors")
        back = sr.SubspaceState.load(tmp_path / f"{coefficients}.safetensors")
        assert back.layout.coefficients == coefficients and back.layout.group == state.layout.group
        for name, x in state.layout.live_arrays().items():
            np.testing.assert_array_equal(back.layout.live_arrays()[name], x, err_msg=name)
        q = rng.standard_normal((2, 16))
        np.testing.assert_array_equal(sr.attend(q, back), sr.attend(q, state))


def test_triton_attends_low_bit_states():
    """The triton decode kernels read the packed codes (issue 16 item 1): declared, no refusal,
    and the oracle's output within the harness's derived tolerance (the differential harness's
    int4/int2 cases and tests/test_triton_kernels.py::TestLowBitDecode test it at length)."""
    from subspace_ref.registry import get_backend

    from tests.differential.tolerance import reference_error, tolerance

    torch = pytest.importorskip("torch")
    try:
        impl = get_backend("triton")
    except (KeyError, ValueError, ImportError) as err:
        pytest.skip(f"triton backend not registered: {err}")
    if not impl.availability():
        pytest.skip(f"triton unavailable: {impl.availability().reason}")
    assert {"int4", "int2"} <= set(impl.capabilities.coefficient_formats)
    rng = np.random.default_rng(10)
    for coefficients in FORMATS:
        # batch 1, 11 tokens: two complete key groups of 4 and a tail of 3
        state = sr.SubspaceState.static(_basis(rng), coefficients=coefficients, group_size=4, batch=1)
        state.append(rng.standard_normal((1, 2, 11, 16)), rng.standard_normal((1, 2, 11, 16)))
        tstate = state.to("triton", dtype="float32")  # on the GPU when there is one
        tq = torch.from_numpy(rng.standard_normal((1, 2, 16))).float().to(tstate.layout.key_coef.device)
        assert impl.not_supported_reasons(tq, tstate) == []
        q = tq.double().cpu().numpy()
        want = sr.attend(q, state)
        got = sr.attend(tq, tstate, backend="triton").double().cpu().numpy()
        assert np.abs(got - want).max() <= tolerance(reference_error(state, q, None, want, "float32"), want, "float32")


@pytest.mark.parametrize("coefficients", FORMATS)
def test_output_bound_with_low_bit_coefficients(coefficients):
    """spec/quantization.md Q4.1-Q4.3, measured on a static state (one chunk, gamma = 1)."""
    rng = np.random.default_rng(11)
    H, d, T, G = 2, 16, 70, 8
    basis = _basis(rng, H, d, r=6, r_v=6)
    state = sr.SubspaceState.static(basis, coefficients=coefficients, group_size=G)
    K = rng.standard_normal((H, T, d)) * 2
    V = rng.standard_normal((H, T, d))
    state.append(K, V)
    K_hat, V_hat = state.reconstruct()
    lay = state.layout
    done = (T // G) * G
    worst_ratio = 0.0
    for h in range(H):
        B, E = basis.B[h], basis.E[h]
        proj_k = np.sum((K[h] - K[h] @ B.T @ B) ** 2, axis=1)
        proj_v = np.sum((V[h] - V[h] @ E.T @ E) ** 2, axis=1)
        sigma = np.zeros((T, B.shape[0]))
        sigma[:done] = np.repeat(lay.key_group_scale[0, h, : T // G].astype(np.float64), G, axis=0)
        tau = lay.value_token_scale[0, h, :T].astype(np.float64)
        err_k = np.sum((K[h] - K_hat[h]) ** 2, axis=1)
        err_v = np.sum((V[h] - V_hat[h]) ** 2, axis=1)
        bound_k = proj_k + np.sum(sigma**2, axis=1) / 4
        bound_v = proj_v + E.shape[0] * tau**2 / 4
        assert (err_k <= bound_k * (1 + 1e-9)).all() and (err_v <= bound_v * (1 + 1e-9)).all()  # Q4.1, Q4.2
        quant = err_k[:done] - proj_k[:done]
        worst_ratio = max(worst_ratio, float(np.max(quant / (np.sum(sigma[:done] ** 2, axis=1) / 4))))
        np.testing.assert_allclose(err_k[done:], proj_k[done:], rtol=1e-9, atol=1e-12)  # the tail is exact
        for _ in range(5):  # Q4.3
            q = rng.standard_normal(d) * 3
            s = 1 / np.sqrt(d)
            delta_q = s * np.linalg.norm(q) * np.sqrt(bound_k.max())
            bound_o = 2 * np.tanh(delta_q / 2) * np.linalg.norm(V[h], axis=1).max() + np.sqrt(bound_v.max())
            err_o = np.linalg.norm(exact_attention(q[None], K[h][None], V[h][None]) - exact_attention(q[None], K_hat[h][None], V_hat[h][None]))
            assert err_o <= bound_o
    assert worst_ratio > 1 / 3  # Q4.1's quantisation term is approached on some token


def test_a_flipped_byte_in_a_low_bit_tensor_fails_the_checksum(tmp_path):
    from subspace_ref.persistence import LOW_BIT_TENSORS, StateFileError

    rng = np.random.default_rng(12)
    state, _ = _states(rng, "int2", "adaptive")
    state.append(rng.standard_normal((2, 21, 16)), rng.standard_normal((2, 21, 16)))
    path = tmp_path / "s"
    state.save(path)
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:start])
    assert set(LOW_BIT_TENSORS) <= set(header)
    for name in LOW_BIT_TENSORS + ("key_coef", "value_coef"):
        a, _ = header[name]["data_offsets"]
        corrupt = bytearray(data)
        corrupt[start + a] ^= 0xFF
        (tmp_path / "bad").write_bytes(bytes(corrupt))
        with pytest.raises(StateFileError, match="checksum"):
            sr.SubspaceState.load(tmp_path / "bad")
