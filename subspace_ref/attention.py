"""``attend``: coefficient-space attention over a state, on any registered backend (spec A2, A3).

The operation lives in :mod:`subspace_ref.operations`; a :class:`~subspace_ref.layer_state.LayerState`
attends group by group (:meth:`LayerState.attend`, spec/layer_state.md L5).
"""

from __future__ import annotations

from typing import Any

from subspace_ref import operations
from subspace_ref.layer_state import LayerState


def attend(q: Any, state, backend: str = "numpy", scale: float | None = None) -> Any:
    """Coefficient-space attention of queries over a compressed state (spec A2, A3).

    :func:`subspace_ref.operations.attend` documents the checks and refusals.

    Parameters
    ----------
    q : array
        Queries (H_q, d), or (N, H_q, d) for a batched state; H_q a multiple of the KV heads.
    state : SubspaceState or LayerState
        What to attend over (a layer state attends group by group, spec/layer_state.md L5).
    backend : str
        A registered backend name (:func:`subspace_ref.backends`).
    scale : float, optional
        Logit scale; defaults to 1/sqrt(d).

    Returns
    -------
    array
        (H_q, d_v), or (N, H_q, d_v), in ``q``'s array family and dtype.

    Examples
    --------
    >>> import numpy as np, subspace_ref as sr
    >>> rng = np.random.default_rng(0)
    >>> K, V = rng.standard_normal((2, 2, 32, 8))
    >>> state = sr.SubspaceState.static(sr.calibrate(K, V, rank_k=4, rank_v=4))
    >>> state = state.append(K, V)  # returns the state itself
    >>> sr.attend(rng.standard_normal((2, 8)), state).shape
    (2, 8)
    """
    if isinstance(state, LayerState):
        return state.attend(q, backend=backend, scale=scale)
    return operations.attend(q, state, backend=backend, scale=scale)


__all__ = ["attend"]
