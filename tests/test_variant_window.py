"""spec/window.md: an exact recent window, a length threshold, lookahead anchoring and sinks.

Statements W6.1-W6.9 and W7-W9 are cited per test."""

import math

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.policies import append_adaptive, append_rotating, append_static
from subspace_ref.arrays import to_numpy
from subspace_ref.exact import exact_attention
from subspace_ref.layout import live_arrays
from subspace_ref.window import compressed_count

from conftest import low_rank_stream

H, D, R = 2, 12, 3

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def stream(rng, T, noise=0.3):
    K = low_rank_stream(rng, H, T, D, 4, noise=noise)
    V = low_rank_stream(rng, H, T, D, 4, noise=noise)
    return K, V


def make(kind, K, V, **kw):
    if kind == "static":
        return sr.SubspaceState.static(sr.calibrate(K, V, rank_k=R, rank_v=R), **kw)
    if kind == "adaptive":
        return sr.SubspaceState.adaptive(H, D, rank_k=R, rank_v=R, tau_k=0.3, tau_v=0.3, max_chunk=16, **kw, **PAPER)
    return sr.SubspaceState.rotating(H, D, rank_k=R, rank_v=R, refresh_every=7, **kw)


def snapshot(state):
    """Everything a state holds, copied (layout live ranges, sketches, exact part)."""
    out = {name: to_numpy(x).copy() for name, x in live_arrays(state).items()}
    out["num_tokens"] = np.array(state.num_tokens)
    if state.sketches is not None:
        out["f"] = np.array([state.sketches.filled_k, state.sketches.filled_v])
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_compressed_count_partitions_and_is_monotone():
    """W1, W1.1: T_c = 0 below M, max(T - W, 0) after; non-decreasing."""
    for W in (0, 3, 10):
        for M in (0, 5, 20):
            counts = [compressed_count(T, W, M) for T in range(40)]
            assert all(a <= b for a, b in zip(counts, counts[1:]))
            assert counts[4] == (0 if 4 < M else max(4 - W, 0))
            assert all(0 <= c <= T for T, c in enumerate(counts))


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_window_covering_everything_is_exact_attention(rng, kind):
    """W6.1 (W3.2): window >= T, or T < min_tokens, gives exact attention (A1) to rounding."""
    T = 30
    K, V = stream(rng, T)
    q = rng.standard_normal((2 * H, D))
    ref = exact_attention(q, K, V)
    for kw in (dict(window=T), dict(window=T + 5), dict(min_tokens=T + 1), dict(window=4, min_tokens=T + 1)):
        state = make(kind, K, V, **kw)
        for t in range(T):  # one token at a time, as decoding
            state.append(K[:, t], V[:, t])
        assert state.layout.num_tokens == 0 and state.num_tokens == T
        np.testing.assert_allclose(sr.attend(q, state), ref, rtol=0, atol=1e-13)
    # and the threshold is not a no-op: at T = min_tokens everything but the window is compressed
    state = make(kind, K, V, window=4, min_tokens=T).append(K, V)
    assert state.layout.num_tokens == T - 4 and np.abs(sr.attend(q, state) - ref).max() > 1e-6


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_zero_window_is_the_plain_state_bit_for_bit(rng, kind):
    """W6.2: window = 0, min_tokens = 0 is the plain state."""
    K, V = stream(rng, 50)
    plain, zero = make(kind, K, V), make(kind, K, V, window=0, min_tokens=0)
    assert zero.window is None
    for t in range(0, 50, 7):
        plain.append(K[:, t : t + 7], V[:, t : t + 7])
        zero.append(K[:, t : t + 7], V[:, t : t + 7])
    assert_same(snapshot(plain), snapshot(zero))
    q = rng.standard_normal((H, D))
    np.testing.assert_array_equal(sr.attend(q, plain), sr.attend(q, zero))
    assert plain.nbytes == zero.nbytes


def test_static_window_is_projected_prefix_plus_exact_suffix(rng):
    """W6.4 (W3.3): attention over [gamma-scaled K B^T B, V E^T E of tokens < T-W] ∪ [exact last W]."""
    T, W = 40, 9
    K, V = stream(rng, T)
    basis = sr.calibrate(K, V, rank_k=R, rank_v=R, gamma=0.7)
    state = sr.SubspaceState.static(basis, window=W).append(K, V)
    assert state.layout.num_tokens == T - W and state.window.count == W
    q = rng.standard_normal((2 * H, D))
    Kp = np.einsum("htd,hrd,hre->hte", K, basis.B, basis.B) * np.asarray(basis.gamma).reshape(-1, 1, 1)
    Vp = np.einsum("htd,hrd,hre->hte", V, basis.E, basis.E)
    K_mix = np.concatenate([Kp[:, : T - W], K[:, T - W :]], axis=1)
    V_mix = np.concatenate([Vp[:, : T - W], V[:, T - W :]], axis=1)
    np.testing.assert_allclose(sr.attend(q, state), exact_attention(q, K_mix, V_mix), rtol=0, atol=1e-12)
    # the window does something: the plain state differs
    plain = sr.SubspaceState.static(basis).append(K, V)
    assert np.abs(sr.attend(q, plain) - sr.attend(q, state)).max() > 1e-4
    # reconstruct: the compressed part projected, the exact part as given
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_allclose(K_hat[:, : T - W], Kp[:, : T - W] / np.asarray(basis.gamma).reshape(-1, 1, 1), atol=1e-12)
    np.testing.assert_array_equal(K_hat[:, T - W :], K[:, T - W :])
    np.testing.assert_array_equal(V_hat[:, T - W :], V[:, T - W :])


@pytest.mark.parametrize("kind", ["adaptive", "rotating"])
def test_online_window_equals_plain_state_over_the_prefix_plus_exact_suffix(rng, kind):
    """W3.1 for online states: the compressed part is the plain state of tokens < T_c."""
    T, W, M = 60, 8, 20
    K, V = stream(rng, T)
    state = make(kind, K, V, window=W, min_tokens=M)
    for t in range(T):
        state.append(K[:, t], V[:, t])
    T_c = T - W
    plain = make(kind, K, V).append(K[:, :T_c], V[:, :T_c])
    np.testing.assert_array_equal(state.num_chunks, plain.num_chunks)
    K_hat, V_hat = plain.reconstruct()
    q = rng.standard_normal((H, D))
    K_mix = np.concatenate([K_hat, K[:, T_c:]], axis=1)
    V_mix = np.concatenate([V_hat, V[:, T_c:]], axis=1)
    np.testing.assert_allclose(sr.attend(q, state), exact_attention(q, K_mix, V_mix), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("static", dict(window=5, min_tokens=12)),
        ("adaptive", dict(window=8, lookahead=4)),
        ("adaptive", dict(window=6, min_tokens=25, lookahead=6)),
        ("rotating", dict(window=5)),
    ],
)
def test_block_equals_token_by_token(rng, kind, kw):
    """W6.5 (W2.1): blocks of any sizes give the state token-by-token appends give."""
    K, V = stream(rng, 70)
    one, blocks = make(kind, K, V, **kw), make(kind, K, V, **kw)
    for t in range(70):
        one.append(K[:, t], V[:, t])
    for a, b in ((0, 3), (3, 30), (30, 31), (31, 70)):
        blocks.append(K[:, a:b], V[:, a:b])
    a, b = snapshot(one), snapshot(blocks)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-12, err_msg=name)


def test_lookahead_zero_is_the_streaming_default_bit_for_bit(rng):
    """W6.3: lookahead = 0 with a window equals the default (no lookahead keyword)."""
    K, V = stream(rng, 80, noise=0.5)
    a = make("adaptive", K, V, window=10)
    b = make("adaptive", K, V, window=10, lookahead=0)
    for t in range(0, 80, 9):
        a.append(K[:, t : t + 9], V[:, t : t + 9])
        b.append(K[:, t : t + 9], V[:, t : t + 9])
    assert_same(snapshot(a), snapshot(b))
    assert a.num_chunks.max() > 2  # triggers fired, so the anchoring path ran


def test_lookahead_changes_the_bases_and_is_causal(rng):
    """W6.6 (W4.2): with lookahead the new bases differ from the streaming ones, and every
    output along the stream is the same whatever tokens follow (prefix stability)."""
    T, W, L = 90, 10, 5
    K, V = stream(rng, T, noise=0.5)
    K2, V2 = K.copy(), V.copy()
    K2[:, 50:] = rng.standard_normal(K2[:, 50:].shape) * 3  # a different continuation from token 50
    V2[:, 50:] = rng.standard_normal(V2[:, 50:].shape) * 3
    q = rng.standard_normal((T, H, D))
    outs = []
    for KK, VV in ((K, V), (K2, V2)):
        state = make("adaptive", KK, VV, window=W, lookahead=L)
        outs.append([sr.attend(q[t], state.append(KK[:, t], VV[:, t])) for t in range(T)])
    for t in range(50):  # outputs before the change agree exactly
        np.testing.assert_array_equal(outs[0][t], outs[1][t])
    assert np.abs(outs[0][60] - outs[1][60]).max() > 1e-3
    streaming = make("adaptive", K, V, window=W).append(K, V)
    ahead = make("adaptive", K, V, window=W, lookahead=L).append(K, V)
    assert streaming.num_chunks.max() > 2
    assert np.abs(ahead.layout.key_bases[0, 0, 1] - streaming.layout.key_bases[0, 0, 1]).max() > 1e-6


def test_lookahead_bases_by_hand(rng):
    """W4 steps 1-3 by hand: the first trigger's bases are the top directions of the rows
    before the firing token plus the L_h rows after it (sketch not yet compacted)."""
    T, W, L = 40, 8, 4
    K, V = stream(rng, T, noise=0.5)
    state = sr.SubspaceState.adaptive(H, D, rank_k=R, rank_v=R, ell_k=T, ell_v=T, tau_k=0.3, tau_v=0.3, window=W, lookahead=L, **PAPER)
    state.append(K, V)
    from subspace_ref import frequent_directions as fd

    for h in range(H):
        t = int(state.layout.chunk_starts[0, h, 1]) - 1  # the first firing token
        assert t + L < T
        rows = np.concatenate([K[h, :t], K[h, t + 1 : t + 1 + L]])
        np.testing.assert_allclose(state.layout.key_bases[0, h, 1], fd.top_directions(rows, R), atol=1e-10)


def test_nbytes_by_hand(rng):
    """W6.7 (W5): exact tokens cost N H e (d + d_v) itemsize on top of the compressed part."""
    T, W, M = 50, 7, 20
    d_v = 10
    K = rng.standard_normal((H, T, D))
    V = rng.standard_normal((H, T, d_v))
    basis = sr.calibrate(K, V, rank_k=R, rank_v=2)
    for n in (10, 19, 20, 50):
        state = sr.SubspaceState.static(basis, window=W, min_tokens=M, dtype=np.float32).append(K[:, :n], V[:, :n])
        T_c = 0 if n < M else n - W
        e = n - T_c
        coefficients = H * T_c * (R + 2) * 4  # float32 coefficients of the compressed tokens
        bases = H * ((R * D + 2 * d_v) * 4 + 4)  # per head: B (R x D), E (2 x d_v), gamma
        assert state.nbytes == coefficients + bases + H * e * (D + d_v) * 4
    adaptive = sr.SubspaceState.adaptive(H, D, d_v, rank_k=R, rank_v=2, window=W, **PAPER).append(K, V)
    plain = sr.SubspaceState.adaptive(H, D, d_v, rank_k=R, rank_v=2, **PAPER).append(K[:, : T - W], V[:, : T - W])
    assert adaptive.nbytes == plain.nbytes + H * W * (D + d_v) * 8


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(window=-1), ValueError, "window must be >= 0"),
        (dict(window=2.0), TypeError, "window must be an int"),
        (dict(window=True), TypeError, "window must be an int"),
        (dict(min_tokens=-3), ValueError, "min_tokens must be >= 0"),
        (dict(min_tokens="8"), TypeError, "min_tokens must be an int"),
        (dict(window=4, lookahead=5), ValueError, "lookahead must be <= window"),
        (dict(window=4, lookahead=-1), ValueError, "lookahead must be >= 0"),
    ],
)
def test_bad_options_are_named(rng, kw, err, match):
    """W6.8: bad options raise naming the argument."""
    K, V = stream(rng, 10)
    with pytest.raises(err, match=match):
        make("adaptive", K, V, **kw)
    if "lookahead" not in kw:
        with pytest.raises(err, match=match):
            make("static", K, V, **kw)
        with pytest.raises(err, match=match):
            make("rotating", K, V, **kw)


def test_lookahead_only_for_adaptive_states(rng):
    K, V = stream(rng, 10)
    for kind in ("static", "rotating"):
        with pytest.raises(TypeError, match="lookahead"):
            make(kind, K, V, window=4, lookahead=2)
    from subspace_ref.window import options

    with pytest.raises(ValueError, match="lookahead applies to adaptive states only"):
        options(4, 0, 2, "rotating")


@pytest.mark.parametrize("kind,kw", [("static", dict(window=5)), ("adaptive", dict(window=6, lookahead=3)), ("rotating", dict(window=5, min_tokens=9))])
def test_failing_appends_leave_the_state_unchanged(rng, kind, kw, monkeypatch):
    """W6.8: bad input, and a failure inside the compressed append (W2 step 3), change nothing."""
    K, V = stream(rng, 40)
    state = make(kind, K, V, **kw).append(K[:, :20], V[:, :20])
    before = snapshot(state)
    with pytest.raises(ValueError):
        state.append(K[:, 20:25, :5], V[:, 20:25])
    with pytest.raises(ValueError):
        state.append(np.full((H, 3, D), np.nan), V[:, 20:23])
    assert_same(before, snapshot(state))

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    for module in (append_static, append_rotating, append_adaptive):  # every policy's coefficient writes
        monkeypatch.setattr(module, "store", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        state.append(K[:, 20:30], V[:, 20:30])
    assert_same(before, snapshot(state))
    monkeypatch.undo()
    state.append(K[:, 20:30], V[:, 20:30])  # and it still works
    assert state.num_tokens == 30


@pytest.mark.parametrize("kind,kw", [("static", dict(window=5, min_tokens=8)), ("adaptive", dict(window=6, lookahead=3)), ("rotating", dict(window=5))])
def test_copy_and_persistence_round_trip(rng, tmp_path, kind, kw):
    """W6.9: copy and save/load keep the exact part; appending afterwards agrees bit for bit."""
    K, V = stream(rng, 40)
    state = make(kind, K, V, **kw).append(K[:, :25], V[:, :25])
    path = tmp_path / "s.safetensors"
    state.save(path)
    loaded = sr.SubspaceState.load(path)
    copied = state.copy()
    assert (loaded.window.size, loaded.window.min_tokens, loaded.window.lookahead) == (state.window.size, state.window.min_tokens, state.window.lookahead)
    for other in (loaded, copied):
        assert_same(snapshot(state), snapshot(other))
    copied.append(K[:, 25:26], V[:, 25:26])  # the copy is independent
    assert state.num_tokens == 25
    state.append(K[:, 25:], V[:, 25:])
    loaded.append(K[:, 25:], V[:, 25:])
    assert_same(snapshot(state), snapshot(loaded))
    import json

    import safetensors

    with safetensors.safe_open(path, "np") as f:
        meta = f.metadata()
    assert meta["format_version"] == "2" and json.loads(meta["state"])["window"]["size"] == kw["window"]


def test_plain_files_stay_version_1_and_bad_window_headers_are_rejected(rng, tmp_path):
    import json

    import safetensors
    import safetensors.numpy

    from subspace_ref import persistence

    K, V = stream(rng, 20)
    make("static", K, V).append(K, V).save(tmp_path / "plain")
    with safetensors.safe_open(tmp_path / "plain", "np") as f:
        assert f.metadata()["format_version"] == "1" and "window" not in json.loads(f.metadata()["state"])
    make("static", K, V, window=5).append(K, V).save(tmp_path / "w")
    data = safetensors.numpy.load_file(tmp_path / "w")
    with safetensors.safe_open(tmp_path / "w", "np") as f:
        meta = f.metadata()

    def rewrite(name, tensors, header=None, version="2"):
        m = dict(meta, format_version=version)
        if header is not None:
            m["state"] = persistence._canonical_json(header)
        m.pop("checksum")
        m["checksum"] = persistence.checksum(tensors, m)
        safetensors.numpy.save_file(tensors, tmp_path / name, metadata=m)
        return tmp_path / name

    header = json.loads(meta["state"])
    with pytest.raises(persistence.StateFileError, match="format_version"):
        sr.SubspaceState.load(rewrite("v1", data, version="1"))
    with pytest.raises(persistence.StateFileError, match="do not fit window"):
        sr.SubspaceState.load(
            rewrite(
                "count",
                dict(
                    data, window_keys=np.ascontiguousarray(data["window_keys"][:, :, :3]), window_values=np.ascontiguousarray(data["window_values"][:, :, :3])
                ),
            )
        )
    with pytest.raises(persistence.StateFileError, match="lookahead"):
        sr.SubspaceState.load(rewrite("la", data, dict(header, window=dict(header["window"], lookahead=2))))
    with pytest.raises(persistence.StateFileError, match="window_keys"):
        sr.SubspaceState.load(rewrite("missing", {k: v for k, v in data.items() if k != "window_keys"}))


def test_hf_factories_forward_the_keywords(rng):
    import torch

    from subspace_ref.hf import StateSpec, adaptive_states, rotating_states, static_states

    K, V = stream(rng, 30)
    spec = StateSpec(0, 1, H, D, D, torch.float32, torch.device("cpu"))
    s = static_states([sr.calibrate(K, V, rank_k=R, rank_v=R)], window=lambda li: 16, min_tokens=64)(spec)
    assert (s.window.size, s.window.min_tokens) == (16, 64)
    a = adaptive_states(rank_k=R, rank_v=R, window=8, lookahead=4)(spec)
    assert (a.window.size, a.window.lookahead) == (8, 4)
    r = rotating_states(rank_k=R, rank_v=R, window=8, min_tokens=3)(spec)
    assert (r.window.size, r.window.min_tokens) == (8, 3)
    assert static_states([sr.calibrate(K, V, rank_k=R, rank_v=R)])(spec).window is None


# ----------------------------------------------------------------------------- torch backend
torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    "kind,kw", [("static", dict(window=6, min_tokens=15)), ("adaptive", dict(window=7)), ("rotating", dict(window=5)), ("static", dict(window=100))]
)
def test_torch_attend_and_append_agree_with_the_oracle(rng, kind, kw):
    """W6.9 / W3: the torch backend's merged softmax and its appends equal the oracle's in float64."""
    K, V = stream(rng, 60)
    oracle = make(kind, K, V, **kw)
    on_torch = make(kind, K, V, **kw).to("torch")
    for a, b in ((0, 1), (1, 20), (20, 21), (21, 60)):
        oracle.append(K[:, a:b], V[:, a:b])
        on_torch.append(torch.from_numpy(K[:, a:b]), torch.from_numpy(V[:, a:b]))
    assert on_torch.num_tokens == 60 and on_torch.window.count == oracle.window.count
    np.testing.assert_array_equal(on_torch.window.keys.numpy(), oracle.window.keys)
    q = rng.standard_normal((2 * H, D))
    out = sr.attend(torch.from_numpy(q), on_torch, backend="torch").numpy()
    np.testing.assert_allclose(out, sr.attend(q, oracle), rtol=0, atol=1e-12)
    if kw["window"] >= 60:
        np.testing.assert_allclose(out, exact_attention(q, K, V), rtol=0, atol=1e-12)
    # float32 on torch, from a converted state
    out32 = sr.attend(torch.from_numpy(q).float(), oracle.to("torch", dtype=torch.float32), backend="torch").numpy()
    np.testing.assert_allclose(out32, sr.attend(q, oracle), rtol=0, atol=1e-4)


def test_torch_plain_state_unchanged_and_refusals(rng):
    """W6.2 on torch; lookahead appends on torch and window attention on triton/cupy refuse by name."""
    K, V = stream(rng, 30)
    plain = make("static", K, V).to("torch").append(torch.from_numpy(K), torch.from_numpy(V))
    zero = make("static", K, V, window=0).to("torch").append(torch.from_numpy(K), torch.from_numpy(V))
    q = torch.from_numpy(rng.standard_normal((H, D)))
    assert torch.equal(sr.attend(q, plain, backend="torch"), sr.attend(q, zero, backend="torch"))

    ahead = make("adaptive", K, V, window=6, lookahead=3).to("torch")
    before = snapshot(ahead.to("numpy"))
    with pytest.raises(NotImplementedError, match="lookahead"):
        ahead.append(torch.from_numpy(K), torch.from_numpy(V))
    assert_same(before, snapshot(ahead.to("numpy")))

    windowed = make("static", K, V, window=6).to("torch").append(torch.from_numpy(K), torch.from_numpy(V))
    from subspace_ref.registry import get_backend

    for name in ("triton", "cupy"):
        try:
            impl = get_backend(name)
        except Exception:
            continue
        # refused by name exactly when the backend declares no window (triton merges it since issue 16)
        assert any("exact window" in r for r in impl.not_supported_reasons(q[None], windowed)) != impl.capabilities.window


def test_rows_run_on_the_tiny_profile(tiny_calibration):
    """Deliverable 5: the rows build and score; a window covering the whole context (64 >= 48
    tokens of the tiny profile) reproduces the stock model through the HF cache (W3.2)."""
    from subspace_ref.lab.experiments import ppl
    from subspace_ref.lab.experiments.variant_rows import window as rows_module

    ctx, record, svd = tiny_calibration
    rows = {v.name: v for v in rows_module.variants(ctx, record, svd)}
    assert all(v.group == "window" and v.plain in ("static", "adaptive") for v in rows.values())
    ids = ctx.eval_windows(1)
    stock = ppl.score(ctx.model, ids)
    r = rows_module.plain_rank(ctx, record)

    def by(**extra):
        return next(v for v in rows.values() if v.extra == dict(rank=r, **extra))

    covering = by(window=64)
    out = ppl.score(ctx.model, ids, covering.factory, backend=covering.backend)
    np.testing.assert_allclose(out["nll"], stock["nll"], rtol=0, atol=1e-4)
    partial = by(window=32)
    out = ppl.score(ctx.model, ids, partial.factory, backend=partial.backend)
    assert np.abs(out["nll"] - stock["nll"]).max() > 1e-4  # 16 of 48 tokens compressed
    ahead = next(v for v in rows.values() if v.extra.get("lookahead"))
    assert ahead.backend == "numpy"
    out = ppl.score(ctx.model, ids, ahead.factory, backend=ahead.backend)
    assert np.isfinite(out["nll"]).all()


# --------------------------------------------------------------------------- long prefill (issue 17 item 5)
@pytest.mark.parametrize(
    "kind,kw",
    [
        ("static", dict(window=16, min_tokens=40)),
        ("rotating", dict(window=16)),
        ("static", dict(window=16, sinks=4)),
        ("rotating", dict(window=9, min_tokens=30, sinks=3)),
    ],
)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_long_prefill_in_blocks_equals_token_by_token_bit_for_bit(rng, kind, kw, backend):
    """W2.1 for a prefill: one append of 300 tokens moves the 284 leaving the window to the
    compressed part in ONE call of the policy's append (no per-token loop), and gives exactly,
    bit for bit in float64, the state that 300 single-token appends give. One exception: torch's
    static projection is one matmul whose BLAS kernel differs between a 1-row and an n-row
    product, so there the coefficients agree to a few ulps, not bit for bit."""
    if backend == "torch":
        pytest.importorskip("torch")
    K, V = stream(rng, 300)
    empty = make(kind, K, V, **kw)
    if backend == "torch":
        import torch

        empty, K, V = empty.to("torch"), torch.from_numpy(K), torch.from_numpy(V)
    one, block = empty.copy(), empty.copy()
    for t in range(300):
        one.append(K[:, t], V[:, t])
    calls = []
    impl = sr.registry.get_backend(backend)
    original = type(impl).append

    def counted(self, state, keys, values):
        calls.append(keys.shape[2])
        return original(self, state, keys, values)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(impl), "append", counted)
        block.append(K, V)
    assert len(calls) == 1 and calls[0] == block.layout.num_tokens, calls
    a, b = snapshot(one), snapshot(block)
    assert a.keys() == b.keys()
    for name in a:
        if backend == "torch" and kind == "static" and name.endswith("_coef"):
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=8 * np.finfo(np.float64).eps * np.abs(b[name]).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# --------------------------------------------------------------------------- attention sinks (W7-W9)
def sink_split(T, S, W, M):
    """(sinks, compressed, recent) token counts of W7, by its definition."""
    s = min(T, S)
    c = compressed_count(T - s, W, max(M - S, 0))
    return s, c, T - s - c


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
@pytest.mark.parametrize("S,W,M", [(3, 5, 0), (4, 0, 0), (6, 4, 20), (50, 2, 0)])
def test_sinks_split_and_attention_is_exact_over_sinks_projection_and_window(rng, kind, S, W, M):
    """W7: the first S tokens stay exact (bit for bit), the rest splits as W1 with M - S; W8.1:
    attention equals A1 over [sinks ; reconstructed compressed tokens ; recent window], with
    the compressed logits scaled by gamma; W9: bytes by hand."""
    T = 40
    K, V = stream(rng, T)
    state = make(kind, K, V, sinks=S, window=W, min_tokens=M)
    state.append(K[:, :7], V[:, :7]).append(K[:, 7:], V[:, 7:])
    s, c, e = sink_split(T, S, W, M)
    assert (state.window.sink_count, state.layout.num_tokens, state.window.recent, state.num_tokens) == (s, c, e, T)
    np.testing.assert_array_equal(state.window.sink_keys[0], K[:, :s])  # stored batched, N = 1
    np.testing.assert_array_equal(state.window.sink_values[0], V[:, :s])
    np.testing.assert_array_equal(state.window.keys[0], K[:, T - e :])
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_array_equal(K_hat[:, :s], K[:, :s])
    np.testing.assert_array_equal(K_hat[:, s + c :], K[:, T - e :])
    # gamma enters through the compressed keys only: scale them, the exact ones not
    g = state.layout.gamma
    K_mix = K_hat.copy()
    K_mix[:, s : s + c] *= g[:, None, None]
    q = rng.standard_normal((2 * H, D))
    np.testing.assert_allclose(sr.attend(q, state), exact_attention(q, K_mix, V_hat), rtol=0, atol=1e-12)
    plain = make(kind, K, V, window=W, min_tokens=max(M - S, 0)) if (W or M > S) else make(kind, K, V)
    plain.append(K[:, s:], V[:, s:])
    assert state.nbytes == plain.nbytes + H * s * 2 * D * 8  # W9: N H s (d + d_v) itemsize more
    assert state.allocated_nbytes >= state.nbytes


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_sinks_zero_is_the_window_state_and_sinks_compose_with_gamma(rng, kind):
    """W7: sinks=0 holds no sink arrays and is the window state bit for bit; a state with only
    sinks (W = M = 0) compresses every token after them."""
    K, V = stream(rng, 30)
    a, b = make(kind, K, V, window=5), make(kind, K, V, window=5, sinks=0)
    a.append(K, V), b.append(K, V)
    assert b.window.sink_keys is None and "sink_keys" not in live_arrays(b)
    assert_same(snapshot(a), snapshot(b))
    only = make(kind, K, V, sinks=4).append(K, V)
    assert (only.window.sink_count, only.layout.num_tokens, only.window.recent) == (4, 26, 0)


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(sinks=-1), ValueError, "sinks must be >= 0"),
        (dict(sinks=2.5), TypeError, "sinks"),
        (dict(sinks="4"), TypeError, "sinks"),
    ],
)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_bad_sinks_are_named(rng, kind, kw, err, match):
    K, V = stream(rng, 20)
    with pytest.raises(err, match=match):
        make(kind, K, V, **kw)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("appends", ["block", "tokens"])
def test_sinks_with_rope_are_exact_on_low_rank_pre_rope_keys(rng, backend, appends):
    """W10.1: pre-RoPE keys in a 4-dimensional subspace, a rank-4 pre-RoPE key basis (and
    full-rank values), sinks and a window: attention is exact attention over the (post-RoPE)
    keys given, because compressed token t is un-rotated and rotated at its position S + t. At
    position t (the offset forgotten) the un-rotated key R_t^-1 R_(S+t) k leaves the subspace and
    the error is O(1); a full-rank basis would hide it (R_t B^T B R_t^-1 = I)."""
    from subspace_ref.rope import RopeParams, rotate

    rope = RopeParams(1.0 / 10000.0 ** (np.arange(D // 2) / (D // 2)))
    K_pre = low_rank_stream(rng, H, 40, D, 4, noise=0.0)
    V = low_rank_stream(rng, H, 40, D, 4, noise=0.3)
    K = rotate(K_pre, np.arange(40), rope)  # the model's keys: rotated at their positions
    basis = sr.calibrate(K_pre, V, rank_k=4, rank_v=D)
    state = sr.SubspaceState.static(basis, rope=rope, sinks=3, window=5)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        state = state.to("torch", dtype=torch.float64)
    chunks = [(0, 40)] if appends == "block" else [(t, t + 1) for t in range(40)]
    for a, b in chunks:
        k, v = K[:, a:b], V[:, a:b]
        state.append(*((torch.from_numpy(k), torch.from_numpy(v)) if backend == "torch" else (k, v)))
    assert (state.window.sink_count, state.layout.num_tokens) == (3, 32)
    q = rng.standard_normal((H, D))
    out = to_numpy(sr.attend(torch.from_numpy(q) if backend == "torch" else q, state, backend=backend))
    np.testing.assert_allclose(out, exact_attention(q, K, V), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("kind,kw", [("static", dict(sinks=3, window=5)), ("adaptive", dict(sinks=4, window=6, lookahead=3)), ("rotating", dict(sinks=2))])
def test_sinks_failing_append_copy_persistence(rng, tmp_path, kind, kw, monkeypatch):
    """W7 commit rule, and W6.9 with sinks: a failing append that would fill the sinks changes
    nothing; copy and save/load keep the sinks; appends afterwards agree bit for bit."""
    K, V = stream(rng, 40)
    state = make(kind, K, V, **kw).append(K[:, :1], V[:, :1])
    before = snapshot(state)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    for module in (append_static, append_rotating, append_adaptive):  # every policy's coefficient writes
        monkeypatch.setattr(module, "store", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        state.append(K[:, 1:30], V[:, 1:30])
    assert_same(before, snapshot(state))
    monkeypatch.undo()
    state.append(K[:, 1:25], V[:, 1:25])
    path = tmp_path / "s.safetensors"
    state.save(path)
    loaded = sr.SubspaceState.load(path)
    assert loaded.window.sinks == kw["sinks"]
    assert_same(snapshot(state), snapshot(loaded))
    assert_same(snapshot(state), snapshot(state.copy()))
    state.append(K[:, 25:], V[:, 25:])
    loaded.append(K[:, 25:], V[:, 25:])
    assert_same(snapshot(state), snapshot(loaded))


def test_sink_headers_are_checked(rng, tmp_path):
    """A file whose sinks disagree with its header is rejected with the reason."""
    import json

    import safetensors.numpy as stn

    from subspace_ref import persistence

    K, V = stream(rng, 20)
    state = make("rotating", K, V, sinks=3, window=4).append(K, V)
    path = tmp_path / "s.safetensors"
    state.save(path)
    tensors = stn.load_file(path)
    import safetensors

    with safetensors.safe_open(path, "np") as f:
        meta = f.metadata()
    header = json.loads(meta["state"])
    for change, match in ((dict(sinks=0), "sinks = 0"), (dict(sinks=5), "sink tokens for sinks = 5")):
        bad = dict(meta, state=json.dumps(dict(header, window=dict(header["window"], **change))))
        bad["checksum"] = persistence.checksum(tensors, bad)
        stn.save_file(tensors, tmp_path / "bad.safetensors", metadata=bad)
        with pytest.raises(ValueError, match=match):
            sr.SubspaceState.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating"])
def test_torch_attend_with_sinks_agrees_with_the_oracle(rng, kind):
    """W8 in torch: sinks, compressed and recent tokens in one softmax, d != d_v, gamma != 1."""
    torch = pytest.importorskip("torch")
    d, d_v = D, 5
    Kx, Vx = rng.standard_normal((H, 50, d)), rng.standard_normal((H, 50, d_v))
    gamma = np.array([0.6, 1.7])
    if kind == "static":
        basis = sr.calibrate(Kx, Vx, rank_k=R, rank_v=R)
        state = sr.SubspaceState.static(sr.StaticBasis.from_bases(basis.B, basis.E, gamma), sinks=4, window=6)
    elif kind == "adaptive":
        state = sr.SubspaceState.adaptive(H, d, d_v, rank_k=R, rank_v=R, max_chunk=8, sinks=4, window=6, gamma=gamma, **PAPER)
    else:
        state = sr.SubspaceState.rotating(H, d, d_v, rank_k=R, rank_v=R, refresh_every=5, sinks=4, window=6, gamma=gamma)
    state.append(Kx, Vx)
    q = rng.standard_normal((2 * H, d)) * 3
    want = sr.attend(q, state)
    got = sr.attend(torch.from_numpy(q), state.to("torch"), backend="torch")
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    for name in ("triton", "cupy"):
        if name in sr.registry.registered() and sr.registry.backend_availability(name):
            impl = sr.registry.get_backend(name)
            reasons = impl.not_supported_reasons(torch.from_numpy(q), state.to("torch"))
            assert any("sinks=4" in r for r in reasons) != impl.capabilities.sinks, reasons
