"""The NumPy oracle: spec A3 written step by step, and the appends of spec A6-A8 (one module per
policy in :mod:`subspace_ref.policies`; they also run on CuPy arrays via ``xp``).

Every accelerated backend is tested against these two functions. They favour a reader holding the
paper beside them over speed: attention loops over heads and chunks, appends over tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref import window
from subspace_ref.arrays import to_numpy
from subspace_ref.backend import Availability
from subspace_ref.blockwise_softmax import SoftmaxPartial
from subspace_ref.capabilities import SKETCH_VARIANTS, Capabilities, attend_reasons
from subspace_ref.policies.append_adaptive import append_adaptive
from subspace_ref.policies.append_rotating import append_rotating
from subspace_ref.policies.append_static import append_static
from subspace_ref.rope import rotate


def append_reference(state, keys: Any, values: Any, ahead: tuple | None = None) -> None:
    """Append keys (N, H, n, d), values (N, H, n, d_v) to ``state``: spec A6 (static), A7
    (adaptive; ``ahead``, the L_h tokens after the block, anchors its snapshots under lookahead,
    spec/window.md W4) or A8 (rotating), each in its own module of :mod:`subspace_ref.policies`.
    Nothing visible changes until the append's final commit."""
    kind = state.policy.kind
    if kind == "static":
        append_static(state, keys, values)
    elif kind == "rotating":
        append_rotating(state, keys, values)
    else:
        append_adaptive(state, keys, values, ahead)


def attend_reference(q: np.ndarray, state, scale: float | None) -> np.ndarray:
    """Spec A3 over every chunk of every head: q (N, H_q, d) -> (N, H_q, d_v) in q's dtype.

    Computes in float64 when q and the state are float64, else in float32 (a float16 input is
    widened, as the accelerated backends accumulate in float32).
    """
    lay = state.layout
    work = np.promote_types(np.promote_types(q.dtype, lay.dtype), np.float32)
    N, Hq, d = q.shape
    group = Hq // state.heads
    s = 1.0 / np.sqrt(d) if scale is None else float(scale)
    out = np.empty((N, Hq, state.d_v), dtype=work)
    rope = getattr(state.policy, "rope", None)
    for n in range(N):
        for hq in range(Hq):
            h = hq // group
            qv = q[n, hq].astype(work)
            partial = SoftmaxPartial.empty(state.d_v, work)
            for j, (a, b) in enumerate(state.chunk_bounds(h, n)):
                B_j = lay.basis("key", (n, h, j), work)
                if rope is None:
                    q_proj = B_j @ qv  # spec A3 step 2.1
                    logits = work.type(lay.gamma[h] * s) * (lay.coefficient_rows("key", n, h, a, b, work) @ q_proj)
                else:  # spec/rope.md P3: keys rebuilt and rotated to their positions, O(r d) per token
                    first = window.first_compressed_position(state)  # spec/window.md W10
                    keys = rotate(lay.coefficient_rows("key", n, h, a, b, work) @ B_j, np.arange(first + a, first + b), rope)
                    logits = work.type(lay.gamma[h] * s) * (keys @ qv)
                partial.add_chunk(logits, lay.coefficient_rows("value", n, h, a, b, work), lay.basis("value", (n, h, j), work))
            if state.window is not None:  # spec/window.md W3: the exact tokens, one more chunk
                window.add_exact_chunk(partial, qv, state.window, n, h, s, work)
            out[n, hq] = partial.result()
    return out.astype(q.dtype)


class NumpyBackend:
    """The oracle as a backend: CPU, NumPy arrays, float32 and float64 (float16 widened)."""

    name = "numpy"
    array_family = "numpy"
    capabilities = Capabilities(
        array_families=("numpy",),
        devices=("cpu",),
        dtypes=("float16", "float32", "float64"),
        window=True,
        sinks=True,
        rope=True,
        sketch_variants=SKETCH_VARIANTS,
    )
    devices = capabilities.devices
    dtypes = capabilities.dtypes

    def availability(self) -> Availability:
        return Availability(True)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        return attend_reasons(self.name, self, q, state)

    def converter(self, device: Any = None, dtype: Any = None):
        if device not in (None, "cpu"):
            raise ValueError(f"device must be None or 'cpu' for the numpy backend, got {device!r}")

        def convert(x):
            x = np.array(to_numpy(x))
            return x.astype(dtype) if dtype is not None and x.dtype.kind == "f" else x

        return convert

    def append(self, state, keys, values, ahead=None) -> None:
        """``ahead``: the lookahead tokens after the block (spec/window.md W4), or None."""
        append_reference(state, keys, values, ahead)

    def attend(self, q, state, scale):
        return attend_reference(q, state, scale)
