"""Spec B1-B10: the statements as functions, their counterexamples (kept, so a paper form can
never silently become "verified"), and the tightness witnesses."""

import math

import numpy as np
import pytest

from subspace_ref import FrequentDirections
from subspace_ref.lab.bounds import CLAIMS, COUNTEREXAMPLES, check
from subspace_ref.lab.bounds import statements as st


def test_every_claim_has_a_function_and_paper_forms_are_complete():
    for cid, claim in CLAIMS.items():
        assert claim.function is not None, cid
        assert claim.kind in ("guarantee", "paper form"), cid
        if claim.kind == "paper form":
            # spec B0: a paper form always comes with a condition, a correction and a counterexample
            assert claim.condition and claim.corrected_by in CLAIMS and CLAIMS[claim.corrected_by].kind == "guarantee", cid
            assert cid in COUNTEREXAMPLES[claim.counterexample].refutes, cid


def test_formulas_as_written_in_the_papers():
    assert st.logit_single(0.5, 4, 3.0, 2.0) == pytest.approx(0.5 / 2 * 3 * 2)
    assert st.logit_multichunk(1.0, 4, 2.0, [1.0, 3.0, 2.0]) == pytest.approx(3.0)
    assert st.logit_multichunk(1.0, 4, 2.0, []) == 0.0
    assert st.logit_corrected(0.5, 4, 2.0, 1.0, 4.0) == pytest.approx((1.0 + 0.5 * 4.0))
    assert st.softmax_tanh(1.0) == pytest.approx(2 * math.tanh(0.5))
    assert st.output_multichunk(1.0, 4, 2.0, [1.0], 3.0, [0.5]) == pytest.approx(2 * math.tanh(0.5) * 3 + 0.5)
    assert st.fd_covariance(6.0, 5, 2) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        st.fd_covariance(1.0, 3, 3)
    assert st.fd_projection_paper(0.25, 1e4 - 1) == pytest.approx(0.5 + 0.5 / (1e4 - 1))
    assert st.fd_projection_paper(0.25, 0.0) == math.inf
    assert st.fd_projection_corrected(3.0, 16.0) == pytest.approx(5.0)
    assert st.davis_kahan_angle(1.0, 1.0) == 1.0 and st.davis_kahan_angle(0.1, 1.0) == pytest.approx(0.2)
    assert st.seed003_logit(2.0, 3.0, 9) == pytest.approx(2.0)
    assert st.seed003_value(0.75, 4.0) == pytest.approx(2.0)
    assert st.seed003_value(1.0 + 1e-12, 4.0) == 0.0  # e may exceed 1 by rounding


# --------------------------------------------------------------------------- counterexamples
def _run(name):
    x = COUNTEREXAMPLES[name].build()
    return x, check(x["q"], x["K"], x["V"], x["state"])


@pytest.mark.parametrize("name", sorted(COUNTEREXAMPLES))
def test_counterexample_refutes_exactly_its_claims_and_no_guarantee(name):
    _, report = _run(name)
    failed = {r.id for r in report.failures}
    assert failed == set(COUNTEREXAMPLES[name].refutes)
    assert report.violations == []  # every corrected form holds on the same input
    for cid in COUNTEREXAMPLES[name].refutes:
        row = report[cid]
        assert not row.guarantee and row.status.startswith("paper form, NOT a guarantee")


def test_gamma_counterexample_numbers():
    # spec B10.1: all residuals 0, bounds 0, yet l_hat = gamma l at the paper's gamma_0 = sqrt(r/d)
    x, report = _run("gamma")
    assert x["state"].layout.gamma[0] == pytest.approx(math.sqrt(0.5))
    for cid in ("B1", "B2", "B4.4", "B7"):
        assert report[cid].bound == 0.0 and report[cid].ratio == math.inf
    delta = (1 - math.sqrt(0.5)) * 6 / math.sqrt(2)
    assert report["B1"].measured == pytest.approx(delta, rel=1e-12)
    assert report["B4.4"].measured == pytest.approx(0.04704, abs=1e-5)
    # the corrected bound is attained: one token dominates, the key lies in span(B) (spec B1.c)
    assert report["B1.c"].ratio == pytest.approx(1.0, rel=1e-12)


def test_gamma_one_removes_the_gamma_counterexample():
    from subspace_ref import StaticBasis, SubspaceState

    x = COUNTEREXAMPLES["gamma"].build()
    state = SubspaceState.static(StaticBasis.from_bases(np.array([[[1.0, 0.0]]]), np.eye(2)[None], gamma=1.0))
    state.append(x["K"], x["V"])
    report = check(x["q"], x["K"], x["V"], state)
    for cid in ("B1", "B2", "B4.4", "B7"):
        assert report[cid].held and report[cid].guarantee
        assert report[cid].status == "paper form, condition met (γ = 1)" or cid == "B4.4"


def test_fd_gap_counterexample_numbers():
    # spec B10.2: sigma = (100, 100, 1), r = 2, ell = 6: the bound 0.50005 misses sigma_3 = 1
    _, report = _run("fd_gap")
    row = report["B6.1"]
    assert row.measured == pytest.approx(1.0, rel=1e-12)
    assert row.bound == pytest.approx(0.5 + 0.5 / (1e4 - 1), rel=1e-12)
    assert report["B6.2"].held and report["B6.2"].bound == pytest.approx(math.sqrt(1.25), rel=1e-12)
    # the same failure straight from FrequentDirections and the statement functions
    A = np.zeros((3, 8))
    A[0, 0] = A[1, 1] = 100.0
    A[2, 2] = 1.0
    fd = FrequentDirections(8, 6).update(A)
    P = fd.basis(2)
    resid = np.linalg.norm(A - A @ P.T @ P, 2)
    eps = st.fd_covariance(1.0, 6, 2)
    assert resid > st.fd_projection_paper(eps, 100.0**2 - 1.0) * 1.99
    assert resid <= st.fd_projection_corrected(1.0, eps)
    assert not st.paper_fd_condition(1.0, eps, 100.0**2 - 1.0)


def test_rotating_counterexample_numbers():
    # spec B10.3: the refresh projects the warm-up coefficient of k_1; K(I - P_B) does not see it
    x, report = _run("rotating")
    K_hat, _ = x["state"].reconstruct()
    assert np.linalg.norm(x["K"][0, 1] - K_hat[0, 1]) == pytest.approx(4.975, abs=1e-3)
    assert report["B1"].ratio == pytest.approx(7.05, abs=0.01)
    assert report["B4.2"].measured == pytest.approx(2.545, abs=1e-3)
    assert report["B8"].bound == pytest.approx(0.7053, abs=1e-4)
    # seed 003's statement is stated with the reconstruction and survives (spec B7)
    assert report["B7"].held and report["B7"].guarantee


# --------------------------------------------------------------------------- tightness witnesses
@pytest.mark.parametrize("delta", [1e-6, 0.1, 1.0, 5.0, 40.0])
def test_tanh_bound_is_attained(delta):
    # spec B3.1: l = (-delta/2, delta/2), l_hat = (delta/2, -delta/2) gives equality
    def softmax(x):
        w = np.exp(x - x.max())
        return w / w.sum()

    lhs = np.abs(softmax(np.array([-delta / 2, delta / 2])) - softmax(np.array([delta / 2, -delta / 2]))).sum()
    assert lhs == pytest.approx(st.softmax_tanh(delta), rel=1e-9)
    # computing a softmax of 2 entries errs by a few u absolutely (spec B0 allowance, n = 2)
    assert lhs <= st.softmax_linear(delta) + 8 * 2 * np.finfo(float).eps / 2


def test_key_term_is_attained():
    # spec B4.1: two tokens with opposite values
    alpha, alpha_hat = np.array([0.7, 0.3]), np.array([0.4, 0.6])
    V = np.array([[2.0, 0.0], [-2.0, 0.0]])
    lhs = np.linalg.norm((alpha - alpha_hat) @ V)
    assert lhs == pytest.approx(st.output_key_term(np.abs(alpha - alpha_hat).sum(), 2.0))
