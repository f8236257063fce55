"""Property tests of spec B1-B8 over adversarial inputs: flat and gapless spectra, exact low
rank, one dominant token, orthogonal queries, gamma != 1, r = 1 and r = d - 1, ell = r + 1,
scales from 1e-3 to 1e3, float32 states, INT8 coefficients, GQA.

Guarantees are asserted within the rounding allowance of spec B0 (8 n u times the magnitude the
quantities were accumulated from); paper forms are asserted where their condition holds and
asserted to *fail* on families of counterexamples."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from subspace_ref import FrequentDirections, SubspaceState, calibrate
from subspace_ref.lab.bounds import check
from subspace_ref.lab.bounds import statements as bs

U64 = np.finfo(np.float64).eps / 2
SPECTRA = ("flat", "decay", "gap", "lowrank", "single", "sparse")
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


UNDERFLOW = math.sqrt(np.finfo(np.float64).tiny)


def allowance(n: int, magnitude: float, u: float = U64) -> float:
    """Spec B0: what rounding (and underflow of squares) can contribute to one comparison of
    length-n computations."""
    return 8 * n * (u * magnitude + UNDERFLOW)


def spectrum_rows(rng, T: int, d: int, kind: str) -> np.ndarray:
    """T x d rows whose singular values follow ``kind`` (random singular vectors)."""
    m = min(T, d)
    s = {
        "flat": np.ones(m),  # gapless: every sigma equal
        "decay": 0.5 ** np.arange(m),
        "gap": np.where(np.arange(m) < max(1, m // 2), 100.0, 1.0),
        "lowrank": (np.arange(m) < max(1, m // 3)).astype(float),
        "single": (np.arange(m) == 0).astype(float),  # every row along one direction
        "sparse": rng.exponential(size=m) * (rng.random(m) < 0.5),
    }[kind]
    U = np.linalg.qr(rng.standard_normal((T, m)))[0]
    W = np.linalg.qr(rng.standard_normal((d, m)))[0].T
    return (U * s) @ W


def softmax(x):
    w = np.exp(x - x.max())
    return w / w.sum()


def orthonormal(rng, r, d):
    return np.linalg.qr(rng.standard_normal((d, r)))[0].T


# --------------------------------------------------------------------------- whole states
@st.composite
def histories(draw, max_tokens: int = 40):
    """(q, K, V, state) with the state built from K, V by the public API."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    H, g = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    d = draw(st.sampled_from([2, 3, 4, 6, 8, 16]))
    d_v = draw(st.sampled_from([d, 3]))
    T = draw(st.integers(1, max_tokens))
    scale_k, scale_v = 10.0 ** draw(st.floats(-3, 3)), 10.0 ** draw(st.floats(-2, 2))
    K = np.stack([spectrum_rows(rng, T, d, draw(st.sampled_from(SPECTRA))) for _ in range(H)]) * scale_k
    V = np.stack([spectrum_rows(rng, T, d_v, draw(st.sampled_from(SPECTRA))) for _ in range(H)]) * scale_v
    dominant = draw(st.integers(0, T - 1)) if draw(st.booleans()) else None
    if dominant is not None:  # one dominant token
        K[:, dominant] *= 100.0
    r = draw(st.sampled_from([1, d - 1, None])) or draw(st.integers(1, d))
    r = max(1, r)
    r_v = draw(st.integers(1, d_v))
    gamma = draw(st.sampled_from([1.0, math.sqrt(r / d), 1.2, 0.3, None]))
    if gamma is None:
        gamma = draw(st.floats(0.05, 4.0))
    kind = draw(st.sampled_from(["static", "static_in_sample", "adaptive", "rotating"]))
    coefficients = "int8" if draw(st.integers(0, 5)) == 0 else "float"
    if kind.startswith("static"):
        N = max(d, d_v) + 4
        if kind == "static_in_sample":  # bases from the history itself: K may lie in span(B)
            Kc = np.concatenate([K, scale_k * rng.standard_normal((H, N, d))], axis=1) if T < N else K
            Vc = np.concatenate([V, scale_v * rng.standard_normal((H, N, d_v))], axis=1) if T < N else V
            if T < N:
                Kc[:, T:] *= 1e-6  # dominated by the history, so its top directions lead
                Vc[:, T:] *= 1e-6
        else:
            Kc = scale_k * rng.standard_normal((H, N, d))
            Vc = scale_v * rng.standard_normal((H, N, d_v))
        state = SubspaceState.static(calibrate(Kc, Vc, rank_k=r, rank_v=r_v, gamma=gamma), coefficients=coefficients)
    else:
        ell = draw(st.sampled_from([r + 1, None])) or draw(st.integers(r + 1, 3 * r + 2))
        ell_v = draw(st.sampled_from([r_v + 1, 2 * r_v + 1]))
        dtype = np.float32 if draw(st.integers(0, 4)) == 0 else np.float64
        common = dict(rank_k=r, rank_v=r_v, ell_k=ell, ell_v=ell_v, gamma=gamma, dtype=dtype,
                      warmup=draw(st.integers(0, min(r, r_v))), coefficients=coefficients)
        if kind == "adaptive":
            state = SubspaceState.adaptive(
                H, d, d_v, tau_k=draw(st.floats(0.01, 0.95)), tau_v=draw(st.floats(0.01, 0.95)),
                max_chunk=draw(st.integers(1, 40)), sketch_reset=draw(st.booleans()), **common)
        else:
            state = SubspaceState.rotating(H, d, d_v, refresh_every=draw(st.integers(1, 12)), **common)
    state.append(K, V)
    q = rng.standard_normal((H * g, d)) * 10.0 ** draw(st.floats(-2, 2))
    query = draw(st.sampled_from(["random", "orthogonal", "dominant"]))
    if query == "orthogonal":  # a query orthogonal to every key of head 0, when there is room
        _, s, wt = np.linalg.svd(K[0], full_matrices=True)
        rank = int((s > s.max(initial=0) * 1e-12).sum()) if s.size else 0
        if rank < d:
            q[:] = wt[rank] * np.linalg.norm(q[0])
    elif query == "dominant" and dominant is not None:
        q[:] = K[:, dominant].repeat(g, axis=0) / scale_k
    return q, K, V, state


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_every_guarantee_holds_on_states_built_by_the_api(inputs):
    # spec B0: every row whose statement is a guarantee for this input held, on every head
    q, K, V, state = inputs
    report = check(q, K, V, state)
    assert not report.violations, str(report)
    for row in report.rows:
        if row.applicable and CLAIMS_KIND[row.id] == "guarantee":
            assert row.guarantee


CLAIMS_KIND = {cid: c.kind for cid, c in bs.CLAIMS.items()}


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories(max_tokens=120))
def test_every_guarantee_holds_long_sweep(inputs):
    q, K, V, state = inputs
    assert not check(q, K, V, state).violations


# --------------------------------------------------------------------------- B1, B2, B7: logits
@st.composite
def chunked_projections(draw):
    """K, a partition into chunks with one orthonormal basis each, K_hat = per-chunk projection."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.integers(1, 12))
    T = draw(st.integers(1, 30))
    K = spectrum_rows(rng, T, d, draw(st.sampled_from(SPECTRA))) * 10.0 ** draw(st.floats(-3, 3))
    cuts = sorted(set(draw(st.lists(st.integers(1, T), max_size=4)))) if T > 1 else []
    bounds = [0] + [c for c in cuts if c < T] + [T]
    chunks = list(zip(bounds[:-1], bounds[1:]))
    K_hat = np.empty_like(K)
    residual_ops = []
    for a, b in chunks:
        B = orthonormal(rng, draw(st.integers(1, d)), d)
        if draw(st.booleans()):  # keys of this chunk inside span(B): zero residual
            K[a:b] = (K[a:b] @ B.T) @ B
        K_hat[a:b] = (K[a:b] @ B.T) @ B
        residual_ops.append(np.linalg.norm(K[a:b] - K_hat[a:b], 2))
    q = rng.standard_normal(d) * 10.0 ** draw(st.floats(-2, 2))
    return K, K_hat, residual_ops, q, len(chunks)


def _logit_error(K, K_hat, q, gamma):
    s = 1 / math.sqrt(K.shape[1])
    return float(np.abs(s * K @ q - gamma * s * K_hat @ q).max())


def _logit_allowance(K, K_hat, q, gamma):
    n = K.shape[0] + 2 * K.shape[1]
    mag = np.linalg.norm(q) / math.sqrt(K.shape[1]) * (np.linalg.norm(K, axis=1).max() + gamma * np.linalg.norm(K_hat, axis=1).max())
    return allowance(n, mag)


@FAST
@given(chunked_projections(), st.sampled_from([1.0, 0.3, 1.2, 2.0]))
def test_logit_bounds_on_projections(data, gamma):
    K, K_hat, ops, q, J = data
    d = K.shape[1]
    delta = _logit_error(K, K_hat, q, gamma)
    a = _logit_allowance(K, K_hat, q, gamma)
    qn = float(np.linalg.norm(q))
    corrected = bs.logit_corrected(gamma, d, qn, np.linalg.norm(K - K_hat, axis=1).max(), np.linalg.norm(K_hat, axis=1).max())
    assert delta <= corrected + a  # B1.c / B2.c, every gamma
    assert delta <= bs.seed003_logit_gamma(qn, np.linalg.norm(K - gamma * K_hat, 2), d) + a  # B7.c
    if gamma == 1.0:  # B1 (one chunk), B2 and B7 at gamma = 1 on projections
        assert delta <= bs.logit_multichunk(1.0, d, qn, ops) + a
        assert delta <= bs.seed003_logit(qn, np.linalg.norm(K - K_hat, 2), d) + a
        if J == 1:
            assert delta <= bs.logit_single(1.0, d, ops[0], qn) + a


@FAST
@given(chunked_projections(), st.floats(0.05, 4.0).filter(lambda g: abs(g - 1) > 1e-3))
def test_paper_logit_bound_fails_when_keys_lie_in_the_bases_and_gamma_is_not_one(data, gamma):
    # spec B1/B2: the family of the "gamma" counterexample. Residuals vanish, the bound is 0,
    # yet l_hat = gamma l; whenever some logit is clearly non-zero the paper form fails.
    K, _, _, q, _ = data
    d = K.shape[1]
    K_hat = K.copy()  # every chunk stores its keys exactly (K inside span(B_j))
    logits = K @ q / math.sqrt(d)
    a = _logit_allowance(K, K_hat, q, gamma)
    assume(abs(1 - gamma) * np.abs(logits).max() > 100 * a)
    delta = _logit_error(K, K_hat, q, gamma)
    assert delta > bs.logit_multichunk(gamma, d, float(np.linalg.norm(q)), [0.0]) + a
    assert delta == pytest.approx(abs(1 - gamma) * np.abs(logits).max(), rel=1e-9)


@FAST
@given(chunked_projections(), st.floats(-1, 1), st.sampled_from([1.0, 0.5, 1.5]))
def test_seed003_logit_with_any_reconstruction(data, noise, gamma):
    # spec B7, B2.c: stated with the actual reconstruction, so K_hat need not be a projection
    # (rotating state, INT8 coefficients)
    K, K_hat, _, q, _ = data
    rng = np.random.default_rng(abs(hash((K.shape, noise))) % 2**32)
    K_hat = K_hat + noise * rng.standard_normal(K_hat.shape) * (np.abs(K).max() or 1.0)
    d = K.shape[1]
    delta = _logit_error(K, K_hat, q, gamma)
    a = _logit_allowance(K, K_hat, q, gamma)
    qn = float(np.linalg.norm(q))
    assert delta <= bs.seed003_logit_gamma(qn, np.linalg.norm(K - gamma * K_hat, 2), d) + a
    assert delta <= bs.logit_corrected(gamma, d, qn, np.linalg.norm(K - K_hat, axis=1).max(), np.linalg.norm(K_hat, axis=1).max()) + a
    if gamma == 1.0:
        assert delta <= bs.seed003_logit(qn, np.linalg.norm(K - K_hat, 2), d) + a


# --------------------------------------------------------------------------- B3: softmax
@st.composite
def logit_pairs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    T = draw(st.integers(1, 50))
    spread = 10.0 ** draw(st.floats(-3, 3))
    l = rng.standard_normal(T) * spread
    if draw(st.booleans()):  # one dominant logit
        l[draw(st.integers(0, T - 1))] += 50 * spread
    delta = 10.0 ** draw(st.floats(-6, 2))
    shape = draw(st.sampled_from(["uniform", "signs", "one"]))
    if shape == "uniform":
        x = rng.uniform(-delta, delta, T)
    elif shape == "signs":  # every entry at +-delta: the extreme case of the proof
        x = delta * np.sign(rng.standard_normal(T))
    else:
        x = np.zeros(T)
        x[draw(st.integers(0, T - 1))] = delta
    return l, l + x


@settings(max_examples=200, deadline=None)
@given(logit_pairs())
def test_softmax_sensitivity(pair):
    l, l_hat = pair
    delta = float(np.abs(l - l_hat).max())
    w_err = float(np.abs(softmax(l) - softmax(l_hat)).sum())
    # each softmax entry carries a relative error of a few u; T entries, plus delta's own rounding
    a = allowance(l.size, 1.0) + allowance(l.size, delta)
    assert w_err <= bs.softmax_tanh(delta) + a  # B3.1
    assert w_err <= bs.softmax_linear(delta) + a  # B3.2
    osc = float((l_hat - l).max() - (l_hat - l).min())
    assert w_err <= 2 * math.tanh(osc / 4) + a  # the sharper form in the proof of B3.1


# --------------------------------------------------------------------------- B4, B8: outputs
@st.composite
def output_inputs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    T, d_v = draw(st.integers(1, 30)), draw(st.integers(1, 10))
    V = spectrum_rows(rng, T, d_v, draw(st.sampled_from(SPECTRA))) * 10.0 ** draw(st.floats(-3, 3))
    cuts = sorted(set(draw(st.lists(st.integers(1, T), max_size=4)))) if T > 1 else []
    bounds = [0] + [c for c in cuts if c < T] + [T]
    chunks = list(zip(bounds[:-1], bounds[1:]))
    V_hat = np.empty_like(V)
    for a, b in chunks:
        E = orthonormal(rng, draw(st.integers(1, d_v)), d_v)
        V_hat[a:b] = (V[a:b] @ E.T) @ E
    l = rng.standard_normal(T) * 10.0 ** draw(st.floats(-2, 2))
    l_hat = l + rng.uniform(-1, 1, T) * 10.0 ** draw(st.floats(-4, 1))
    return V, V_hat, chunks, l, l_hat


@FAST
@given(output_inputs())
def test_output_bounds(data):
    V, V_hat, chunks, l, l_hat = data
    alpha, alpha_hat = softmax(l), softmax(l_hat)
    o, o_hat = alpha @ V, alpha_hat @ V_hat
    delta = float(np.abs(l - l_hat).max())
    w_err = float(np.abs(alpha - alpha_hat).sum())
    vmax = float(np.linalg.norm(V, axis=1).max())
    n = V.shape[0] + V.shape[1]
    a = allowance(n, vmax + float(np.linalg.norm(V_hat, axis=1).max())) + allowance(n, vmax) * (1 + delta)
    key_term = (alpha - alpha_hat) @ V
    value_term = alpha_hat @ (V - V_hat)
    assert np.linalg.norm(o - o_hat - key_term - value_term) <= a  # the identity of spec B4
    assert np.linalg.norm(key_term) <= bs.output_key_term(w_err, vmax) + a  # B4.1
    ops = [np.linalg.norm(V[x:y] - V_hat[x:y], 2) for x, y in chunks]
    assert np.linalg.norm(value_term) <= bs.output_value_term(ops) + a  # B4.2 (projections) = B4.2.c
    assert np.linalg.norm(o - o_hat) <= bs.output_combined(delta, vmax, ops) + a  # B4.3 / B4.3.c
    # B4.4.c: any delta_c >= delta gives a valid bound (tanh is increasing)
    assert np.linalg.norm(o - o_hat) <= bs.output_combined(2 * delta + 1e-3, vmax, ops) + a
    # B8 (projections) and B8.c: the energy forms
    frob = float(np.linalg.norm(V))
    e_proj = 1 - float(np.sum((V - V_hat) ** 2)) / frob**2 if frob else 1.0
    e_allow = frob * (math.sqrt(max(1 - e_proj, 0) + 8 * n * U64) - math.sqrt(max(1 - e_proj, 0)))
    assert np.linalg.norm(value_term) <= bs.seed003_value(e_proj, frob) + a + e_allow


# --------------------------------------------------------------------------- B5, B6: FD
@st.composite
def fd_streams(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.integers(2, 12))
    r = draw(st.sampled_from([1, d - 1, None])) or draw(st.integers(1, d - 1))
    ell = draw(st.sampled_from([r + 1, 2 * r, None])) or draw(st.integers(r + 1, 3 * r + 3))
    ell = max(ell, r + 1)
    T = draw(st.integers(1, 80))
    A = spectrum_rows(rng, T, d, draw(st.sampled_from(SPECTRA))) * 10.0 ** draw(st.floats(-3, 3))
    if draw(st.booleans()):
        A[draw(st.integers(0, T - 1))] *= 1e3
    return A, r, ell


def _fd_quantities(A, r, ell):
    fd = FrequentDirections(A.shape[1], ell).update(A)
    S = fd.sketch
    sigma = np.zeros(A.shape[1] + 1)
    sv = np.linalg.svd(A, compute_uv=False)
    sigma[: sv.size] = sv
    diff = A.T @ A - S.T @ S
    lam = np.linalg.eigvalsh((diff + diff.T) / 2)
    a5 = allowance(2 * A.shape[0] + A.shape[1], float(np.sum(A * A)))
    return fd, S, sigma, lam, a5


@FAST
@given(fd_streams())
def test_fd_covariance_every_k(data):
    A, r, ell = data
    _, _, sigma, lam, a5 = _fd_quantities(A, r, ell)
    assert -lam.min() <= bs.fd_lower() + a5  # B5.1
    eps_measured = float(np.abs(lam).max())
    for k in range(ell):
        assert eps_measured <= bs.fd_covariance(float(np.sum(sigma[k:] ** 2)), ell, k) + a5  # B5.2


@FAST
@given(fd_streams())
def test_fd_projection(data):
    A, r, ell = data
    fd, _, sigma, lam, a5 = _fd_quantities(A, r, ell)
    P = fd.basis(r)
    resid = float(np.linalg.norm(A - (A @ P.T) @ P, 2))
    eps = bs.fd_covariance(float(np.sum(sigma[r:] ** 2)), ell, r)
    a_sq = 2 * a5 + allowance(A.shape[0] + A.shape[1], float(np.sum(A * A)))
    assert resid**2 <= bs.fd_projection_corrected(sigma[r], eps) ** 2 + a_sq  # B6.2
    assert resid**2 <= bs.fd_projection_corrected(sigma[r], float(np.abs(lam).max())) ** 2 + a_sq  # with measured eps
    gap = float(sigma[r - 1] ** 2 - sigma[r] ** 2)
    if bs.paper_fd_condition(float(sigma[r]), eps, gap):  # B6.1 where its condition holds
        assert resid**2 <= bs.fd_projection_paper(eps, gap) ** 2 + a_sq
    # B6.3: the angle to A's own top-r space
    W = np.linalg.svd(A, full_matrices=True)[2][:r]
    angle = float(np.linalg.norm(W - (W @ P.T) @ P, 2))
    slack = allowance(A.shape[0] + A.shape[1], 1.0) + (4 * (a5 + allowance(A.shape[0] + A.shape[1], float(np.sum(A * A)))) / gap if gap > 0 else 0.0)
    assert angle <= bs.davis_kahan_angle(eps, gap) + slack


@FAST
@given(st.integers(1, 6), st.integers(1, 4), st.floats(1e-3, 1e3), st.floats(1e-2, 10.0))
def test_fd_projection_paper_form_fails_on_the_gap_family(r, extra, top, ratio):
    # spec B6.1, the family of the "fd_gap" counterexample: sigma = (top x r, s, 0...), ell = r + 4,
    # at most ell rows so the sketch is exact: measured = s, bound = s/2 + eta.
    d = r + 1 + extra
    s = top / ratio if ratio > 1 else top * ratio / 10
    A = np.zeros((r + 1, d))
    A[np.arange(r), np.arange(r)] = top
    A[r, r] = s
    ell = r + 4
    eps = bs.fd_covariance(s**2, ell, r)
    gap = top**2 - s**2
    assume(gap > 0)
    bound = bs.fd_projection_paper(eps, gap)
    P = FrequentDirections(d, ell).update(A).basis(r)
    resid = float(np.linalg.norm(A - (A @ P.T) @ P, 2))
    assert resid == pytest.approx(s, rel=1e-9)
    if s / 2 > 2 * eps / gap * 1.01:
        assert resid > bound
