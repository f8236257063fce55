"""``attend``: coefficient-space attention over a state, on any registered backend (spec A2, A3).

The operation lives in :mod:`subspace_ref.operations`; a :class:`~subspace_ref.layer_state.LayerState`
attends group by group (:meth:`LayerState.attend`, spec/layer_state.md L5).
"""

from __future__ import annotations

from typing import Any

from subspace_ref import operations
from subspace_ref.layer_state import LayerState


def attend(q: Any, state, backend: str = "numpy", scale: float | None = None) -> Any:
    """Attention of queries q (H_q, d) -- or (N, H_q, d) for a batched state -- over ``state``
    (a :class:`~subspace_ref.SubspaceState` or a :class:`~subspace_ref.LayerState`) on
    ``backend``: :func:`subspace_ref.operations.attend`, which documents the call."""
    if isinstance(state, LayerState):
        return state.attend(q, backend=backend, scale=scale)
    return operations.attend(q, state, backend=backend, scale=scale)


__all__ = ["attend"]
