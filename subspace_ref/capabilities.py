"""What each backend supports, declared as data, and the one composer of refusal reasons.

A backend declares a :class:`Capabilities` (its ``capabilities`` attribute; third-party backends
registered by entry point declare the same). :func:`attend_reasons` and :func:`append_reasons`
compare a call's features (:func:`features`) with the declaration and list EVERY mismatch, then
add the reasons only a look at the actual arrays can give (the backend's optional
``call_reasons(q, state)``: devices that differ, strides, shared memory). A refused call raises
one exception type, :class:`NotSupportedError`, with all of them.

Adding a variant: a field here (what a backend may support), a line in :func:`features` (how a
state shows it) and its check in :func:`_shared_reasons`; every backend then states it in its
declaration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from subspace_ref.arrays import array_family
from subspace_ref.basis_storage import FORMATS as BASIS_FORMATS
from subspace_ref.formats import MIXED_FORMATS, UNIFORM_FORMATS

POLICIES = ("static", "adaptive", "rotating")
#: Every coefficient format a layout can report (spec/quantization.md Q0): uniform, then per-side pairs.
COEFFICIENT_FORMATS = UNIFORM_FORMATS + MIXED_FORMATS
#: Online-sketch and window options set away from their neutral values (spec/sketch_variants.md,
#: spec/window.md W4): the policy fields marked optional, and the window's lookahead.
SKETCH_VARIANTS = ("ring_warm_start", "fd_stride", "reuse_angle", "trigger", "byte_ceiling", "track", "lookahead")


class NotSupportedError(ValueError, NotImplementedError, TypeError):
    """A backend (or the file format) does not support this call; ``reasons`` lists every reason.

    A ValueError. It is also a NotImplementedError and a TypeError only so that callers written
    against the refusals this type replaced keep working; catch ValueError (or this) in new code.
    """

    def __init__(self, what: str, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__(f"{what}: " + "; ".join(self.reasons))


@dataclass(frozen=True)
class Capabilities:
    """What one backend supports (every field is data; nothing here runs a kernel).

    ``array_families``: the array types it reads, the first being what ``state.to(backend)``
    converts to. ``dtypes``: floating dtypes of the state and the query. ``window``: exact windows
    (spec/window.md W3); ``sinks``: exact attention sinks (W7-W8); ``rope``: pre-RoPE states (spec/rope.md P2); ``query_sharing``: per-query
    -head states (spec/sharing.md A3); ``append_policies``: the policies it appends for (spec
    A6-A8); ``sketch_variants``: the options of :data:`SKETCH_VARIANTS` its append implements.
    ``max_*``: size limits (None: none) on the head sizes d and d_v, the ranks, and query heads
    per KV head.
    """

    array_families: tuple[str, ...]
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    coefficient_formats: tuple[str, ...] = COEFFICIENT_FORMATS
    basis_formats: tuple[str, ...] = BASIS_FORMATS
    window: bool = False
    sinks: bool = False
    rope: bool = False
    query_sharing: bool = True
    append_policies: tuple[str, ...] = POLICIES
    sketch_variants: tuple[str, ...] = ()
    max_head_size: int | None = None
    max_rank: int | None = None
    max_query_group: int | None = None

    def row(self) -> dict[str, str]:
        """The declaration as printable strings (the ``subspace-kv backends`` table)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = (
                (",".join(value) or "-")
                if isinstance(value, tuple)
                else ("-" if value is None else ("yes" if value is True else "no" if value is False else str(value)))
            )
        return out


_KINDS = {"numpy": "NumPy arrays", "torch": "torch tensors", "cupy": "CuPy arrays"}


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _device(x: Any) -> str:
    family = array_family(x)
    if family == "torch":
        return x.device.type
    return "cuda" if family == "cupy" else "cpu"


def sketch_variants(state) -> list[str]:
    """The options of :data:`SKETCH_VARIANTS` ``state`` sets away from their neutral values."""
    policy = state.policy
    variants = [f.name for f in dataclasses.fields(policy) if f.metadata.get("optional") and getattr(policy, f.name) != f.default]
    if state.window is not None and state.window.lookahead:
        variants.append("lookahead")
    return variants


def features(state) -> dict[str, Any]:
    """The facts about ``state`` that capabilities are checked against (for appends also
    :func:`sketch_variants`)."""
    lay = state.layout
    policy = state.policy
    try:
        family = array_family(lay.key_coef)
    except ValueError:
        family = type(lay.key_coef).__name__
    return {
        "family": family,
        "device": _device(lay.key_coef) if family in ("numpy", "torch", "cupy") else "?",
        "dtype": _name(lay.dtype),
        "coefficients": lay.coefficients,
        "bases": lay.basis_format,
        "window": state.window is not None and bool(state.window.size or state.window.min_tokens),
        "sinks": 0 if state.window is None else state.window.sinks,
        "rope": getattr(policy, "rope", None) is not None,
        "query_group": getattr(policy, "query_group", None) or 1,
        "policy": policy.kind,
        "d": state.d,
        "d_v": state.d_v,
        "ranks": (lay.key_coef.shape[3], lay.value_coef.shape[3]),
    }


def _state_reasons(backend: str, caps: Capabilities, f: dict[str, Any]) -> list[str]:
    """The mismatches between a state's features and a declaration that attend and append share."""
    out = []
    if f["family"] not in caps.array_families:
        out.append(
            f"the state holds {f['family']} arrays; the {backend} backend reads {', '.join(caps.array_families)}: convert it with state.to({backend!r}, device=...)"
        )
    elif f["device"] not in caps.devices:
        out.append(f"the state is on {f['device']}; the {backend} backend runs on {', '.join(caps.devices)}")
    if f["dtype"] not in caps.dtypes:
        out.append(f"the state has dtype {f['dtype']}; the {backend} backend supports {', '.join(caps.dtypes)}")
    if f["coefficients"] not in caps.coefficient_formats:
        supported = [name for name in caps.coefficient_formats if "/" not in name] + (["a format per side"] if any("/" in name for name in caps.coefficient_formats) else [])
        out.append(f"the state stores {f['coefficients']} coefficients; the {backend} backend supports {', '.join(supported)}")
    if f["bases"] not in caps.basis_formats:
        out.append(
            f"the state stores its bases as {f['bases']} (spec/storage.md S1); the {backend} backend reads {', '.join(caps.basis_formats)}: use the torch or numpy backend"
        )
    if f["rope"] and not caps.rope:
        out.append(
            f"the state un-rotates appended keys (SubspaceState.static(..., rope=...), spec/rope.md P2); the {backend} backend does not implement it: use backend 'numpy', 'torch' or 'triton'"
        )
    if f["query_group"] > 1 and not caps.query_sharing:
        out.append(f"the state has one head per query head (query_group={f['query_group']}, spec/sharing.md A3); the {backend} backend does not run it")
    for what, size, limit in (
        ("key head size d", f["d"], caps.max_head_size),
        ("value head size d_v", f["d_v"], caps.max_head_size),
        ("key rank r", f["ranks"][0], caps.max_rank),
        ("value rank r_v", f["ranks"][1], caps.max_rank),
    ):
        if limit is not None and size > limit:
            out.append(f"{what} is {size}; the {backend} backend supports at most {limit}")
    return out


def _attend_state_reasons(backend: str, caps: Capabilities, f: dict[str, Any], state) -> list[str]:
    out = _state_reasons(backend, caps, f)
    if f["window"] and not caps.window:
        out.append(
            f"the state keeps an exact window (window={state.window.size}, min_tokens={state.window.min_tokens}); the {backend} backend does not merge exact tokens: use the torch or numpy backend"
        )
    if f["sinks"] and not caps.sinks:
        out.append(
            f"the state keeps exact attention sinks (sinks={f['sinks']}, spec/window.md W7); the {backend} backend does not merge exact tokens: use the torch or numpy backend"
        )
    return out


def attend_reasons(backend: str, impl: Any, q: Any, state) -> list[str]:
    """Every reason ``impl`` (registered as ``backend``) refuses ``attend(q, state)``: the query's,
    the state's against the declaration, then the backend's ``call_reasons(q, state)`` about
    the arrays themselves (which must accept arrays of any family)."""
    caps: Capabilities = impl.capabilities
    f = features(state)
    out = []
    try:
        q_family = array_family(q)
    except ValueError:
        q_family = type(q).__name__
    if q_family not in caps.array_families:
        kinds = " or ".join(_KINDS.get(f, f"{f} arrays") for f in caps.array_families)
        out.append(f"q is a {q_family} array; the {backend} backend takes {kinds}")
    elif _name(q.dtype) not in caps.dtypes:
        out.append(f"q has dtype {q.dtype}; the {backend} backend supports {', '.join(caps.dtypes)}")
    if caps.max_query_group is not None and getattr(q, "ndim", 0) == 3 and q.shape[1] // state.heads > caps.max_query_group:
        out.append(f"{q.shape[1] // state.heads} query heads per KV head; the {backend} backend supports at most {caps.max_query_group}")
    out += _attend_state_reasons(backend, caps, f, state)
    if hasattr(impl, "call_reasons"):
        out += impl.call_reasons(q, state)
    return out


def append_reasons(backend: str, impl: Any, state) -> list[str]:
    """Every reason ``impl`` (registered as ``backend``) refuses appending to ``state``."""
    caps: Capabilities = impl.capabilities
    f = features(state)
    out = _state_reasons(backend, caps, f)
    if f["policy"] not in caps.append_policies:
        out.append(f"the {backend} backend does not append to {f['policy']} states (it appends for {', '.join(caps.append_policies)})")
    missing = [v for v in sketch_variants(state) if v not in caps.sketch_variants]
    if missing:
        shown = [f"{v}={state.window.lookahead if v == 'lookahead' else getattr(state.policy, v)}" for v in missing]
        out.append(
            f"the {backend} append does not implement {'; '.join(shown)} (spec/sketch_variants.md, spec/window.md W4): append on the numpy backend (state.to('numpy'))"
        )
    return out


def state_reasons(backend: str, impl: Any, state) -> list[str]:
    """Every reason ``impl`` refuses to append to ``state`` or to attend over it, whatever the
    query: what a cache asks before it takes a state."""
    caps: Capabilities = impl.capabilities
    f = features(state)
    reasons = append_reasons(backend, impl, state) + _attend_state_reasons(backend, caps, f, state)
    return list(dict.fromkeys(reasons))


def require(reasons: list[str], what: str) -> None:
    """Raise :class:`NotSupportedError` listing ``reasons`` unless there are none."""
    if reasons:
        raise NotSupportedError(what, reasons)


def table(declared: dict[str, Capabilities | None]) -> str:
    """A plain-text table of declarations, one column per backend (None: could not be loaded)."""
    names = list(declared)
    rows = [f.name for f in dataclasses.fields(Capabilities)]
    cells = {n: (c.row() if c is not None else {r: "?" for r in rows}) for n, c in declared.items()}
    width = [max(len(r) for r in rows)] + [max(len(n), *(len(cells[n][r]) for r in rows)) for n in names]
    lines = ["  ".join(s.ljust(w) for s, w in zip(["capability", *names], width))]
    lines += ["  ".join(s.ljust(w) for s, w in zip([r, *(cells[n][r] for n in names)], width)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
