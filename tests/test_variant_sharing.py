"""Sharing under GQA (spec/sharing.md): the logit-error objective (S1-S6), query-aware key
bases (A1, A1', A2), per-query-head static states (A3, B1), the cache argument, the rows."""

from __future__ import annotations


import numpy as np
import pytest
import scipy.linalg

import subspace_ref
from subspace_ref import StaticBasis, SubspaceState, exact_attention
from subspace_ref.sharing import (calibrate_query_heads, logit_error, query_aware_key_basis, second_moment,
                                  shared_query_aware_key_basis)

from conftest import random_orthonormal

HKV, G, D = 2, 2, 8
HQ = HKV * G


def moments(rng, d=D, n=400):
    """Anisotropic keys and correlated queries, so the query-aware basis differs from PCA."""
    Xk = rng.standard_normal((n, d)) * np.linspace(3.0, 0.3, d)
    Xq = rng.standard_normal((n, d)) @ rng.standard_normal((d, d))
    return Xq, Xk, second_moment(Xq), second_moment(Xk)


def pca(K, r):
    w, V = scipy.linalg.eigh(K)
    return V[:, ::-1][:, :r].T


# ----------------------------------------------------------------------------- S1-S6
def test_s1_logit_error_is_the_mean_over_all_query_key_pairs(rng):
    """S1: with sample moments, tr(Sigma_q Q Sigma_k Q) is exactly the mean of (q_i^T Q k_j)^2
    over all pairs (i, j), computed here by brute force."""
    Xq, Xk, A, K = moments(rng, n=60)
    B = random_orthonormal(rng, r=3, d=D)
    Q = np.eye(D) - B.T @ B
    brute = np.mean([(q @ Q @ k) ** 2 for q in Xq for k in Xk])
    assert logit_error(B, A, K) == pytest.approx(brute, rel=1e-12)


def test_s2_s3_gradient_matches_finite_differences(rng):
    """S2/S3: the Euclidean gradient in U of f(U U^T) is 2 G U with G = -(K Q A + A Q K)."""
    _, _, A, K = moments(rng)
    U = random_orthonormal(rng, r=3, d=D).T
    Q = np.eye(D) - U @ U.T
    grad = 2 * -(K @ Q @ A + A @ Q @ K) @ U
    f = lambda V: float(np.trace(A @ (np.eye(D) - V @ V.T) @ K @ (np.eye(D) - V @ V.T)))  # noqa: E731
    Z = rng.standard_normal(U.shape)
    eps = 1e-6
    fd = (f(U + eps * Z) - f(U - eps * Z)) / (2 * eps)
    assert fd == pytest.approx(float(np.sum(grad * Z)), rel=1e-6)


@pytest.mark.parametrize("r", [1, 3, 6])
def test_s4_query_aware_never_worse_than_pca_and_strictly_better_here(rng, r):
    _, _, A, K = moments(rng)
    B = query_aware_key_basis(A, K, r)
    assert B.shape == (r, D)
    np.testing.assert_allclose(B @ B.T, np.eye(r), atol=1e-12)
    f_pca, f_qa = logit_error(pca(K, r), A, K), logit_error(B, A, K)
    assert f_qa <= f_pca
    assert f_qa < 0.98 * f_pca  # correlated queries: the query-aware basis really helps


def test_s4_isotropic_queries_reach_the_pca_optimum(rng):
    """Sigma_q = c I: f = c tr(Sigma_k Q), minimised by PCA at c x (sum of the d - r smallest
    eigenvalues of Sigma_k) (Ky Fan); the calibration reaches it."""
    _, _, _, K = moments(rng)
    c, r = 2.5, 3
    B = query_aware_key_basis(c * np.eye(D), K, r)
    w = np.sort(np.linalg.eigvalsh(K))
    assert logit_error(B, c * np.eye(D), K) == pytest.approx(c * w[: D - r].sum(), rel=1e-10)


def test_s4_start_is_never_beaten_by_the_result(rng):
    _, _, A, K = moments(rng)
    start = random_orthonormal(rng, r=3, d=D)
    B = query_aware_key_basis(A, K, 3, start=start, iterations=0)
    assert logit_error(B, A, K) <= logit_error(start, A, K) + 1e-12


def test_s5_s6_shared_and_per_query_head_ordering(rng):
    """S5: the shared basis is never worse than PCA on the group's sum; S6: each query head's own
    basis is never worse than the shared one on its own f."""
    Aq = np.stack([moments(rng)[2] for _ in range(G)])
    K = moments(rng)[3]
    r = 3
    shared = shared_query_aware_key_basis(Aq, K, r)
    total = lambda B: sum(logit_error(B, a, K) for a in Aq)  # noqa: E731
    assert total(shared) <= total(pca(K, r))
    basis = calibrate_query_heads(Aq, K[None], random_orthonormal(rng, 1, r=2, d=D), r)
    assert basis.heads == G and basis.rank_k == (r,) * G
    for i in range(G):
        assert logit_error(basis.B[i], Aq[i], K) <= logit_error(shared, Aq[i], K) + 1e-12
    kv = calibrate_query_heads(Aq, K[None], random_orthonormal(rng, 1, r=2, d=D), r, share="kv_head")
    assert kv.heads == 1
    np.testing.assert_allclose(kv.B[0].T @ kv.B[0], shared.T @ shared, atol=1e-10)


def test_calibration_bad_input_names_the_argument(rng):
    _, _, A, K = moments(rng)
    with pytest.raises(ValueError, match="r must lie"):
        query_aware_key_basis(A, K, D + 1)
    with pytest.raises(ValueError, match="Sigma_q has shape"):
        query_aware_key_basis(A[:4, :4], K, 2)
    with pytest.raises(ValueError, match="Sigma_k must be symmetric"):
        query_aware_key_basis(A, K + np.triu(np.ones((D, D)), 1), 2)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        calibrate_query_heads(np.stack([A] * 3), np.stack([K] * 2), np.zeros((2, 1, D)), 2)
    with pytest.raises(ValueError, match="share must be"):
        calibrate_query_heads(np.stack([A] * 2), K[None], np.zeros((1, 1, D)), 2, share="group")


# ----------------------------------------------------------------------------- A3 states
def per_query_basis(rng, r, r_v, gamma=1.0):
    B = random_orthonormal(rng, HQ, r=r, d=D)
    E = np.repeat(random_orthonormal(rng, HKV, r=r_v, d=D), G, axis=0)
    return StaticBasis.from_bases(B, E, gamma)


def test_a3_full_rank_equals_exact_gqa_attention(rng):
    basis = per_query_basis(rng, D, D)
    st = SubspaceState.static(basis, query_group=G)
    K, V = rng.standard_normal((HKV, 9, D)), rng.standard_normal((HKV, 9, D))
    st.append(K[:, :4], V[:, :4]).append(K[:, 4], V[:, 4]).append(K[:, 5:], V[:, 5:])
    assert st.heads == HQ and st.kv_heads == HKV and st.num_tokens == 9
    q = rng.standard_normal((HQ, D))
    np.testing.assert_allclose(subspace_ref.attend(q, st), exact_attention(q, K, V), rtol=0, atol=1e-12)


def test_a3_low_rank_equals_attention_over_per_query_projections(rng):
    """Query head i attends K_{i // g} B_i^T B_i and V_{i // g} E^T E (hand computation), with gamma."""
    r, r_v = 3, 5
    basis = per_query_basis(rng, r, r_v, gamma=np.linspace(0.8, 1.3, HQ))
    st = SubspaceState.static(basis, query_group=G, batch=2)
    K, V = rng.standard_normal((2, HKV, 7, D)), rng.standard_normal((2, HKV, 7, D))
    st.append(K, V)
    q = rng.standard_normal((2, HQ, D))
    Kq, Vq = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)
    Kp = np.einsum("nhtd,hrd,hre->nhte", Kq, basis.B, basis.B) * basis.gamma[None, :, None, None]
    Vp = np.einsum("nhtd,hrd,hre->nhte", Vq, basis.E, basis.E)
    np.testing.assert_allclose(subspace_ref.attend(q, st), exact_attention(q, Kp, Vp), rtol=0, atol=1e-12)
    # and it differs from the plain per-KV-head state (each query head really has its own basis)
    plain = SubspaceState.static(StaticBasis.from_bases(basis.B[::G], basis.E[::G], basis.gamma[::G]), batch=2).append(K, V)
    assert np.abs(subspace_ref.attend(q, plain) - subspace_ref.attend(q, st)).max() > 1e-3


def test_b1_nbytes_by_hand(rng):
    r, r_v, T, N = 3, 5, 6, 2
    st = SubspaceState.static(per_query_basis(rng, r, r_v), query_group=G, batch=N)
    st.append(rng.standard_normal((N, HKV, T, D)), rng.standard_normal((N, HKV, T, D)))
    coef = N * HQ * T * (r + r_v) * 8  # per query head, values included (B1)
    bases = N * HQ * (r * D + r_v * D) * 8
    assert st.nbytes == coef + bases + HQ * 8
    plain = SubspaceState.static(StaticBasis.from_bases(random_orthonormal(rng, HKV, r=r, d=D),
                                                        random_orthonormal(rng, HKV, r=r_v, d=D)), batch=N)
    plain.append(rng.standard_normal((N, HKV, T, D)), rng.standard_normal((N, HKV, T, D)))
    assert st.nbytes == G * plain.nbytes


def test_a3_bad_input_is_refused_and_state_unchanged(rng):
    basis = per_query_basis(rng, 3, 3)
    with pytest.raises(ValueError, match="query_group = 3 must divide"):
        SubspaceState.static(basis, query_group=3)
    with pytest.raises(ValueError, match="query_group must be >= 1"):
        SubspaceState.static(basis, query_group=0)
    with pytest.raises(TypeError, match="query_group must be an int"):
        SubspaceState.static(basis, query_group=2.0)
    st = SubspaceState.static(basis, query_group=G).append(rng.standard_normal((HKV, 2, D)), rng.standard_normal((HKV, 2, D)))
    before = {k: v.copy() for k, v in st.layout.live_arrays().items()}
    with pytest.raises(ValueError, match=r"keys has shape \(4, 1, 8\); expected \(2, \*, 8\)"):
        st.append(rng.standard_normal((HQ, 1, D)), rng.standard_normal((HQ, 1, D)))  # query heads, not KV heads
    with pytest.raises(ValueError, match="values has shape"):
        st.append(rng.standard_normal((HKV, 1, D)), rng.standard_normal((HQ, 1, D)))
    assert st.num_tokens == 2
    for k, v in st.layout.live_arrays().items():
        np.testing.assert_array_equal(v, before[k])


def test_persistence_refuses_per_query_state_before_writing(tmp_path, rng):
    st = SubspaceState.static(per_query_basis(rng, 3, 3), query_group=G).append(np.ones((HKV, D)), np.ones((HKV, D)))
    path = tmp_path / "s.safetensors"
    with pytest.raises(NotImplementedError, match=r"query_group=2 cannot be saved.*spec/sharing.md"):
        st.save(path)
    assert not path.exists()
    # a plain state built with the default query_group=1 still round-trips
    plain = SubspaceState.static(per_query_basis(rng, 3, 3)).append(np.ones((HQ, D)), np.ones((HQ, D)))
    assert plain.policy.query_group is None
    plain.save(path)
    np.testing.assert_array_equal(SubspaceState.load(path).reconstruct()[0], plain.reconstruct()[0])


def test_torch_backend_agrees_with_the_oracle(rng):
    torch = pytest.importorskip("torch")
    basis = per_query_basis(rng, 3, 5, gamma=np.linspace(0.9, 1.2, HQ))
    st = SubspaceState.static(basis, query_group=G, batch=2)
    tst = st.to("torch")
    K, V = rng.standard_normal((2, HKV, 6, D)), rng.standard_normal((2, HKV, 6, D))
    st.append(K, V)
    tst.append(torch.from_numpy(K), torch.from_numpy(V))
    q = rng.standard_normal((2, HQ, D))
    got = subspace_ref.attend(torch.from_numpy(q), tst, backend="torch").numpy()
    np.testing.assert_allclose(got, subspace_ref.attend(q, st), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="keys has shape"):
        tst.append(torch.zeros(2, HQ, D, dtype=torch.float64), torch.zeros(2, HQ, D, dtype=torch.float64))
    assert tst.num_tokens == 6


# ----------------------------------------------------------------------------- cache and rows
@pytest.fixture
def tiny(tiny_calibration):
    return tiny_calibration


def test_cache_per_query_full_rank_equals_stock_model(tiny):
    """share="query_head" with distinct full-rank key bases per query head: the stock model's
    log-probabilities (A3 exactness through the cache), on the torch backend."""
    from subspace_ref.lab.experiments.ppl import score
    from subspace_ref.hf import static_states

    ctx, record, svd = tiny
    ids = ctx.eval_windows()[:1]
    H_kv, d = record["kv_heads"], ctx.d
    g = ctx.model.config.num_attention_heads // H_kv
    rng = np.random.default_rng(0)
    full = [StaticBasis.from_bases(random_orthonormal(rng, H_kv * g, r=d, d=d), np.repeat(random_orthonormal(rng, H_kv, r=d, d=d), g, 0))
            for _ in svd]
    stock = score(ctx.model, ids)["nll"]
    got = score(ctx.model, ids, static_states(full, share="query_head", dtype=np.float64))["nll"]
    np.testing.assert_allclose(got, stock, atol=1e-4)
    with pytest.raises(ValueError, match="share must be"):
        static_states(full, share="group")


def test_rows_run_and_report_heldout_logit_errors(tiny):
    from subspace_ref.lab.experiments.ppl import score
    from subspace_ref.lab.experiments.variant_rows import plain_rows
    from subspace_ref.lab.experiments.variant_rows.sharing import variants

    ctx, record, svd = tiny
    rows = variants(ctx, record, svd)
    assert [v.name.rsplit("_r", 1)[0] for v in rows] == ["shared_qa", "per_query", "per_query_matched"]
    ids = ctx.eval_windows()
    plain = score(ctx.model, ids, plain_rows(ctx, record, svd)["static"])
    res = {v.name: score(ctx.model, ids, v.factory, backend=v.backend) for v in rows}
    g = rows[0].extra["group_size"]
    assert res[rows[0].name]["bytes_per_token"] == plain["bytes_per_token"]
    assert res[rows[1].name]["bytes_per_token"] == g * plain["bytes_per_token"]
    # matched coefficient and basis bytes; only gamma has H_q entries instead of H (B2)
    assert plain["bytes_per_token"] <= res[rows[2].name]["bytes_per_token"] <= 1.01 * plain["bytes_per_token"]
    assert all(np.isfinite(r["nll"]).all() for r in res.values())
    ex = rows[0].extra
    # on the calibration moments the orderings S5/S6 hold by construction
    fc = ex["calibration_logit_error"]
    assert fc["per_query"] <= fc["shared_qa"] <= fc["plain_pca"]
    assert set(ex["heldout_f_reduction"]) == {"shared_qa", "per_query", "per_query_matched"}
