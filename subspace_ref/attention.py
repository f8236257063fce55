"""``attend``: coefficient-space attention over a state, on any registered backend (spec A2, A3)."""

from __future__ import annotations

from typing import Any

from subspace_ref import _checks
from subspace_ref.registry import get_backend


def attend(q: Any, state, backend: str = "numpy", scale: float | None = None) -> Any:
    """Attention of queries q (H_q, d) — or (N, H_q, d) for a batched state — over ``state``,
    computed in coefficient space with the one-pass blockwise softmax of spec A3 and the state's
    per-head logit scale gamma: logits are gamma * scale * (B_j q) . c_t, scale defaulting to 1/sqrt(d).

    ``backend`` names a registered backend (see :func:`subspace_ref.backends`). The result has
    q's array type, device and dtype: (H_q, d_v) or (N, H_q, d_v).
    """
    from subspace_ref.state import SubspaceState

    if not isinstance(state, SubspaceState):
        raise TypeError(f"state must be a SubspaceState, got {type(state).__name__}")
    impl = get_backend(backend)
    available = impl.availability()
    if not available:
        raise RuntimeError(f"backend {backend!r} is not available on this machine: {available.reason}")
    q = _checks.as_array("q", q)
    _checks.float_dtype("q", q)
    if state.batched:
        _checks.shape("q", q, (state.batch, None, state.d))
    else:
        _checks.shape("q", q, (None, state.d))
        q = q[None]
    if q.shape[1] % state.heads or q.shape[1] == 0:
        raise ValueError(f"q has {q.shape[1]} heads; expected a positive multiple of the state's {state.heads} KV heads")
    _checks.finite("q", q)
    if scale is not None and not 0 < _checks.real("scale", scale) < float("inf"):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if state.num_tokens == 0:
        raise ValueError("the state holds no tokens; append keys and values before attending")
    reasons = impl.not_supported_reasons(q, state)
    if reasons:
        raise ValueError(f"backend {backend!r} does not support this call: " + "; ".join(reasons))
    out = impl.attend(q, state, scale)
    if not bool((out == out).all()) or not bool(abs(out).max() < float("inf")):
        # inputs were finite, so the logits overflowed the dtype (|q| |k| too large)
        raise ValueError(f"attention output is not finite: the logits overflow {q.dtype} (rescale q or the keys)")
    return out if state.batched else out[0]
