"""spec/sketch_variants.md: ring warm start (S1), strided FD (S2), basis reuse (S3) of the
adaptive state, and the per-head rank rows (S5)."""

import math

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.frequent_directions import FrequentDirections
from subspace_ref.policies.variants import largest_principal_angle

from conftest import low_rank_stream
from test_adaptive_state import drifting_stream
from test_bad_input import assert_unchanged, snapshot

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def drifting(rng, H, T, d, rank=3, every=90):
    return np.stack([drifting_stream(rng, T, d, rank, every) for _ in range(H)])


def build(H, d, **kw):
    base = dict(rank_k=3, rank_v=3, tau_k=0.3, tau_v=0.3, max_chunk=40, **PAPER)
    base.update(kw)
    return sr.SubspaceState.adaptive(H, d, **base)


def state_arrays(state) -> dict:
    out = {k: np.array(v) for k, v in state.layout.live_arrays().items()}
    sk = state.sketches
    out.update(sk_keys=sk.keys, sk_values=sk.values, fills=np.array([sk.filled_k, sk.filled_v, sk.rows_seen]))
    if sk.ring_keys is not None:
        out.update(ring_keys=sk.ring_keys, ring_values=sk.ring_values)
    return out


def assert_same(a, b):
    a, b = state_arrays(a), state_arrays(b)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# ----------------------------------------------------------------------------- neutral values
def test_neutral_values_give_the_plain_state_bit_for_bit(rng):
    """S1.3, S2.2, S3: the options at their neutral values run A7 verbatim."""
    H, T, d = 2, 200, 10
    K, V = drifting(rng, H, T, d), drifting(rng, H, T, d)
    for reset in (False, True):
        plain = build(H, d, sketch_reset=reset).append(K, V)
        neutral = build(H, d, sketch_reset=reset, ring_warm_start=0, fd_stride=1, reuse_angle=None).append(K, V)
        assert_same(plain, neutral)
        assert plain.num_chunks.sum() > 2 * H  # the stream does trigger


# ----------------------------------------------------------------------------- S2 stride
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_stride_inserts_ceil_T_over_m_rows_and_the_sketch_is_FD_of_them(rng, m):
    """S2.1: ceil(T/m) rows, the tokens 0, m, 2m, ...; the buffer equals FD fed exactly those."""
    H, T, d, ell = 2, 157, 8, 5
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d))
    state = build(H, d, rank_k=2, rank_v=2, ell_k=ell, ell_v=ell, fd_stride=m)
    state.append(K[:, :70], V[:, :70]).append(K[:, 70:], V[:, 70:])
    assert state.sketches.rows_inserted == math.ceil(T / m)
    for h in range(H):
        ref = FrequentDirections(d, ell).update(K[h, ::m])
        assert state.sketches.filled_k == ref._filled
        np.testing.assert_allclose(state.sketches.keys[0, h], ref._buffer, atol=1e-12)


def test_svd_counter_by_hand(rng):
    """S2.3: compactions max(0, ceil((n - 2 ell)/(ell + 1))) per side and head for n rows, plus
    two snapshot SVDs per fired head; with tau close to 1 only the length cap fires."""
    H, T, d, ell, L = 3, 300, 8, 6, 50
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d))
    for m in (1, 2, 4):
        state = build(H, d, rank_k=2, rank_v=2, ell_k=ell, ell_v=ell, tau_k=0.9999, tau_v=0.9999, max_chunk=L, fd_stride=m).append(K, V)
        n = math.ceil(T / m)
        compactions = max(0, math.ceil((n - 2 * ell) / (ell + 1)))
        fired = int((state.num_chunks - 1).sum())
        assert fired == H * (T // L)  # cap only: chunks open at L, 2L, ..., T (the last one empty)
        assert state.sketches.svds == 2 * H * compactions + 2 * fired


# ----------------------------------------------------------------------------- S1 ring
@pytest.mark.parametrize("trigger", ["paper", "reproject"])
@pytest.mark.parametrize("W_over_ell", [1, 3])
def test_ring_snapshots_are_FD_of_the_last_W_rows(rng, W_over_ell, trigger):
    """S1.1: with the paper's order every chunk opened at t + 1 has the A4 basis of FD of tokens
    max(0, t - W) .. t - 1; with reproject (A7.2) the chunk opens at the firing token t, and the
    ring holds t too: tokens max(0, t + 1 - W) .. t."""
    H, T, d, r, ell = 2, 260, 10, 3, 7
    W = W_over_ell * ell
    K, V = drifting(rng, H, T, d), drifting(rng, H, T, d, rank=2, every=70)
    state = build(H, d, rank_k=r, rank_v=r, ell_k=ell, ell_v=ell, ring_warm_start=W, trigger=trigger, track=False).append(K, V)  # A7.4 would replace a snapshot that misses its token
    checked = 0
    for h in range(H):
        for j, (a, _) in enumerate(state.chunk_bounds(h)):
            if j == 0:
                continue
            stop = a + 1 if trigger == "reproject" else a - 1  # one past the last token in the ring
            for X, bases in ((K, state.layout.key_bases), (V, state.layout.value_bases)):
                want = FrequentDirections(d, ell).update(X[h, max(0, stop - W) : stop]).basis(r)
                np.testing.assert_allclose(bases[0, h, j], want, atol=1e-9)
            checked += 1
    assert checked > 5


def test_ring_rows_in_the_ring_follow_the_stride(rng):
    """S1 step 1 with S2: the ring holds the last W offered rows (tokens t mod m = 0) in slot q mod W."""
    H, T, d, W, m = 1, 53, 6, 8, 3
    K = rng.standard_normal((H, T, d))
    state = build(H, d, rank_k=2, rank_v=2, ring_warm_start=W, fd_stride=m).append(K, K)
    offered = K[0, ::m]
    for q in range(len(offered) - W, len(offered)):
        np.testing.assert_array_equal(state.sketches.ring_keys[0, 0, q % W], offered[q])


def test_ring_nbytes_by_hand(rng):
    """S1.5: coefficients + bases of chunks in use + gamma + chunk offsets + rings (no sketches)."""
    H, T, d, d_v, W = 2, 120, 8, 6, 16
    K, V = rng.standard_normal((H, T, d)), rng.standard_normal((H, T, d_v))
    state = sr.SubspaceState.adaptive(
        H, d, d_v, rank_k=(3, 2), rank_v=2, tau_k=0.3, tau_v=0.3, max_chunk=30, ring_warm_start=W, dtype=np.float32, **PAPER
    ).append(K, V)
    J = int(state.num_chunks.sum())
    want = 4 * (H * T * (3 + 2) + J * (3 * d + 2 * d_v) + H) + 8 * J + 4 * H * W * (d + d_v)
    assert state.nbytes == want
    assert state.sketches.keys.shape == (1, H, 0, d)


def test_ring_with_sketch_reset_is_refused():
    """S1.4."""
    with pytest.raises(ValueError, match="ring_warm_start.*sketch_reset"):
        build(2, 8, ring_warm_start=8, sketch_reset=True)


# ----------------------------------------------------------------------------- S3 reuse
def test_principal_angle_by_hand():
    """S3.1: angle between span(e1, e2) and span(e1, cos a e2 + sin a e3) is a; different
    dimensions give pi/2."""
    a = 0.3
    B = np.eye(4)[:2]
    B2 = np.array([[1, 0, 0, 0], [0, math.cos(a), math.sin(a), 0.0]])
    assert largest_principal_angle(B, B2) == pytest.approx(a, abs=1e-12)
    assert largest_principal_angle(B, np.vstack([B2[:1], np.zeros(4)])) == pytest.approx(math.pi / 2)


def test_reuse_collapses_a_stationary_stream_to_one_chunk(rng):
    """S3: on an exactly rank-3 stream with the length cap as the only trigger, every snapshot
    spans the open basis (angle ~0), so each head keeps chunk 0; plain opens one per L tokens.
    Reconstruction stays exact and the basis bytes drop accordingly."""
    H, T, d, L = 2, 240, 9, 40
    K = low_rank_stream(rng, H, T, d, 3)
    plain = build(H, d, max_chunk=L, tau_k=0.5, tau_v=0.5).append(K, K)
    reuse = build(H, d, max_chunk=L, tau_k=0.5, tau_v=0.5, reuse_angle=0.2).append(K, K)
    assert plain.num_chunks.tolist() == [T // L + 1] * H  # the last one opened at T, empty
    assert reuse.num_chunks.tolist() == [1] * H
    Kh, _ = reuse.reconstruct()
    np.testing.assert_allclose(Kh, K, atol=1e-9)
    per_chunk = 8 * 2 * 3 * d + 8  # two r x d float64 bases and one chunk offset
    assert plain.nbytes - reuse.nbytes == H * (T // L) * per_chunk


@pytest.mark.parametrize("angle", [0.2, 0.5, 1.2])
def test_reuse_does_not_increase_chunks_on_drift(rng, angle):
    """S3.3 on the drifting stream; each kept chunk's bases are those it opened with, and every
    chunk opened by a trigger is farther than the angle from its predecessor on one side."""
    H, T, d = 2, 360, 10
    K, V = drifting(rng, H, T, d), drifting(rng, H, T, d, rank=2, every=120)
    for reset in (False, True):
        plain = build(H, d, sketch_reset=reset).append(K, V)
        reuse = build(H, d, sketch_reset=reset, reuse_angle=angle).append(K, V)
        assert (reuse.num_chunks <= plain.num_chunks).all(), (reuse.num_chunks, plain.num_chunks)
        lay = reuse.layout
        for h in range(H):
            for j in range(1, int(reuse.num_chunks[h])):
                theta = max(
                    largest_principal_angle(lay.key_bases[0, h, j - 1], lay.key_bases[0, h, j]),
                    largest_principal_angle(lay.value_bases[0, h, j - 1], lay.value_bases[0, h, j]),
                )
                assert theta >= angle


# ----------------------------------------------------------------------------- causality
@pytest.mark.parametrize("opts", [dict(ring_warm_start=12), dict(fd_stride=3), dict(reuse_angle=0.4), dict(ring_warm_start=20, fd_stride=2, reuse_angle=0.3)])
def test_prefix_stability_and_blocks(rng, opts):
    """S1.2, S3.4: appending in blocks equals appending at once, and the state after T1 tokens
    is the prefix of the state after T (coefficients, chunk starts, bases of opened chunks)."""
    H, T, T1, d = 2, 230, 131, 10
    K, V = drifting(rng, H, T, d), drifting(rng, H, T, d, rank=2, every=70)
    whole = build(H, d, **opts).append(K, V)
    pieces = build(H, d, **opts)
    for a, b in ((0, 1), (1, 50), (50, 51), (51, 190), (190, T)):
        pieces.append(K[:, a:b], V[:, a:b])
    assert_same(whole, pieces)
    prefix = build(H, d, **opts).append(K[:, :T1], V[:, :T1])
    np.testing.assert_array_equal(prefix.layout.key_coef[:, :, :T1], whole.layout.key_coef[:, :, :T1])
    np.testing.assert_array_equal(prefix.layout.value_coef[:, :, :T1], whole.layout.value_coef[:, :, :T1])
    for h in range(H):
        J1 = int(prefix.num_chunks[h])
        assert prefix.chunk_bounds(h)[:-1] == whole.chunk_bounds(h)[: J1 - 1]
        np.testing.assert_array_equal(prefix.layout.key_bases[0, h, :J1], whole.layout.key_bases[0, h, :J1])


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(ring_warm_start=-1), "ring_warm_start"),
        (dict(ring_warm_start=2.0), "ring_warm_start"),
        (dict(ring_warm_start=True), "ring_warm_start"),
        (dict(fd_stride=0), "fd_stride"),
        (dict(fd_stride="2"), "fd_stride"),
        (dict(reuse_angle=0.0), "reuse_angle"),
        (dict(reuse_angle=math.pi / 2), "reuse_angle"),
        (dict(reuse_angle="0.3"), "reuse_angle"),
        (dict(reuse_angle=float("nan")), "reuse_angle"),
    ],
)
def test_bad_options_name_the_argument(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build(2, 8, **kw)


def test_bad_append_leaves_a_variant_state_unchanged(rng):
    H, d = 2, 8
    state = build(H, d, ring_warm_start=10, fd_stride=2, reuse_angle=0.3)
    state.append(rng.standard_normal((H, 30, d)), rng.standard_normal((H, 30, d)))
    before = snapshot(state)
    ring = state.sketches.ring_keys.copy()
    bad = rng.standard_normal((H, 5, d))
    bad[1, 3, 2] = np.nan
    with pytest.raises(ValueError):
        state.append(bad, rng.standard_normal((H, 5, d)))
    assert_unchanged(before, snapshot(state))
    np.testing.assert_array_equal(state.sketches.ring_keys, ring)


def test_torch_append_refuses_before_mutation(rng):
    torch = pytest.importorskip("torch")
    H, d = 2, 8
    for kw in (dict(ring_warm_start=10), dict(fd_stride=2), dict(reuse_angle=0.3)):
        state = build(H, d, **kw).to("torch")
        before = snapshot(state)
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            state.append(torch.randn(H, 4, d, dtype=torch.float64), torch.randn(H, 4, d, dtype=torch.float64))
        assert_unchanged(before, snapshot(state))


# ----------------------------------------------------------------------------- persistence
def test_persistence_round_trips_stride_and_reuse(rng, tmp_path):
    H, T, d = 2, 150, 8
    K, V = drifting(rng, H, T, d), drifting(rng, H, T, d)
    state = build(H, d, fd_stride=3, reuse_angle=0.35).append(K[:, :100], V[:, :100])
    state.save(tmp_path / "s.safetensors")
    loaded = sr.SubspaceState.load(tmp_path / "s.safetensors")
    assert loaded.policy == state.policy
    assert loaded.policy.fd_stride == 3 and loaded.policy.reuse_angle == 0.35
    assert_same(state, loaded)
    assert_same(state.append(K[:, 100:], V[:, 100:]), loaded.append(K[:, 100:], V[:, 100:]))


def test_persistence_refuses_ring_states(rng, tmp_path):
    """S1.6: version 1 has no tensor for the rings; nothing is written."""
    state = build(2, 8, ring_warm_start=8).append(rng.standard_normal((2, 20, 8)), rng.standard_normal((2, 20, 8)))
    with pytest.raises(TypeError, match="ring_warm_start"):
        state.save(tmp_path / "r.safetensors")
    assert not (tmp_path / "r.safetensors").exists()


def test_copy_keeps_the_ring_independent(rng):
    state = build(2, 8, ring_warm_start=8).append(rng.standard_normal((2, 20, 8)), rng.standard_normal((2, 20, 8)))
    twin = state.copy()
    assert_same(state, twin)
    state.append(rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8)))
    assert not np.array_equal(state.sketches.ring_keys, twin.sketches.ring_keys)


# ----------------------------------------------------------------------------- HF factory
def test_factory_forwards_the_options():
    torch = pytest.importorskip("torch")
    from subspace_ref.hf import adaptive_states
    from subspace_ref.hf.state_factories import StateSpec

    state = adaptive_states(rank_k=3, rank_v=3, ring_warm_start=16, fd_stride=2, reuse_angle=lambda li: 0.1 * (li + 1))(
        StateSpec(1, 1, 2, 8, 8, torch.float64, torch.device("cpu"))
    )
    assert (state.policy.ring_warm_start, state.policy.fd_stride, state.policy.reuse_angle) == (16, 2, 0.2)


# ----------------------------------------------------------------------------- rows (tiny profile)
def test_sketch_rows_build_and_score(tiny_calibration):
    from subspace_ref.lab.experiments.ppl import score
    from subspace_ref.lab.experiments.variant_rows import plain_rows, sketch

    ctx, record, svd = tiny_calibration
    rows = sketch.variants(ctx, record, svd)
    assert [v.extra for v in rows] == [
        dict(ring_warm_start=64),
        dict(ring_warm_start=256),
        dict(fd_stride=2),
        dict(fd_stride=4),
        dict(reuse_angle=0.2),
        dict(reuse_angle=0.5),
    ]
    assert all(v.group == "sketch" and v.plain == "adaptive" and v.backend == "numpy" for v in rows)
    ids = ctx.eval_windows()[:1]
    res = score(ctx.model, ids, rows[2].factory, backend=rows[2].backend)
    assert np.isfinite(res["nll"]).all() and res["bytes_per_token"] > 0
    plain = sketch.sketch_counters(ctx.model, ids, plain_rows(ctx, record, svd)["adaptive"])
    strided = sketch.sketch_counters(ctx.model, ids, rows[3].factory)
    T = ids.shape[1]
    assert plain["fd_rows_per_token"] == 1.0 and strided["fd_rows_per_token"] == math.ceil(T / 4) / T  # S2.1
    reuse = sketch.sketch_counters(ctx.model, ids, rows[5].factory)
    assert reuse["chunks_mean"] <= plain["chunks_mean"]


def test_rank_rows_build_and_score(tiny_calibration):
    from subspace_ref.lab.experiments.ppl import score
    from subspace_ref.lab.experiments.variant_rows import ranks

    ctx, record, svd = tiny_calibration
    rows = ranks.variants(ctx, record, svd)
    assert [(v.group, v.plain) for v in rows] == [("ranks", "static")] * 2 + [("ranks", "adaptive")] * 2
    ex = rows[0].extra
    # S5 by hand: the layout pads every head to the widest one
    rk, rv = ex["rank_k"], ex["rank_v"]
    assert ex["coef_bytes_per_token_padded"] == 4 * sum(len(k) * (max(k) + max(v)) for k, v in zip(rk, rv))
    assert ex["coef_bytes_per_token_unpadded"] <= ex["coef_bytes_per_token_padded"]
    import torch

    from subspace_ref.hf.state_factories import StateSpec

    H, d = record["kv_heads"], record["d"]
    state = rows[0].factory(StateSpec(0, 1, H, d, d, torch.float32, torch.device("cpu")))
    state.append(np.ones((1, H, 3, d), np.float32), np.ones((1, H, 3, d), np.float32))
    assert state.layout.key_coef.shape[3] == max(rk[0])
    assert state.nbytes - state.basis_nbytes == 3 * H * (max(rk[0]) + max(rv[0])) * 4  # padded columns counted
    res = score(ctx.model, ctx.eval_windows()[:1], rows[2].factory, backend=rows[2].backend)
    assert np.isfinite(res["nll"]).all()


def test_stride_reset_waits_for_ell_sketch_rows(rng):
    """S2.4: with sketch_reset and stride m, a chunk resets the sketches only after feeding them
    max(ell) rows, so on an exactly rank-3 stream every snapshot sees >= 3 independent rows and
    every chunk has a complete rank-3 basis (counting tokens instead fails: chunks of 10 tokens
    feed 2-3 rows, and the snapshot after such a reset is rank-deficient)."""
    H, T, d, m, ell = 1, 400, 9, 4, 6
    K = low_rank_stream(rng, H, T, d, 3)
    state = build(H, d, ell_k=ell, ell_v=ell, max_chunk=10, sketch_reset=True, fd_stride=m).append(K, K)
    bounds = state.chunk_bounds(0)
    for j, (a, b) in enumerate(bounds):
        B = state.layout.key_bases[0, 0, j]
        assert np.count_nonzero(np.linalg.norm(B, axis=1) > 0.5) == 3, (j, a, b)
    Kh, _ = state.reconstruct()
    np.testing.assert_allclose(Kh, K, atol=1e-8)
