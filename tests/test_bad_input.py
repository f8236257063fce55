"""Bad input across the public API (issue 9): every rejected call raises ValueError or TypeError
(RuntimeError for an unusable backend) whose message names the offending argument, never crashes
inside a kernel, never returns NaN without an error, and leaves the state exactly as it was.

Known core bugs are marked ``xfail(strict=True)`` with the reason; each flips to a failure (XPASS)
once fixed, so the marker is removed with the fix.
"""

from __future__ import annotations


import numpy as np
import pytest

import subspace_ref
from subspace_ref import FrequentDirections, StaticBasis, SubspaceState, attend, calibrate, exact_attention
from subspace_ref import operations
from subspace_ref.arrays import to_numpy


def _available(name):
    try:
        return any(b.name == name and b.available for b in subspace_ref.backends())
    except Exception:
        return False


HAS_TORCH = _available("torch")
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch backend not available")
BACKENDS = ["numpy"] + (["torch"] if HAS_TORCH else [])


def _np(x):
    return np.asarray(to_numpy(x))


def snapshot(state) -> dict:
    lay = state.layout
    T = lay.num_tokens
    out = {"num_tokens": T, "engine": state.engine, "policy": state.policy, "layout_id": id(lay)}
    for name, x in lay.live_arrays().items():
        out[name] = _np(x).copy()
    if state.sketches is not None:
        sk = state.sketches
        out.update(sk_keys=_np(sk.keys).copy(), sk_values=_np(sk.values).copy(), fills=(sk.filled_k, sk.filled_v, sk.rows_seen))
    return out


def assert_unchanged(before, after):
    assert before.keys() == after.keys()
    for k in before:
        if k == "layout_id":
            continue
        if isinstance(before[k], np.ndarray):
            assert before[k].dtype == after[k].dtype and before[k].tobytes() == after[k].tobytes(), f"{k} changed"
        else:
            assert before[k] == after[k], f"{k} changed"


def rejects(state, fn, exc, match):
    """fn() raises ``exc`` with a message matching ``match`` and leaves ``state`` unchanged."""
    before = snapshot(state)
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(before, snapshot(state))


def orthonormal(rng, heads, r, d):
    return np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T[:r] for _ in range(heads)])


def states(backend="numpy"):
    """One state of every kind with some tokens (H = 2, d = 6, d_v = 5), on ``backend``."""
    rng = np.random.default_rng(0)
    basis = StaticBasis.from_bases(orthonormal(rng, 2, 3, 6), orthonormal(rng, 2, 2, 5))
    out = {
        "static": SubspaceState.static(basis),
        "adaptive": SubspaceState.adaptive(2, 6, 5, rank_k=2, rank_v=2, max_chunk=3),
        "rotating": SubspaceState.rotating(2, 6, 5, rank_k=2, rank_v=2, refresh_every=2),
        "batched": SubspaceState.adaptive(2, 6, 5, rank_k=2, rank_v=2, batch=3),
        "int8": SubspaceState.adaptive(2, 6, 5, rank_k=2, rank_v=2, coefficients="int8"),
    }
    for name, s in out.items():
        lead = (3, 2) if s.batched else (2,)
        s.append(rng.standard_normal(lead + (4, 6)), rng.standard_normal(lead + (4, 5)))
        if backend != "numpy":
            out[name] = s.to(backend)
    return out


def arr(backend, x):
    if backend == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(x))
    return x


# ------------------------------------------------------------------------------------- append
def bad_appends(lead, backend):
    """(label, keys, values, exception, message regex naming the argument)."""
    rng = np.random.default_rng(1)
    k, v = rng.standard_normal(lead + (2, 6)), rng.standard_normal(lead + (2, 5))
    nan_k = k.copy()
    nan_k[..., 1, 3] = np.nan
    inf_v = v.copy()
    inf_v[..., 0, 0] = np.inf
    A = lambda x: arr(backend, x)  # noqa: E731
    cases = [
        ("wrong head count", A(rng.standard_normal(lead[:-1] + (3, 2, 6))), A(rng.standard_normal(lead[:-1] + (3, 2, 5))), ValueError, r"keys has shape"),
        ("wrong d", A(rng.standard_normal(lead + (2, 7))), A(v), ValueError, r"keys has shape .*6\)"),
        ("wrong d_v", A(k), A(rng.standard_normal(lead + (2, 6))), ValueError, r"values has shape .*5\)"),
        ("NaN keys", A(nan_k), A(v), ValueError, r"keys contains NaN"),
        ("Inf values", A(k), A(inf_v), ValueError, r"values contains NaN or Inf"),
        ("integer keys", A(np.ones(lead + (2, 6), dtype=np.int64)), A(v), TypeError, r"keys has dtype .*int64"),
        ("bool values", A(k), A(np.ones(lead + (2, 5), dtype=bool)), TypeError, r"values has dtype .*bool"),
        ("complex keys", A(k.astype(np.complex128)), A(v), TypeError, r"keys has dtype .*complex"),
        ("token counts differ", A(k), A(rng.standard_normal(lead + (3, 5))), ValueError, r"keys has 2 tokens but values has 3"),
        ("rank 1 keys", A(k.reshape(-1)), A(v.reshape(-1)), ValueError, r"keys has shape"),
        ("extra leading axis", A(k[None]), A(v[None]), ValueError, r"keys has shape"),
        ("None", None, A(v), (TypeError, ValueError), r"keys|NoneType"),
        ("string", "keys", A(v), (TypeError, ValueError), r"keys|str"),
    ]
    if backend == "numpy":
        cases.append(("object array", np.array(k, dtype=object), v, TypeError, r"keys has dtype object"))
    other = "torch" if backend == "numpy" else "numpy"
    if other == "numpy" or HAS_TORCH:
        cases.append(("keys of the other array family", arr(other, k), A(v), TypeError, rf"keys is a {other} array but the state holds {backend} arrays"))
        cases.append(("values of the other array family", A(k), arr(other, v), TypeError, rf"values is a {other} array"))
    return cases


@pytest.fixture
def value_scans():
    """The debug switch on (subspace_ref.operations.set_debug): value scans on every backend."""
    previous = operations.set_debug(True)
    yield
    operations.set_debug(previous)


def test_without_debug_host_appends_are_scanned_and_only_numpy_scans_queries():
    """Default (subspace_ref/operations.py): keys and values appended from host memory are
    always scanned (a non-finite token would stay in the state for good, and a host scan waits
    for nothing); a query is scanned on the numpy backend only; metadata checks run everywhere."""
    assert not operations._debug
    for backend in BACKENDS:
        state = states(backend)["static"]
        nan = np.ones((2, 2, 6))
        nan[0, 0, 0] = np.nan
        rejects(state, lambda: state.append(arr(backend, nan), arr(backend, np.ones((2, 2, 5)))), ValueError, r"keys contains NaN")
        rejects(state, lambda: state.append(arr(backend, np.ones((2, 2, 7))), arr(backend, np.ones((2, 2, 5)))), ValueError, r"keys has shape")
        state.append(arr(backend, np.ones((2, 2, 6))), arr(backend, np.ones((2, 2, 5))))
        q = np.ones((2, 6))
        q[1, 2] = np.nan
        if backend == "numpy":
            rejects(state, lambda: attend(arr(backend, q), state, backend=backend), ValueError, r"q contains NaN")
        else:
            out = attend(arr(backend, q), state, backend=backend)  # unscanned: NaN in, NaN out, as torch SDPA does
            assert np.isnan(to_numpy(out)).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating", "batched", "int8"])
def test_bad_append_is_rejected_and_changes_nothing(backend, kind, value_scans):
    """Under the debug switch, so that every backend scans values (NaN/Inf cases) too."""
    state = states(backend)[kind]
    lead = (3, 2) if state.batched else (2,)
    for label, k, v, exc, match in bad_appends(lead, backend):
        try:
            rejects(state, lambda: state.append(k, v), exc, match)
        except AssertionError as err:
            raise AssertionError(f"{kind} on {backend}: {label}: {err}") from None


def test_unbatched_input_to_batched_state_and_vice_versa():
    s = states()
    rejects(s["batched"], lambda: s["batched"].append(np.ones((2, 6)), np.ones((2, 5))), ValueError, r"keys has shape \(2, 6\); expected \(3, 2, \*, 6\)")
    rejects(s["adaptive"], lambda: s["adaptive"].append(np.ones((3, 2, 1, 6)), np.ones((3, 2, 1, 5))), ValueError, r"keys has shape")


def test_ragged_list_is_rejected_naming_keys():
    s = states()["static"]
    rejects(s, lambda: s.append([[0.0] * 6, [0.0] * 5], np.ones((2, 5))), (ValueError, TypeError), r"keys")


def test_empty_append_is_a_no_op():
    s = states()["adaptive"]
    before = snapshot(s)
    s.append(np.ones((2, 0, 6)), np.ones((2, 0, 5)))
    assert_unchanged(before, snapshot(s))


@needs_torch
def test_torch_device_mismatch_is_rejected():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to have two devices")
    state = states()["adaptive"].to("torch", device="cuda")
    k = torch.ones(2, 6, dtype=torch.float64)
    rejects(state, lambda: state.append(k, k[:, :5]), ValueError, r"keys is on cpu but the state is on cuda")
    rejects(state, lambda: attend(k, state, backend="torch"), ValueError, r"q is on cpu")


@pytest.mark.parametrize("dtype, size", [(np.float64, 1e160), (np.float32, 1e20)])
def test_keys_too_large_for_the_dtype_are_rejected_cleanly(dtype, size):
    """Finite keys whose squared norm overflows: a clear ValueError naming keys, state unchanged
    (today: numpy.linalg.LinAlgError 'SVD did not converge' from inside the FD compaction)."""
    rng = np.random.default_rng(2)
    state = SubspaceState.adaptive(1, 4, rank_k=1, rank_v=1, max_chunk=2, dtype=dtype)
    rejects(state, lambda: state.append(rng.standard_normal((1, 8, 4)) * size, rng.standard_normal((1, 8, 4))), ValueError, r"keys")


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_rows_within_range_whose_total_overflows_are_accepted(engine):
    """The append's value scan sums every squared entry at once and looks row by row only when
    that total is not finite (``_checks.finite_rows``): a block whose rows are each within
    float32's range but whose total is not must be appended, and one row beyond it refused."""
    rng = np.random.default_rng(4)
    state = SubspaceState.static(StaticBasis.from_bases(np.eye(4)[None, :2], np.eye(4)[None, :2]), dtype=np.float32)
    if engine == "torch":
        torch = pytest.importorskip("torch")
        state = state.to("torch", dtype="float32")
        A = lambda x: torch.from_numpy(x.astype(np.float32))  # noqa: E731
    else:
        A = lambda x: x.astype(np.float32)  # noqa: E731
    big = np.full((1, 40, 4), 4e18)  # each row's squared norm 6.4e37 < 3.4e38; the 40 rows' 2.6e39
    state.append(A(big), A(rng.standard_normal((1, 40, 4))))
    assert state.num_tokens == 40
    huge = big.copy()
    huge[0, 7] = 2e19  # that row's squared norm 1.6e39
    rejects(state, lambda: state.append(A(huge), A(rng.standard_normal((1, 40, 4)))), ValueError, r"keys has rows whose squared norm overflows")


def test_frequent_directions_rejects_rows_too_large():
    fd = FrequentDirections(3, 2)
    try:
        fd.update(np.full((5, 3), 1e200))
    except ValueError:
        return
    assert np.isfinite(fd.sketch).all(), f"NaN sketch from finite rows: {fd.sketch}"


# ------------------------------------------------------------------------------------- attend
def bad_queries(state, backend):
    rng = np.random.default_rng(3)
    lead = (3,) if state.batched else ()
    q = rng.standard_normal(lead + (4, 6))
    nan_q = q.copy()
    nan_q[..., 2, 1] = np.nan
    A = lambda x: arr(backend, x)  # noqa: E731
    return [
        ("no query heads", A(q[..., :0, :]), {}, ValueError, r"q has 0 heads"),
        ("heads not a multiple", A(rng.standard_normal(lead + (3, 6))), {}, ValueError, r"q has 3 heads; expected a positive multiple"),
        ("wrong d", A(rng.standard_normal(lead + (4, 5))), {}, ValueError, r"q has shape"),
        ("rank 1", A(rng.standard_normal(6)), {}, ValueError, r"q has shape"),
        ("NaN", A(nan_q), {}, ValueError, r"q contains NaN"),
        ("integer", A(np.ones(lead + (4, 6), dtype=np.int32)), {}, TypeError, r"q has dtype"),
        ("scale 0", A(q), {"scale": 0.0}, ValueError, r"scale must be positive"),
        ("scale < 0", A(q), {"scale": -1.0}, ValueError, r"scale must be positive"),
        ("scale NaN", A(q), {"scale": float("nan")}, ValueError, r"scale"),
        ("unknown backend", A(q), {"backend": "no-such"}, ValueError, r"unknown backend 'no-such'; registered backends: .*numpy"),
        ("backend None", A(q), {"backend": None}, ValueError, r"unknown backend None"),
        ("backend not a string", A(q), {"backend": 3}, ValueError, r"unknown backend 3"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["static", "adaptive", "rotating", "batched", "int8"])
def test_bad_attend_is_rejected_and_changes_nothing(backend, kind, value_scans):
    state = states(backend)[kind]
    for label, q, kw, exc, match in bad_queries(state, backend):
        kw = {"backend": backend, **kw}
        try:
            rejects(state, lambda: attend(q, state, **kw), exc, match)
        except AssertionError as err:
            raise AssertionError(f"{kind} on {backend}: {label}: {err}") from None


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_on_an_empty_state(backend):
    state = SubspaceState.adaptive(2, 6, rank_k=2, rank_v=2)
    if backend != "numpy":
        state = state.to(backend)
    rejects(state, lambda: attend(arr(backend, np.ones((2, 6))), state, backend=backend), ValueError, r"holds no tokens")


def test_attend_with_the_wrong_array_family():
    s = states()["adaptive"]
    if HAS_TORCH:
        import torch

        rejects(s, lambda: attend(torch.ones(2, 6, dtype=torch.float64), s), ValueError, r"q is a torch array; the numpy backend takes NumPy arrays")
        rejects(s, lambda: attend(torch.ones(2, 6, dtype=torch.float64), s, backend="torch"), ValueError, r"the state holds numpy arrays")
        t = s.to("torch")
        rejects(t, lambda: attend(np.ones((2, 6)), t, backend="torch"), ValueError, r"q is a numpy .*torch backend takes torch tensors")
        rejects(t, lambda: attend(np.ones((2, 6)), t), ValueError, r"state holds torch arrays")


def test_batched_query_batch_size_must_match():
    s = states()["batched"]
    rejects(s, lambda: attend(np.ones((2, 4, 6)), s), ValueError, r"q has shape \(2, 4, 6\); expected \(3, \*, 6\)")


@pytest.mark.parametrize("backend", ["triton", "cupy"])
def test_unavailable_backend_is_a_runtime_error_naming_it(backend):
    if _available(backend):
        pytest.skip(f"{backend} is available here")
    s = states()["adaptive"]
    rejects(s, lambda: attend(np.ones((2, 6)), s, backend=backend), RuntimeError, rf"backend '{backend}'")


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinite_scale_is_rejected(backend):
    """(Was a bug: scale=inf passed the `scale > 0` check and every output was NaN.)"""
    s = states(backend)["adaptive"]
    rejects(s, lambda: attend(arr(backend, np.ones((2, 6))), s, backend=backend, scale=float("inf")), ValueError, r"scale")


def test_attend_on_a_non_state_names_the_argument():
    with pytest.raises(TypeError, match=r"state"):
        attend(np.ones((2, 6)), {"not": "a state"})


def test_non_numeric_scale_names_the_argument():
    s = states()["adaptive"]
    rejects(s, lambda: attend(np.ones((2, 6)), s, scale="big"), (TypeError, ValueError), r"scale")


# ------------------------------------------------------------------------------- constructors
ONLINE_BAD = [
    (dict(rank_k=0), ValueError, r"rank_k must lie in \[1, 6\]"),
    (dict(rank_k=7), ValueError, r"rank_k must lie in \[1, 6\]"),
    (dict(rank_k=(1, 2, 3)), ValueError, r"rank_k must be one int or 2 ints"),
    (dict(rank_v=6), ValueError, r"rank_v must lie in \[1, 5\]"),
    (dict(ell_k=2), ValueError, r"ell_k = 2 must be > rank_k = 2"),
    (dict(ell_v=1), ValueError, r"ell_v = 1 must be > rank_v"),
    (dict(ell_k=0), ValueError, r"ell_k must be >= 1"),
    (dict(ell_k=3.5), TypeError, r"ell_k must be an int"),
    (dict(warmup=3), ValueError, r"warmup must be an int in \[0, 2\]"),
    (dict(warmup=-1), ValueError, r"warmup"),
    (dict(warmup=True), ValueError, r"warmup"),
    (dict(warmup=1.0), ValueError, r"warmup"),
    (dict(gamma="huge"), ValueError, r"gamma must be"),
    (dict(gamma=-1.0), ValueError, r"gamma must be positive"),
    (dict(gamma=float("nan")), ValueError, r"gamma must be positive and finite"),
    (dict(gamma=float("inf")), ValueError, r"gamma must be positive and finite"),
    (dict(gamma=(1.0, 2.0, 3.0)), ValueError, r"gamma must be .*2 \(one per head\)"),
    (dict(gamma="mse"), ValueError, r'gamma="mse" needs calibration queries'),
    (dict(dtype=np.float16), TypeError, r"dtype must be float32 or float64"),
    (dict(dtype=np.int32), TypeError, r"dtype must be float32 or float64"),
    (dict(dtype=np.complex128), TypeError, r"dtype must be float32 or float64"),
    (dict(batch=0), ValueError, r"batch must be >= 1"),
    (dict(batch=2.0), TypeError, r"batch must be an int"),
    (dict(batch=True), TypeError, r"batch must be an int"),
    (dict(coefficients="int3"), ValueError, r"coefficients must be"),
]
ADAPTIVE_BAD = [
    (dict(tau_k=0.0), ValueError, r"tau_k must lie in the open interval \(0, 1\)"),
    (dict(tau_k=1.0), ValueError, r"tau_k must lie in the open interval"),
    (dict(tau_v=-0.1), ValueError, r"tau_v must lie"),
    (dict(tau_v=float("nan")), ValueError, r"tau_v must lie"),
    (dict(tau_k=float("inf")), ValueError, r"tau_k must lie"),
    (dict(max_chunk=0), ValueError, r"max_chunk must be >= 1"),
    (dict(max_chunk=2.5), TypeError, r"max_chunk must be an int"),
    (dict(max_chunk=True), TypeError, r"max_chunk must be an int"),
]
ROTATING_BAD = [
    (dict(refresh_every=0), ValueError, r"refresh_every must be >= 1"),
    (dict(refresh_every=1.5), TypeError, r"refresh_every must be an int"),
]


@pytest.mark.parametrize("kw, exc, match", ONLINE_BAD + ADAPTIVE_BAD)
def test_adaptive_constructor_rejects(kw, exc, match):
    args = dict(rank_k=2, rank_v=2)
    args.update(kw)
    with pytest.raises(exc, match=match):
        SubspaceState.adaptive(2, 6, 5, **args)


@pytest.mark.parametrize("kw, exc, match", ONLINE_BAD + ROTATING_BAD)
def test_rotating_constructor_rejects(kw, exc, match):
    args = dict(rank_k=2, rank_v=2)
    args.update(kw)
    with pytest.raises(exc, match=match):
        SubspaceState.rotating(2, 6, 5, **args)


@pytest.mark.parametrize(
    "heads, d, d_v, exc, match",
    [
        (0, 6, 5, ValueError, r"heads must be >= 1"),
        (2.0, 6, 5, TypeError, r"heads must be an int"),
        (2, 0, 5, ValueError, r"d must be >= 1"),
        (2, 6, 0, ValueError, r"d_v must be >= 1"),
        (2, "6", 5, TypeError, r"d must be an int"),
    ],
)
def test_online_dimensions_rejected(heads, d, d_v, exc, match):
    """(A rank given as a string is caught by the per-head count check: "rank_k must be one int or 2 ints".)"""
    with pytest.raises(exc, match=match):
        SubspaceState.adaptive(heads, d, d_v, rank_k=1, rank_v=1)


@pytest.mark.parametrize("rank", [2.0, True, "2"])
def test_non_int_rank_names_the_argument(rank):
    with pytest.raises((TypeError, ValueError), match=r"rank_k"):
        SubspaceState.adaptive(2, 6, 5, rank_k=rank, rank_v=2)


def test_numpy_integer_ranks_are_accepted():
    state = SubspaceState.adaptive(2, 6, 5, rank_k=np.int64(2), rank_v=np.array([1, 2]), warmup=np.int32(1))
    assert state.policy.rank_k == (2, 2) and state.policy.rank_v == (1, 2) and state.policy.warmup == 1


def test_non_numeric_tau_names_the_argument():
    with pytest.raises((TypeError, ValueError), match=r"tau_k"):
        SubspaceState.adaptive(2, 6, 5, rank_k=2, rank_v=2, tau_k="0.2x")


# ------------------------------------------------------------------------------------- bases
def test_from_bases_rejects_non_orthonormal_hand_made_bases():
    rng = np.random.default_rng(4)
    B, E = orthonormal(rng, 2, 3, 6), orthonormal(rng, 2, 2, 5)
    with pytest.raises(ValueError, match=r"B\[0\] rows are not orthonormal"):
        StaticBasis.from_bases(B * 1.01, E)
    skew = B.copy()
    skew[1, 1] += 0.1 * skew[1, 0]
    with pytest.raises(ValueError, match=r"B\[1\] rows are not orthonormal"):
        StaticBasis.from_bases(skew, E)
    with pytest.raises(ValueError, match=r"E\[0\] rows are not orthonormal"):
        StaticBasis.from_bases(B, np.ones((2, 2, 5)))
    with pytest.raises(ValueError, match=r"B\[0\] has non-zero rows after its rank"):
        StaticBasis.from_bases(np.concatenate([np.zeros((2, 1, 6)), B[:, :2]], axis=1), E)  # padding before a row
    f32 = B.astype(np.float32)
    f32[0, 0] *= 1 + 1e-3
    with pytest.raises(ValueError, match=r"not orthonormal"):
        StaticBasis.from_bases(f32, E.astype(np.float32))
    with pytest.raises(ValueError, match=r"B has shape"):
        StaticBasis.from_bases(B[0], E)
    with pytest.raises(ValueError, match=r"E has shape"):
        StaticBasis.from_bases(B, E[:1])
    with pytest.raises(ValueError, match=r"B.*(orthonormal|NaN)"):
        StaticBasis.from_bases(np.full((2, 3, 6), np.inf), E)


@pytest.mark.parametrize("case", ["gamma nan", "gamma negative", "gamma wrong length", "int basis", "nan basis"])
def test_from_bases_rejects_bad_gamma_and_dtypes(case):
    rng = np.random.default_rng(5)
    B, E = orthonormal(rng, 2, 3, 6), orthonormal(rng, 2, 2, 5)
    args = {
        "gamma nan": ((B, E, float("nan")), r"gamma"),
        "gamma negative": ((B, E, -1.0), r"gamma"),
        "gamma wrong length": ((B, E, [1.0, 2.0, 3.0]), r"gamma"),
        "int basis": ((np.eye(6, dtype=np.int64)[None, :3].repeat(2, 0), E, 1.0), r"B has dtype"),
        "nan basis": ((np.full((2, 3, 6), np.nan), E, 1.0), r"B contains NaN"),
    }[case]
    with pytest.raises((ValueError, TypeError), match=args[1]):
        StaticBasis.from_bases(*args[0])


def test_static_rejects_non_basis():
    with pytest.raises(TypeError, match=r"basis must be a StaticBasis"):
        SubspaceState.static(np.zeros((2, 3, 6)))
    rng = np.random.default_rng(6)
    basis = StaticBasis.from_bases(orthonormal(rng, 2, 3, 6), orthonormal(rng, 2, 2, 5))
    with pytest.raises(ValueError, match=r"batch must be >= 1"):
        SubspaceState.static(basis, batch=0)
    with pytest.raises(ValueError, match=r"coefficients must be"):
        SubspaceState.static(basis, coefficients="fp8")


@pytest.mark.parametrize("dtype", [np.int64, np.complex128, "U4"])
def test_static_rejects_non_float_dtype(dtype):
    rng = np.random.default_rng(7)
    basis = StaticBasis.from_bases(orthonormal(rng, 2, 3, 6), orthonormal(rng, 2, 2, 5))
    with pytest.raises(TypeError, match=r"dtype"):
        SubspaceState.static(basis, dtype=dtype)


# ------------------------------------------------------------------------------- calibration
def test_calibrate_rejects():
    rng = np.random.default_rng(8)
    K, V = rng.standard_normal((2, 20, 6)), rng.standard_normal((2, 20, 5))
    cases = [
        (dict(keys=K, values=V, rank_k=0, rank_v=2), ValueError, r"rank_k must lie in \[1, 6\]"),
        (dict(keys=K, values=V, rank_k=2, rank_v=6), ValueError, r"rank_v must lie in \[1, 5\]"),
        (dict(keys=K, values=V, energy=0.0), ValueError, r"energy must lie in \(0, 1\]"),
        (dict(keys=K, values=V, energy=1.5), ValueError, r"energy"),
        (dict(keys=K, values=V, energy=float("nan")), ValueError, r"energy"),
        (dict(keys=K, values=V), ValueError, r"give rank_k or energy"),
        (dict(keys=K * np.nan, values=V, rank_k=2, rank_v=2), ValueError, r"keys contains NaN"),
        (dict(keys=K, values=V.astype(np.int32), rank_k=2, rank_v=2), TypeError, r"values has dtype"),
        (dict(keys=K, values=V[:, :10], rank_k=2, rank_v=2), ValueError, r"values has shape"),
        (dict(keys=K[0], values=V[0], rank_k=2, rank_v=2), ValueError, r"keys has shape"),
        (dict(keys=K, values=V, rank_k=2, rank_v=2, gamma="mse"), ValueError, r"needs queries"),
        (dict(keys=K, values=V, rank_k=2, rank_v=2, gamma="mse", queries=np.ones((3, 4, 6))), ValueError, r"queries has 3 heads"),
        (dict(keys=K, values=V, rank_k=2, rank_v=2, gamma="mse", queries=np.ones((2, 4, 5))), ValueError, r"queries has shape"),
        (dict(keys=K, values=V, rank_k=2, rank_v=2, gamma=0.0), ValueError, r"gamma must be positive"),
        (dict(keys=K[:, :0], values=V[:, :0], rank_k=1, rank_v=1), ValueError, r"rank_k = 1 exceeds the available rank 0"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            calibrate(**kw)


def test_calibrate_rejects_nan_queries():
    rng = np.random.default_rng(9)
    K, V = rng.standard_normal((2, 20, 6)), rng.standard_normal((2, 20, 5))
    with pytest.raises(ValueError, match=r"queries contains NaN"):
        calibrate(K, V, rank_k=2, rank_v=2, gamma="mse", queries=np.full((2, 4, 6), np.nan))


def test_frequent_directions_rejects():
    with pytest.raises(ValueError, match=r"d must be >= 1"):
        FrequentDirections(0, 2)
    with pytest.raises(ValueError, match=r"ell must be >= 1"):
        FrequentDirections(3, 0)
    with pytest.raises(TypeError, match=r"dtype must be float32 or float64"):
        FrequentDirections(3, 2, dtype=np.int32)
    fd = FrequentDirections(3, 2).update(np.ones((2, 3)))
    before = (fd.sketch.copy(), fd.rows_seen)
    for rows, exc, match in [
        (np.full((1, 3), np.nan), ValueError, r"rows contains NaN"),
        (np.ones((1, 4)), ValueError, r"rows has shape \(1, 4\); expected \(\*, 3\)"),
        (np.ones((2, 2, 3)), ValueError, r"rows has shape"),
    ]:
        with pytest.raises(exc, match=match):
            fd.update(rows)
        assert np.array_equal(fd.sketch, before[0]) and fd.rows_seen == before[1]
    with pytest.raises(ValueError, match=r"r must be < ell = 2"):
        fd.basis(2)
    with pytest.raises((TypeError, ValueError), match=r"r must be"):
        fd.basis(0)


def test_exact_attention_rejects():
    q, K, V = np.ones((2, 4)), np.ones((2, 3, 4)), np.ones((2, 3, 5))
    for args, match in [
        ((q, K[:, :0], V[:, :0]), r"K has no tokens"),
        ((q * np.nan, K, V), r"q contains NaN"),
        ((q, K, V * np.inf), r"V contains NaN or Inf"),
        ((np.ones((3, 4)), K, V), r"q has 3 heads; expected a multiple of the 2"),
        ((q, np.ones((2, 3, 5)), V), r"K has shape"),
        ((q, K, np.ones((2, 2, 5))), r"V has shape"),
    ]:
        with pytest.raises(ValueError, match=match):
            exact_attention(*args)


# ------------------------------------------------------------------------------- conversions
def test_to_rejects_unknown_backend_and_device():
    s = states()["adaptive"]
    rejects(s, lambda: s.to("no-such"), ValueError, r"unknown backend 'no-such'")
    rejects(s, lambda: s.to("numpy", device="cuda"), ValueError, r"device must be None or 'cpu' for the numpy backend")


@needs_torch
def test_to_torch_rejects_bad_dtype_and_device():
    import torch

    s = states()["adaptive"]
    rejects(s, lambda: s.to("torch", dtype="int8"), TypeError, r"dtype must be one of")
    rejects(s, lambda: s.to("torch", dtype=np.complex64), TypeError, r"dtype must be one of")
    if not torch.cuda.is_available():
        rejects(s, lambda: s.to("torch", device="cuda"), ValueError, r"device 'cuda' requested but torch sees no CUDA device")


@pytest.mark.parametrize("target", ["numpy"] + (["torch"] if HAS_TORCH else []))
def test_to_rejects_integer_dtype(target):
    s = states()["adaptive"]
    dtype = np.int32
    if target == "torch":
        import torch

        dtype = torch.int32
    rejects(s, lambda: s.to(target, dtype=dtype), TypeError, r"dtype")


@pytest.mark.parametrize("target", ["cupy", "triton"])
def test_to_unavailable_backend_is_a_clear_runtime_error(target):
    if _available(target):
        pytest.skip(f"{target} is available here")
    s = states()["adaptive"]
    rejects(s, lambda: s.to(target), RuntimeError, rf"backend '{target}' is not available")


@needs_torch
def test_torch_append_detaches_inputs():
    import torch

    s = states()["adaptive"].to("torch")
    k = torch.ones(2, 6, dtype=torch.float64, requires_grad=True)
    s.append(k, torch.ones(2, 5, dtype=torch.float64))
    assert not any(x.requires_grad for x in s.layout.arrays().values())
    out = attend(torch.ones(2, 6, dtype=torch.float64), s, backend="torch")
    assert not out.requires_grad


def test_nothing_changes_after_many_rejections():
    """All of the above rejections in a row on one state, then the state still appends and attends
    exactly like an untouched copy."""
    s = states()["adaptive"]
    twin = s.copy()
    for _, k, v, exc, match in bad_appends((2,), "numpy"):
        with pytest.raises(exc):
            s.append(k, v)
    for _, q, kw, exc, match in bad_queries(s, "numpy"):
        with pytest.raises(exc):
            attend(q, s, **kw)
    rng = np.random.default_rng(10)
    k, v = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 5))
    s.append(k, v)
    twin.append(k, v)
    a, b = snapshot(s), snapshot(twin)
    a.pop("layout_id"), b.pop("layout_id")
    assert_unchanged(a, b)
    q = rng.standard_normal((4, 6))
    assert attend(q, s).tobytes() == attend(q, twin).tobytes()
