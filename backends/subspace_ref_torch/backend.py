"""``TorchBackend``: the Backend protocol (subspace_ref.backend) over torch tensors, CPU or CUDA.

This module imports torch lazily, so the backend can be registered, listed and asked for its
availability on a machine without torch.
"""

from __future__ import annotations

from typing import Any, Callable

from subspace_ref.arrays import array_family
from subspace_ref.backend import Availability
from subspace_ref.capabilities import Capabilities, attend_reasons


class TorchBackend:
    """Append (spec A6-A8) and coefficient-space attention (spec A2, A3) on torch tensors, with
    float or int8 (spec A10) coefficients.

    States must hold torch tensors (``state.to("torch", device=..., dtype=...)``); appends run
    on the state's device. float16/bfloat16 are computed in float32 and stored in their dtype.
    """

    name = "torch"
    array_family = "torch"
    # spec/window.md W3, W7-W9 in subspace_ref_torch.window; pre-RoPE states (spec/rope.md P2-P3) in append/attend;
    # of the sketch variants in its append (spec/sketch_variants.md S4) only both trigger orders (spec A7.2)
    capabilities = Capabilities(array_families=("torch",), devices=("cpu", "cuda"), dtypes=("float16", "bfloat16", "float32", "float64"), window=True,
                                sinks=True, rope=True, sketch_variants=("trigger", "byte_ceiling", "track"))
    devices = capabilities.devices
    dtypes = capabilities.dtypes

    def availability(self) -> Availability:
        try:
            import torch  # noqa: F401
        except ImportError as err:
            return Availability(False, f"torch is not installed ({err}); pip install 'subspace_ref[torch]'")
        return Availability(True)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        return attend_reasons(self.name, self, q, state)

    def call_reasons(self, q: Any, state) -> list[str]:
        return device_reasons(q, state)

    def converter(self, device: Any = None, dtype: Any = None) -> Callable[[Any], Any]:
        from subspace_ref_torch.convert import converter

        return converter(device, dtype)

    def append(self, state, keys, values) -> None:
        from subspace_ref_torch.append import append

        append(state, keys, values)

    def attend(self, q, state, scale):
        from subspace_ref_torch.attend import attend

        return attend(q, state, scale)

    def attend_route(self, q, state):
        from subspace_ref_torch.attend import attend_route

        return attend_route(q, state)


def device_reasons(q: Any, state) -> list[str]:
    """The refusals every backend reading torch tensors shares beyond its declaration: q on
    another device than the state, the state's arrays spread over devices. None for arrays that
    are not torch tensors (the declaration refuses those)."""
    if not (is_tensor(q) and is_tensor(state.layout.key_coef)):
        return []
    sdev = state.layout.key_coef.device
    reasons = []
    if q.device != sdev:
        reasons.append(f"q is on {q.device} but the state is on {sdev}; move one of them")
    lay = state.layout
    devices = {x.device for x in (lay.key_coef, lay.value_coef, lay.key_bases, lay.value_bases, lay.gamma)}  # what attend reads
    if len(devices) > 1:
        reasons.append(f"the state's arrays are spread over devices {sorted(map(str, devices))}")
    return reasons


def is_tensor(x: Any) -> bool:
    try:
        return array_family(x) == "torch"
    except ValueError:
        return False
