"""The byte-budget allocator (subspace_ref/allocation.py): hull greedy against brute force,
bytes as subspace_ref/byte_convention.py counts them, serialisation, and a run on the shipped model's calibration data."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from subspace_ref.allocation import (Allocation, Candidate, HeadAllocation, allocate, allocation_bases, greedy, lower_hull,
                                     plane_rows, side_losses)
from subspace_ref.lab.baselines.combined import Subspace
from subspace_ref.byte_convention import Geometry, side_parts


def test_lower_hull_drops_dominated_and_concave_points():
    c = [Candidate(0, 10, "a"), Candidate(1, 4, "b"), Candidate(2, 3.9, "c"), Candidate(3, 1, "d"), Candidate(4, 2, "e")]
    assert [x.config for x in lower_hull(c)] == ["a", "b", "d"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("unit_cost", [True, False])
def test_greedy_matches_brute_force_on_convex_tables(seed, unit_cost):
    """Convex decreasing loss curves (known optimum): with equal step costs the greedy hull walk
    equals exhaustive search at every budget; with unequal costs it is never worse than the
    optimum of the budget less one step (its prefix before a skipped step is a Lagrangian optimum)."""
    rng = np.random.default_rng(seed)
    tables, costs = {}, []
    for key in range(3):
        decay = rng.uniform(0.2, 0.9)
        cost = 1 if unit_cost else int(rng.integers(1, 4))
        costs.append(cost)
        tables[key] = [Candidate(float(cost * r), float(10 * decay**r), r) for r in range(6)]

    def best(budget):
        return min(sum(tables[k][r].loss for k, r in enumerate(rs)) for rs in itertools.product(range(6), repeat=3)
                   if sum(tables[k][r].bytes for k, r in enumerate(rs)) <= budget)

    for budget in range(0, 20):
        _, spent, loss = greedy(tables, budget)
        assert spent <= budget + 1e-9 and loss >= best(budget) - 1e-12
        if unit_cost:
            assert loss == pytest.approx(best(budget))
        else:
            assert loss <= best(max(0, budget - max(costs) + 1)) + 1e-12


def test_two_heads_known_optimum():
    """Head 0's loss falls 10x faster per byte than head 1's: every byte goes to head 0 first."""
    geom = Geometry(1, 2, 8, 8, 64)
    losses = [[{("key", "post_rope"): {(r, 16): 100.0 * 0.1**r for r in range(9)}, ("value", "subspace"): {(r, 16): 1.0 * 0.5**r for r in range(9)}},
               {("key", "post_rope"): {(r, 16): 1.0 * 0.5**r for r in range(9)}, ("value", "subspace"): {(r, 16): 1.0 * 0.5**r for r in range(9)}}]]
    a = allocate(losses, geom, bytes_per_token=a_bytes(geom, [(3, 0), (1, 0)]))
    assert [(h.rank_k, h.rank_v) for h in a.heads[0]] == [(3, 0), (1, 0)]


def a_bytes(geom, ranks):
    h = [HeadAllocation(rk, rv) for rk, rv in ranks]
    return Allocation((tuple(h),), 32).bytes(geom).per_token


def test_bytes_are_budget_py_bytes():
    """fp16 and int8 coefficients at uniform ranks cost what budget.py's Subspace rows cost."""
    geom = Geometry(4, 2, 64, 64, 1024)
    for coefficients, bits in (("fp16", 16), ("int8", 8)):
        a = Allocation(tuple(tuple(HeadAllocation(20, 12, bits, bits) for _ in range(2)) for _ in range(4)), 32)
        assert a.bytes(geom).per_token == pytest.approx(Subspace(20, 12, coefficients).bytes(geom).per_token)
    # int4 keys: codes of complete groups, fp16 scale + zero per group and channel, the tail in fp16
    geom = Geometry(1, 1, 64, 64, 100)
    parts = side_parts(geom, "key", 10, 4, 32)
    assert parts["key_codes"] == pytest.approx(5 * 96 / 100) and parts["key_scales"] == pytest.approx(4 * 10 * 3 / 100)
    assert parts["key_tail"] == pytest.approx(10 * 2 * 4 / 100)


def test_round_trip_and_bad_values():
    a = Allocation(((HeadAllocation(3, 2, 4, 2, "pre_rope"), HeadAllocation(1, 0)),), 16, 123.0, 8, 4, 0.5)
    assert Allocation.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    with pytest.raises(ValueError, match="bits_k"):
        HeadAllocation(1, 1, bits_k=3)
    with pytest.raises(ValueError, match="key_basis"):
        HeadAllocation(1, 1, key_basis="planes")
    with pytest.raises(ValueError, match="rank_k must be even"):
        HeadAllocation(3, 1, key_basis="plane")
    p = Allocation(((HeadAllocation(4, 2, 4, 2, "plane"),),), 16, calibration_loss=0.25)
    assert Allocation.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ValueError, match="exactly one"):
        allocate([], Geometry(1, 1, 8, 8, 8))


def test_measured_losses_fall_with_rank_and_bits():
    """side_losses on synthetic low-rank data: the loss falls with rank and bits, and reaches 0
    at full rank in fp16 (the reconstruction is exact)."""
    rng = np.random.default_rng(0)
    N, d = 256, 8
    K = rng.standard_normal((N, 3)) @ rng.standard_normal((3, d)) + 0.01 * rng.standard_normal((N, d))
    V = rng.standard_normal((N, d))
    layer = dict(keys=K, values=V, keys_pre=None, positions=np.arange(N),
                 Wk=np.linalg.svd(K, full_matrices=False)[2], Wv=np.linalg.svd(V, full_matrices=False)[2])
    out = side_losses(layer, 0, rng.standard_normal((64, d)), range(d + 1), group=32)
    key = out[("key", "post_rope")]
    assert key[(d, 16)] == pytest.approx(0, abs=1e-20) and key[(3, 16)] < 0.01 * key[(2, 16)]
    assert key[(3, 2)] > key[(3, 4)] > key[(3, 8)] > key[(3, 16)]


def test_allocation_on_the_shipped_model():
    """The allocator on the shipped model's calibration data (one 128-token window): it fits its
    budget, and its measured loss is at most that of the best uniform configuration (same bits
    on both sides, post- or pre-RoPE keys) at no more bytes, which is one of its candidates."""
    from subspace_ref.lab.experiments import _common as C
    from subspace_ref.lab.experiments.baselines import uniform
    from subspace_ref.hf.calibration_losses import calibration_losses

    model, _ = C.load_model("default")
    ids = C.windows("train", 1, 128, C.SEED_BASES)
    ranks = tuple(range(0, 65, 16))
    data = calibration_losses(model, ids, ranks=ranks)
    geom = Geometry.of_model(model, 128)
    for fraction in (0.25, 0.125):
        a = allocate(data.losses, geom, compression_ratio=fraction)
        assert a.bytes(geom).fraction <= fraction + 1e-9
        assert a.bytes(geom).per_token == pytest.approx(a.meta["bytes_per_token"])
        for bits in (4, 2):
            for kind in ("post_rope", "pre_rope"):
                u = uniform(geom, fraction, bits, kind)
                r = max(x for x in ranks if x <= u.heads[0][0].rank_v)  # on the measured grid
                loss = sum(t[("key", kind)][(r, bits)] + t[("value", "subspace")][(r, bits)] for layer in data.losses for t in layer)
                assert a.calibration_loss <= loss * (1 + 1e-12)


# ----------------------------------------------------------------------------- plane key bases (spec/rope.md P4, R5)
def _rope(d, layout="half", scaling=1.0, rotary_dim=None):
    from subspace_ref.rope import RopeParams

    rot = d if rotary_dim is None else rotary_dim
    return RopeParams(1.0 / 37.0 ** (np.arange(0, rot, 2) / rot), layout, scaling)


def _key_loss(K, Q, W, r):
    """The allocator's fp16 key loss without its constant factors: E_{q,t} (q . (k_t - P k_t))^2."""
    dk = K - K @ W[:r].T @ W[:r]
    return float(np.mean((Q @ dk.T) ** 2))


@pytest.mark.parametrize("layout,scaling,rot", [("half", 1.0, None), ("interleaved", 1.0, None), ("half", 1.2, 6)])
def test_R5_plane_rows_projection_commutes_with_rope(layout, scaling, rot):
    """R5 numerically: for the allocator's plane rows at every even rank, projecting post-RoPE keys
    equals rotating projected pre-RoPE keys at every position, the dropped energy is a^2 times the
    pre-RoPE one at every position (a = 1: equal), and the coefficients move by the kept planes'
    rotation blocks alone (B R_t = (B R_t B^T) B, with B R_t B^T orthogonal up to a)."""
    from subspace_ref.rope import rotate

    rng = np.random.default_rng(1)
    d, N = 10, 300
    rope = _rope(d, layout, scaling, rot)
    pos = rng.integers(0, 5000, N)
    K0 = rng.standard_normal((N, d)) * rng.uniform(0.1, 3, d)
    K = rotate(K0, pos, rope)
    W = plane_rows(K, rope.planes(d), rng.standard_normal((64, d)))
    assert np.allclose(W @ W.T, np.eye(d))
    for r in range(2, d + 1, 2):
        B = W[:r]
        P = B.T @ B
        np.testing.assert_allclose(K @ P, rotate(K0 @ P, pos, rope), atol=1e-12)
        drop, drop0 = np.sum((K - K @ P) ** 2, 1), np.sum((K0 - K0 @ P) ** 2, 1)
        if rot is None:  # every plane rotates: the factor a^2 on every dropped plane
            np.testing.assert_allclose(drop, scaling**2 * drop0, rtol=1e-10, atol=1e-12)
        for t in (0, 1, 17, 4096):
            Rt = rotate(np.eye(d), np.full(d, t), rope).T  # columns R_t e_j
            Rb = B @ Rt @ B.T
            np.testing.assert_allclose(B @ Rt, Rb @ B, atol=1e-12)
            np.testing.assert_allclose(Rb @ Rb.T, np.diag(np.diag(Rb @ Rb.T)), atol=1e-12)


def test_plane_selection_by_measured_loss_not_energy():
    """Keys with most energy on plane A, queries that read only plane B: the energy rule (P1)
    keeps A, the loss rule (P4) keeps B, and at every rank the loss rule's next plane is the one
    of least measured loss given the planes already kept (its greedy step)."""
    rng = np.random.default_rng(2)
    d, N = 8, 2000
    rope = _rope(d)
    pairs = rope.planes(d)
    K0 = rng.standard_normal((N, d)) * np.array([0.1, 3.0, 1.0, 0.2, 0.1, 3.0, 1.0, 0.2])  # planes (1, 5) = A, (2, 6) = B
    K = rotate_keys(K0, rope)
    Q = np.zeros((256, d))
    Q[:, [2, 6]] = rng.standard_normal((256, 2)) * 2
    Q[:, [0, 4]] = rng.standard_normal((256, 2)) * 0.5
    by_energy, by_loss = plane_rows(K, pairs), plane_rows(K, pairs, Q)
    assert set(np.flatnonzero(by_energy[:2].sum(0))) == {1, 5}
    assert set(np.flatnonzero(by_loss[:2].sum(0))) == {2, 6}
    assert _key_loss(K, Q, by_loss, 2) < 0.1 * _key_loss(K, Q, by_energy, 2)
    for r in range(0, d, 2):
        kept = by_loss[:r]
        losses = []
        for p in pairs:
            if np.abs(kept[:, p]).sum() == 0:
                W = np.zeros((r + 2, d))
                W[:r] = kept
                W[r, p[0]] = W[r + 1, p[1]] = 1
                losses.append(_key_loss(K, Q, W, r + 2))
        assert _key_loss(K, Q, by_loss, r + 2) == pytest.approx(min(losses), rel=1e-12, abs=1e-15)


def rotate_keys(K0, rope):
    from subspace_ref.rope import rotate

    return rotate(K0, np.arange(len(K0)), rope)


def test_allocator_picks_planes_when_they_are_cheapest_for_the_loss():
    """The constructed example above through side_losses and allocate: at the bytes of rank-2 keys
    the post- and pre-RoPE SVD bases keep the high-energy plane the queries ignore; the plane
    basis (P4) keeps the plane they read, so its loss is lowest and the allocator picks it. With
    the plane kind withheld, it picks an SVD kind at a higher loss."""
    rng = np.random.default_rng(3)
    d, N = 8, 512
    rope = _rope(d)
    K0 = rng.standard_normal((N, d)) * np.array([0.1, 3.0, 1.0, 0.2, 0.1, 3.0, 1.0, 0.2])
    K = rotate_keys(K0, rope)
    V = rng.standard_normal((N, d))
    Q = np.zeros((128, d))
    Q[:, [2, 6]] = rng.standard_normal((128, 2)) * 2
    svd = lambda X: np.linalg.svd(X, full_matrices=False)[2]  # noqa: E731
    layer = dict(keys=K, keys_pre=K0, values=V, positions=np.arange(N), Wk=svd(K), Wk_pre=svd(K0), Wv=svd(V), Wk_plane=plane_rows(K, rope.planes(d), Q))
    table = side_losses(layer, 0, Q, range(d + 1), bits=(16,), rope=rope)
    assert set(k for k, _ in table if k == "key") and ("key", "plane") in table
    assert all(r % 2 == 0 for r, _ in table[("key", "plane")])
    assert table[("key", "plane")][(2, 16)] < 0.01 * min(table[("key", "post_rope")][(2, 16)], table[("key", "pre_rope")][(2, 16)])
    table[("value", "subspace")] = {(0, 16): table[("value", "subspace")][(0, 16)]}  # every byte goes to the keys
    geom = Geometry(1, 1, d, d, 64)
    budget = a_bytes(geom, [(2, 0)])
    a = allocate([[table]], geom, bytes_per_token=budget)
    assert a.heads[0][0].key_basis == "plane" and a.heads[0][0].rank_k == 2
    without = {k: v for k, v in table.items() if k != ("key", "plane")}
    b = allocate([[without]], geom, bytes_per_token=budget)
    svd_best = min(table[("key", kind)][(r, 16)] for kind in ("post_rope", "pre_rope") for r in (1, 2))
    assert b.heads[0][0].key_basis != "plane" and b.calibration_loss - a.calibration_loss > 0.99 * svd_best
    # the state stores a plane basis as dense rows: counted as a post-RoPE basis of the same rank
    same = Allocation(((HeadAllocation(2, 0, key_basis="post_rope"),),))
    assert a.bytes(geom).per_token == same.bytes(geom).per_token == budget


def test_plane_allocation_builds_plain_static_states_and_persists(tmp_path):
    """An allocation with plane heads builds plain static states (no rope) whose attention equals
    exact attention over the projected post-RoPE keys and values, and the bases with the
    allocation round-trip through the artifact."""
    import subspace_ref
    from subspace_ref import SubspaceState, exact_attention
    from subspace_ref.hf.artifact import CalibratedBases

    rng = np.random.default_rng(4)
    d, N, H = 8, 40, 2
    rope = _rope(d)
    K = np.stack([rotate_keys(rng.standard_normal((N, d)), rope) for _ in range(H)])
    V = rng.standard_normal((H, N, d))
    Q = rng.standard_normal((64, d))
    planes = [np.stack([plane_rows(K[h], rope.planes(d), Q) for h in range(H)])]
    svd = [dict(Wk=np.stack([np.linalg.svd(K[h])[2] for h in range(H)]), Wv=np.stack([np.linalg.svd(V[h])[2] for h in range(H)]))]
    alloc = Allocation(((HeadAllocation(4, 3, key_basis="plane"), HeadAllocation(5, 2)),))
    with pytest.raises(ValueError, match="planes"):
        allocation_bases(alloc, svd)
    (basis,) = allocation_bases(alloc, svd, planes=planes)
    st = SubspaceState.static(basis)
    st.append(K, V)
    q = rng.standard_normal((H, d))
    P = [basis.B[h, : basis.rank_k[h]].T @ basis.B[h, : basis.rank_k[h]] for h in range(H)]
    E = [basis.E[h, : basis.rank_v[h]].T @ basis.E[h, : basis.rank_v[h]] for h in range(H)]
    want = np.stack([exact_attention(q[h : h + 1], (K[h] @ P[h])[None], (V[h] @ E[h])[None])[0] for h in range(H)])
    np.testing.assert_allclose(subspace_ref.attend(q, st, backend="numpy"), want, atol=1e-12)
    np.testing.assert_array_equal(basis.B[0, :4], planes[0][0, :4])
    cb = CalibratedBases((basis,), "x" * 64, allocation=alloc)
    back = CalibratedBases.from_pretrained(cb.save_pretrained(tmp_path / "b"))
    assert back.allocation.heads == alloc.heads and back.allocation.heads[0][0].key_basis == "plane"
    np.testing.assert_array_equal(back.layers[0].B, basis.B)
    with pytest.raises(ValueError, match="svd_pre"):  # a pre-RoPE head needs the pre-RoPE bases
        allocation_bases(Allocation(((HeadAllocation(4, 3, key_basis="pre_rope"), HeadAllocation(4, 2, key_basis="plane")),)), svd, planes=planes)


def test_plane_rows_bad_input():
    pairs = _rope(8).planes(8)
    K = np.ones((5, 8))
    with pytest.raises(ValueError, match="keys"):
        plane_rows(np.ones(8), pairs)
    with pytest.raises(ValueError, match="pairs"):
        plane_rows(K, pairs[:3])
    with pytest.raises(ValueError, match="pairs"):
        plane_rows(K, np.array([[0, 1], [0, 1], [4, 5], [6, 7]]))
    with pytest.raises(ValueError, match="queries"):
        plane_rows(K, pairs, np.ones((3, 6)))
    with pytest.raises(TypeError, match="alloc"):
        allocation_bases({"heads": []}, [])
