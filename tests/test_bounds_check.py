"""``subspace_ref.lab.bounds.check``: the report (spec B0) — rows, worst head, GQA, premises,
allowances, printing and ``to_dict``."""

import json
import math

import numpy as np
import pytest
from conftest import state_from_chunks

from subspace_ref import StaticBasis, SubspaceState, attend, calibrate
from subspace_ref.lab.bounds import CLAIMS, BoundsReport, check


def stream(rng, H, T, d, rank, noise=0.05):
    W = rng.standard_normal((H, rank, d))
    return np.einsum("htr,hrd->htd", rng.standard_normal((H, T, rank)), W) + noise * rng.standard_normal((H, T, d))


def test_report_has_one_row_per_statement_and_serialises(rng):
    K, V = stream(rng, 2, 50, 8, 3), stream(rng, 2, 50, 8, 3)
    state = SubspaceState.adaptive(2, 8, rank_k=3, rank_v=3, gamma="paper")
    state.append(K, V)
    report = check(rng.standard_normal((4, 8)), K, V, state)
    assert isinstance(report, BoundsReport)
    assert [r.id for r in report.rows] == list(CLAIMS)
    d = report.to_dict()
    text = json.dumps(d)  # plain JSON: infinities and nans as strings
    assert "NaN" not in text and "Infinity" not in text
    assert set(d) == {"rows", "predictors", "info"}
    assert d["info"]["query_heads"] == 4 and d["info"]["gamma"] == pytest.approx([math.sqrt(3 / 8)] * 2)
    printed = str(report)
    for cid in CLAIMS:
        assert f"\n{cid} " in printed
    assert "predictors:" in printed
    assert not report.violations


def test_approximate_logits_are_what_attend_computes(rng):
    # check's l_hat = gamma s K_hat q must be the logits attend uses: the outputs agree
    K, V = stream(rng, 2, 40, 6, 2), stream(rng, 2, 40, 6, 2)
    state = SubspaceState.adaptive(2, 6, rank_k=2, rank_v=2, tau_k=0.1, tau_v=0.1, gamma=0.7)
    state.append(K, V)
    report = check(rng.standard_normal((2, 6)), K, V, state)
    assert report.predictors["attend_consistency"] <= 1e-12
    assert len(report.predictors["chunk_residuals_k"][0]) == sum(b > a for a, b in state.chunk_bounds(0))


def test_grouped_query_heads_read_their_kv_head(rng):
    # KV head 1 is stored exactly, KV head 0 loses a direction: with H_q = 4 (g = 2), only
    # query heads 0 and 1 (reading KV head 0) can have a logit error
    d = 4
    K = rng.standard_normal((2, 10, d))
    V = rng.standard_normal((2, 10, d))
    B = np.zeros((2, 3, d))
    B[0] = np.eye(d)[:3]
    B[1] = np.linalg.qr(K[1, :3].T)[0].T  # span of K[1, :3] ...
    K[1] = K[1, :3][rng.integers(0, 3, 10)]  # ... which holds every key of head 1
    state = SubspaceState.static(StaticBasis.from_bases(B, np.tile(np.eye(d), (2, 1, 1))))
    state.append(K, V)
    q = rng.standard_normal((4, d))
    report = check(q, K, V, state)
    assert report["B1"].where in ("query head 0", "query head 1")
    s = 1 / math.sqrt(d)
    K_hat, _ = state.reconstruct()
    for hq in (2, 3):
        assert np.abs(s * K[1] @ q[hq] - s * K_hat[1] @ q[hq]).max() < 1e-12


def test_worst_head_and_held_over_all_heads(rng):
    d = 4
    K = rng.standard_normal((2, 12, d))
    V = rng.standard_normal((2, 12, d))
    # head 0 with gamma = 1 (B1 guaranteed), head 1 with gamma = 2 and its keys in span(B): fails
    B = np.zeros((2, 2, d))
    B[0] = np.eye(d)[:2]
    B[1] = np.eye(d)[:2]
    K[1, :, 2:] = 0.0
    state = SubspaceState.static(StaticBasis.from_bases(B, np.tile(np.eye(d), (2, 1, 1)), gamma=[1.0, 2.0]))
    state.append(K, V)
    report = check(rng.standard_normal((2, d)), K, V, state)
    row = report["B1"]
    assert not row.held and not row.guarantee and row.where == "query head 1"
    assert row.ratio == math.inf and "γ ≠ 1" in row.status
    assert report["B1.c"].held and not report.violations


def test_static_state_has_no_sketch_rows(rng):
    K, V = stream(rng, 1, 30, 6, 2), stream(rng, 1, 30, 6, 2)
    state = SubspaceState.static(calibrate(K, V, rank_k=2, rank_v=2))
    state.append(K, V)
    report = check(rng.standard_normal((1, 6)), K, V, state)
    for cid in ("B5.1", "B5.2", "B6.1", "B6.2", "B6.3"):
        assert not report[cid].applicable and report[cid].status.startswith("n/a")
    assert report.predictors["fd_eps_k"] is None
    assert report["B1"].guarantee and report["B1"].held  # static, gamma = 1


def test_adaptive_with_several_chunks_has_no_single_basis_rows(rng):
    K = np.concatenate([stream(rng, 1, 30, 8, 2), stream(rng, 1, 30, 8, 2)], axis=1)
    state = SubspaceState.adaptive(1, 8, rank_k=2, rank_v=2, tau_k=0.3, tau_v=0.3)
    state.append(K, K)
    assert state.num_chunks[0] > 1
    report = check(rng.standard_normal((1, 8)), K, K, state)
    assert not report["B1"].applicable and report["B2"].applicable
    assert report["B2"].guarantee  # adaptive, gamma = 1: a projection state
    assert not report.violations


def test_int8_coefficients_are_not_projections(rng):
    # spec A10: quantised coefficients break k_hat = P_B k; the paper forms are then not guaranteed,
    # the corrected forms (stated with K_hat) still hold
    K, V = stream(rng, 1, 40, 8, 3, noise=0.0), stream(rng, 1, 40, 8, 3, noise=0.0)
    state = SubspaceState.static(calibrate(K, V, rank_k=3, rank_v=3), coefficients="int8")
    state.append(K, V)
    report = check(rng.standard_normal((1, 8)) * 30, K, V, state)
    assert "int8 coefficients" in report["B2"].status and not report["B2"].guarantee
    assert report["B7"].guarantee  # seed 003's statement uses the reconstruction
    assert not report.violations


def test_float32_state_uses_float32_rounding(rng):
    K, V = stream(rng, 1, 40, 8, 3), stream(rng, 1, 40, 8, 3)
    s64 = SubspaceState.rotating(1, 8, rank_k=3, rank_v=3, refresh_every=5)
    s32 = SubspaceState.rotating(1, 8, rank_k=3, rank_v=3, refresh_every=5, dtype=np.float32)
    s64.append(K, V)
    s32.append(K, V)
    q = rng.standard_normal((1, 8))
    r64, r32 = check(q, K, V, s64), check(q, K, V, s32)
    assert r32.info["unit_roundoff"] == np.finfo(np.float32).eps / 2
    assert r64.info["unit_roundoff"] == np.finfo(np.float64).eps / 2
    assert r32["B7"].allowance > 1e6 * r64["B7"].allowance
    assert not r32.violations and not r64.violations


def test_sketch_reset_measures_the_rows_since_the_reset(rng):
    # spec A7 step 3b: after a reset the sketch summarises only recent rows; B5 over the whole
    # history would be wrong (the sketch forgot the old rows on purpose)
    d = 12
    W = np.linalg.qr(rng.standard_normal((d, d)))[0]
    K = np.concatenate([rng.standard_normal((80, 3)) @ W[:3], rng.standard_normal((80, 3)) @ W[6:9]])[None]
    state = SubspaceState.adaptive(1, d, rank_k=3, rank_v=3, sketch_reset=True)
    state.append(K, K)
    report = check(rng.standard_normal((1, d)), K, K, state)
    assert report["B5.2"].applicable and report["B5.2"].held
    assert not report.violations


def test_inconsistent_sketch_is_not_measured(rng):
    # a state whose sketch never saw the history (built by hand): no FD rows rather than wrong ones
    K, V = rng.standard_normal((1, 10, 4)), rng.standard_normal((1, 10, 4))
    bases = np.stack([np.eye(4)[:2], np.eye(4)[2:]])[None]
    state = state_from_chunks(K, V, [0, 5], bases, bases)
    report = check(rng.standard_normal((1, 4)), K, V, state)
    assert not report["B5.2"].applicable
    assert report["B2"].guarantee and report["B2"].held


def test_rejects_bad_input(rng):
    K, V = stream(rng, 2, 10, 4, 2), stream(rng, 2, 10, 4, 2)
    state = SubspaceState.adaptive(2, 4, rank_k=2, rank_v=2)
    state.append(K, V)
    q = rng.standard_normal((2, 4))
    with pytest.raises(ValueError, match="K has shape"):
        check(q, K[:, :5], V, state)
    with pytest.raises(ValueError, match="V has shape"):
        check(q, K, V[:1], state)
    with pytest.raises(ValueError, match="q has shape"):
        check(q[:1].repeat(3, 0), K, V, state)
    with pytest.raises(ValueError, match="NaN"):
        check(q * np.nan, K, V, state)
    batched = SubspaceState.adaptive(2, 4, rank_k=2, rank_v=2, batch=1)
    batched.append(K[None], V[None])
    with pytest.raises(ValueError, match="unbatched"):
        check(q, K, V, batched)


def test_custom_scale_matches_attend(rng):
    K, V = stream(rng, 1, 20, 4, 2), stream(rng, 1, 20, 4, 2)
    state = SubspaceState.static(calibrate(K, V, rank_k=2, rank_v=2))
    state.append(K, V)
    q = rng.standard_normal((1, 4))
    report = check(q, K, V, state, scale=0.1)
    assert report.info["scale"] == 0.1
    assert report.predictors["attend_consistency"] < 1e-12
    o = attend(q, state, scale=0.1)
    assert np.isfinite(o).all() and not report.violations


def test_non_orthonormal_bases_are_no_projection(rng):
    # spec B0/B10.4: P = B^T B with non-orthogonal rows is no projector, so the paper forms lose
    # their premise; the corrected forms, stated with K_hat, still hold
    d = 3
    K, V = rng.standard_normal((1, 12, d)), rng.standard_normal((1, 12, d))
    skew = np.array([[[[1.0, 0.0, 0.0], [0.6, 0.8, 0.0]]]])  # unit rows, 0.6 apart
    state = state_from_chunks(K, V, [0], skew, skew)
    report = check(rng.standard_normal((1, d)), K, V, state)
    assert report.predictors["basis_orthonormality_error"] == pytest.approx(0.6)
    for cid in ("B2", "B4.2", "B8"):
        assert not report[cid].guarantee and "bases not orthonormal" in report[cid].status
    assert not report.violations
