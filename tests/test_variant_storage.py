"""spec/storage.md: bases stored as native, float16, float8_e4m3 or int8 (seed 001 §10)."""


import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.basis_storage import FORMATS, decode, encode, float8_dtype
from subspace_ref.calibration import StaticBasis
from subspace_ref.exact import exact_attention

from conftest import low_rank_stream, random_orthonormal

H, D, DV, R = 2, 8, 6, 3
STORED = {"native": np.float64, "float16": np.float16, "float8_e4m3": None, "int8": np.int8}


def make(kind, fmt, rng, dtype=np.float64, coefficients="float"):
    if kind == "static":
        basis = StaticBasis.from_bases(random_orthonormal(rng, H, r=R, d=D), random_orthonormal(rng, H, r=R, d=DV))
        return sr.SubspaceState.static(basis, dtype=dtype, coefficients=coefficients, bases=fmt)
    if kind == "adaptive":
        return sr.SubspaceState.adaptive(H, D, DV, rank_k=R, rank_v=R, tau_k=0.3, tau_v=0.3, max_chunk=7, dtype=dtype, coefficients=coefficients, bases=fmt)
    return sr.SubspaceState.rotating(H, D, DV, rank_k=R, rank_v=R, refresh_every=5, dtype=dtype, coefficients=coefficients, bases=fmt)


def stream(rng, T=40):
    return low_rank_stream(rng, H, T, D, 4, noise=0.2), low_rank_stream(rng, H, T, DV, 4, noise=0.2)


def filled(kind, fmt, rng, **kw):
    K, V = stream(rng)
    state = make(kind, fmt, rng, **kw)
    state.append(K[:, :2], V[:, :2])  # through the warm-up token by token ...
    state.append(K[:, 2], V[:, 2])
    state.append(K[:, 3:], V[:, 3:])  # ... then a block
    return state, K, V


def test_encode_decode_bounds(rng):
    """S2: float16/float8 round to nearest (relative error <= 2^-11 / 2^-4 of each entry, float8
    subnormals below 2^-9 absolute), int8 within s/2 per entry with s = max|row| / 127."""
    x = random_orthonormal(rng, 5, r=4, d=16)
    for fmt, bound in (("float16", lambda x: 2.0**-11 * np.abs(x)), ("float8_e4m3", lambda x: np.maximum(2.0**-4 * np.abs(x), 2.0**-10))):
        stored, scale = encode(x, fmt, np.float64)
        assert scale is None
        err = np.abs(decode(stored, scale, np.float64) - x)
        assert np.all(err <= bound(x) * (1 + 1e-9)) and err.max() > 0
    q, s = encode(x, "int8", np.float64)
    assert q.dtype == np.int8 and s.shape == (5, 4) and s.dtype == np.float32
    assert np.all(np.abs(decode(q, s, np.float64) - x) <= s[..., None] / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(encode(x, "native", np.float32)[0], x.astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_attention_is_exact_over_the_reconstruction(rng, kind, fmt):
    """S3.1: stored really encoded, and the state's attention equals exact attention over its
    own reconstruction from the decoded bases (float64)."""
    state, K, V = filled(kind, fmt, rng)
    lay = state.layout
    want = float8_dtype() if fmt == "float8_e4m3" else np.dtype(STORED[fmt])
    assert lay.key_bases.dtype == want and lay.value_bases.dtype == want and state.dtype == np.float64
    assert (lay.key_basis_scale is not None) == (fmt == "int8")
    K_hat, V_hat = state.reconstruct()
    q = rng.standard_normal((2 * H, D))
    np.testing.assert_allclose(sr.attend(q, state), exact_attention(q, K_hat, V_hat), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fmt", ["float16", "float8_e4m3", "int8"])
def test_coefficients_use_the_decoded_stored_basis(rng, fmt):
    """S3.2: every token's coefficients are decode(B_j) k_t for its chunk j (adaptive, warm-up,
    triggers, sketch resets), not the unencoded snapshot: float8 rounding is far above 1e-12."""
    K, V = stream(rng, 60)
    state = sr.SubspaceState.adaptive(H, D, DV, rank_k=R, rank_v=R, tau_k=0.3, tau_v=0.3, max_chunk=9, sketch_reset=True, bases=fmt, track=False)  # warm-up rows, no growth
    state.append(K, V)
    lay = state.layout
    assert state.num_chunks.min() > 3
    for h in range(H):
        for j, (a, b) in enumerate(state.chunk_bounds(h)):
            B = lay.basis("key", (0, h, j), np.float64)
            E = lay.basis("value", (0, h, j), np.float64)
            want_k, want_v = K[h, a:b] @ B.T, V[h, a:b] @ E.T
            if j == 0:  # warm-up token t (t < W = R) saw only rows 0..t of chunk 0 (spec A7 step 0)
                rows = np.arange(R)[None, :] <= np.arange(a, b)[:, None]
                want_k, want_v = want_k * rows, want_v * rows
            np.testing.assert_allclose(lay.key_coef[0, h, a:b], want_k, rtol=0, atol=1e-12)
            np.testing.assert_allclose(lay.value_coef[0, h, a:b], want_v, rtol=0, atol=1e-12)
    # the decoded bases are not orthonormal to 1e-12: the encoding is really lossy
    B0 = lay.basis("key", (0, 0, 1), np.float64)
    assert np.abs(B0 @ B0.T - np.eye(R)).max() > 1e-6


def test_native_is_the_state_it_was(rng):
    """S3.2: bases="native" (the constructors' default) stores the dtype itself."""
    a, K, V = filled("adaptive", "native", np.random.default_rng(5))
    b = sr.SubspaceState.adaptive(H, D, DV, rank_k=R, rank_v=R, tau_k=0.3, tau_v=0.3, max_chunk=7)
    b.append(K[:, :2], V[:, :2])
    b.append(K[:, 2], V[:, 2])
    b.append(K[:, 3:], V[:, 3:])
    assert b.basis_format == "native" and b.layout.key_basis_scale is None
    for name, x in a.layout.live_arrays().items():
        np.testing.assert_array_equal(x, b.layout.live_arrays()[name])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["static", "adaptive"])
def test_bytes_by_hand_count(rng, kind, fmt):
    """S4: basis bytes in the stored format plus int8 row scales; coefficients unchanged."""
    state, K, V = filled(kind, fmt, rng, dtype=np.float32, coefficients="int8")
    T, J = state.num_tokens, int(state.num_chunks.sum())
    entry = {"native": 4, "float16": 2, "float8_e4m3": 1, "int8": 1}[fmt]
    scales = 4 * (R + R) if fmt == "int8" else 0
    bases = J * ((R * D + R * DV) * entry + scales) + H * 4
    assert state.basis_nbytes == bases
    per_token = H * ((R + R) * 1 + 2 * 4)  # int8 coefficients + two float32 scales per token and head
    sketches = 0 if kind == "static" else H * (2 * 2 * R * D + 2 * 2 * R * DV) * 4
    offsets = 0 if kind == "static" else J * 8
    assert state.nbytes == T * per_token + bases + sketches + offsets


def test_bad_format_names_the_argument(rng):
    with pytest.raises(ValueError, match="bases must be one of"):
        make("static", "bfloat16", rng)
    with pytest.raises(ValueError, match="bases must be one of"):
        sr.SubspaceState.adaptive(H, D, rank_k=2, rank_v=2, bases=None)


@pytest.mark.parametrize("fmt", ["float8_e4m3", "int8"])
def test_failing_append_leaves_an_encoded_state_unchanged(rng, fmt):
    for kind in ("adaptive", "rotating"):
        state, K, V = filled(kind, fmt, rng)
        before = {k: np.array(v, copy=True) for k, v in state.layout.live_arrays().items()}
        bad = rng.standard_normal((H, 3, D))
        bad[1, 2, 0] = np.nan
        with pytest.raises(ValueError, match="keys"):
            state.append(bad, rng.standard_normal((H, 3, DV)))
        after = state.layout.live_arrays()
        assert set(after) == set(before)
        for name, x in before.items():
            assert after[name].tobytes() == x.tobytes(), name


@pytest.mark.parametrize("fmt", ["float16", "float8_e4m3", "int8"])
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_persistence_round_trip(tmp_path, rng, kind, fmt):
    """S5: encoded bases and their scales round-trip bit-exactly (version 2) and appending
    continues identically."""
    import json

    from subspace_ref.persistence import StateFileError

    state, K, V = filled(kind, fmt, rng)
    path = tmp_path / "s.safetensors"
    state.save(path)
    loaded = sr.SubspaceState.load(path)
    assert loaded.basis_format == fmt
    for name, x in state.layout.live_arrays().items():
        y = loaded.layout.live_arrays()[name]
        assert y.dtype == x.dtype and y.tobytes() == x.tobytes(), name
    more_k, more_v = stream(rng, 9)
    state.append(more_k, more_v)
    loaded.append(more_k, more_v)
    q = rng.standard_normal((H, D))
    assert sr.attend(q, state).tobytes() == sr.attend(q, loaded).tobytes()
    # the header says version 2 and names the format; a wrong format is refused clearly
    from test_persistence import edited

    bad = edited(tmp_path, path, state=lambda h: h.update(bases="int4"))
    with pytest.raises(StateFileError, match="bases is 'int4'"):
        sr.SubspaceState.load(bad)
    raw = path.read_bytes()
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert meta["format_version"] == "2"


def test_native_files_stay_version_1(tmp_path, rng):
    import json

    state, _, _ = filled("static", "native", rng)
    state.save(tmp_path / "s.safetensors")
    raw = (tmp_path / "s.safetensors").read_bytes()
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert meta["format_version"] == "1" and "bases" not in json.loads(meta["state"])


# ------------------------------------------------------------------------------ torch backend
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_torch_backend_agrees_with_the_oracle(rng, kind, fmt):
    """S7: the torch backend decodes the same stored bases: appends give the same stored arrays
    and attention the same output (float64)."""
    K, V = stream(rng)
    oracle = make(kind, fmt, np.random.default_rng(7))
    t = make(kind, fmt, np.random.default_rng(7)).to("torch")
    for a, b in ((0, 2), (2, 3), (3, K.shape[1])):  # warm-up token by token, then a block
        oracle.append(K[:, a:b], V[:, a:b])
        t.append(torch.from_numpy(K[:, a:b]), torch.from_numpy(V[:, a:b]))
    np.testing.assert_array_equal(t.num_chunks, oracle.num_chunks)
    assert (
        str(t.layout.key_bases.dtype)
        .removeprefix("torch.")
        .startswith({"native": "float64", "float16": "float16", "float8_e4m3": "float8", "int8": "int8"}[fmt])
    )
    back = t.to("numpy")
    np.testing.assert_allclose(back.reconstruct()[0], oracle.reconstruct()[0], rtol=0, atol=1e-12)
    q = rng.standard_normal((2 * H, D))
    np.testing.assert_allclose(sr.attend(torch.from_numpy(q), t, backend="torch").numpy(), sr.attend(q, oracle), rtol=0, atol=1e-12)
    # converted without appending: the encoded arrays travel unchanged, both ways
    moved = oracle.to("torch", dtype=torch.float32).to("numpy")
    assert moved.dtype == np.float32 and moved.basis_format == fmt
    if fmt != "native":  # native bases follow the dtype; encoded ones keep their bytes
        live, moved_live = oracle.layout.live_arrays(), moved.layout.live_arrays()
        for name in ("key_bases", "value_bases", "key_basis_scale", "value_basis_scale"):
            assert (name in live) == (name in moved_live) == (fmt == "int8" or "scale" not in name)
            if name in live:
                assert live[name].dtype == moved_live[name].dtype and live[name].tobytes() == moved_live[name].tobytes(), name


def test_hf_factories_default_to_float16_bases_below_float64(rng):
    """S6: the factories store float16 bases for float32 states, native for float64 ones."""
    from subspace_ref.hf.state_factories import StateSpec, adaptive_states, static_states

    basis = StaticBasis.from_bases(random_orthonormal(rng, H, r=R, d=D), random_orthonormal(rng, H, r=R, d=DV))
    spec32 = StateSpec(0, 1, H, D, DV, torch.float32, torch.device("cpu"))
    spec64 = StateSpec(0, 1, H, D, DV, torch.float64, torch.device("cpu"))
    assert static_states([basis])(spec32).basis_format == "float16"
    assert static_states([basis])(spec64).basis_format == "native"
    assert static_states([basis], basis_format="int8")(spec32).basis_format == "int8"
    assert adaptive_states(rank_k=2, rank_v=2)(spec32).layout.key_bases.dtype == np.float16
    assert adaptive_states(rank_k=2, rank_v=2, basis_format="native")(spec32).layout.key_bases.dtype == np.float32


def test_storage_rows_run_on_the_tiny_profile(tiny_calibration):
    """The variant rows build and one scores (tiny profile)."""
    from subspace_ref.lab.experiments.ppl import score
    from subspace_ref.lab.experiments.variant_rows import storage

    ctx, record, svd = tiny_calibration
    rows = storage.variants(ctx, record, svd)
    names = [v.name for v in rows]
    assert len(names) == len(set(names)) and {v.group for v in rows} == {"storage"}
    assert any("int8 coefficients" in n for n in names)
    v = next(v for v in rows if v.extra.get("bases") == "float8_e4m3" and v.plain == "adaptive")
    result = score(ctx.model, ctx.eval_windows(), v.factory, backend=v.backend)
    assert np.isfinite(result["nll"]).all() and result["bytes_per_token"] > 0


@pytest.mark.parametrize("fmt", ["float16", "float8_e4m3", "int8"])
def test_warmup_of_repeated_tokens_adds_no_noise_rows(fmt):
    """Found on the shipped model (layer 0 values repeat exactly for a repeated byte): the
    residual of a token already in the span of *stored* warm-up rows is their storage error; the
    warm-up must treat it as zero (spec/storage.md S2.1) instead of normalising it into a new row.
    Before the fix, int8 bases got two nearly parallel rows (Gram off-diagonal 1.0) and a
    reconstruction error of 586% on the warm-up chunk."""
    from subspace_ref.basis_storage import row_error_bound

    rng = np.random.default_rng(11)
    d, r = 32, 16
    base = rng.standard_normal((4, d))
    seq = base[rng.integers(0, 4, size=24)]  # 24 tokens, 4 distinct
    K = seq[None].astype(np.float32)
    st = sr.SubspaceState.adaptive(1, d, rank_k=r, rank_v=r, tau_k=0.5, tau_v=0.5, max_chunk=64, bases=fmt, dtype=np.float32)
    st.append(K, K)
    E = st.layout.basis("key", (0, 0, 0), np.float64)
    nonzero = np.linalg.norm(E, axis=1) > 0.5
    assert nonzero.sum() == 4  # one row per distinct token, zero rows for the repeats
    G = E[nonzero] @ E[nonzero].T
    delta = row_error_bound(fmt, d)
    assert np.abs(G - np.eye(4)).max() < 4 * delta
    Kh, _ = st.reconstruct()
    assert np.linalg.norm(Kh - K) / np.linalg.norm(K) < 4 * delta
