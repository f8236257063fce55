"""Spec A6: appending to a static state, one projection per token onto the fixed bases."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from subspace_ref.arrays import namespace
from subspace_ref.policies.storing import store
from subspace_ref.rope import rotate
from subspace_ref.window import first_compressed_position


def append_static(state, keys: Any, values: Any) -> None:
    """Spec A6 for keys (N, H, n, d), values (N, H, n, d_v): c_t = B k_t, d_t = E v_t with chunk
    0's bases; a pre-RoPE state first turns the keys back to their pre-RoPE values at positions
    S+T..S+T+n-1 (spec/rope.md P2 step 1, S the sinks: spec/window.md W10)."""
    xp = namespace(keys)
    policy = state.policy
    n_new = keys.shape[2]
    T = state.layout.num_tokens
    lay = state.layout.with_capacity(T + n_new, state.layout.key_bases.shape[2])
    every = (slice(None), slice(None), 0)  # chunk 0 of every sequence and head
    if policy.rope is not None:
        first = first_compressed_position(state)  # spec/window.md W10
        keys = rotate(keys, np.arange(first + T, first + T + n_new), policy.rope, inverse=True)
    store(lay, "key", slice(T, T + n_new), xp.einsum("nhtd,nhrd->nhtr", keys, lay.basis("key", every, keys.dtype)))
    store(lay, "value", slice(T, T + n_new), xp.einsum("nhtd,nhrd->nhtr", values, lay.basis("value", every, values.dtype)))
    state.layout = replace(lay, num_tokens=T + n_new)
