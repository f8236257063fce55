"""``TritonBackend``: the Backend protocol (subspace_ref.backend) with Triton kernels for the decode
hot paths, on the torch array family.

* ``attend`` (spec A2, A3, A3.2): :func:`subspace_ref_triton.decode.decode_attention`, the
  flash-decoding kernel over the chunked coefficient cache plus the split merge, except for
  static post-RoPE states with 16-bit float coefficients, which :mod:`subspace_ref_triton.vendor`
  hands to torch SDPA (FlashAttention) over (γ B q, C, D); exact tokens
  (spec/window.md W3 window, W7-W8 sinks) add one partial per segment
  (:mod:`subspace_ref_triton.window_decode`) to the same merge.
* ``append`` (spec A6-A8): static states project in one launch
  (:func:`subspace_ref_triton.project.project_append`, coefficients written straight into the
  state's buffers). Adaptive and rotating states use the torch backend's append — warm-up, FD
  sketches (``torch.linalg.svd`` on the device), triggers and rotations — and, when it accepts a
  ``project`` hook for its per-window projection, :func:`~subspace_ref_triton.project.project_window`
  through it.

This module imports neither torch nor triton at import time and never touches CUDA then.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Callable

from subspace_ref_torch.backend import device_reasons, is_tensor

from subspace_ref.backend import Availability
from subspace_ref.basis_storage import decoded_state
from subspace_ref.capabilities import Capabilities, attend_reasons
from subspace_ref.window import first_compressed_position
from subspace_ref_triton._common import SUPPORTED_DTYPES, dtype_name, interpreting
from subspace_ref_triton.capabilities import declared

_NO_DEVICE = "no CUDA device; set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter"

def _kernels():
    """The kernel modules, imported on first use (see the package docstring for why)."""
    from subspace_ref_triton import decode, project

    return decode, project


def _loaded_mode() -> bool | None:
    """Whether the kernels were decorated for the interpreter (True) or the GPU (False); None
    when no kernel module is imported yet. Looks, never imports."""
    for name, kernel in (("subspace_ref_triton.decode", "_decode_split_kernel"), ("subspace_ref_triton.project", "_project_kernel")):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, kernel):
            return type(getattr(module, kernel)).__name__ == "InterpretedFunction"
    return None


class TritonBackend:
    """Coefficient-space attention (spec A2, A3) and appends (spec A6-A8) with Triton kernels.

    Reads states converted with ``state.to("triton", device="cuda")`` (torch tensors; the
    default device is CUDA when the kernels run compiled). float32, float16 and bfloat16 states,
    float, int8 (spec A10) or int4/int2 (spec/quantization.md Q2) coefficients, all arithmetic the softmax sees in float32. Under
    ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors through Triton's interpreter
    (slow: for tests at small shapes).
    """

    name = "triton"
    array_family = "torch"
    dtypes = SUPPORTED_DTYPES

    @property
    def devices(self) -> tuple[str, ...]:
        """("cuda",); under TRITON_INTERPRET=1 also "cpu": the interpreter runs the programs on
        the host and takes CPU tensors."""
        return ("cpu", "cuda") if interpreting() else ("cuda",)

    # ------------------------------------------------------------------ availability
    def availability(self) -> Availability:
        try:
            import torch
        except ImportError as err:
            return Availability(False, f"torch is not installed ({err}); pip install 'subspace_ref[triton]'")
        from importlib.util import find_spec

        if find_spec("triton") is None:
            return Availability(False, "triton is not installed; pip install 'subspace_ref[triton]'")
        if find_spec("subspace_ref_torch") is None:
            return Availability(False, "the torch backend (subspace_ref_torch), which the triton backend builds on, is not installed")
        # Triton fixed each kernel's mode (interpreter or GPU) when it was decorated.
        loaded = _loaded_mode()
        if interpreting():
            if loaded is False:
                return Availability(False, "the kernels were loaded for the GPU before TRITON_INTERPRET=1 was set; restart the process with it set")
            return Availability(True)
        if not torch.cuda.is_available():
            return Availability(False, _NO_DEVICE)
        if loaded is True:
            return Availability(False, "the kernels were loaded for the interpreter (TRITON_INTERPRET=1) and it is unset now; restart the process")
        return Availability(True)

    @property
    def capabilities(self) -> Capabilities:
        return declared(self.devices)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        return attend_reasons(self.name, self, q, state)

    def call_reasons(self, q: Any, state) -> list[str]:
        """Refusals beyond the declaration: the arrays' dtypes, devices and strides."""
        if not (is_tensor(q) and is_tensor(state.layout.key_coef)):
            return []
        reasons = device_reasons(q, state)
        if dtype_name(q.dtype) == "float64" or dtype_name(state.layout.dtype) == "float64":
            reasons.append("the triton kernels have no float64 path: use the torch backend for float64")
        lay = state.layout
        # each side in its own format (spec/quantization.md Q0): int8 codes with float32 scales
        # (spec A10); int4/int2 uint8 codes with float16 scales and zero points (Q2) by definition
        own_dtype = set()
        for which in ("key", "value"):
            fmt = lay.side_format(which)
            if fmt.per_token_scale:
                own_dtype |= {f"{which}_coef", f"{which}_scale"}
                got = {name: dtype_name(getattr(lay, name).dtype) for name in (f"{which}_coef", f"{which}_scale")}
                want = {f"{which}_coef": "int8", f"{which}_scale": "float32"}
                if got != want:
                    reasons.append(f"int8 {which} coefficients (spec A10) need int8 codes and float32 scales, got {got}")
            elif fmt.low_bits:
                coded = (f"{which}_coef",) + tuple(name for name in fmt.arrays(which) if name != "key_tail")
                own_dtype |= set(coded)
                got = {name: dtype_name(getattr(lay, name).dtype) for name in coded}
                want = {name: "uint8" if name.endswith("coef") else "float16" for name in coded}
                if got != want:
                    reasons.append(f"int{fmt.low_bits} {which} coefficients (spec/quantization.md Q2) need uint8 codes and float16 scales and zero points, got {got}")
        if lay.basis_format != "native":  # decoded before the launch (spec/storage.md S2)
            own_dtype |= {"key_bases", "value_bases", "key_basis_scale", "value_basis_scale"}
        floats = {name: dtype_name(x.dtype) for name, x in lay.arrays().items() if x.is_floating_point() and name not in own_dtype}
        if len(set(floats.values())) > 1:
            reasons.append(f"the state's floating arrays have mixed dtypes {floats}; convert it with one dtype")
        if lay.key_coef.device.type == "cpu" and "cpu" not in self.devices:
            reasons.append("the state is on the CPU; move it to a CUDA device (state.to('triton', device='cuda')) or set TRITON_INTERPRET=1")
        for name, x in lay.arrays().items():
            if x.ndim and x.stride(-1) != 1:
                reasons.append(f"the state's {name} has a non-unit stride in its last dimension; copy the state (state.copy())")
        return reasons

    # ------------------------------------------------------------------ conversion
    def converter(self, device: Any = None, dtype: Any = None) -> Callable[[Any], Any]:
        """The torch backend's converter; the default device is CUDA when the kernels run
        compiled (a CPU state could not be attended), the CPU under the interpreter."""
        from subspace_ref_torch.convert import converter

        if device is None and not interpreting():
            import torch

            if torch.cuda.is_available():
                device = "cuda"
        return converter(device, dtype)

    # ------------------------------------------------------------------ operations
    def append(self, state, keys, values) -> None:
        """Spec A6 with one projection launch for static states; spec A7/A8 through the torch
        backend's append for the others (see the module docstring)."""
        from subspace_ref_torch import append as torch_append

        lay = state.layout
        if getattr(lay, "basis_format", "native") != "native" or not lay.uniform or lay.low_bits:
            # encoded bases (spec/storage.md S1), int4/int2 coefficients (spec/quantization.md
            # Q2) or a format per side (Q0): the torch backend's append decodes / quantises them
            torch_append.append(state, keys, values)
            return
        if state.policy.kind == "static" and getattr(state.policy, "rope", None) is None and dtype_name(state.layout.key_bases.dtype) in self.dtypes:
            self._append_static(state, keys, values)
            return
        _, project = _kernels()
        torch_append.append(state, keys, values, project=project.project_window)

    def _append_static(self, state, keys, values) -> None:
        """Spec A6: c_t = B k_t, d_t = E v_t for the whole block and every head, one launch,
        written into the spare rows T.. of the state's buffers before the commit."""
        _, project = _kernels()
        lay = state.layout
        T, n_new = lay.num_tokens, keys.shape[2]
        lay = lay.with_capacity(T + n_new, lay.key_bases.shape[2])
        new = slice(T, T + n_new)
        scales = {}
        if getattr(lay, "key_scale", None) is not None:  # int8 coefficients: quantised in the kernel (A10)
            scales = dict(out_key_scale=lay.key_scale[:, :, new], out_value_scale=lay.value_scale[:, :, new])
        project.project_append(
            keys, values, lay.key_bases, lay.value_bases, lay.num_chunks - 1,
            lay.key_coef[:, :, new], lay.value_coef[:, :, new], **scales,
        )
        state.layout = replace(lay, num_tokens=T + n_new)

    def attend(self, q, state, scale):
        """Spec A2/A3 (flash-decoding, A3.2) of q (N, H_q, d) -> (N, H_q, d_v) in q's dtype."""
        decode, _ = _kernels()
        # bases stored encoded (spec/storage.md S1) are decoded before the launch: J r d entries
        layout = decoded_state(state).layout
        q = q.contiguous()
        rope = getattr(state.policy, "rope", None)
        from subspace_ref_triton import vendor

        if not vendor.refusals(q, state):  # issue 38 item 4: torch SDPA beat the split kernel (docs/gpu.md)
            if state.window is None:
                return vendor.attention(q, layout, scale)
            compressed = vendor.partials
        elif rope is not None:  # spec/rope.md P3: the fused rebuild + RoPE kernel
            from subspace_ref_triton import rope_decode

            if state.window is None:
                return rope_decode.decode_attention(q, layout, rope, scale)
            first = first_compressed_position(state)  # spec/window.md W10
            compressed = lambda q, lay, s: rope_decode.attention_partials(q, lay, rope, s, first_position=first)  # noqa: E731
        elif state.window is None:
            return decode.decode_attention(q, layout, scale)
        else:
            compressed = decode.attention_partials
        # spec/window.md W3, W8: the exact tokens' partials join the compressed part's splits
        # in one log-sum-exp merge (spec A3.2)
        from subspace_ref_triton import window_decode

        return window_decode.decode_attention(q, state, layout, scale, compressed)
