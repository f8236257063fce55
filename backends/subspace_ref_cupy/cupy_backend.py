"""``CupyBackend``: the Backend protocol (spec A9, :mod:`subspace_ref.backend`) on raw CUDA kernels
compiled at run time by NVRTC through ``cupy.RawModule``.

Importing this module imports neither cupy nor torch and initialises no CUDA context: CuPy is
imported in :meth:`CupyBackend.availability` and by the launches, which run only after the
backend was found available.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import numpy as np

from subspace_ref.arrays import array_family
from subspace_ref.backend import Availability
from subspace_ref.capabilities import Capabilities, attend_reasons
from subspace_ref_cupy import _interop, _kernels, _launch
from subspace_ref_cupy.capabilities import declared

# The fields of the packed layout (spec A9, A10) the kernels read.
_FLOAT_FIELDS = ("key_coef", "value_coef", "key_bases", "value_bases")
_INDEX_FIELDS = ("chunk_starts", "num_chunks")
_SCALE_FIELDS = ("key_scale", "value_scale")
# int4/int2 (spec/quantization.md Q2): beside the packed uint8 codes in key_coef/value_coef
_LOW_BIT_FIELDS = ("key_group_scale", "key_group_zero", "key_tail", "value_token_scale", "value_token_zero")
_LOW_BIT_SIDE_FIELDS = {"key": _LOW_BIT_FIELDS[:3], "value": _LOW_BIT_FIELDS[3:]}
_KERNEL_DTYPES = tuple(_kernels.CUDA_TYPES)
_INT32_MAX = 2**31 - 1


def _has_ml_dtypes() -> bool:
    """Whether CuPy arrays can hold bfloat16 here: ml_dtypes' bfloat16, which CuPy accepts from
    version 14 on (pyproject's cupy extra pins it)."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    try:
        import cupy
    except Exception:  # no CuPy: availability says why; the dtype list is moot
        return True
    return int(cupy.__version__.split(".")[0]) >= 14


def _nvidia_driver_present() -> bool:
    """Whether an NVIDIA kernel driver or its user-space library is installed."""
    import ctypes.util
    import os

    return os.path.exists("/proc/driver/nvidia/version") or ctypes.util.find_library("cuda") is not None


class CupyBackend:
    """Decode attention (spec A2, A3, A3.2) and static appends (spec A6) on the CUDA kernels of
    ``kernels/*.cu``; adaptive and rotating appends (spec A7, A8) run the oracle's array-generic
    token loop on CuPy arrays.

    Accepts CuPy arrays and torch CUDA tensors (viewed through DLPack, not copied) and returns the
    kind of array ``q`` was. Float16, bfloat16 and float32 storage, accumulation in float32;
    coefficients may also be INT8 with per-(token, head) float32 scales (spec A10,
    ``kernels/int8_coef.cuh``).

    ``splits`` = (number of splits, tokens per split) fixes the split of the token axis instead of
    the occupancy-based choice; tests use it to exercise the merge and empty splits (spec A3.2).
    """

    name = "cupy"
    array_family = "cupy"
    devices = ("cuda",)

    def __init__(self, splits: tuple[int, int] | None = None) -> None:
        self.splits = splits

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes a CuPy-family state can hold here: CuPy has bfloat16 only with ml_dtypes
        (torch bfloat16 tensors are accepted by :meth:`attend` either way)."""
        return _KERNEL_DTYPES if _has_ml_dtypes() else tuple(t for t in _KERNEL_DTYPES if t != "bfloat16")

    # ------------------------------------------------------------------ capability
    def availability(self) -> Availability:
        """Needs cupy, NVRTC and at least one CUDA device; the reason names the missing piece."""
        try:
            import cupy
        except Exception as err:  # ImportError, or a broken CUDA install failing at import
            return Availability(False, f"cupy is not importable ({type(err).__name__}: {err}); install the 'gpu' extra")
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as err:
            if not _nvidia_driver_present():  # CuPy then reports a driver "too old" for its runtime, which reads like a broken one
                return Availability(False, "no CUDA device (GPU): this machine has no NVIDIA driver")
            return Availability(False, f"no CUDA device usable: cupy.cuda.runtime.getDeviceCount() failed with {type(err).__name__}: {err}")
        if count == 0:
            return Availability(False, "no CUDA device (GPU) found: cupy.cuda.runtime.getDeviceCount() returned 0")
        try:
            cupy.cuda.nvrtc.getVersion()
        except Exception as err:
            return Availability(False, f"NVRTC, which compiles the kernels at run time, is not usable ({type(err).__name__}: {err})")
        return Availability(True)

    @property
    def capabilities(self) -> Capabilities:
        return declared(self.dtypes)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        return attend_reasons(self.name, self, q, state)

    def call_reasons(self, q: Any, state) -> list[str]:
        """Refusals beyond the declaration: availability, array kinds and devices, dtypes,
        shapes with no compiled kernel, and shared memory per block."""
        reasons: list[str] = []
        available = self.availability()
        if not available:
            reasons.append(f"the cupy backend is unavailable: {available.reason}")
        lay = state.layout
        scales = {f: getattr(lay, f, None) for f in _SCALE_FIELDS}
        arrays = {"q": q, **{f: getattr(lay, f) for f in (*_FLOAT_FIELDS, *_INDEX_FIELDS, "gamma")}}
        arrays.update({f: x for f, x in scales.items() if x is not None})
        # each side in its own format (a layout with a format per side, spec/quantization.md Q0)
        side_bits = {side: _side_bits(lay, side) for side in ("key", "value")}
        for side, bits in side_bits.items():
            if bits:
                arrays.update({f: getattr(lay, f) for f in _LOW_BIT_SIDE_FIELDS[side]})
        exact = _exact_arrays(state)
        arrays.update(exact)

        devices = set()
        for field, x in arrays.items():
            try:
                family = array_family(x)
            except ValueError:
                reasons.append(f"{field} is a {type(x).__name__}; expected a cupy array or a torch CUDA tensor")
                continue
            if family == "numpy":
                fix = "move q to the GPU (cupy.asarray or a torch CUDA tensor)" if field == "q" else "convert the state with state.to('cupy')"
                reasons.append(f"{field} is a NumPy (host) array; the cupy backend reads GPU memory: {fix}")
            elif family == "torch" and x.device.type != "cuda":
                reasons.append(f"{field} is a torch tensor on {x.device}; expected a CUDA tensor")
            else:
                devices.add(_interop.device_id(x))
        if len(devices) > 1:
            reasons.append(f"q and the state's arrays are on different CUDA devices {sorted(devices)}; expected one device")

        q_dtype = _interop.dtype_name(q)
        dtype = _interop.dtype_name(lay.key_bases)
        if q_dtype not in _KERNEL_DTYPES:
            reasons.append(f"q has dtype {q_dtype}; compiled kernels take {', '.join(_KERNEL_DTYPES)}")
        if dtype not in _KERNEL_DTYPES:
            reasons.append(f"the state has dtype {dtype}; compiled kernels take {', '.join(_KERNEL_DTYPES)} (convert with state.to('cupy', dtype=...))")
        if q_dtype != dtype:
            reasons.append(f"q has dtype {q_dtype} but the state's bases have {dtype}; expected the same dtype")
        if _interop.dtype_name(lay.value_bases) != dtype:
            reasons.append(f"value_bases has dtype {_interop.dtype_name(lay.value_bases)} but key_bases has {dtype}; expected one dtype")
        for side, bits in side_bits.items():
            field, scale = f"{side}_coef", scales[f"{side}_scale"]
            got = _interop.dtype_name(getattr(lay, field))
            if bits:
                if got != "uint8":
                    reasons.append(f"{field} has dtype {got}; int{bits} codes are packed in uint8 (spec/quantization.md Q2)")
            elif got == "int8" and scale is None:
                reasons.append(f"{field} is int8 but the layout has no {side}_scale array; INT8 coefficients need their float32 scales")
            elif got != "int8" and scale is not None:
                reasons.append(f"{field} has dtype {got} but the layout carries {side}_scale; expected int8")
            elif got not in ("int8", dtype):
                reasons.append(f"{field} has dtype {got} but the bases have {dtype}; expected the same dtype (or int8 with scales)")
        if side_bits["key"] and _interop.dtype_name(lay.key_tail) != dtype:
            reasons.append(f"key_tail has dtype {_interop.dtype_name(lay.key_tail)} but the bases have {dtype}; expected the same dtype")
        for field in _INDEX_FIELDS:
            if _interop.dtype_name(getattr(lay, field)) != "int64":
                reasons.append(f"{field} has dtype {_interop.dtype_name(getattr(lay, field))}; expected int64 (spec A9)")

        d, d_v = lay.key_bases.shape[-1], lay.value_bases.shape[-1]
        r, r_v = _ranks(lay)
        coef, value_coef = (_side_kind(lay, side) for side in ("key", "value"))
        if _kernels.find_config(dtype if dtype in _KERNEL_DTYPES else "float32", coef, d, d_v, r, r_v, value_coef) is None:
            reasons.append(
                f"no compiled kernel for head sizes (d, d_v) = ({d}, {d_v}) with ranks (r, r_v) = ({r}, {r_v}); "
                f"rank tiles compiled: {', '.join(map(str, _kernels.RANK_TILES))}"
            )
        for field, x in exact.items():
            if _interop.dtype_name(x) != dtype:
                reasons.append(f"{field} has dtype {_interop.dtype_name(x)} but the bases have {dtype}; expected one dtype")
        if len(q.shape) == 3 and q.shape[2] != d:
            reasons.append(f"q has head size {q.shape[2]}; the state has d = {d}")
        if lay.num_tokens > _INT32_MAX:
            reasons.append(f"the state holds {lay.num_tokens} tokens; the kernels index tokens with int32")

        if available and not reasons and len(q.shape) == 3:
            reasons += self._shared_memory_reasons(q, state)
        return reasons

    def _shared_memory_reasons(self, q: Any, state) -> list[str]:
        import cupy


        lay = state.layout
        group = q.shape[1] // lay.key_coef.shape[1]
        d, d_v = lay.key_bases.shape[-1], lay.value_bases.shape[-1]
        rt = _kernels.rank_tile(*_ranks(lay))
        dtype = _interop.dtype_name(lay.key_bases)
        coef_type, value_coef_type = (_kernels.coef_cuda_type(dtype, _side_kind(lay, side)) for side in ("key", "value"))
        if getattr(state.policy, "rope", None) is not None:
            need = _kernels.rope_shared_bytes(group, d, rt, coef_type, value_coef_type)
        else:
            need = _kernels.decode_shared_bytes(group, d, d_v, rt, coef_type, value_coef_type)
        if _launch.exact_segments(state):
            need = max(need, _kernels.exact_shared_bytes(group, d, d_v))
        device = _interop.device_id(q)
        limit = _launch.max_shared_bytes(cupy.cuda.Device(device))
        if need > limit:
            return [
                f"a GQA group of {group} query heads needs {need} bytes of shared memory per block (d={d}, d_v={d_v}, rank tile {rt}); device {device} allows {limit}"
            ]
        return []

    # ------------------------------------------------------------------ conversion
    def converter(self, device: Any = None, dtype: Any = None):
        """``state.to('cupy', device, dtype)``: any array -> CuPy on ``device`` (an index,
        "cuda", "cuda:N" or None for the current device), floating arrays cast to ``dtype``."""
        import cupy

        if isinstance(device, str):
            if not device.startswith("cuda"):
                raise ValueError(f"device must be a CUDA device ('cuda', 'cuda:N' or an index) for the cupy backend, got {device!r}")
            device = int(device.split(":")[1]) if ":" in device else None
        target = _cupy_dtype(dtype) if dtype is not None else None

        def convert(x):
            with cupy.cuda.Device(device) if device is not None else nullcontext():
                if array_family(x) == "torch":
                    x = x.detach()
                    if str(x.dtype) == "torch.bfloat16":
                        x = x.float()  # CuPy has bfloat16 only with ml_dtypes
                    x = x.cpu().numpy() if x.device.type != "cuda" else x
                x = cupy.array(x, copy=True)
                if target is not None and x.dtype.kind == "f":
                    x = x.astype(target)
                return x

        return convert

    # ------------------------------------------------------------------ operations
    def append(self, state, keys: Any, values: Any) -> None:
        """Spec A6 (static): one projection launch for every head, written past the live rows
        (INT8 layouts quantised in the kernel, spec A10). Spec A7/A8 (adaptive, rotating): the
        oracle's token loop (:func:`subspace_ref.numpy_backend.append_reference`) on CuPy arrays."""
        if any(_side_bits(state.layout, side) for side in ("key", "value")):  # refused before anything changes
            fmt = state.layout.coefficients
            raise NotImplementedError(f"the cupy backend cannot append to {fmt} coefficients (spec/quantization.md); append on the torch or numpy backend")
        import cupy


        lay = state.layout
        if getattr(lay, "basis_format", "native") != "native":  # refused before anything changes
            raise ValueError(
                f"the cupy backend cannot append to a state whose bases are stored as {lay.basis_format} (spec/storage.md S1); use the torch or numpy backend"
            )
        dtype = _interop.dtype_name(lay.key_bases)
        quantized = getattr(lay, "key_scale", None) is not None
        # the projection kernel writes one format to both sides: float/int8 and int8/float run the oracle's loop
        uniform = quantized == (getattr(lay, "value_scale", None) is not None)
        d, d_v = keys.shape[3], values.shape[3]
        r, r_v = lay.key_coef.shape[3], lay.value_coef.shape[3]
        coef_arrays = [lay.key_coef, lay.value_coef] + ([lay.key_scale, lay.value_scale] if quantized else [])
        fast = (
            state.kind == "static"
            and uniform
            and array_family(lay.key_coef) == "cupy"
            and _kernels.find_config(dtype, "int8" if quantized else "same", d, d_v, r, r_v) is not None
            and (not quantized or all(_interop.dtype_name(s) == "float32" for s in coef_arrays[2:]))
            # the kernel writes into the buffers in place: a strided view would need a copy back
            and all(x.flags.c_contiguous for x in coef_arrays)
        )
        if not fast:
            from subspace_ref.numpy_backend import append_reference

            if state.kind != "static" and dtype in ("float16", "bfloat16"):
                _append_widened(state, keys, values)
            else:
                append_reference(state, keys, values)
            return
        T, n_new = lay.num_tokens, keys.shape[2]
        keys = _pre_rope_keys(state, keys)
        lay = lay.with_capacity(T + n_new, lay.key_bases.shape[2])
        with _interop.launch_context(_interop.device_id(lay.key_coef)):
            _launch.project(
                dtype,
                cupy.ascontiguousarray(keys),
                cupy.ascontiguousarray(values),
                cupy.ascontiguousarray(lay.key_bases),
                cupy.ascontiguousarray(lay.value_bases),
                cupy.ascontiguousarray(lay.num_chunks),
                lay.key_coef,
                lay.value_coef,
                T,
                lay.key_scale if quantized else None,
                lay.value_scale if quantized else None,
            )
        state.layout = replace(lay, num_tokens=T + n_new)

    def attend(self, q: Any, state, scale: float | None) -> Any:
        """Spec A2/A3 with the flash-decoding split of A3.2: q (N, H_q, d) -> (N, H_q, d_v) in
        q's dtype and array kind, accumulated in float32."""

        from subspace_ref.window import first_compressed_position

        lay = state.layout
        segments = _launch.exact_segments(state)
        if lay.num_tokens == 0 and not segments:
            raise ValueError("no tokens were attended to; the softmax of an empty set is undefined")
        family = array_family(q)
        dtype = _interop.dtype_name(q)
        s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        scale_k, scale_v = (getattr(lay, f, None) for f in _SCALE_FIELDS)
        rope = getattr(state.policy, "rope", None)
        with _interop.launch_context(_interop.device_id(q), q, *lay.arrays().values(), *(x for seg in segments for x in seg)):
            import cupy

            extra = {}
            if rope is not None:  # spec/rope.md P3 from position S (spec/window.md W10)
                fields = _launch.rope_fields(rope, q.shape[-1], first_compressed_position(state))
                extra = {**fields, "rope_inv_freq": cupy.asarray(fields["rope_inv_freq"]), "rope_order": cupy.asarray(fields["rope_order"])}
            # spec/window.md W3, W8: the exact tokens as stored, one partial per segment
            extra["exact"] = tuple((cupy.ascontiguousarray(_interop.as_cupy(k)), cupy.ascontiguousarray(_interop.as_cupy(v))) for k, v in segments)
            arrays = _launch.CoefArrays(
                key_coef=_interop.as_cupy(lay.key_coef),
                value_coef=_interop.as_cupy(lay.value_coef),
                key_bases=_interop.as_cupy(lay.key_bases),
                value_bases=_interop.as_cupy(lay.value_bases),
                chunk_starts=_interop.as_cupy(lay.chunk_starts),
                num_chunks=_interop.as_cupy(lay.num_chunks),
                gamma=_interop.as_cupy_float32(lay.gamma),
                num_tokens=int(lay.num_tokens),
                # spec A10 scales are float32; a state cast wholesale to 16 bits is widened here
                key_scale=None if scale_k is None else _interop.as_cupy_float32(scale_k),
                value_scale=None if scale_v is None else _interop.as_cupy_float32(scale_v),
                **_low_bit_arrays(lay),
                **extra,
            )
            out = _launch.attend(_interop.as_cupy(q), dtype, arrays, s, self.splits)
        return _interop.to_family(out, family, dtype)

    # ------------------------------------------------------------------ extras
    @staticmethod
    def project_tokens(keys: Any, values: Any, B: Any, E: Any):
        """(c, d, rho_k, rho_v) of new tokens (N, H, n, d) against explicit open bases B (N, H, r, d),
        E (N, H, r_v, d_v) in one launch (spec A7 steps 1-2), for an online-policy token loop that
        keeps its open bases outside the layout. CuPy in, CuPy out."""

        with _interop.launch_context(_interop.device_id(keys)):
            return _launch.project_tokens(_interop.dtype_name(keys), keys, values, B, E)


def _append_widened(state, keys: Any, values: Any) -> None:
    """Spec A7/A8 appends of a 16-bit online state: the oracle's token loop on float32 copies,
    rounded back to the state's dtype afterwards. CuPy's SVD (the FD sketches, spec A4) takes
    float32/float64 only. Costs a copy of the state per call."""
    from subspace_ref.numpy_backend import append_reference

    narrow = keys.dtype

    def widen(name, x):
        return x.astype(np.float32) if x.dtype.kind == "f" and x.dtype.itemsize == 2 else x

    def back(name, x):
        return x.astype(narrow) if x.dtype == np.float32 and name not in _SCALE_FIELDS else x

    sketches = replace(state.sketches, keys=widen("", state.sketches.keys), values=widen("", state.sketches.values))
    wide = type(state)(state.policy, state.layout.map_arrays(widen), sketches, state.batched, state.engine)
    append_reference(wide, keys.astype(np.float32), values.astype(np.float32))
    state.layout = wide.layout.map_arrays(back)
    state.sketches = replace(wide.sketches, keys=back("", wide.sketches.keys), values=back("", wide.sketches.values))


def _pre_rope_keys(state, keys: Any) -> Any:
    """Spec/rope.md P2 step 1 for the keys a static append is about to project: a pre-RoPE state's
    are un-rotated at positions S+T.. (S the sinks, spec/window.md W10; T the compressed tokens
    held); other states' are returned as they are."""
    rope = getattr(state.policy, "rope", None)
    if rope is None:
        return keys
    from subspace_ref.rope import rotate
    from subspace_ref.window import first_compressed_position

    first = first_compressed_position(state) + state.layout.num_tokens
    return rotate(keys, np.arange(first, first + keys.shape[2]), rope, inverse=True)


def _exact_arrays(state) -> dict:
    """The exact tokens' arrays the kernels read (spec/window.md W3, W7), by name."""
    win = state.window
    if win is None:
        return {}
    fields = ("sink_keys", "sink_values", "keys", "values")
    return {f"window.{f}": getattr(win, f) for f in fields if getattr(win, f) is not None and getattr(win, f).shape[2] > 0}


def _cupy_dtype(dtype: Any) -> np.dtype:
    name = np.dtype(dtype).name if isinstance(dtype, type) else str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as err:
            raise TypeError("bfloat16 CuPy arrays need the ml_dtypes package; install it or use float16/float32") from err
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _side_format(lay, side: str):
    """The subspace_ref.formats record of the "key" or "value" side of a layout."""
    if hasattr(lay, "side_format"):
        return lay.side_format(side)
    from subspace_ref.formats import FORMATS

    return FORMATS["int8" if getattr(lay, f"{side}_scale", None) is not None else "float"]


def _side_bits(lay, side: str) -> int:
    """The int4/int2 code width of a layout side (spec/quantization.md Q2), 0 for float and int8."""
    return int(_side_format(lay, side).low_bits)


def _side_kind(lay, side: str) -> str:
    """The kernels' coefficient kind of a layout side: "same" (float), "int8", "int4" or "int2"."""
    return _kernels.FORMAT_KINDS[_side_format(lay, side).name]


def _ranks(lay) -> tuple[int, int]:
    """(r, r_v): a side's coefficient width, or its bases' rank for an int4/int2 side, whose
    coefficient rows are packed bytes."""
    return tuple(
        getattr(lay, f"{side}_bases").shape[-2] if _side_bits(lay, side) else getattr(lay, f"{side}_coef").shape[-1] for side in ("key", "value")
    )


def _low_bit_arrays(lay) -> dict:
    """The CoefArrays fields of the int4/int2 sides of a layout (spec/quantization.md Q2), each
    side in its own format (Q0); empty when neither side is int4/int2."""
    bits = {side: _side_bits(lay, side) for side in ("key", "value")}
    if not any(bits.values()):
        return {}
    import cupy

    out = {}
    for side, b in bits.items():
        if b:
            out.update({f: _interop.as_cupy(getattr(lay, f)) for f in _LOW_BIT_SIDE_FIELDS[side]})
    # the kernel reads float16 scales and zero points (spec Q2); state.to(dtype=...) casts every
    # floating array, and float16 values survive a float32 round trip exactly
    for f in ("key_group_scale", "key_group_zero", "value_token_scale", "value_token_zero"):
        if f in out:
            out[f] = cupy.ascontiguousarray(out[f].astype(cupy.float16, copy=False))
    if "key_tail" in out:
        out["key_tail"] = cupy.ascontiguousarray(out["key_tail"])
    kb, vb = bits["key"], bits["value"]
    sides = {"low_bits": kb} if kb == vb else {"low_bits": 0, "key_low_bits": kb, "value_low_bits": vb}
    return {**sides, "key_group": int(lay.group) if kb else 0, **out}
