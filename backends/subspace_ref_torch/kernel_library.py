"""The C kernels' shared library: its build by the host C compiler (``subspace_ref.host_build``),
its ctypes binding, and the description of a layout's coefficient arrays that every kernel reads
(:func:`kernel_sides`). Which calls the kernels serve is decided in :mod:`subspace_ref_torch.plan`.

Without a C compiler, or with ``SUBSPACE_REF_CPU_KERNELS=0``, :func:`library_status` says why and
every caller takes its torch-operations path (docs/benchmarks.md, "CPU kernels").
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import torch

from subspace_ref.host_build import build_shared_library

SOURCES = [Path(__file__).resolve().parent / "kernels" / name for name in ("coefficient_products.c", "quantized_stores.c", "static_append.c")]
FLAGS = ["-std=c11", "-O3", "-march=native", "-fopenmp-simd"]
#: the kernels' fixed buffers (MAX_BYTES, MAX_QUERIES, MAX_DIM in the source)
MAX_ROW_BYTES = 256
MAX_QUERIES = 64
MAX_DIM = 512
ROPE_BLOCK = 16  # positions per base angle of the rotation (ROPE_BLOCK in the source)
#: a side's ``bits`` when it is stored as float32 rows (FLOAT_BITS in the source)
FLOAT_BITS = 0

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class Side(ctypes.Structure):
    """``struct coefficient_side`` of the source: one side (keys or values) of a state as stored."""

    _fields_ = [
        ("codes", _ptr), ("head_stride", _i64), ("width", _i64), ("rank", _i64),
        ("scale", _ptr), ("zero", _ptr), ("scale_head_stride", _i64), ("group", _i64),
    ]  # fmt: skip


class RopeStruct(ctypes.Structure):
    """``struct rope_keys`` of the source: the rotation of a pre-RoPE state's keys (spec/rope.md P3)."""

    _fields_ = [
        ("order", _ptr), ("planes", _i64), ("inv_freq", _ptr), ("scaling", ctypes.c_double), ("first", _i64),
        ("offsets", _ptr), ("turns", _ptr),
    ]  # fmt: skip


class ExactStruct(ctypes.Structure):
    """``struct exact_part`` of the source: a windowed state's sinks and recent tokens (spec/window.md W3)."""

    _fields_ = [("keys", _ptr * 2), ("values", _ptr * 2), ("count", _i64 * 2), ("scale", ctypes.c_float)]


class UnrotationStruct(ctypes.Structure):
    """``struct key_unrotation`` of the source: the rotating planes of a pre-RoPE state's keys (spec/rope.md §1)."""

    _fields_ = [
        ("first", _ptr), ("second", _ptr), ("planes", _i64), ("inv_freq", _ptr), ("scaling", ctypes.c_double),
        ("scaling_squared", ctypes.c_double),
    ]  # fmt: skip


class GroupCallStruct(ctypes.Structure):
    """``struct group_call`` of the source: the arguments of ``coefficient_attention`` for one head
    group of a layer, with ``rows`` (each of its heads' first query row in the layer's q and out)."""

    _fields_ = [
        ("key_bits", ctypes.c_int), ("value_bits", ctypes.c_int), ("heads", _i64), ("queries", _i64), ("tokens", _i64), ("tile", _i64),
        ("q", _ptr), ("d", _i64), ("query_map", _ptr), ("keys", ctypes.POINTER(Side)), ("key_tail", _ptr), ("tail_head_stride", _i64),
        ("rope", ctypes.POINTER(RopeStruct)), ("values", ctypes.POINTER(Side)), ("value_map", _ptr), ("d_v", _i64),
        ("exact", ctypes.POINTER(ExactStruct)), ("rows", _ptr), ("out", _ptr),
    ]  # fmt: skip


_SIGNATURES = {
    "coefficient_attention": [
        ctypes.c_int, ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, ctypes.POINTER(Side), _ptr, _i64, ctypes.POINTER(RopeStruct),
        ctypes.POINTER(Side), _ptr, _i64, ctypes.POINTER(ExactStruct), _ptr,
    ],
    "layer_attention": [_i64, ctypes.POINTER(GroupCallStruct)],
    "low_bit_rows": [ctypes.c_int, _i64, _i64, _i64, ctypes.POINTER(Side), _ptr, _i64],
    "rope_offset_tables": [_i64, _ptr, _ptr, _ptr],
    "softmax_exp": [_i64, _ptr, _ptr],
    "int8_store": [_i64, _i64, _i64, _ptr, ctypes.POINTER(Side)],
    "low_bit_store_values": [ctypes.c_int, _i64, _i64, _i64, _ptr, ctypes.POINTER(Side), ctypes.POINTER(ctypes.c_double)],
    "low_bit_store_keys": [ctypes.c_int, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.POINTER(Side), ctypes.POINTER(ctypes.c_double)],
    "static_append": [
        ctypes.c_int, ctypes.c_int, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, ctypes.POINTER(UnrotationStruct), _i64, _ptr, _ptr,
        ctypes.POINTER(Side), ctypes.POINTER(Side), ctypes.POINTER(ctypes.c_double),
    ],
    "layer_window_append": [_i64, _ptr, ctypes.POINTER(ctypes.c_double)],
    "layer_decode": [_i64, _ptr, ctypes.POINTER(ctypes.c_double), ctypes.POINTER(GroupCallStruct)],
}  # fmt: skip


def compiler() -> str | None:
    """The host C compiler: ``$CC``, else cc, gcc or clang on the PATH; None without one.

    Returns
    -------
    str or None
        The compiler's command.
    """
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(flags: list[str] = FLAGS, stem: str = "coefficient_products") -> ctypes.CDLL:
    """The kernels built with ``flags`` (cached by ``host_build``) and loaded, their signatures
    declared. Tests also build them for CPUs without AVX-512 (``-march=x86-64-v3``, ``-march=x86-64``):
    every path must hold the same tolerance.

    Parameters
    ----------
    flags : list of str
        Compiler flags.
    stem : str
        Name of the cached library file.

    Returns
    -------
    ctypes.CDLL
        The loaded library. OSError or RuntimeError when it does not build.
    """
    source = "\n".join(path.read_text() for path in SOURCES)
    lib = ctypes.CDLL(str(build_shared_library(source, compiler(), flags, stem)))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded at the first call; None where they cannot be (:func:`library_status` says why).

    Returns
    -------
    ctypes.CDLL or None
    """
    global _library, _failure
    if _library is not None:  # asked on every decode step: no lock once loaded
        return _library
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        if os.environ.get("SUBSPACE_REF_CPU_KERNELS", "1") == "0":
            _failure = "disabled by SUBSPACE_REF_CPU_KERNELS=0"
        elif compiler() is None:
            _failure = "no C compiler (cc, gcc, clang or $CC) to build the kernels (kernels/*.c)"
        else:
            try:
                _library = build()
            except (OSError, RuntimeError) as e:
                _failure = f"the kernels (kernels/*.c) did not build: {e}"
        return _library


def library_status() -> tuple[bool, str]:
    """Whether the kernels are built and loaded.

    Returns
    -------
    tuple of (bool, str)
        (True, "") when they are, else (False, why).
    """
    return (True, "") if library() is not None else (False, _failure or "")


def check(rc: int, name: str) -> None:
    """Raise ValueError when kernel ``name`` returned a non-zero ``rc`` (a shape beyond its buffers).

    Parameters
    ----------
    rc : int
        The kernel's return code.
    name : str
        The kernel's name, for the message.
    """
    if rc != 0:
        raise ValueError(
            f"{name}: shape beyond the CPU kernel's limits (row bytes <= {MAX_ROW_BYTES}, query heads per KV head <= {MAX_QUERIES}, "
            f"head size of pre-RoPE keys <= {MAX_DIM})"
        )


def side_bits(layout, which: str) -> int | None:
    """The kernels' ``bits`` of ``layout``'s "key" or "value" side, from its declared format.

    Parameters
    ----------
    layout : PackedLayout
    which : {"key", "value"}

    Returns
    -------
    int or None
        4 or 2 (int4 / int2), 8 (int8), FLOAT_BITS (float coefficients stored as float32), or
        None for float coefficients of another dtype, which the kernels do not read.
    """
    fmt = layout.side_format(which)
    if fmt.low_bits:
        return fmt.low_bits
    if fmt.per_token_scale:
        return 8
    return FLOAT_BITS if getattr(layout, f"{which}_coef").dtype == torch.float32 else None


def side_arrays(layout) -> tuple:
    """What the kernels read of ``layout``'s coefficients, by each side's format.

    Returns
    -------
    tuple
        (key codes, their scales, their zeros, value codes, their scales, their zeros): zeros
        None but for int4 / int2, scales None for float rows.
    """
    out = []
    for which in ("key", "value"):
        fmt = layout.side_format(which)
        coef = getattr(layout, f"{which}_coef")
        if fmt.low_bits and which == "key":
            out += [coef, layout.key_group_scale, layout.key_group_zero]
        elif fmt.low_bits:
            out += [coef, layout.value_token_scale, layout.value_token_zero]
        else:
            out += [coef, getattr(layout, f"{which}_scale"), None]
    return tuple(out)


def in_place(x: torch.Tensor | None) -> bool:
    """Whether the kernels read ``x`` (N, H, rows[, width]) where it lies: its last axis
    contiguous, its (N, H) heads evenly spaced and its rows back to back, as every array a state
    allocates is.

    Parameters
    ----------
    x : torch.Tensor or None
        A layout array (None, or rows of width 0: nothing to read).

    Returns
    -------
    bool
    """
    if x is None or x.dim() == 4 and x.shape[3] == 0:  # rows of no coefficients (rank 0): nothing to read
        return True
    N, H = x.shape[:2]
    return x.stride(-1) == 1 and (N == 1 or x.stride(0) == H * x.stride(1)) and (x.dim() == 3 or x.stride(2) == x.shape[3])


def kernel_sides(layout) -> tuple[Side, Side] | None:
    """The :class:`Side` of ``layout``'s key and value coefficients as stored: int8 codes with
    per-token float32 scales (spec A10); int4 / int2 codes with float16 scales and zeros per
    channel and group of keys, per value token (spec/quantization.md Q2); float rows without
    scales. Derived once per set of arrays: they hold addresses and strides, not the token count.

    Returns
    -------
    tuple of (Side, Side) or None
        None when the arrays do not lie as the kernels read them (:func:`in_place`).
    """
    arrays = side_arrays(layout)
    keys, values = arrays[:3], arrays[3:]

    def side(arrays: tuple, rank: int, group: int) -> Side:
        codes, scale, zero = arrays
        if zero is not None and (zero.stride(1) != scale.stride(1) or scale.dtype != torch.float16 or zero.dtype != torch.float16):
            raise ValueError(f"scale and zero must be float16 arrays of one layout (spec/quantization.md Q2), got {scale.dtype}, {zero.dtype}")
        pointer = lambda x: None if x is None else x.data_ptr()  # noqa: E731  (float rows have no scales, int8 no zeros)
        return Side(codes.data_ptr(), codes.stride(1), codes.shape[-1], rank, pointer(scale), pointer(zero), 0 if scale is None else scale.stride(1), group)

    def make_sides() -> tuple[Side, Side] | None:
        if not all(map(in_place, keys + values)):
            return None
        group = layout.group if layout.side_format("key").low_bits else 0
        return side(keys, layout.key_bases.shape[3], group), side(values, layout.value_bases.shape[3], 0)

    return layout.derived("kernel_sides", keys + values, make_sides, writes=False)


__all__ = [
    "FLAGS", "FLOAT_BITS", "MAX_DIM", "MAX_QUERIES", "MAX_ROW_BYTES", "ROPE_BLOCK", "SOURCES", "ExactStruct", "GroupCallStruct", "RopeStruct", "Side",
    "UnrotationStruct", "library_status", "build", "check", "compiler", "in_place", "kernel_sides", "library", "side_arrays", "side_bits",
]  # fmt: skip
