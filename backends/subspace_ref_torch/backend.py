"""``TorchBackend``: the Backend protocol (subspace_ref.backend) over torch tensors, CPU or CUDA.

This module imports torch lazily, so the backend can be registered, listed and asked for its
availability on a machine without torch.
"""

from __future__ import annotations

from typing import Any, Callable

from subspace_ref.arrays import array_family
from subspace_ref.backend import Availability
from subspace_ref.rope import refusal


class TorchBackend:
    """Append (spec A6-A8) and coefficient-space attention (spec A2, A3) on torch tensors, with
    float or int8 (spec A10) coefficients.

    States must hold torch tensors (``state.to("torch", device=..., dtype=...)``); appends run
    on the state's device. float16/bfloat16 are computed in float32 and stored in their dtype.
    """

    name = "torch"
    array_family = "torch"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16", "float32", "float64")

    def availability(self) -> Availability:
        try:
            import torch  # noqa: F401
        except ImportError as err:
            return Availability(False, f"torch is not installed ({err}); pip install 'subspace_ref[torch]'")
        return Availability(True)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        reasons, q_ok, state_ok = tensor_call_reasons("torch", q, state, "state.to('torch', device=...)")
        if q_ok and str(q.dtype).removeprefix("torch.") not in self.dtypes:
            reasons.append(f"q has dtype {q.dtype}; the torch backend supports {', '.join(self.dtypes)}")
        if state_ok:
            sdtype = str(state.layout.dtype).removeprefix("torch.")
            if sdtype not in self.dtypes:
                reasons.append(f"the state has dtype {sdtype}; the torch backend supports {', '.join(self.dtypes)}")
            sdev = state.layout.key_coef.device
            if sdev.type not in self.devices:
                reasons.append(f"the state is on {sdev}; the torch backend runs on {', '.join(self.devices)}")
            if q_ok and q.device != sdev:
                reasons.append(f"q is on {q.device} but the state is on {sdev}; move one of them")
            devices = {x.device for x in state.layout.arrays().values()}
            if len(devices) > 1:
                reasons.append(f"the state's arrays are spread over devices {sorted(map(str, devices))}")
        return reasons

    def converter(self, device: Any = None, dtype: Any = None) -> Callable[[Any], Any]:
        from subspace_ref_torch.convert import converter

        return converter(device, dtype)

    def append(self, state, keys, values) -> None:
        from subspace_ref_torch.append import append

        append(state, keys, values)

    def attend(self, q, state, scale):
        from subspace_ref_torch.attend import attend

        return attend(q, state, scale)


def tensor_call_reasons(backend: str, q: Any, state, conversion: str) -> tuple[list[str], bool, bool]:
    """The refusals every backend reading torch tensors shares: torch missing, q not a tensor,
    a state not held in torch arrays. Returns (reasons, q is a tensor, state holds tensors)."""
    try:
        import torch
    except ImportError:
        return ["torch is not installed"], False, False
    reasons = []
    q_ok = isinstance(q, torch.Tensor)
    if not q_ok:
        reasons.append(f"q is a {type(q).__module__.split('.')[0]} {type(q).__name__}; the {backend} backend takes torch tensors")
    try:
        family = array_family(state.layout.key_coef)
    except ValueError:
        family = type(state.layout.key_coef).__name__
    state_ok = family == "torch"
    if not state_ok:
        reasons.append(f"the state holds {family} arrays; convert it with {conversion}")
    reasons += refusal(state, backend)
    return reasons, q_ok, state_ok
