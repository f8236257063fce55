"""Torch-specific behaviour of the torch backend: conversion, devices, dtypes, refusals, commit
discipline, tiling. Agreement with the oracle is the differential harness's job
(tests/differential)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.arrays import to_numpy

torch = pytest.importorskip("torch")

from subspace_ref_torch import append as tappend  # noqa: E402
from subspace_ref_torch import attend as tattend  # noqa: E402
from subspace_ref_torch import fd as tfd  # noqa: E402
from subspace_ref_torch import maps as tmaps  # noqa: E402
from subspace_ref_torch import plan as tplan  # noqa: E402
from subspace_ref_torch.convert import as_torch_dtype  # noqa: E402

from conftest import low_rank_stream, random_orthonormal  # noqa: E402

BACKEND = sr.get_backend("torch")


def _static(rng, H=2, d=16, d_v=12, r=4, r_v=3, T=30, batch=None):
    B = random_orthonormal(rng, H, r=r, d=d)
    E = random_orthonormal(rng, H, r=r_v, d=d_v)
    state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, gamma=0.9), batch=batch)
    lead = (H,) if batch is None else (batch, H)
    state.append(rng.standard_normal(lead + (T, d)), rng.standard_normal(lead + (T, d_v)))
    return state


def _adaptive(rng, H=2, d=16, d_v=12, T=120, **kw):
    kw = {"rank_k": 4, "rank_v": 3, "tau_k": 0.6, "tau_v": 0.6, "max_chunk": 16, **kw}
    state = sr.SubspaceState.adaptive(H, d, d_v, **kw)
    state.append(rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d_v)))
    return state


def _snapshot(state):
    lay = state.layout
    arrays = {k: to_numpy(v).copy() for k, v in lay.arrays().items()}
    sk = state.sketches
    extra = None if sk is None else (to_numpy(sk.keys).copy(), to_numpy(sk.values).copy(), sk.filled_k, sk.filled_v, sk.rows_seen)
    return lay.num_tokens, arrays, extra


def _assert_same_snapshot(a, b):
    assert a[0] == b[0]
    T = a[0]
    for name in a[1]:
        x, y = a[1][name], b[1][name]
        if name in ("key_coef", "value_coef"):
            x, y = x[:, :, :T], y[:, :, :T]
        if name in ("key_bases", "value_bases", "chunk_starts"):
            J = int(a[1]["num_chunks"].max())
            x, y = x[:, :, :J], y[:, :, :J]
        np.testing.assert_array_equal(x, y, err_msg=name)
    if a[2] is not None:
        for x, y in zip(a[2], b[2]):
            np.testing.assert_array_equal(x, y)


# ----------------------------------------------------------------------------- the protocol
def test_declares_itself():
    assert isinstance(BACKEND, sr.Backend)
    assert (BACKEND.name, BACKEND.array_family) == ("torch", "torch")
    assert BACKEND.devices == ("cpu", "cuda")
    assert set(BACKEND.dtypes) == {"float16", "bfloat16", "float32", "float64"}
    assert BACKEND.availability()


def test_import_does_not_import_torch_and_reports_missing_torch():
    code = (
        "import sys; sys.modules['torch'] = None\nimport subspace_ref_torch\na = subspace_ref_torch.TorchBackend().availability()\nprint(bool(a), a.reason)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False") and "torch is not installed" in out


# ----------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("spelling", ["float16", np.float16, np.dtype("float16"), torch.float16, "torch.float16"])
def test_dtype_spellings(spelling):
    assert as_torch_dtype(spelling) is torch.float16
    x = BACKEND.converter(dtype=spelling)(np.ones(3))
    assert x.dtype == torch.float16


def test_converter_casts_floats_and_keeps_integer_dtypes():
    convert = BACKEND.converter(device="cpu", dtype="bfloat16")
    f = convert(np.arange(4.0))
    i64 = convert(np.arange(4, dtype=np.int64))
    i8 = convert(np.arange(4, dtype=np.int8))  # int8 coefficients of spec A10
    assert f.dtype == torch.bfloat16 and f.device.type == "cpu"
    assert i64.dtype == torch.int64 and i64.tolist() == [0, 1, 2, 3]
    assert i8.dtype == torch.int8
    t = convert(torch.ones(2, dtype=torch.float64))
    assert t.dtype == torch.bfloat16
    assert BACKEND.converter()(np.ones(2, dtype=np.float32)).dtype == torch.float32  # no dtype: kept


def test_int8_state_keeps_int8_coefficients_and_float32_scales(rng):
    state = sr.SubspaceState.rotating(2, 16, 12, rank_k=4, rank_v=3, refresh_every=8, coefficients="int8")
    state.append(rng.standard_normal((2, 20, 16)), rng.standard_normal((2, 20, 12)))
    ts = state.to("torch", dtype="float16")
    lay = ts.layout
    assert lay.key_coef.dtype == torch.int8 and lay.key_scale.dtype == torch.float32
    assert lay.key_bases.dtype == torch.float16 and ts.dtype == torch.float16
    ts.append(torch.randn(2, 5, 16, dtype=torch.float16), torch.randn(2, 5, 12, dtype=torch.float16))
    assert ts.layout.key_coef.dtype == torch.int8 and ts.num_tokens == 25
    out = sr.attend(torch.randn(4, 16, dtype=torch.float16), ts, backend="torch")
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_converter_copies_host_arrays():
    a = np.zeros(3)
    t = BACKEND.converter()(a)
    a[0] = 5.0
    assert t[0].item() == 0.0


def test_converter_rejects_bad_dtype_and_device():
    with pytest.raises(TypeError, match="dtype must be one of"):
        BACKEND.converter(dtype="int8")
    with pytest.raises(ValueError, match="device must be"):
        BACKEND.converter(device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            BACKEND.converter(device="cuda")


@pytest.mark.parametrize("kind", ["static", "adaptive"])
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_state_to_torch_and_back(rng, kind, dtype):
    state = _static(rng) if kind == "static" else _adaptive(rng)
    ts = state.to("torch", device="cpu", dtype=dtype)
    assert ts.engine == "torch"
    for name, x in ts.layout.arrays().items():
        assert isinstance(x, torch.Tensor) and x.device.type == "cpu"
        expected = torch.int64 if name in ("chunk_starts", "num_chunks") else as_torch_dtype(dtype)
        assert x.dtype == expected, name
    back = ts.to("numpy", dtype=np.float64)
    K0, V0 = state.reconstruct()
    K1, V1 = back.reconstruct()
    tol = {"float64": 0.0, "float32": 1e-6, "float16": 1e-2, "bfloat16": 5e-2}[dtype]
    assert np.abs(K1 - K0).max() <= tol * np.abs(K0).max()
    assert np.array_equal(back.num_chunks, state.num_chunks)
    if dtype == "float64":
        _assert_same_snapshot(_snapshot(back), _snapshot(state))


# ----------------------------------------------------------------------------- attend: dtypes, devices, refusals
@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("sdtype", ["float16", "float32", "float64"])
def test_output_has_q_dtype_and_device(rng, qdtype, sdtype):
    state = _adaptive(rng).to("torch", dtype=sdtype)
    q = torch.from_numpy(rng.standard_normal((4, 16))).to(qdtype)
    out = sr.attend(q, state, backend="torch")
    assert out.dtype == qdtype and out.device == q.device and out.shape == (4, 12)
    assert torch.isfinite(out).all()


def test_unbatched_and_batched_shapes(rng):
    s1 = _static(rng).to("torch")
    assert sr.attend(torch.randn(2, 16, dtype=torch.float64), s1, backend="torch").shape == (2, 12)
    s2 = _static(rng, batch=3).to("torch")
    assert sr.attend(torch.randn(3, 8, 16, dtype=torch.float64), s2, backend="torch").shape == (3, 8, 12)


def test_refusals_are_all_listed(rng):
    state = _static(rng)
    q_np = rng.standard_normal((1, 2, 16))
    reasons = BACKEND.not_supported_reasons(q_np, state)
    assert len(reasons) == 2
    assert "takes torch tensors" in reasons[0]
    assert "state.to('torch', device=...)" in reasons[1]
    ts = state.to("torch")
    assert BACKEND.not_supported_reasons(torch.zeros(1, 2, 16, dtype=torch.float64), ts) == []
    meta = torch.zeros(1, 2, 16, device="meta")
    assert any("q is on meta but the state is on cpu" in r for r in BACKEND.not_supported_reasons(meta, ts))
    assert any("dtype torch.int32" in r for r in BACKEND.not_supported_reasons(torch.zeros(1, 2, 16, dtype=torch.int32), ts))
    with pytest.raises(ValueError, match="does not support this call: .*state.to\\('torch'"):
        sr.attend(torch.zeros(2, 16, dtype=torch.float64), state, backend="torch")


def test_appending_numpy_to_a_torch_state_is_refused(rng):
    ts = _static(rng).to("torch")
    before = _snapshot(ts)
    with pytest.raises(TypeError, match="numpy array but the state holds torch"):
        ts.append(rng.standard_normal((2, 16)), rng.standard_normal((2, 12)))
    _assert_same_snapshot(_snapshot(ts), before)


def test_huge_logits_stay_finite(rng):
    ts = _adaptive(rng).to("torch", dtype="float32")
    q = torch.randn(4, 16) * 1e5
    out = sr.attend(q, ts, backend="torch")
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- attend pieces
def test_token_chunk_index_matches_chunk_bounds(rng):
    state = _adaptive(rng, T=200)
    ts = state.to("torch")
    J = tattend.used_chunks(ts)
    assert J == int(state.num_chunks.max()) > 1
    index = tattend.token_chunk_index(ts, J)[0]
    for h in range(state.heads):
        expected = np.concatenate([np.full(b - a, j) for j, (a, b) in enumerate(state.chunk_bounds(h))])
        np.testing.assert_array_equal(index[h].numpy(), expected)


def test_project_queries_is_scaled_basis_times_query(rng):
    ts = _adaptive(rng).to("torch")
    q = torch.randn(1, 4, 16, dtype=torch.float64)
    J = tattend.used_chunks(ts)
    qp = tattend.project_queries(q, ts, 0.3, J)
    assert qp.shape == (1, 2, J, 2, 4)
    B = ts.layout.key_bases[0, 1, J - 1]
    expected = ts.layout.gamma[1] * 0.3 * (B @ q[0, 3])
    torch.testing.assert_close(qp[0, 1, J - 1, 1], expected)


@pytest.mark.parametrize("make", [_static, _adaptive])
def test_tiling_does_not_change_the_result(rng, monkeypatch, make):
    ts = make(rng).to("torch")
    q = torch.randn(4, 16, dtype=torch.float64)
    whole = sr.attend(q, ts, backend="torch")
    monkeypatch.setattr(tattend, "TILE_ELEMENTS", 64)
    monkeypatch.setattr(tmaps, "VALUE_TILE", 7)
    tiled = sr.attend(q, ts, backend="torch")
    torch.testing.assert_close(tiled, whole, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- append
@pytest.mark.parametrize("window", [(1, 1, 1), (1024, 1024, 1024), (3, 2, 5)])
def test_window_size_does_not_change_the_state(rng, monkeypatch, window):
    K, V = rng.standard_normal((2, 150, 16)), rng.standard_normal((2, 150, 12))
    ref = sr.SubspaceState.adaptive(2, 16, 12, rank_k=4, rank_v=3, tau_k=0.7, tau_v=0.7, max_chunk=16).to("torch")
    ref.append(torch.from_numpy(K), torch.from_numpy(V))
    first, lo, hi = window
    monkeypatch.setattr(tappend, "FIRST_WINDOW", first)
    monkeypatch.setattr(tappend, "MIN_WINDOW", lo)
    monkeypatch.setattr(tappend, "MAX_WINDOW", hi)
    got = sr.SubspaceState.adaptive(2, 16, 12, rank_k=4, rank_v=3, tau_k=0.7, tau_v=0.7, max_chunk=16).to("torch")
    got.append(torch.from_numpy(K), torch.from_numpy(V))
    assert np.array_equal(got.num_chunks, ref.num_chunks)
    np.testing.assert_allclose(got.reconstruct()[0], ref.reconstruct()[0], atol=1e-12)


@pytest.mark.parametrize("kind", ["adaptive", "rotating"])
def test_failing_append_changes_nothing(rng, monkeypatch, kind):
    if kind == "adaptive":
        ts = _adaptive(rng, T=40).to("torch")
    else:
        ts = sr.SubspaceState.rotating(2, 16, 12, rank_k=4, rank_v=3, refresh_every=8)
        ts.append(rng.standard_normal((2, 20, 16)), rng.standard_normal((2, 20, 12)))
        ts = ts.to("torch")
    before = _snapshot(ts)
    calls = {"n": 0}
    real = tfd.top_directions

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(tfd, "top_directions", flaky)
    K, V = torch.from_numpy(rng.standard_normal((2, 60, 16))), torch.from_numpy(rng.standard_normal((2, 60, 12)))
    with pytest.raises(RuntimeError, match="injected failure"):
        ts.append(K, V)
    _assert_same_snapshot(_snapshot(ts), before)
    monkeypatch.setattr(tfd, "top_directions", real)
    ts.append(K, V)  # and the state still works
    assert ts.num_tokens == before[0] + 60


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_online_append(rng, dtype):
    K = low_rank_stream(rng, 2, 80, 16, 3, noise=0.01)
    V = low_rank_stream(rng, 2, 80, 12, 3, noise=0.01)
    ref = sr.SubspaceState.rotating(2, 16, 12, rank_k=4, rank_v=4, refresh_every=16)
    ts = ref.to("torch", dtype=dtype)
    ref.append(K, V)
    ts.append(torch.from_numpy(K).to(as_torch_dtype(dtype)), torch.from_numpy(V).to(as_torch_dtype(dtype)))
    assert ts.layout.key_coef.dtype == as_torch_dtype(dtype) and ts.sketches.keys.dtype == as_torch_dtype(dtype)
    K_ref, _ = ref.reconstruct()
    K_got, _ = ts.reconstruct()
    rel = np.abs(K_got - K_ref).max() / np.abs(K_ref).max()
    assert rel < {"float16": 2e-2, "bfloat16": 1e-1}[dtype]


def test_static_append_is_one_block_and_in_place_past_live_rows(rng):
    ts = _static(rng, T=5).to("torch")
    ts.append(torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 3, 12, dtype=torch.float64))
    assert ts.num_tokens == 8
    K, _ = ts.reconstruct()
    assert K.shape == (2, 8, 16)


def test_fd_helpers_match_the_oracle(rng):
    from subspace_ref import frequent_directions as fd

    buf = rng.standard_normal((3, 10, 6))
    buf[1, 4:] = 0.0  # a rank-deficient stack: zero rows for zero singular values
    np.testing.assert_allclose(tfd.top_directions(torch.from_numpy(buf), 5).numpy(), fd.top_directions(buf, 5), atol=1e-12)
    for ell in (3, 8):  # ell > d takes the no-shrink branch
        a = tfd.compact(torch.from_numpy(buf), ell).numpy()
        b = fd.compact(buf, ell)
        np.testing.assert_allclose(np.swapaxes(a, -1, -2) @ a, np.swapaxes(b, -1, -2) @ b, atol=1e-10)


# ------------------------------------------------------------------ by hand, without the harness
def _attention_by_hand(q, state, scale=None):
    """softmax(gamma_h * scale * K_hat_h q) V_hat_h per query head, in float64 from the state's
    reconstruction (spec A2; exact window tokens with gamma = 1, spec/window.md W3): nothing of
    the backend's code path is shared."""
    K, V = state.reconstruct()
    gamma = to_numpy(state.layout.gamma).astype(np.float64)
    s = 1 / np.sqrt(state.d) if scale is None else scale
    g = q.shape[0] // state.heads
    out = np.zeros((q.shape[0], state.d_v))
    for i in range(q.shape[0]):
        h = i // g
        g_t = np.where(np.arange(K.shape[1]) < state.layout.num_tokens, gamma[h], 1.0)
        logits = g_t * s * (K[h] @ q[i])
        w = np.exp(logits - logits.max())
        out[i] = (w / w.sum()) @ V[h]
    return out


@pytest.mark.parametrize("kind", ["static", "adaptive", "windowed"])
def test_attend_applies_gamma_once_with_d_unlike_d_v(rng, kind):
    """gamma differs per head and from 1, d = 16 != d_v = 12: a doubled (or missing) gamma, or
    a scale taken from d_v, changes the result far beyond float64 rounding."""
    H, d, d_v = 2, 16, 12
    if kind == "adaptive":
        state = sr.SubspaceState.adaptive(H, d, d_v, rank_k=4, rank_v=3, tau_k=0.6, tau_v=0.6, max_chunk=16, gamma=np.array([0.4, 2.5]))
    else:
        B, E = random_orthonormal(rng, H, r=4, d=d), random_orthonormal(rng, H, r=3, d=d_v)
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(B, E, gamma=[0.4, 2.5]), window=5 if kind == "windowed" else 0)
    state.append(3 * rng.standard_normal((H, 60, d)), rng.standard_normal((H, 60, d_v)))
    assert len(set(to_numpy(state.layout.gamma).tolist())) == 2 and state.num_chunks.max() >= (3 if kind == "adaptive" else 1)
    q = 2 * rng.standard_normal((2 * H, d))
    want = _attention_by_hand(q, state)
    got = sr.attend(torch.from_numpy(q), state.to("torch"), backend="torch").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_online_bases_are_sign_fixed(rng):
    """Spec A4: every basis row an online append stores has its largest-magnitude entry positive
    (an SVD's signs are arbitrary; the oracle's convention makes the bases deterministic)."""
    state = sr.SubspaceState.adaptive(3, 16, 12, rank_k=4, rank_v=3, tau_k=0.6, tau_v=0.6, max_chunk=8, warmup=0).to("torch")
    state.append(torch.randn(3, 80, 16, dtype=torch.float64), torch.randn(3, 80, 12, dtype=torch.float64))
    lay = state.layout
    rows = 0
    for which in ("key", "value"):
        bases = to_numpy(getattr(lay, f"{which}_bases"))
        for h in range(3):
            for j in range(int(to_numpy(lay.num_chunks)[0, h])):
                for row in bases[0, h, j]:
                    if np.abs(row).max() > 0:
                        rows += 1
                        assert row[np.argmax(np.abs(row))] > 0
    assert rows > 100  # enough rows that unfixed SVD signs (each negative half the time) would show
    directions = tfd.top_directions(torch.randn(5, 6, 16, dtype=torch.float64), 4)
    pivots = torch.gather(directions, -1, directions.abs().argmax(-1, keepdim=True))
    assert (pivots > 0).all()


def test_decoded_bases_are_cached_until_the_bases_change(rng):
    state = _adaptive(rng, bases="int8").to("torch", dtype=torch.float32)
    lay = state.layout
    first = lay.decoded_bases("key", torch.float32)
    assert lay.decoded_bases("key", torch.float32) is first
    torch.testing.assert_close(first, lay.basis("key", (slice(None),) * 3, torch.float32), rtol=0, atol=0)
    lay.key_basis_scale[0, 0, 0, 0] *= 2  # an in-place write: the cache must see it
    again = lay.decoded_bases("key", torch.float32)
    assert again is not first and torch.equal(again, lay.basis("key", (slice(None),) * 3, torch.float32))


def test_one_chunk_path_rereads_bases_gamma_and_tokens_after_writes(rng):
    """The decode fast path (attend_one_chunk) derives its maps once; every in-place write to
    what they come from, and every appended token, must show in the next result (a stale
    cache fails here)."""
    state = _static(rng).to("torch", dtype=torch.float64)
    q = torch.from_numpy(rng.standard_normal((2, 16)))
    assert tplan.plan_attend(q, state).way is tplan.Way.ONE_CHUNK

    def oracle():
        return torch.from_numpy(sr.attend(to_numpy(q), state.to("numpy"), backend="numpy"))

    torch.testing.assert_close(sr.attend(q, state, backend="torch"), oracle())
    state.layout.gamma.mul_(1.7)
    torch.testing.assert_close(sr.attend(q, state, backend="torch"), oracle())
    state.layout.key_bases[0, 1, 0, 2] *= -1
    state.layout.value_bases[0, 0, 0, 1] *= 0.5
    torch.testing.assert_close(sr.attend(q, state, backend="torch"), oracle())
    state.append(torch.from_numpy(rng.standard_normal((2, 3, 16))), torch.from_numpy(rng.standard_normal((2, 3, 12))))
    torch.testing.assert_close(sr.attend(q, state, backend="torch"), oracle())
    torch.testing.assert_close(
        sr.attend(q, state, backend="torch", scale=0.3), torch.from_numpy(sr.attend(to_numpy(q), state.to("numpy"), backend="numpy", scale=0.3))
    )


def test_admitted_calls_are_remembered_only_after_every_check_passed(rng):
    """operations.attend checks a (backend, query kind) once per state; a refused call is not
    remembered, and another query kind is checked again."""
    state = _static(rng).to("torch", dtype=torch.float32)
    q = torch.randn(2, 16)
    sr.attend(q, state, backend="torch")
    assert len(state.admitted) == 1
    with pytest.raises(ValueError, match="q"):
        sr.attend(torch.randn(2, 15), state, backend="torch")
    with pytest.raises(ValueError, match="heads"):
        sr.attend(torch.randn(3, 16), state, backend="torch")
    assert len(state.admitted) == 1
    with pytest.raises(TypeError, match="q"):
        sr.attend(torch.randn(2, 16).to(torch.int32), state, backend="torch")
    sr.attend(q.double(), state, backend="torch")
    assert len(state.admitted) == 2
    assert not state.copy().admitted  # a copy starts unchecked
