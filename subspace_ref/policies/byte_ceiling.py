"""Spec A7.3, the byte ceiling of an adaptive state: a trigger opens a chunk only when the state
with it stays within ``byte_ceiling`` times the full cache, its fixed bytes (sketches) included,
so ``nbytes`` never exceeds max(byte_ceiling x full cache, a one-chunk state's bytes) (statement
A7.3.1). Shared by the oracle and the torch append through the array namespace."""

from __future__ import annotations

import math
from typing import Any

from subspace_ref.arrays import itemsize
from subspace_ref.layout import FIXED, STATE_ARRAYS, counted_nbytes, growth_rates


def ceiling_option(byte_ceiling: Any) -> float:
    """byte_ceiling checked: a real number > 0, or math.inf (no ceiling: seed 001's policy)."""
    from subspace_ref import _checks

    value = _checks.real("byte_ceiling", byte_ceiling)
    if not value > 0:
        raise ValueError(f"byte_ceiling must be > 0 (a fraction of the full cache's bytes; math.inf for none), got {byte_ceiling!r}")
    return value


def rates(state) -> tuple[int, float, float]:
    """(B_c, T_c, beta) of spec A7.3 for one (sequence, head): the bytes one more chunk adds, the
    bytes one more token adds, and the ceiling's bytes per token, byte_ceiling (d + d_v) in the
    state's dtype."""
    per_chunk, per_token = growth_rates(state)
    beta = state.policy.byte_ceiling * (state.d + state.d_v) * itemsize(state.layout.gamma)
    return per_chunk, per_token, beta


def fixed_bytes(state) -> float:
    """F of spec A7.3 for one (sequence, head): the counted bytes that do not grow with tokens or
    chunks (sketches, rings, gamma, an int4/int2 key tail), shared out evenly over the N H
    (sequence, head) pairs. The exact window and sinks are not in F: their tokens cost exactly
    their share of the full cache (spec A7.3.1's remark)."""
    names = [a.name for a in STATE_ARRAYS if a.axis == FIXED and a.part != "window"]
    return counted_nbytes(state, names) / (state.batch * state.heads)


def check_ceiling(state) -> None:
    """ValueError when the ceiling is below the bytes a token's coefficients cost (spec A7.3
    needs T_c <= beta, else no chunk layout could stay under it)."""
    per_chunk, per_token, beta = rates(state)
    if per_token > beta:
        raise ValueError(
            f"byte_ceiling={state.policy.byte_ceiling} allows {beta:g} bytes per token and head, below the {per_token:g} bytes "
            f"of one token's coefficients at ranks {max(state.policy.rank_k)}/{max(state.policy.rank_v)}; raise it or lower the ranks"
        )


def opener(state):
    """Spec A7.3 step 1 for the appends to ``state``: a function (num_chunks, ends) -> whether a
    head holding ``num_chunks`` chunks may open one more at the token that makes ``ends`` tokens,
    F + (J + 1) B_c + ends T_c <= ends beta, elementwise (integer or float64 arrays that
    broadcast: float64 arithmetic, the same in every backend). The rates are taken once."""
    if math.isinf(state.policy.byte_ceiling):
        return lambda num_chunks, ends: ends >= 0
    per_chunk, per_token, beta = rates(state)
    fixed = fixed_bytes(state)
    return lambda num_chunks, ends: fixed + (num_chunks + 1) * float(per_chunk) + ends * per_token <= ends * beta


def may_open(state, num_chunks: Any, ends: Any) -> Any:
    """:func:`opener` of ``state`` applied once."""
    return opener(state)(num_chunks, ends)
