"""Persistence (spec/persistence.md) of the harness's variant states: every case with int4/int2
coefficients, attention sinks or pre-RoPE bases, built by the oracle, saved and loaded back must
hold the same bytes in every array (layout and exact tokens), the same policy and window, and
attend to the same output bit for bit; pre-RoPE states keep their RoPE parameters exactly
(spec/rope.md §5). Query-shared states are outside the saved schema (spec/sharing.md §6): saving
one must be refused with that reason and write nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import subspace_ref as sr
from subspace_ref.layout import held_arrays

from .cases import CASES, Case, build

VARIANTS = {"int4", "int2", "sinks", "rope"}
PERSISTED = [c for c in CASES if c.features & VARIANTS]


def test_the_variants_are_covered():
    covered = set().union(*(c.features for c in PERSISTED)) & VARIANTS
    assert covered == VARIANTS, VARIANTS - covered
    saved = set().union(*(c.features for c in PERSISTED if not c.share))
    assert VARIANTS <= saved


@pytest.mark.parametrize("case", PERSISTED, ids=str)
def test_round_trip_is_bit_exact(tmp_path, case: Case):
    b = build(case)
    path = tmp_path / "state.safetensors"
    if case.share:
        from subspace_ref.capabilities import NotSupportedError

        with pytest.raises(NotSupportedError, match="spec/sharing.md §6"):
            b.state.save(path)
        assert not path.exists()
        return
    b.state.save(path)
    back = sr.SubspaceState.load(path)
    rope, back_rope = getattr(b.state.policy, "rope", None), getattr(back.policy, "rope", None)
    if rope is not None:  # RopeParams compare by identity: compare what they hold
        assert back_rope.inv_freq.tobytes() == rope.inv_freq.tobytes()
        assert (back_rope.layout, back_rope.attention_scaling) == (rope.layout, rope.attention_scaling)
    assert dataclasses.replace(back.policy, **({"rope": rope} if rope is not None else {})) == b.state.policy
    assert back.num_tokens == b.state.num_tokens
    assert back.layout.coefficients == b.state.layout.coefficients and back.layout.group == b.state.layout.group
    assert (back.window is None) == (b.state.window is None)
    if b.state.window is not None:
        assert back.window.sink_count == b.state.window.sink_count
    want, got = held_arrays(b.state), held_arrays(back)
    assert want.keys() == got.keys()
    for name, x in want.items():
        live_x, live_y = np.asarray(x), np.asarray(got[name])
        assert live_x.dtype == live_y.dtype, name
        if name in b.state.layout.live_arrays():  # spare capacity is not saved: compare the live rows
            live_x, live_y = np.asarray(b.state.layout.live_arrays()[name]), np.asarray(back.layout.live_arrays()[name])
        assert live_x.shape == live_y.shape and live_x.tobytes() == live_y.tobytes(), f"{case}: {name} differs after the round trip"
    np.testing.assert_array_equal(sr.attend(b.q, back, scale=b.scale), b.out64)
