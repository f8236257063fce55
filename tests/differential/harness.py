"""Backends, devices and dtypes the differential harness runs, and how it feeds them.

To plug a backend in, register it (a ``subspace_ref.backends`` entry point in pyproject, or
``subspace_ref.register_backend``): :data:`BACKENDS` lists every registered backend, and each
runs on every device in its ``devices`` that this machine has, for every dtype in its
``dtypes``. The backend's own ``converter`` (through ``state.to(name, device, dtype)``) turns the
oracle's float64 state and queries into its arrays; nothing else here is backend-specific.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from subspace_ref.arrays import array_family, to_numpy
from subspace_ref.registry import backend_availability, get_backend, registered

BACKENDS: list[str] = registered()
DTYPES = ("float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Target:
    """One (backend, device, dtype) the harness runs, or why it cannot run here (``skip``)."""

    backend: str
    device: str | None = None
    dtype: str | None = None
    skip: str = ""

    @property
    def id(self) -> str:
        return "-".join(x for x in (self.backend, self.device, self.dtype) if x) or self.backend


def device_problem(device: str) -> str:
    """Why ``device`` is not usable on this machine ("" when it is)."""
    if device == "cpu":
        return ""
    if device.startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_available():
                return ""
        except ImportError:
            pass
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return ""
        except Exception:  # noqa: BLE001 - any failure means: no usable GPU
            pass
        return "no CUDA device on this machine"
    return f"the harness does not know how to probe device {device!r}"


def targets(dtypes: tuple[str, ...] = DTYPES) -> list[Target]:
    """Every registered backend x its devices x its dtypes among ``dtypes``; a backend, device or
    dtype that cannot run gives one Target carrying the reason (the test then skips with it)."""
    out = []
    for name in BACKENDS:
        available = backend_availability(name)
        if not available:
            out.append(Target(name, skip=f"backend {name!r} unavailable: {available.reason}"))
            continue
        impl = get_backend(name)
        for device in impl.devices:
            problem = device_problem(device)
            if problem:
                out.append(Target(name, device, skip=f"backend {name!r} on {device}: {problem}"))
                continue
            usable = [dt for dt in dtypes if dt in impl.dtypes]
            if not usable:
                out.append(Target(name, device, skip=f"backend {name!r} supports none of {', '.join(dtypes)}"))
            out.extend(Target(name, device, dt) for dt in usable)
    return out


# ----------------------------------------------------------------------------- declared refusals
def declared_gaps(backend: str, operation: str, features: frozenset[str], case) -> frozenset[str]:
    """The case's features (cases.Case.features) that ``backend`` declares it lacks for
    ``operation`` ("attend" or "append"), read from its capabilities (subspace_ref.capabilities):
    the only features it may refuse the case for. A declared gap permits a refusal, it does not
    demand one: a backend that gains a feature is compared with the oracle at once."""
    caps = get_backend(backend).capabilities
    supported = {
        "window": caps.window,
        "sinks": caps.sinks,
        "rope": caps.rope,
        "query_group": caps.query_sharing,
        "int8": case.coefficients in caps.coefficient_formats,
        "int4": case.coefficients in caps.coefficient_formats,
        "int2": case.coefficients in caps.coefficient_formats,
        "mixed_formats": case.coefficients in caps.coefficient_formats,
        "encoded_bases": case.bases in caps.basis_formats,
    }
    if operation == "append":
        supported.update({v: v in caps.sketch_variants for v in ("lookahead", "ring_warm_start", "fd_stride", "reuse_angle")})
        supported["policy"] = case.kind in caps.append_policies
    return frozenset(f for f in features | {"policy"} if not supported.get(f, True))


#: How a reason names a feature (the composer's wording, subspace_ref.capabilities).
REASON_WORDS = {
    "window": ("exact window",),
    "sinks": ("sinks",),
    "lookahead": ("lookahead",),
    "rope": ("rope",),
    "query_group": ("query_group",),
    "int8": ("int8",),
    "int4": ("int4",),
    "int2": ("int2",),
    "mixed_formats": ("coefficients",),
    "ring_warm_start": ("ring_warm_start",),
    "fd_stride": ("fd_stride",),
    "reuse_angle": ("reuse_angle",),
    "encoded_bases": ("bases as",),
    "policy": ("does not append to",),
}


def declared_refusal(backend: str, operation: str, case, reasons: list[str]) -> str:
    """Check that ``backend`` refusing ``operation`` on ``case`` is declared: its capabilities
    lack a feature the case has, and every reason names one of those. Returns the skip
    message; AssertionError otherwise."""
    features = case.features
    lacking = declared_gaps(backend, operation, features, case)
    assert lacking, f"{backend} refuses {operation} on a case with {sorted(features)} but declares none of them missing: {reasons}"
    for reason in reasons:
        assert reason.strip(), f"{backend} gave an empty reason for refusing {operation}"
        named = [f for f in lacking if any(word in reason for word in REASON_WORDS[f])]
        assert named, f"{backend}'s reason for refusing {operation} names none of its declared gaps {sorted(lacking)}: {reason!r}"
    return f"{backend} declares no {'/'.join(sorted(lacking))} for {operation}: {reasons[0]}"


# ----------------------------------------------------------------------------- conversion
def to_backend(x: np.ndarray, target: Target):
    """A NumPy array as the target backend's array (its converter, device and dtype)."""
    return get_backend(target.backend).converter(device=target.device, dtype=target.dtype)(x)


def to_float64(x) -> np.ndarray:
    return np.asarray(to_numpy(x), dtype=np.float64)


def dtype_name(x) -> str:
    return str(x.dtype).removeprefix("torch.")


POISON_INDEX = -1  # spare chunk_starts


def backend_state(state64, target: Target, poison: bool = True):
    """The oracle's float64 NumPy state converted for ``target`` (``state.to``), with every spare
    entry (rows >= num_tokens, chunk slots >= a head's num_chunks) set to NaN / -1 (int8
    coefficients: 127 with NaN scales; int4/int2: codes 0xFF, NaN scales and zero points past the
    complete key groups and the tokens, NaN key_tail rows past the unfinished group), so that a backend reading outside the live ranges of
    spec A9 fails loudly."""
    if target.backend == "cupy" and state64.basis_format != "native":
        import pytest

        pytest.skip("the cupy backend refuses encoded bases (spec/storage.md S7)")
    state = state64.copy()
    if poison:
        lay = state.layout
        J = lay.key_bases.shape[2]
        spare = np.arange(J)[None, None, :] >= lay.num_chunks[..., None]  # (N, H, J), per head
        if lay.key_basis_scale is not None:  # int8 bases (spec/storage.md S1): NaN scales
            lay.key_bases[spare], lay.value_bases[spare] = 127, 127
            lay.key_basis_scale[spare], lay.value_basis_scale[spare] = np.nan, np.nan
        else:
            lay.key_bases[spare] = np.nan
            lay.value_bases[spare] = np.nan
        lay.chunk_starts[spare] = POISON_INDEX
    state = state.to(target.backend, device=target.device, dtype=target.dtype)
    if poison:
        lay = state.layout
        T, J = lay.num_tokens, lay.key_bases.shape[2]
        lay = lay.with_capacity(T + 7, J + 3)  # spare capacity past the live ranges ...
        for which in ("key", "value"):  # each side as its format stores it (spec/quantization.md Q0)
            fmt = lay.side_format(which)
            if fmt.low_bits:  # int4/int2 (spec/quantization.md Q2): codes, scales, zero points, tail
                getattr(lay, f"{which}_coef")[:, :, T:] = 0xFF
                if which == "key":
                    G = lay.group
                    for name in ("key_group_scale", "key_group_zero"):  # the unfinished group's keys are in key_tail
                        getattr(lay, name)[:, :, T // G :] = float("nan")
                    lay.key_tail[:, :, T - T // G * G :] = float("nan")
                else:
                    for name in ("value_token_scale", "value_token_zero"):
                        getattr(lay, name)[:, :, T:] = float("nan")
            elif fmt.per_token_scale:  # int8 coefficients (spec A10): poison their scales
                getattr(lay, f"{which}_coef")[:, :, T:] = 127
                getattr(lay, f"{which}_scale")[:, :, T:] = float("nan")
            else:
                getattr(lay, f"{which}_coef")[:, :, T:] = float("nan")  # ... filled with poison
        if lay.key_basis_scale is not None:  # int8 bases: poison their scales
            lay.key_bases[:, :, J:], lay.value_bases[:, :, J:] = 127, 127
            lay.key_basis_scale[:, :, J:] = float("nan")
            lay.value_basis_scale[:, :, J:] = float("nan")
        else:
            lay.key_bases[:, :, J:] = float("nan")
            lay.value_bases[:, :, J:] = float("nan")
        lay.chunk_starts[:, :, J:] = POISON_INDEX
        state.layout = lay
    return state


def check_output(out, target: Target, shape: tuple[int, ...]) -> np.ndarray:
    """The backend's output has the backend's array family, q's dtype, the target device and the
    full shape, every entry written and finite (spare inputs are NaN-poisoned, so reading them
    shows up here). Returns it as float64 NumPy."""
    family = get_backend(target.backend).array_family
    assert array_family(out) == family, f"output is a {array_family(out)} array, expected {family}"
    assert dtype_name(out) == target.dtype, f"output dtype {dtype_name(out)}, expected q's {target.dtype}"
    assert tuple(out.shape) == shape, f"output shape {tuple(out.shape)}, expected {shape}"
    device = getattr(out, "device", None)
    if family == "torch" and target.device is not None:
        assert device.type == target.device.split(":")[0], f"output on {device}, expected {target.device}"
    host = to_float64(out)
    bad = ~np.isfinite(host)
    assert not bad.any(), f"{int(bad.sum())} of {host.size} outputs are NaN/Inf (first at {np.argwhere(bad)[0].tolist()})"
    return host


@dataclass
class Record:
    """Outcome of one comparison, for the terminal summary."""

    target: str
    case: str
    err: float
    tol: float
    ref: float


RESULTS: list[Record] = []  # filled by the tests, read by conftest's terminal summary
