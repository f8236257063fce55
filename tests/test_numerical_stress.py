"""Numerical stress (issue 9): half-precision inputs with logits near the dtype's range, tokens of
zero norm, constant and repeated streams, streams whose subspace rotates every few tokens,
thousands of chunks, and (slow) 10^6 tokens on a static state.

"Thrash" (adaptive chunking, spec A7) is defined here as any of: a chunk closing with no token in
it, more than one chunk closing per token, more chunks than tokens (J > T when W >= 1, J > T + 1
when W = 0: the last token may open an empty chunk), or a chunk longer than ``max_chunk`` (chunk 0
may also hold the W warm-up tokens plus the first one that can fire). These hold for every
stream; :func:`assert_no_thrash` checks them.
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import pytest

import subspace_ref
from subspace_ref import StaticBasis, SubspaceState, attend, exact_attention
from subspace_ref.arrays import to_numpy
from subspace_ref.policies.online_run import relative_residual

PAPER = dict(trigger="paper", byte_ceiling=math.inf)  # seed 001's policy (spec A7 verbatim), which these tests encode


def _available(name):
    try:
        return any(b.name == name and b.available for b in subspace_ref.backends())
    except Exception:
        return False


HAS_TORCH = _available("torch")
BACKENDS = ["numpy"] + (["torch"] if HAS_TORCH else [])
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch backend not available")


def _np(x):
    return np.asarray(to_numpy(x))


def on(backend, x, dtype=None):
    """x (NumPy) as an input for ``backend``."""
    if backend == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x))
        return t.to(dtype) if dtype is not None else t
    return x if dtype is None else x.astype(dtype)


def all_finite(state) -> bool:
    arrays = list(state.layout.arrays().values())
    if state.sketches is not None:
        arrays += [state.sketches.keys, state.sketches.values]
    return all(np.isfinite(_np(x).astype(np.float64)).all() for x in arrays if _np(x).dtype.kind == "f")


def oracle(q, state, scale=None, group=1):
    """Spec A3.1: exact attention (float64) over the state's own reconstruction, gamma per KV head."""
    K_hat, V_hat = state.reconstruct()
    q = _np(q).astype(np.float64)
    gq = q * np.repeat(_np(state.layout.gamma).astype(np.float64), group)[:, None]
    return exact_attention(gq, K_hat.astype(np.float64), V_hat.astype(np.float64), scale=scale)


def assert_no_thrash(state, max_chunk, warmup):
    T = state.num_tokens
    for h in range(state.heads):
        bounds = state.chunk_bounds(h)
        lengths = [b - a for a, b in bounds]
        J = len(bounds)
        assert all(n >= 1 for n in lengths[:-1]), f"head {h}: a closed chunk is empty: {lengths}"
        assert J - 1 <= max(T - warmup, 0), f"head {h}: {J - 1} chunk closings for {T - warmup} tokens past warm-up"
        assert J <= (T if warmup >= 1 else T + 1), f"head {h}: {J} chunks for {T} tokens"
        assert lengths[0] <= max(max_chunk, warmup + 1) and all(n <= max_chunk for n in lengths[1:]), f"head {h}: {lengths}"


def expected_chunks_by_length_rule(T, max_chunk, warmup):
    """Chunks when only the max_chunk rule fires (spec A7 step 3 with rho <= tau throughout)."""
    start, J = 0, 1
    for t in range(T):
        if t >= warmup and t + 1 - start >= max_chunk:
            J, start = J + 1, t + 1
    return J


def orthonormal(rng, heads, r, d):
    return np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T[:r] for _ in range(heads)])


# ------------------------------------------------------------------------- half precision, torch
@needs_torch
@pytest.mark.parametrize("tdtype, logit", [("float16", 3.0e4), ("float16", 6.0e4), ("bfloat16", 1.0e4), ("bfloat16", 1.0e30)])
def test_half_precision_logits_near_dtype_range(tdtype, logit):
    """Static state in float16/bfloat16 with logits up to ~the dtype's largest finite value: the
    torch backend (float32 accumulation) gives finite results equal to a float64 computation on
    the same rounded inputs."""
    import torch

    dt = getattr(torch, tdtype)
    rng = np.random.default_rng(1)
    H, d, r, T = 2, 16, 4, 64
    basis = StaticBasis.from_bases(orthonormal(rng, H, r, d), orthonormal(rng, H, r, d))
    state = SubspaceState.static(basis).to("torch", dtype=dt)
    # coefficient and query sizes such that max |gamma s q~ . c| ~ logit, with every factor
    # representable in the dtype (fp16 max 65504)
    size = math.sqrt(logit * math.sqrt(d)) / 2
    keys = rng.standard_normal((H, T, d)) * size / math.sqrt(d) * 2
    values = rng.standard_normal((H, T, d)) * min(size, 1e3)
    state.append(on("torch", keys, dt), on("torch", values, dt))
    assert all_finite(state)
    q = torch.from_numpy(rng.standard_normal((2 * H, d)) * size / math.sqrt(d) * 2).to(dt)
    out = attend(q, state, backend="torch")
    assert out.dtype == dt
    out64 = _np(out.float()).astype(np.float64)
    assert np.isfinite(out64).all(), f"non-finite output for logits ~{logit:g} in {tdtype}"
    K_hat, V_hat = state.reconstruct()
    logits = np.einsum("hd,htd->ht", _np(q.float()).astype(np.float64), np.repeat(K_hat.astype(np.float64), 2, axis=0)) / math.sqrt(d)
    assert np.abs(logits).max() > logit / 20, "the test did not reach the intended logit size"
    want = oracle(q.float(), state, group=2)
    # float32 accumulation of logits ~L has absolute error ~L * 1e-6 * sqrt(d), which moves softmax
    # weights by that much; the output is then rounded to the dtype (8 or 11 bits)
    L = np.abs(logits).max()
    weight_err = min(1.0, L * 2e-6 * math.sqrt(d))
    half_eps = 2.0**-8 if tdtype == "bfloat16" else 2.0**-11
    tol = (weight_err + 2 * half_eps) * np.abs(V_hat).max()
    np.testing.assert_allclose(out64, want, rtol=0, atol=tol)


@needs_torch
@pytest.mark.parametrize("tdtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["adaptive", "rotating"])
def test_half_precision_online_states_stay_finite(tdtype, kind):
    """Keys with |k|^2 far beyond float16's range (|k| ~ 2000, |k|^2 ~ 4e6 > 65504): residuals and
    FD updates must be computed in float32, so nothing overflows; attend stays finite and matches
    the oracle over the reconstruction."""
    import torch

    dt = getattr(torch, tdtype)
    rng = np.random.default_rng(2)
    H, d, T = 2, 8, 48
    make = SubspaceState.adaptive if kind == "adaptive" else SubspaceState.rotating
    extra = dict(max_chunk=8) if kind == "adaptive" else dict(refresh_every=5)
    state = make(H, d, rank_k=3, rank_v=3, dtype=np.float32, **extra).to("torch", dtype=dt)
    base = rng.standard_normal((H, 3, d))
    keys = np.einsum("htr,hrd->htd", rng.standard_normal((H, T, 3)), base) * 700 + rng.standard_normal((H, T, d))
    values = rng.standard_normal((H, T, d)) * 300
    for t in range(0, T, 6):
        state.append(on("torch", keys[:, t : t + 6], dt), on("torch", values[:, t : t + 6], dt))
    assert all_finite(state), "NaN/Inf in the state"
    q = torch.from_numpy(rng.standard_normal((H, d)) * 1e-3).to(dt)
    out = _np(attend(q, state, backend="torch").float()).astype(np.float64)
    assert np.isfinite(out).all()
    want = oracle(q.float(), state)
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-2 * np.abs(state.reconstruct()[1]).max())


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_numpy_half_and_single_queries_near_range(dtype):
    """The numpy oracle widens float16 to float32: logits ~5e4 from float16 q stay finite."""
    rng = np.random.default_rng(3)
    H, d, r = 1, 8, 2
    basis = StaticBasis.from_bases(orthonormal(rng, H, r, d), orthonormal(rng, H, r, d))
    state = SubspaceState.static(basis, dtype=np.float32)
    state.append(rng.standard_normal((H, 10, d)).astype(np.float32) * 200, rng.standard_normal((H, 10, d)).astype(np.float32))
    q = (rng.standard_normal((H, d)) * 200).astype(dtype)
    out = attend(q, state)
    assert out.dtype == dtype and np.isfinite(out.astype(np.float64)).all()
    np.testing.assert_allclose(out.astype(np.float64), oracle(q, state), atol=2e-3 if dtype == np.float16 else 1e-5)


def test_float64_logit_overflow_is_an_error_not_nan():
    """q and keys finite but q.k beyond float64's range: attend must raise a clear error (or return
    a finite result), never NaN silently."""
    rng = np.random.default_rng(4)
    basis = StaticBasis.from_bases(orthonormal(rng, 1, 2, 4), orthonormal(rng, 1, 2, 4))
    state = SubspaceState.static(basis)
    # |k|^2 ~ 1e300 still fits float64; q.k ~ 1e350 does not
    state.append(rng.standard_normal((1, 3, 4)) * 1e150, rng.standard_normal((1, 3, 4)))
    try:
        out = attend(rng.standard_normal((1, 4)) * 1e200, state)
    except (ValueError, OverflowError, FloatingPointError):
        return
    assert np.isfinite(out).all(), f"NaN/Inf result without an error: {out}"


# ----------------------------------------------------------------------------- zero-norm tokens
def test_relative_residual_of_zero_is_zero_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = np.zeros((3, 5))
        assert np.array_equal(relative_residual(x, np.zeros((3, 2))), np.zeros(3))
        tiny = np.full((1, 4), 1e-170)  # |x|^2 underflows to 0: treated as a zero token
        assert relative_residual(tiny, np.zeros((1, 2)))[0] == 0.0
        sub = np.full((1, 4), 1e-310)  # subnormal
        rho = relative_residual(sub, np.zeros((1, 2)))
        assert np.isfinite(rho).all() and 0 <= rho[0] <= 1
        big = np.full((1, 4), 1e150)
        rho = relative_residual(big, big[:, :2])
        assert np.isfinite(rho).all() and 0 <= rho[0] <= 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["adaptive", "rotating"])
@pytest.mark.parametrize("warmup", [0, 2])
def test_zero_norm_tokens(backend, kind, warmup):
    """Zero keys and values (first tokens, later tokens, one head only): rho = 0 so only the
    max_chunk rule fires, bases stay orthonormal-or-zero, nothing is NaN, no warning is raised,
    and attend matches the oracle."""
    rng = np.random.default_rng(5)
    H, d, L, T = 2, 6, 4, 30
    make = SubspaceState.adaptive if kind == "adaptive" else SubspaceState.rotating
    extra = dict(max_chunk=L, tau_k=0.2, tau_v=0.2, **PAPER) if kind == "adaptive" else dict(refresh_every=3)
    state = make(H, d, rank_k=2, rank_v=2, warmup=warmup, **extra)
    if backend != "numpy":
        state = state.to(backend)
    keys = np.zeros((H, T, d))
    values = np.zeros((H, T, d))
    # head 1 becomes non-zero after token 10 (1-dim: in span after warm-up/refresh) then zero again
    keys[1, 10:20] = rng.standard_normal(d)
    values[1, 10:20] = rng.standard_normal(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(T):
            state.append(on(backend, keys[:, t]), on(backend, values[:, t]))
        assert all_finite(state)
        if kind == "adaptive":
            # head 0 never sees a non-zero token: rho = 0 always, chunks by length only
            assert state.chunk_bounds(0) == _length_rule_bounds(T, L, warmup)
            assert_no_thrash(state, L, warmup)
        q = rng.standard_normal((H, d))
        out = _np(attend(on(backend, q), state, backend=backend))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle(q, state), atol=1e-12)
    assert np.array_equal(out[0], np.zeros(d)), "head 0 attends over zero values only"


def _length_rule_bounds(T, L, W):
    bounds, start = [], 0
    for t in range(T):
        if t >= W and t + 1 - start >= L:
            bounds.append((start, t + 1))
            start = t + 1
    return bounds + [(start, T)]


def test_zero_query_gives_uniform_weights():
    rng = np.random.default_rng(6)
    state = SubspaceState.adaptive(1, 4, rank_k=2, rank_v=2, max_chunk=3, **PAPER)
    V = rng.standard_normal((1, 11, 4))
    state.append(rng.standard_normal((1, 11, 4)), V)
    out = attend(np.zeros((1, 4)), state)
    np.testing.assert_allclose(out, state.reconstruct()[1].mean(axis=1), atol=1e-12)


# ------------------------------------------------------------------- constant and repeated streams
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L, W", [(1, 0), (1, 3), (5, 2), (16, 3), (16, 0)])
def test_constant_stream_chunks_by_length_only(backend, L, W):
    """The same token over and over: after warm-up (or the first chunk) it lies in the basis, rho ~ 0,
    so chunks close by the max_chunk rule only, and the reconstruction is exact."""
    rng = np.random.default_rng(7)
    H, d, T = 2, 8, 120
    state = SubspaceState.adaptive(H, d, rank_k=3, rank_v=3, warmup=W, max_chunk=L, tau_k=0.1, tau_v=0.1, **PAPER)
    if backend != "numpy":
        state = state.to(backend)
    k, v = rng.standard_normal((H, d)), rng.standard_normal((H, d))
    for _ in range(T // 8):
        state.append(on(backend, np.repeat(k[:, None], 8, 1)), on(backend, np.repeat(v[:, None], 8, 1)))
    T = state.num_tokens
    # W = 0 is the paper verbatim: token 0 meets an empty basis (rho = 1) and closes chunk 0; chunk 1
    # gets its basis from a sketch that has seen nothing yet (FD updates after the trigger), so
    # token 1 closes it too; from token 2 on the basis holds k.
    lead = 0 if W else 2
    for h in range(H):
        bounds = state.chunk_bounds(h)
        assert bounds[:lead] == [(0, 1), (1, 2)][:lead]
        assert [(a - lead, b - lead) for a, b in bounds[lead:]] == _length_rule_bounds(T - lead, L, W)
    assert_no_thrash(state, L, W)
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_allclose(K_hat[:, lead:], np.broadcast_to(k[:, None], K_hat[:, lead:].shape), atol=1e-9)
    np.testing.assert_allclose(V_hat[:, lead:], np.broadcast_to(v[:, None], V_hat[:, lead:].shape), atol=1e-9)
    q = rng.standard_normal((H, d))
    np.testing.assert_allclose(_np(attend(on(backend, q), state, backend=backend)), oracle(q, state), atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("period", [2, 3])
def test_periodic_stream_within_rank(backend, period):
    """A cycle of `period` <= rank tokens: once learned, every token lies in the span; chunks by
    length only after the first chunk, exact reconstruction, no thrash."""
    rng = np.random.default_rng(8)
    H, d, T, L, r = 1, 8, 200, 10, 3
    cycle_k, cycle_v = rng.standard_normal((H, period, d)), rng.standard_normal((H, period, d))
    reps = T // period
    keys, values = np.tile(cycle_k, (1, reps, 1)), np.tile(cycle_v, (1, reps, 1))
    state = SubspaceState.adaptive(H, d, rank_k=r, rank_v=r, warmup=r, max_chunk=L, **PAPER)
    if backend != "numpy":
        state = state.to(backend)
    state.append(on(backend, keys), on(backend, values))
    assert_no_thrash(state, L, r)
    bounds = state.chunk_bounds(0)
    assert bounds == _length_rule_bounds(state.num_tokens, L, r)
    K_hat, _ = state.reconstruct()
    np.testing.assert_allclose(K_hat, keys, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotating_state_constant_stream_is_lossless(backend):
    rng = np.random.default_rng(9)
    H, d = 2, 6
    state = SubspaceState.rotating(H, d, rank_k=2, rank_v=2, refresh_every=1)
    if backend != "numpy":
        state = state.to(backend)
    k, v = rng.standard_normal((H, 1, d)), rng.standard_normal((H, 1, d))
    state.append(on(backend, np.repeat(k, 50, 1)), on(backend, np.repeat(v, 50, 1)))
    K_hat, V_hat = state.reconstruct()
    np.testing.assert_allclose(K_hat, np.repeat(k, 50, 1), atol=1e-9)
    np.testing.assert_allclose(V_hat, np.repeat(v, 50, 1), atol=1e-9)


def test_warmup_rows_orthonormal_for_nearly_dependent_tokens():
    """Warm-up (spec A7 step 0) must keep B_0 orthonormal and store warm-up tokens exactly, also
    when the tokens are nearly parallel (here k_i = k_0 + 1e-9 * noise). One pass of classical
    Gram-Schmidt loses orthogonality there; two passes ("twice is enough") keep it."""
    rng = np.random.default_rng(10)
    d = 8
    k0 = rng.standard_normal(d)
    keys = np.stack([k0 + 1e-9 * i * rng.standard_normal(d) for i in range(3)])[None]
    state = SubspaceState.adaptive(1, d, rank_k=3, rank_v=3, warmup=3, **PAPER)
    state.append(keys, keys)
    B = state.layout.key_bases[0, 0, 0]
    gram = B @ B.T
    assert np.abs(gram - np.diag(np.diag(gram))).max() < 1e-8, f"B_0 B_0^T =\n{gram}"
    np.testing.assert_allclose(state.reconstruct()[0], keys, atol=1e-12)


# ------------------------------------------------------------------- rotating subspace streams
def rotating_subspace_stream(rng, H, T, d, dim, period, noise=0.0):
    """Tokens from a `dim`-dimensional subspace that is replaced by a fresh random one every
    `period` tokens."""
    out = np.empty((H, T, d))
    for start in range(0, T, period):
        basis = rng.standard_normal((H, dim, d))
        n = min(period, T - start)
        out[:, start : start + n] = np.einsum("htr,hrd->htd", rng.standard_normal((H, n, dim)), basis)
    return out + noise * rng.standard_normal(out.shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("period", [1, 2, 3, 5])
@pytest.mark.parametrize("W, L, reset", [(2, 8, False), (0, 8, False), (2, 3, True), (1, 64, True)])
def test_rotating_subspace_does_not_thrash(backend, period, W, L, reset):
    """The subspace changes every few tokens, so the residual trigger fires on most tokens; chunking
    must still obey the no-thrash bounds, and attend must match the oracle over the reconstruction."""
    rng = np.random.default_rng(11 + period)
    H, d, T = 2, 8, 150
    keys = rotating_subspace_stream(rng, H, T, d, 2, period)
    values = rotating_subspace_stream(rng, H, T, d, 2, period)
    state = SubspaceState.adaptive(H, d, rank_k=2, rank_v=2, ell_k=4, ell_v=4, warmup=W, max_chunk=L, tau_k=0.3, tau_v=0.3, sketch_reset=reset, **PAPER)
    if backend != "numpy":
        state = state.to(backend)
    for t in range(0, T, 7):
        state.append(on(backend, keys[:, t : t + 7]), on(backend, values[:, t : t + 7]))
    assert_no_thrash(state, L, W)
    assert all_finite(state)
    q = rng.standard_normal((H, d))
    np.testing.assert_allclose(_np(attend(on(backend, q), state, backend=backend)), oracle(q, state), atol=1e-10)


@pytest.mark.parametrize("reset", [False, True])
def test_slowly_switching_subspace_chunk_count(reset):
    """Subspace switching every 100 tokens (spec A7.1): chunks stay bounded per segment; with
    sketch_reset each switch costs a few short chunks (about r + 1), without it J may approach T
    but never exceeds the no-thrash bounds."""
    rng = np.random.default_rng(12)
    H, d, T, P, r, L = 1, 16, 600, 100, 2, 32
    keys = rotating_subspace_stream(rng, H, T, d, r, P, noise=1e-4)
    values = rotating_subspace_stream(rng, H, T, d, r, P, noise=1e-4)
    state = SubspaceState.adaptive(H, d, rank_k=r, rank_v=r, max_chunk=L, tau_k=0.3, tau_v=0.3, sketch_reset=reset, **PAPER)
    state.append(keys, values)
    assert_no_thrash(state, L, r)
    J = int(state.num_chunks[0])
    floor = expected_chunks_by_length_rule(T, L, r)
    if reset:
        # each of the T/P - 1 switches: about r + 1 short chunks, plus the max_chunk-rule chunks
        assert J <= floor + (T // P) * (r + 1 + 4), f"J = {J}: sketch_reset did not bound the cost of a switch"


# --------------------------------------------------------------------------- thousands of chunks
def _many_chunks(backend, L, T):
    rng = np.random.default_rng(20 + L)
    H, d, W = 2, 4, 2
    keys = rng.standard_normal((H, T, d)) * np.linspace(0.5, 3.0, T)[None, :, None]  # rising logits: many rescalings
    values = rng.standard_normal((H, T, d))
    state = SubspaceState.adaptive(H, d, rank_k=2, rank_v=2, max_chunk=L, tau_k=0.99, tau_v=0.99, warmup=W, **PAPER)
    if backend != "numpy":
        state = state.to(backend)
    state.append(on(backend, keys), on(backend, values))
    J = state.num_chunks
    assert (J >= (T - W - 1) // L + 1).all() and (J <= T).all(), J
    assert_no_thrash(state, L, W)
    for mag in (1.0, 30.0):
        q = rng.standard_normal((2 * H, d)) * mag
        out = _np(attend(on(backend, q), state, backend=backend))
        np.testing.assert_allclose(out, oracle(q, state, group=2), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L, T", [(1, 2000), (4, 1000)])
def test_thousands_of_chunks(backend, L, T):
    """max_chunk = 1 over 2000 tokens: ~2000 chunks per head (and 250 with max_chunk = 4). Attend
    (one pass of spec A3 across all chunks, logits large enough that the running max is rescaled
    many times) still matches exact attention over the reconstruction."""
    _many_chunks(backend, L, T)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_thousands_of_chunks_long(backend, L):
    """As above with 6000 tokens: 1500-6000 chunks per head for every max_chunk in 1..4."""
    _many_chunks(backend, L, 6000)


# ------------------------------------------------------------------------- a million tokens (slow)
@pytest.mark.slow
def test_million_tokens_static_linear_memory_and_constant_append_time():
    """10^6 tokens appended to a static state: nbytes grows exactly linearly, the spare capacity
    stays within the geometric-growth factor, and appending a token at T ~ 10^6 costs about what
    it costs at T ~ 0 (per-token time of the first and last 10^4-token blocks, appended one token
    at a time; generous ratio bound, median of blocks of 500 to ignore a growth copy)."""
    rng = np.random.default_rng(30)
    H, d, r, T, block = 1, 8, 2, 10**6, 10**4
    basis = StaticBasis.from_bases(orthonormal(rng, H, r, d), orthonormal(rng, H, r, d))
    state = SubspaceState.static(basis, dtype=np.float32)
    k1 = rng.standard_normal((H, 1, d)).astype(np.float32)
    base = state.nbytes
    per_token = H * 2 * r * 4

    def timed_singles(n):
        times = []
        for i in range(0, n, 500):
            t0 = time.perf_counter()
            for _ in range(500):
                state.append(k1[:, 0], k1[:, 0])
            times.append((time.perf_counter() - t0) / 500)
        return float(np.median(times))

    first = timed_singles(block)
    assert state.nbytes == base + block * per_token
    bulk = rng.standard_normal((H, 10**5, d)).astype(np.float32)
    while state.num_tokens < T - block:
        n = min(10**5, T - block - state.num_tokens)
        state.append(bulk[:, :n], bulk[:, :n])
        assert state.nbytes == base + state.num_tokens * per_token
    last = timed_singles(block)
    assert state.num_tokens == T
    assert state.nbytes == base + T * per_token
    assert state.allocated_nbytes <= 2 * state.nbytes + 4096, "capacity grew more than geometrically"
    print(
        f"\n[10^6 tokens] per-token append: {first * 1e6:.1f} us at T~0, {last * 1e6:.1f} us at T~1e6; nbytes {state.nbytes}, allocated {state.allocated_nbytes}"
    )
    assert last <= 3.0 * first + 20e-6, f"per-token append {first * 1e6:.1f} us at T~0 vs {last * 1e6:.1f} us at T~1e6"
    q = rng.standard_normal((H, d)).astype(np.float32)
    out = attend(q, state)
    assert np.isfinite(out).all()
