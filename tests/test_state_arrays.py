"""The one enumeration of a state's arrays (subspace_ref.layout.STATE_ARRAYS): byte counts, copies
and conversions iterate it, so none can miss an array another one sees."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from subspace_ref import StaticBasis, SubspaceState
from subspace_ref.arrays import array_family
from subspace_ref.layout import (
    BY_NAME,
    COUNT_RULES,
    DTYPE_RULES,
    STATE_ARRAYS,
    held_arrays,
)


def _orthonormal(rng, heads, r, d):
    return np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0].T[:r] for _ in range(heads)])


@st.composite
def variant_states(draw):
    """A state of any policy with any combination of the variants its constructor takes, after
    0..40 appended tokens."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["static", "adaptive", "rotating"]))
    H, d, d_v = 2, 6, 5
    common = dict(
        batch=draw(st.sampled_from([None, 2])),
        dtype=draw(st.sampled_from([np.float32, np.float64])),
        coefficients=draw(st.sampled_from(["float", "int8", "int4", "int2"])),
        bases=draw(st.sampled_from(["native", "float16", "float8_e4m3", "int8"])),
        window=draw(st.sampled_from([0, 3])),
        min_tokens=draw(st.sampled_from([0, 5])),
        sinks=draw(st.sampled_from([0, 2])),
    )
    if kind == "static":
        g = draw(st.sampled_from([1, 2]))
        basis = StaticBasis.from_bases(_orthonormal(rng, H * g, 3, d), _orthonormal(rng, H * g, 2, d_v), gamma=rng.uniform(0.5, 2, H * g))
        state = SubspaceState.static(basis, query_group=g, **common)
    elif kind == "adaptive":
        ring = draw(st.sampled_from([0, 8]))
        state = SubspaceState.adaptive(
            H,
            d,
            d_v,
            rank_k=2,
            rank_v=2,
            max_chunk=4,
            ring_warm_start=ring,
            sketch_reset=not ring and draw(st.booleans()),
            fd_stride=draw(st.sampled_from([1, 3])),
            reuse_angle=draw(st.sampled_from([None, 0.3])),
            lookahead=0 if ring else draw(st.sampled_from([0, common["window"]])),
            **common,
        )
    else:
        state = SubspaceState.rotating(H, d, d_v, rank_k=2, rank_v=3, refresh_every=3, **common)
    n = draw(st.integers(0, 40))
    lead = (state.batch, state.kv_heads) if state.batched else (state.kv_heads,)
    if n:
        state.append(rng.standard_normal(lead + (n, d)), rng.standard_normal(lead + (n, d_v)))
    return state


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant_states())
def test_allocated_nbytes_at_least_nbytes_for_every_variant(state):
    assert state.allocated_nbytes >= state.nbytes > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant_states())
def test_copy_holds_every_array_and_the_same_nbytes(state):
    twin = state.copy()
    assert held_arrays(twin).keys() == held_arrays(state).keys()
    assert twin.nbytes == state.nbytes
    for name, x in held_arrays(twin).items():
        assert not np.shares_memory(x, held_arrays(state)[name]), f"copy shares {name}"


def _array_attributes(obj) -> set[str]:
    """Attributes of a dataclass that hold arrays right now."""
    out = set()
    for f in fields(obj):
        try:
            array_family(getattr(obj, f.name))
        except ValueError:
            continue
        out.add(f.name)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant_states())
def test_enumeration_lists_every_array_the_parts_hold(state):
    """An array field added to the layout, the sketches or the window without a line in
    STATE_ARRAYS fails here: copies, nbytes and files would silently miss it."""
    held = held_arrays(state)
    for part in ("layout", "sketches", "window"):
        obj = getattr(state, part)
        if obj is None:
            continue
        listed = {BY_NAME[n].attr for n in held if BY_NAME[n].part == part}
        assert _array_attributes(obj) == listed, f"{part} holds arrays missing from STATE_ARRAYS"


def test_enumeration_is_well_formed():
    names = [a.name for a in STATE_ARRAYS]
    assert len(names) == len(set(names))
    assert all(a.dtype in DTYPE_RULES and a.counted in COUNT_RULES and a.axis in ("token", "chunk", "fixed", "group") for a in STATE_ARRAYS)


def test_ring_state_counts_its_rings_in_both_byte_counts():
    """The drift issue 18 found: allocated_nbytes 89,776 < nbytes 97,888 for a ring_warm_start=32
    state (the rings were counted in one and not the other)."""
    rng = np.random.default_rng(0)
    state = SubspaceState.adaptive(4, 32, rank_k=4, rank_v=4, ring_warm_start=32, dtype=np.float32)
    state.append(rng.standard_normal((4, 100, 32)), rng.standard_normal((4, 100, 32)))
    rings = sum(x.nbytes for n, x in held_arrays(state).items() if n.startswith("ring_"))
    assert rings == 2 * 4 * 32 * 32 * 4
    assert state.allocated_nbytes >= state.nbytes


@pytest.mark.parametrize(
    "dtype_rule, kept",
    [("coefficients", ("key_coef", "value_coef", "key_scale", "value_scale")), ("bases", ("key_bases", "value_bases", "key_basis_scale", "value_basis_scale"))],
)
def test_conversion_keeps_the_dtype_of_encoded_arrays(dtype_rule, kept):
    rng = np.random.default_rng(1)
    kw = {"coefficients": "int8"} if dtype_rule == "coefficients" else {"bases": "int8"}
    state = SubspaceState.adaptive(2, 6, rank_k=2, rank_v=2, dtype=np.float64, **kw)
    state.append(rng.standard_normal((2, 9, 6)), rng.standard_normal((2, 9, 6)))
    pytest.importorskip("torch")
    import torch

    moved = state.to("torch", dtype=torch.float32)
    before, after = held_arrays(state), held_arrays(moved)
    assert after.keys() == before.keys()
    for name in kept:
        assert str(after[name].dtype).removeprefix("torch.") == str(before[name].dtype), name
    assert after["gamma"].dtype == torch.float32 and after["sketch_keys"].dtype == torch.float32
