"""Every backend's ``append`` (spec A6-A8) against the oracle's, and blocks against single tokens.

The backend's state starts as the oracle's empty float64 state converted by the backend (spare
capacity NaN-poisoned), receives the same keys and values in the same blocks, and must end with
the same chunk boundaries and the same reconstruction (K_hat, V_hat) to float64 rounding. FD
buffers are compared through their Gram matrices S^T S (an SVD fixes singular vectors only up to
sign, and compaction stores sigma * W^T rows as the SVD returns them).
"""

from __future__ import annotations

import numpy as np
import pytest

from subspace_ref.arrays import to_numpy

from .cases import CASES, Case, empty_state, low_bit, tokens
from .harness import Target, backend_state, declared_refusal, to_backend

APPEND_CASES = [
    c
    for c in CASES
    if c.name
    in {
        "static-N2-gqa4-r_eq_d",
        "static-head_ranks",
        "adaptive-T1",
        "adaptive-T_L+1",
        "adaptive-T_5L+1-N2",
        "adaptive-hundreds",
        "adaptive-head_ranks",
        "adaptive-paper_no_warmup",
        "adaptive-r_eq_d",
        "adaptive-sketch_reset",
        "adaptive-sketch_reset-chunk_eq_ell",
        "static-sinks-window-head_ranks",
        "static-query_group4-sinks-int8",
        "static-rope-window",
        "adaptive-sinks-window",
        "adaptive-window-lookahead",
        "rotating-sinks-window-min_tokens",
        "adaptive-ring",
        "adaptive-stride2",
        "adaptive-reuse-int8",
        "rotating-T_m+1",
        "rotating-N2-gqa4-logits1e4",
        "rotating-head_ranks",
        "rotating-r_eq_d",
        "static-int8-N2-gqa4",
        "adaptive-int8",
        "rotating-int8-logits1e4",
        "static-int4-N2-gqa4-G8",
        "adaptive-int2-G8",
        "rotating-int4-logits1e4",
        "static-sinks-window-int2",
        "static-int8keys-int2values-sinks",
        "adaptive-int2keys-int4values",
        "rotating-floatkeys-int8values",
    }
]
# Cases whose chunk boundaries do not depend on rounding (no residual trigger can fire), so a
# float32 append must reproduce the float32 oracle's boundaries exactly.
# int4/int2 are left out: one float32 rounding across a quantiser boundary moves a code by a step
# of up to 2 max|c| / (2^b - 1) (2/3 of the largest entry for int2), a bound too loose to test
# anything; their float64 appends must match the oracle exactly (test_append_matches_oracle).
FLOAT32_CASES = [c for c in APPEND_CASES if (c.kind != "adaptive" or c.data == "lowrank" or c.rank_k == c.d) and not low_bit(c)]


def _inputs(case: Case, salt: int):
    rng = np.random.default_rng(case.seed ^ salt)
    empty = empty_state(case, rng)
    K, V = tokens(case, rng)
    # random block sizes, single tokens included: the same split for every state
    cuts = sorted(set(rng.integers(1, case.T, size=min(case.T - 1, 6)).tolist())) if case.T > 1 else []
    bounds = [0, *cuts, case.T]
    return empty, K, V, list(zip(bounds[:-1], bounds[1:]))


def _feed(state, K, V, blocks, convert, case: Case | None = None, target: Target | None = None):
    """Append the blocks; a backend refusing (NotImplementedError, ValueError) is skipped only
    for a declared gap of the case's features, and must have left the state as it was."""
    for a, b in blocks:
        k, v = convert(K[:, :, a:b]), convert(V[:, :, a:b])
        try:
            state.append(k, v)
        except (NotImplementedError, ValueError) as err:
            if target is None:
                raise
            message = declared_refusal(target.backend, "append", case, getattr(err, "reasons", [str(err)]))
            assert state.num_tokens == a, f"{target.id} {case}: a refused append changed the state"
            pytest.skip(message)
    return state


def assert_same_state(got, want, rtol: float, what: str) -> None:
    """Same tokens, chunk boundaries, reconstruction (to rtol of the largest entry) and sketches."""
    assert got.num_tokens == want.num_tokens, what
    nc_got, nc_want = to_numpy(got.layout.num_chunks), to_numpy(want.layout.num_chunks)
    assert np.array_equal(nc_got, nc_want), f"{what}: chunks per head {nc_got.tolist()} != {nc_want.tolist()}"
    for n in range(nc_want.shape[0]):
        for h in range(nc_want.shape[1]):
            assert got.chunk_bounds(h, n) == want.chunk_bounds(h, n), f"{what}: chunk boundaries of sequence {n} head {h}"
    for name, x, y in zip(("K_hat", "V_hat"), got.reconstruct(), want.reconstruct()):
        err = np.abs(x.astype(np.float64) - y).max(initial=0.0)
        scale = max(np.abs(y).max(initial=0.0), 1.0)
        assert err <= rtol * scale, f"{what}: {name} differs by {err:.3g} (> {rtol:g} x {scale:.3g})"
    np.testing.assert_array_equal(to_numpy(got.layout.gamma).astype(np.float64), to_numpy(want.layout.gamma).astype(np.float64))
    if want.sketches is not None:
        for a, b in ((got.sketches.keys, want.sketches.keys), (got.sketches.values, want.sketches.values)):
            a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
            ga, gb = np.swapaxes(a, -1, -2) @ a, np.swapaxes(b, -1, -2) @ b
            assert np.abs(ga - gb).max() <= rtol * max(np.abs(gb).max(), 1.0), f"{what}: FD sketches differ"
        assert (got.sketches.filled_k, got.sketches.filled_v, got.sketches.rows_seen) == (
            want.sketches.filled_k,
            want.sketches.filled_v,
            want.sketches.rows_seen,
        )


@pytest.mark.parametrize("case", APPEND_CASES, ids=str)
def test_append_matches_oracle(target64: Target, case: Case):
    empty, K, V, blocks = _inputs(case, 0xA1)
    oracle = _feed(empty.copy(), K, V, blocks, lambda x: x)
    state = _feed(backend_state(empty, target64), K, V, blocks, lambda x: to_backend(x, target64), case, target64)
    assert state.engine == oracle.engine or state.engine != "numpy"
    assert_same_state(state, oracle, 1e-9, f"{target64.id} {case} blocks {blocks}")


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=str)
def test_append_float32_matches_oracle(target32: Target, case: Case):
    target = target32
    empty, K, V, blocks = _inputs(case, 0xA3)
    oracle = _feed(empty.to("numpy", dtype="float32"), K, V, blocks, lambda x: x.astype(np.float32))
    state = _feed(backend_state(empty, target), K, V, blocks, lambda x: to_backend(x, target), case, target)
    # int8 (spec A10): a float32 rounding difference may move a coefficient across a rounding
    # boundary of the quantiser (more likely as each refresh requantises), i.e. by one step
    # s = max|c| / 127 -- allowed once; float coefficients must agree to float32 rounding
    rtol = 1e-4 if case.coefficients == "float" else 1.0 / 127
    assert_same_state(state, oracle, rtol, f"{target.id} {case} blocks {blocks}")


@pytest.mark.parametrize("case", APPEND_CASES, ids=str)
def test_token_by_token_equals_block(target64: Target, case: Case):
    empty, K, V, _ = _inputs(case, 0xA2)
    convert = lambda x: to_backend(x, target64)  # noqa: E731
    block = _feed(backend_state(empty, target64), K, V, [(0, case.T)], convert, case, target64)
    single = _feed(backend_state(empty, target64), K, V, [(t, t + 1) for t in range(case.T)], convert, case, target64)
    assert_same_state(single, block, 1e-9, f"{target64.id} {case}: token by token vs one block")
