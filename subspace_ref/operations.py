"""The operations layer: ``attend``, ``append`` and conversion over a state's data.

Each operation validates its arguments once, splits off the exact window (spec/window.md),
asks the backend's declared capabilities (:mod:`subspace_ref.capabilities`) and dispatches to
the backend. The state (:class:`~subspace_ref.state.SubspaceState`), its layout and its window
are data; their public methods (``state.append``, ``state.to``) and :func:`subspace_ref.attend`
are thin wrappers over the functions here. This module imports no state class: it builds new
states with ``type(state)(...)``, so the import graph stays acyclic (docs/architecture.md).

Checks and host synchronisation. Shape, dtype, family, device and capability checks read only
metadata and always run. Scans of the values (NaN/Inf in the inputs, rows whose squared norm
overflows, a non-finite attention output) read every element and, on an accelerator, wait for
the device: they run on the numpy backend always (the oracle is where a bad value must be
named), on keys and values appended from host memory always (a non-finite token would stay in
the state for good, and on the host a scan waits for nothing), and otherwise only under the
debug switch (:func:`set_debug` or the environment variable ``SUBSPACE_REF_DEBUG=1``). Without
it, a non-finite query to a torch/triton/cupy backend gives a non-finite output instead of a
ValueError, as torch's own SDPA does, and a non-finite token appended on a GPU is not refused.
"""

from __future__ import annotations

import os
from typing import Any

from subspace_ref import _checks
from subspace_ref import window as _window
from subspace_ref.arrays import array_family
from subspace_ref.capabilities import append_reasons, attend_reasons, require
from subspace_ref.layout import PackedLayout, mapped_parts
from subspace_ref.registry import get_backend
from subspace_ref.sharing import repeat_kv_heads

_debug = os.environ.get("SUBSPACE_REF_DEBUG", "") not in ("", "0")


def set_debug(enabled: bool) -> bool:
    """Turn the value scans on every backend on (True) or back to numpy-only (False); returns
    the previous setting."""
    global _debug
    previous, _debug = _debug, bool(enabled)
    return previous


def _scans(backend: str) -> bool:
    """Whether the checks that read every value (and sync the device) run for ``backend``."""
    return _debug or backend == "numpy"


def _on_host(x: Any) -> bool:
    """Whether ``x`` is in host memory, where scanning its values synchronises nothing."""
    device = getattr(x, "device", "cpu")
    return getattr(device, "type", device) == "cpu"


def _check_state(state) -> None:
    if not isinstance(getattr(state, "layout", None), PackedLayout):
        raise TypeError(f"state must be a SubspaceState, got {type(state).__name__}")


# ------------------------------------------------------------------------------------- attend
def attend(q: Any, state, backend: str = "numpy", scale: float | None = None) -> Any:
    """Attention of queries q (H_q, d) — or (N, H_q, d) for a batched state — over ``state``,
    computed in coefficient space with the one-pass blockwise softmax of spec A3 and the state's
    per-head logit scale gamma: logits are gamma * scale * (B_j q) . c_t, scale defaulting to 1/sqrt(d).

    ``backend`` names a registered backend (see :func:`subspace_ref.backends`). The result has
    q's array type, device and dtype: (H_q, d_v) or (N, H_q, d_v). A call the backend does not
    support raises :class:`~subspace_ref.capabilities.NotSupportedError` listing every reason.
    """
    impl = get_backend(backend)
    admission = _admission(backend, q)
    admitted = getattr(state, "admitted", {})
    if admission is not None and admission in admitted:
        route, batched_q = admitted[admission], None
    else:
        batched_q = _admit(q, state, backend, impl)
        route = None
        if admission is not None:
            route = admitted[admission] = impl.attend_route(q, state) if hasattr(impl, "attend_route") else None
    check_call(state, scale)
    scans = _scans(backend)
    if route is not None and not scans:
        out = route(q, state, scale)
        if out is not None:
            return out
    if batched_q is None:
        batched_q = q if state.batched else q[None]
    q = batched_q
    if scans:
        _checks.finite("q", q)
    out = impl.attend(q, state, scale)
    if scans and not (bool((out == out).all()) and bool(abs(out).max() < float("inf"))):
        # inputs were finite, so the logits overflowed the dtype (|q| |k| too large)
        raise ValueError(f"attention output is not finite: the logits overflow {q.dtype} (rescale q or the keys)")
    return out if state.batched else out[0]


def check_call(state, scale: float | None) -> None:
    """The checks every attend call runs, admitted or not: the scale, and a state with tokens."""
    if scale is not None and not 0 < _checks.real("scale", scale) < float("inf"):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    if state.num_tokens == 0:
        raise ValueError("the state holds no tokens; append keys and values before attending")


def _admission(backend: str, q: Any) -> tuple | None:
    """What the metadata checks of an attend call depend on besides the state: the backend and
    the query's type, dtype, device and shape (None for a query without a shape, e.g. a list,
    which is checked on every call). A state remembers the admissions that passed, each with
    the backend's route for such calls (``Backend.attend_route``), so a decode loop pays for the
    checks, the capability composer and the backend's dispatch once, not on every token."""
    shape = getattr(q, "shape", None)
    if shape is None:
        return None
    key = (backend, type(q), getattr(q, "dtype", None), getattr(q, "device", None), tuple(shape))
    try:
        hash(key)
    except TypeError:  # a CuPy Device is unhashable: by name (str() of a torch device costs more than the hash)
        key = (backend, type(q), str(key[2]), str(key[3]), key[4])
    return key


def _admit(q: Any, state, backend: str, impl) -> Any:
    """Every check of an attend call that reads only metadata (state, query, capabilities);
    returns q as an array with a leading batch axis."""
    _check_state(state)
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
    require(attend_reasons(backend, impl, q, state), f"backend {backend!r} does not support this call")
    return q


# ------------------------------------------------------------------------------------- append
def append(state, keys: Any, values: Any):
    """Append one token (H, d) or a block (H, n, d) of keys and values (a leading batch axis
    for batched states) on the state's backend (``state.engine``). Checked before anything
    changes: bad input or an unsupported state raises and leaves the state as it was."""
    _check_state(state)
    k = _tokens(state, "keys", keys, state.d)
    v = _tokens(state, "values", values, state.d_v)
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"keys has {k.shape[2]} tokens but values has {v.shape[2]}; expected the same number")
    if k.shape[2] == 0:
        return state
    impl = get_backend(state.engine)
    require(append_reasons(state.engine, impl, state), f"backend {state.engine!r} cannot append to this state")
    if state.window is not None:
        # spec/window.md W2: tokens leaving the exact part go through the backend's append
        # (only a backend declaring "lookahead" is handed the lookahead tokens)
        _window.append(state, k, v, lambda s, k2, v2, ahead: impl.append(s, k2, v2) if ahead is None else impl.append(s, k2, v2, ahead))
    else:
        impl.append(state, k, v)
    return state


def _tokens(state, name: str, x: Any, dim: int) -> Any:
    """x as (N, H, n, dim) in the state's family, dtype and device, after every check."""
    x = _checks.as_array(name, x)
    family = array_family(x)
    held = array_family(state.layout.key_coef)
    if family != held:
        raise TypeError(f"{name} is a {family} array but the state holds {held} arrays; convert one of them (state.to(...))")
    _checks.float_dtype(name, x)
    lead = (state.batch, state.kv_heads) if state.batched else (state.kv_heads,)
    if x.ndim == len(lead) + 1:
        x = x[..., None, :]
    if state.batched:
        _checks.shape(name, x, (state.batch, state.kv_heads, None, dim))
    else:
        _checks.shape(name, x, (state.kv_heads, None, dim))
        x = x[None]
    if family == "torch" and x.device != state.layout.key_coef.device:
        raise ValueError(f"{name} is on {x.device} but the state is on {state.layout.key_coef.device}")
    kept = x.astype(state.dtype) if family != "torch" else x.detach().to(state.dtype)
    if _scans(state.engine) or _on_host(x):
        _checks.finite_rows(name, x, kept)
    x = kept
    return repeat_kv_heads(x, state.heads // state.kv_heads)  # spec/sharing.md A3 step 1


# --------------------------------------------------------------------------------- conversion
def copy(state):
    """An independent copy of ``state`` (arrays copied, spare capacity dropped)."""
    _check_state(state)
    parts = mapped_parts(state, lambda a, x: _clone(state.layout.live(a.axis, x)))
    return type(state)(state.policy, parts["layout"], parts["sketches"], state.batched, state.engine, parts["window"])


def select_sequences(state, index: Any):
    """A copy of batched ``state`` holding its sequences ``index`` (1-d integer indices into
    the batch axis N, in the state's array family; repeats allowed), as beam search reorders
    and repeats them: every array of :data:`subspace_ref.layout.STATE_ARRAYS` is gathered along
    N. ``gamma`` (H,) is shared by the sequences and kept. Token counts, fills and chunk counts
    per sequence travel with the arrays (every sequence of a state holds the same tokens)."""
    _check_state(state)
    if not state.batched:
        raise ValueError("state: select_sequences needs a batched state (built with batch=N)")
    parts = mapped_parts(state, lambda a, x: x if a.name == "gamma" else x[index])  # advanced indexing copies
    return type(state)(state.policy, parts["layout"], parts["sketches"], state.batched, state.engine, parts["window"])


def _clone(x: Any) -> Any:
    return x.clone() if array_family(x) == "torch" else x.copy()


def convert(state, backend: str, device: Any = None, dtype: Any = None):
    """A copy of ``state`` whose arrays belong to ``backend``'s array family, on ``device``,
    with floating arrays cast to ``dtype``; appends to it then run on ``backend``. Arrays stored
    in a dtype of their own (int8 coefficients, encoded bases, scales) keep it: each array's
    dtype rule in :data:`subspace_ref.layout.STATE_ARRAYS` says which."""
    _check_state(state)
    target = get_backend(backend)
    available = target.availability()
    if not available:
        raise RuntimeError(f"backend {backend!r} is not available on this machine: {available.reason}")
    if dtype is not None and not any(f in str(dtype) for f in ("float16", "float32", "float64", "bfloat16")):
        raise TypeError(f"dtype must be one of float16, bfloat16, float32, float64; got {dtype!r}")
    cast = target.converter(device=device, dtype=dtype)
    keep_dtype = target.converter(device=device)
    live = copy(state)
    parts = mapped_parts(live, lambda a, x: cast(x) if live.layout.converts(a.dtype, a.name) else keep_dtype(x))
    return type(state)(state.policy, parts["layout"], parts["sketches"], state.batched, backend, parts["window"])
