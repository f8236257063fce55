"""``attend``: coefficient-space attention over a state, on any registered backend (spec A2, A3)."""

from __future__ import annotations

from typing import Any

from subspace_ref import _checks
from subspace_ref.arrays import array_family
from subspace_ref.registry import get_backend


def attend(q: Any, state, backend: str = "numpy", scale: float | None = None) -> Any:
    """Attention of queries q (H_q, d) — or (N, H_q, d) for a batched state — over ``state``,
    computed in coefficient space with the one-pass blockwise softmax of spec A3 and the state's
    per-head logit scale gamma: logits are gamma * scale * (B_j q) . c_t, scale defaulting to 1/sqrt(d).

    ``backend`` names a registered backend (see :func:`subspace_ref.backends`). The result has
    q's array type, device and dtype: (H_q, d_v) or (N, H_q, d_v).
    """
    impl = get_backend(backend)
    available = impl.availability()
    if not available:
        raise RuntimeError(f"backend {backend!r} is not available on this machine: {available.reason}")
    if array_family(q) == "numpy" or isinstance(q, (list, tuple)):
        import numpy as np

        q = np.asarray(q)
    _checks.float_dtype("q", q)
    if state.batched:
        _checks.shape("q", q, (state.batch, None, state.d))
    else:
        _checks.shape("q", q, (None, state.d))
        q = q[None]
    if q.shape[1] % state.heads or q.shape[1] == 0:
        raise ValueError(f"q has {q.shape[1]} heads; expected a positive multiple of the state's {state.heads} KV heads")
    _checks.finite("q", q)
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if state.num_tokens == 0:
        raise ValueError("the state holds no tokens; append keys and values before attending")
    reasons = impl.not_supported_reasons(q, state)
    if reasons:
        raise ValueError(f"backend {backend!r} does not support this call: " + "; ".join(reasons))
    out = impl.attend(q, state, scale)
    return out if state.batched else out[0]
