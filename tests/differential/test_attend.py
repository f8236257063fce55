"""Every backend's ``attend`` against the float64 NumPy oracle (spec A2, A3), per dtype.

Tolerance: :mod:`.tolerance` (FACTOR x the oracle's own error in the backend's dtype + a floor).
The state is the oracle's, converted by the backend's converter, with its spare capacity
poisoned (NaN coefficients and bases, chunk starts -1; int8 coefficients 127 with NaN scales)
past the live ranges.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.arrays import to_numpy

from .cases import CASES, SLOW_CASES, Case, build
from subspace_ref.registry import get_backend

from .harness import BACKENDS, RESULTS, Record, backend_state, check_output, declared_refusal, to_backend
from .tolerance import FACTOR, reference_error, tolerance


@functools.lru_cache(maxsize=None)
def _reference_error(case: Case, dtype: str) -> float:
    b = build(case)
    return reference_error(b.state, b.q, b.scale, b.out64, dtype, seed=case.seed)


def _check(target, case: Case, record: bool = True) -> None:
    b = build(case)
    state = backend_state(b.state, target)
    q = to_backend(b.q, target)
    reasons = get_backend(target.backend).not_supported_reasons(q, state)
    if reasons:  # allowed only for a declared gap of the backend, and then refused by attend itself
        message = declared_refusal(target.backend, "attend", case, reasons)
        with pytest.raises(ValueError, match=re.escape(reasons[0])):
            sr.attend(q, state, backend=target.backend, scale=b.scale)
        pytest.skip(message)
    out = sr.attend(q, state, backend=target.backend, scale=b.scale)
    host = check_output(out, target, (case.N, case.H * case.group, case.d_v))
    err = float(np.abs(host - b.out64).max())
    ref = _reference_error(case, target.dtype)
    tol = tolerance(ref, b.out64, target.dtype)
    if record:
        RESULTS.append(Record(target.id, case.name, err, tol, ref))
    assert err <= tol, (
        f"{target.id} on {case}: max |backend - oracle64| = {err:.3g} > tol {tol:.3g} "
        f"(= {FACTOR} x oracle-in-{target.dtype} error {ref:.3g} + floor); max |out| = {np.abs(b.out64).max():.3g}, "
        f"max |logit| = {b.max_logit:.3g}, chunks per head = {to_numpy(b.state.layout.num_chunks).tolist()}, seed {case.seed}"
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attend_matches_oracle(target, case):
    _check(target, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=str)
def test_attend_matches_oracle_slow(target, case):
    _check(target, case)


def test_cases_cover_the_brief():
    """The default cases contain what the harness promises to cover."""
    built = {c.name: build(c) for c in CASES}
    kinds = {c.kind for c in CASES}
    assert kinds == {"static", "adaptive", "rotating"}
    assert any(c.T == 1 for c in CASES)
    assert {1, 4, 8} <= {c.group for c in CASES}
    assert any(c.N > 1 for c in CASES)
    assert any(c.rank_k == 1 for c in CASES) and any(c.rank_k == c.d for c in CASES)
    assert max(b.max_logit for b in built.values()) >= 1e4
    chunks = {name: int(b.state.num_chunks.max()) for name, b in built.items()}
    assert max(chunks.values()) >= 200, "a case with hundreds of chunks"
    assert any(c.kind == "adaptive" and chunks[c.name] == 1 and c.T > 1 for c in CASES), "a single-chunk adaptive case"
    features = set().union(*(c.features for c in CASES))
    assert {
        "window",
        "sinks",
        "rope",
        "query_group",
        "ring_warm_start",
        "fd_stride",
        "reuse_angle",
        "int8",
        "int4",
        "int2",
        "encoded_bases",
        "lookahead",
    } <= features
    for low in ("int4", "int2"):  # complete key groups and an unfinished one (spec/quantization.md Q2)
        assert any(low in c.features and c.T % c.group_size and c.T > c.group_size for c in CASES), low
    assert any({"int4", "rope"} <= c.features for c in CASES) or any({"int2", "rope"} <= c.features for c in CASES)
    assert any(c.coefficients in ("int4", "int2") and c.sinks for c in CASES)
    for feature in features - {"int8", "encoded_bases"}:  # every variant with d != d_v (gamma != 1 always: empty_state)
        assert any(feature in c.features and c.d != c.d_v for c in CASES), feature
    assert all(not np.allclose(b.state.layout.gamma, 1.0) for b in built.values())
    sinks = next(b for b in built.values() if b.case.sinks and b.case.window)
    assert sinks.state.window.sink_count and sinks.state.window.recent and sinks.state.layout.num_tokens, "sinks, compressed and recent tokens at once"
    # boundaries at 1, L-1, L, L+1 (L = 8): under the default trigger (spec A7.2) the cap fires at
    # the token that would make the chunk exceed L, which opens chunk 2 at T = L + 1
    for T, J in ((1, 1), (7, 1), (8, 1), (9, 2)):
        name = {1: "adaptive-T1", 7: "adaptive-T_L-1", 8: "adaptive-T_L", 9: "adaptive-T_L+1"}[T]
        assert chunks[name] == J, (name, chunks[name])


def test_backends_listed(capsys):
    """Which backends this run covers (shown with -s / in the terminal summary)."""
    infos = sr.backends()
    with capsys.disabled():
        print("\nsubspace_ref backends: " + "; ".join(str(b) for b in infos))
    assert {b.name for b in infos} == set(BACKENDS)
    assert any(b.name == "numpy" and b.available for b in infos)
