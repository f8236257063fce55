"""RoPE variants (spec/rope.md): plane bases (P1, R1, R3), pre-RoPE static states (P2, P3, R2),
the cache and backends around them, persistence refusal, and the report rows."""

from __future__ import annotations


import numpy as np
import pytest

import subspace_ref
from subspace_ref import StaticBasis, SubspaceState, exact_attention
from subspace_ref.rope import RopeParams, calibrate_rope_planes, plane_basis, plane_energy, plane_pairs, rotate

from conftest import random_orthonormal

H, D = 2, 8


def params(d=D, layout="half", scaling=1.0, rotary_dim=None):
    rot = d if rotary_dim is None else rotary_dim
    return RopeParams(1.0 / 100.0 ** (np.arange(0, rot, 2) / rot), layout, scaling)


def rotation_matrix(rope, t, d):
    """R_t as a d x d matrix, built from the definition of spec/rope.md §1 (not from rotate)."""
    R = np.eye(d)
    for i, (a, b) in enumerate(plane_pairs(d, rope.layout, rope.rotary_dim)[: rope.inv_freq.size]):
        c, s = np.cos(t * rope.inv_freq[i]), np.sin(t * rope.inv_freq[i])
        R[np.ix_([a, b], [a, b])] = rope.attention_scaling * np.array([[c, -s], [s, c]])
    return R


def identity_basis(d=D, heads=H):
    I = np.broadcast_to(np.eye(d), (heads, d, d)).copy()
    return StaticBasis.from_bases(I, I)


# ----------------------------------------------------------------------------- §1 definitions
@pytest.mark.parametrize("layout,scaling,rot", [("half", 1.0, None), ("interleaved", 1.0, None), ("half", 1.3, 4)])
def test_rotate_is_the_block_rotation(rng, layout, scaling, rot):
    rope = params(layout=layout, scaling=scaling, rotary_dim=rot)
    x = rng.standard_normal((H, 5, D))
    pos = np.array([0, 1, 7, 100, 3000])
    want = np.einsum("tde,hte->htd", np.stack([rotation_matrix(rope, t, D) for t in pos]), x)
    np.testing.assert_allclose(rotate(x, pos, rope), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(rotate(want, pos, rope, inverse=True), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout,scaling,rot", [("half", 1.0, None), ("interleaved", 1.3, 4)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rotate_of_cpu_tensors_is_the_torch_operations_bit_for_bit(rng, layout, scaling, rot, dtype):
    """CPU tensors outside autograd are rotated through NumPy (a decode step's one token: fewer
    microseconds per operation); the result must be the torch operations' bit for bit, which a
    tensor that requires grad still takes."""
    torch = pytest.importorskip("torch")
    rope = params(layout=layout, scaling=scaling, rotary_dim=rot)
    x = torch.from_numpy(rng.standard_normal((2, H, 9, D))).to(getattr(torch, dtype))
    pos = np.arange(5, 14) * 37
    for inverse in (False, True):
        fast = rotate(x, pos, rope, inverse=inverse)
        ops = rotate(x.clone().requires_grad_(True), pos, rope, inverse=inverse).detach()
        assert isinstance(fast, torch.Tensor) and fast.dtype == x.dtype
        assert torch.equal(fast, ops)


def test_rotate_matches_transformers_llama(rng):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=500.0)
    rope = RopeParams.from_config(cfg)
    assert rope.rotary_dim == 16 and rope.layout == "half" and rope.attention_scaling == 1.0
    x = torch.from_numpy(rng.standard_normal((1, 2, 6, 16)))
    pos = torch.arange(10, 16)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(x.float(), pos)
    hf, _ = apply_rotary_pos_emb(x, x, cos.double(), sin.double())
    ours = rotate(x.numpy(), np.arange(10, 16), rope)
    np.testing.assert_allclose(ours, hf.numpy(), atol=1e-5)  # transformers' angles are float32
    np.testing.assert_allclose(rotate(x, np.arange(10, 16), rope).numpy(), ours, atol=1e-12)  # torch path


# ----------------------------------------------------------------------------- P1, R1, R3
@pytest.mark.parametrize("layout,rot", [("half", None), ("interleaved", None), ("half", 4)])
def test_R1_plane_basis_commutes_with_every_rotation(rng, layout, rot):
    rope = params(layout=layout, scaling=0.9, rotary_dim=rot)
    B = plane_basis(rng.random((1, D // 2)), 4, layout, rope.rotary_dim)[0]
    P = B.T @ B
    for t in (0, 1, 5, 123, 4097):
        R = rotation_matrix(rope, t, D)
        np.testing.assert_allclose(P @ R, R @ P, rtol=0, atol=1e-14)
        # R1(b): B R_t = R^B_t B with R^B_t = B R_t B^T orthogonal up to a (free transport)
        RB = B @ R @ B.T
        np.testing.assert_allclose(B @ R, RB @ B, rtol=0, atol=1e-14)
    # R4's contrapositive on an example: a random basis does not commute
    G = random_orthonormal(rng, r=4, d=D)
    Pg = G.T @ G
    R = rotation_matrix(rope, 5, D)
    assert np.abs(Pg @ R - R @ Pg).max() > 1e-3


def test_plane_energy_bookkeeping_and_choice(rng):
    scales = np.array([3.0, 0.1, 2.0, 1.0, 0.5, 0.2, 1.5, 0.05])
    K = rng.standard_normal((H, 200, D)) * scales
    E = plane_energy(K)
    pairs = plane_pairs(D)
    np.testing.assert_allclose(E, (K**2).sum(1)[:, pairs].sum(-1), rtol=1e-12)
    basis = calibrate_rope_planes(K, K, rank_k=4, rank_v=3)
    for h in range(H):
        best = sorted(range(D // 2), key=lambda p: -E[h, p])[:2]
        assert sorted(np.nonzero(basis.B[h].sum(0))[0]) == sorted(pairs[best].ravel())  # the top planes
        kept = np.sum((K[h] @ basis.B[h].T) ** 2) / np.sum(K[h] ** 2)
        np.testing.assert_allclose(kept, E[h, best].sum() / E[h].sum(), rtol=1e-12)
        sigma = np.linalg.svd(K[h], compute_uv=False)
        assert kept <= np.sum(sigma[:4] ** 2) / np.sum(sigma**2) + 1e-12  # Eckart-Young
    assert basis.rank_k == (4, 4) and basis.rank_v == (3, 3)
    np.testing.assert_allclose(basis.E, subspace_ref.calibrate(K, K, rank_k=3, rank_v=3).E)  # values: spec A5


def test_R3_plane_energies_rope_invariant(rng):
    rope = params(scaling=1.2)
    K = rng.standard_normal((H, 50, D))
    post = rotate(K, np.arange(50), rope)
    np.testing.assert_allclose(plane_energy(post), 1.2**2 * plane_energy(K), rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rank_k=3, rank_v=2), "even"),
        (dict(rank_k=0, rank_v=2), "even"),
        (dict(rank_k=10, rank_v=2), "even"),
        (dict(rank_k=4, rank_v=2, layout="gptj"), "layout"),
        (dict(rank_k=4, rank_v=2, rotary_dim=3), "rotary_dim"),
    ],
)
def test_plane_calibration_bad_input(rng, kwargs, match):
    K = rng.standard_normal((H, 20, D))
    with pytest.raises(ValueError, match=match):
        calibrate_rope_planes(K, K, **kwargs)


def test_rope_params_bad_input():
    with pytest.raises(ValueError, match="layout"):
        RopeParams(np.ones(4), "sideways")
    with pytest.raises(ValueError, match="attention_scaling"):
        RopeParams(np.ones(4), "half", 0.0)
    with pytest.raises(ValueError, match="inv_freq"):
        RopeParams(np.ones((2, 2)))
    with pytest.raises(ValueError, match="inv_freq"):
        RopeParams(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="rotary_dim"):
        SubspaceState.static(identity_basis(d=6), rope=params(d=D))  # 8 rotary dims, head size 6
    with pytest.raises(TypeError, match="rope"):
        SubspaceState.static(identity_basis(), rope={"inv_freq": [1.0]})


# ----------------------------------------------------------------------------- P2, P3, R2
@pytest.mark.parametrize("scaling,rot", [(1.0, None), (1.25, 4)])
def test_R2_full_rank_pre_rope_state_is_exact_attention(rng, scaling, rot):
    rope = params(scaling=scaling, rotary_dim=rot)
    T = 13
    K = rotate(rng.standard_normal((H, T, D)), np.arange(T), rope)  # post-RoPE, as a cache sees them
    V = rng.standard_normal((H, T, D))
    B = random_orthonormal(rng, H, r=D, d=D)  # full rank, but not the identity
    st = SubspaceState.static(StaticBasis.from_bases(B, np.broadcast_to(np.eye(D), (H, D, D)).copy()), rope=rope)
    for a, b in ((0, 1), (1, 6), (6, T)):  # positions carry across appends
        st.append(K[:, a:b], V[:, a:b])
    q = rng.standard_normal((2 * H, D))  # GQA: two query heads per KV head
    want = exact_attention(q, np.repeat(K, 2, 0), np.repeat(V, 2, 0))
    np.testing.assert_allclose(subspace_ref.attend(q, st, backend="numpy"), want, rtol=0, atol=1e-12)


def test_R2_rank_r_pre_rope_state_attends_rotated_projection(rng):
    rope = params()
    T, r = 17, 3
    K = rng.standard_normal((H, T, D))
    V = rng.standard_normal((H, T, D))
    B = random_orthonormal(rng, H, r=r, d=D)
    E = random_orthonormal(rng, H, r=2, d=D)
    st = SubspaceState.static(StaticBasis.from_bases(B, E, 0.7), rope=rope)
    st.append(K, V)
    # hand computation: k_hat_t = R_t P_B R_t^T k_t (lab/experiments/_project.py), v_hat = P_E v
    Rs = [rotation_matrix(rope, t, D) for t in range(T)]
    K_hat = np.stack([[Rs[t] @ B[h].T @ B[h] @ Rs[t].T @ K[h, t] for t in range(T)] for h in range(H)])
    V_hat = np.einsum("htd,hrd,hre->hte", V, E, E)
    q = rng.standard_normal((H, D))
    want = exact_attention(q, 0.7 * K_hat, V_hat)
    np.testing.assert_allclose(subspace_ref.attend(q, st, backend="numpy"), want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        st.layout.key_coef[0, :, :T], np.einsum("htd,hrd->htr", np.stack([[Rs[t].T @ K[h, t] for t in range(T)] for h in range(H)]), B), atol=1e-13
    )


def test_R1c_pre_rope_state_with_plane_basis_equals_plain_static_state(rng):
    rope = params(scaling=1.1)
    T = 11
    K, V = rng.standard_normal((H, T, D)), rng.standard_normal((H, T, D))
    basis = calibrate_rope_planes(K, V, rank_k=4, rank_v=4)
    plain, pre = SubspaceState.static(basis), SubspaceState.static(basis, rope=rope)
    plain.append(K, V)
    pre.append(K, V)
    q = rng.standard_normal((H, D))
    np.testing.assert_allclose(subspace_ref.attend(q, pre, backend="numpy"), subspace_ref.attend(q, plain, backend="numpy"), rtol=0, atol=1e-13)


def test_pre_rope_state_bytes_are_a_static_states(rng):
    rope = params()
    B = random_orthonormal(rng, H, r=3, d=D)
    st = SubspaceState.static(StaticBasis.from_bases(B, B), rope=rope, coefficients="int8")
    st.append(rng.standard_normal((H, 9, D)), rng.standard_normal((H, 9, D)))
    # 9 tokens x 2 heads x (3 + 3 int8 + two float32 scales), bases 2 x (3x8 + 3x8) float64, gamma 2 float64
    assert st.nbytes == 9 * 2 * (3 + 3 + 4 + 4) + 2 * (24 + 24) * 8 + 2 * 8


def test_bad_append_leaves_pre_rope_state_unchanged(rng):
    st = SubspaceState.static(identity_basis(), rope=params())
    st.append(rng.standard_normal((H, 3, D)), rng.standard_normal((H, 3, D)))
    before = {k: np.array(v) for k, v in st.layout.live_arrays().items()}
    bad = rng.standard_normal((H, 2, D))
    bad[0, 1, 0] = np.nan
    with pytest.raises(ValueError, match="keys"):
        st.append(bad, rng.standard_normal((H, 2, D)))
    after = st.layout.live_arrays()
    assert st.num_tokens == 3 and all(np.array_equal(before[k], after[k]) for k in before)


def test_persistence_round_trips_pre_rope_states_and_plain_static(tmp_path, rng):
    """spec/rope.md §5: the RoPE parameters travel in the header (version 2) and come back exact,
    so the loaded state attends and appends as the original, bit for bit; a header whose rope
    does not fit the keys, or sits on a non-static state, is refused by name."""
    from tests.test_persistence import edited

    from subspace_ref.persistence import StateFileError

    st = SubspaceState.static(calibrate_rope_planes(rng.standard_normal((H, 30, D)), rng.standard_normal((H, 30, D)), rank_k=4, rank_v=4), rope=params())
    st.append(rng.standard_normal((H, 5, D)), rng.standard_normal((H, 5, D)))
    st.save(tmp_path / "pre.safetensors")
    back = SubspaceState.load(tmp_path / "pre.safetensors")
    assert back.policy.rope.inv_freq.tobytes() == st.policy.rope.inv_freq.tobytes()
    assert (back.policy.rope.layout, back.policy.rope.attention_scaling) == (st.policy.rope.layout, st.policy.rope.attention_scaling)
    k, v, q = rng.standard_normal((H, 3, D)), rng.standard_normal((H, 3, D)), rng.standard_normal((H, D))
    st.append(k, v), back.append(k, v)
    np.testing.assert_array_equal(subspace_ref.attend(q, back), subspace_ref.attend(q, st))
    too_wide = edited(tmp_path, tmp_path / "pre.safetensors", state=lambda h: h["rope"].update(inv_freq=[1.0] * (D // 2 + 1)))
    with pytest.raises(StateFileError, match="rope does not fit the keys"):
        SubspaceState.load(too_wide)
    malformed = edited(tmp_path, tmp_path / "pre.safetensors", state=lambda h: h.update(rope={"inv_freq": "1.0"}))
    with pytest.raises(StateFileError, match="rope must be an object"):
        SubspaceState.load(malformed)
    plain = SubspaceState.static(calibrate_rope_planes(rng.standard_normal((H, 30, D)), rng.standard_normal((H, 30, D)), rank_k=4, rank_v=4))
    plain.append(rng.standard_normal((H, 2, D)), rng.standard_normal((H, 2, D)))
    plain.save(tmp_path / "plain.safetensors")
    back = SubspaceState.load(tmp_path / "plain.safetensors")
    assert back.policy == plain.policy and back.policy.rope is None
    assert all(np.array_equal(a, b) for a, b in zip(back.layout.live_arrays().values(), plain.layout.live_arrays().values()))


def test_backends_without_rope_refuse_pre_rope_state(rng):
    """A backend whose capabilities lack ``rope`` refuses a pre-RoPE state (attend and append),
    and the refused append changes nothing; torch and triton declare it (tests/test_rope_decode.py)."""
    import dataclasses

    from subspace_ref.capabilities import append_reasons, attend_reasons

    torch = pytest.importorskip("torch")
    st = SubspaceState.static(identity_basis(), rope=params())
    st.append(rng.standard_normal((H, 2, D)), rng.standard_normal((H, 2, D)))
    tst = st.to("torch")
    impl = subspace_ref.get_backend("torch")
    assert impl.capabilities.rope and attend_reasons("torch", impl, torch.zeros(1, H, D, dtype=torch.float64), tst) == []

    class WithoutRope:  # the torch backend with rope taken out of its declaration
        name = "torch-without-rope"
        capabilities = dataclasses.replace(impl.capabilities, rope=False)

        def call_reasons(self, q, state):
            return []

    assert any("rope" in r for r in attend_reasons("torch-without-rope", WithoutRope(), torch.zeros(1, H, D, dtype=torch.float64), tst))
    assert any("rope" in r for r in append_reasons("torch-without-rope", WithoutRope(), tst))


# ----------------------------------------------------------------------------- cache and rows
@pytest.fixture
def tiny(tiny_calibration):
    return tiny_calibration


def test_cache_pre_rope_full_rank_equals_stock_model(tiny):
    """Through SubspaceCache (prefill evaluator and decode): a full-rank pre-RoPE state gives the
    stock model's log-probabilities (R2), on the numpy and the torch backend."""
    from subspace_ref.lab.experiments.ppl import score
    from subspace_ref.hf import static_states

    ctx, record, svd = tiny
    ids = ctx.eval_windows()[:1]
    rope = RopeParams.from_config(ctx.model.config)
    H_kv = record["kv_heads"]
    full = [identity_basis(ctx.d, H_kv) for _ in svd]
    stock = score(ctx.model, ids)["nll"]
    got = score(ctx.model, ids, static_states(full, rope=rope), backend="numpy")["nll"]
    np.testing.assert_allclose(got, stock, atol=1e-4)
    got_torch = score(ctx.model, ids, static_states(full, rope=rope), backend="torch")["nll"]
    np.testing.assert_allclose(got_torch, stock, atol=1e-4)


def test_rows_run_and_pre_rope_row_equals_projection_ablation(tiny):
    from subspace_ref.lab.experiments.ppl import score, score_projected
    from subspace_ref.lab.experiments.calibrate import load_svd, static_basis
    from subspace_ref.lab.experiments.variant_rows import plain_rows
    from subspace_ref.lab.experiments.variant_rows.rope import variants

    ctx, record, svd = tiny
    rows = variants(ctx, record, svd)
    assert [v.name.split("_r")[0] for v in rows] == ["rope_planes", "rope_pre"]
    ids = ctx.eval_windows()
    res = {v.name: score(ctx.model, ids, v.factory, backend=v.backend) for v in rows}
    plain = score(ctx.model, ids, plain_rows(ctx, record, svd)["static"])
    r = rows[0].extra["rank"]
    for v in rows:
        assert res[v.name]["bytes_per_token"] == plain["bytes_per_token"]  # same bytes as plain static
        assert res[v.name]["chunks_max"] == 1
        traces = v.extra["residual_by_position"]
        assert set(traces) == {"post_svd", "planes", "pre_svd"}
        assert all(0 <= x <= 1 for t in traces.values() for x in t.values())
    # the pre-RoPE row equals lab/experiments/_project.py's ablation (R2), up to the float32 model
    pre = [static_basis(record, load_svd(ctx.out, pre_rope=True), li, rank=r) for li in range(len(svd))]
    proj = score_projected(ctx.model, ids, pre, pre_rope=True)
    np.testing.assert_allclose(res[rows[1].name]["nll"], proj["nll"], atol=1e-3)
    # energy bookkeeping: the planes keep no more than the post-RoPE SVD basis (Eckart-Young)
    e = rows[0].extra["energy_retained"]
    assert e["planes"] <= e["post_svd"] + 1e-12
