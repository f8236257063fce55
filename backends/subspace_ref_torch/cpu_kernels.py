"""The CPU kernels: decode products over int8, int4 and int2 coefficients, dequantised in
registers (``kernels/coefficient_products.c``, spec R14), and the stores that quantise appended
coefficients bit for bit as the other paths do (``kernels/quantized_stores.c``: spec A10,
spec/quantization.md Q1-Q2), and a decode step's append to a static state, projection and
un-rotation of pre-RoPE keys before those stores (``kernels/static_append.c``: spec A6,
spec/rope.md P2). Built into one library with
the host C compiler at first use (``subspace_ref.host_build``) and called through ctypes on CPU
tensors.

Without a C compiler, or with ``SUBSPACE_REF_CPU_KERNELS=0``, :func:`availability` says why; the
attend path then dequantises tiles with torch operations instead (the same numbers to within
float32 rounding order, several times slower: docs/benchmarks.md) and appends project with
torch operations and quantise with array operations (the same bits).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import shutil
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from subspace_ref.host_build import build_shared_library
from subspace_ref.quantization import check_fp16_range

SOURCES = [Path(__file__).resolve().parent / "kernels" / name for name in ("coefficient_products.c", "quantized_stores.c", "static_append.c")]
FLAGS = ["-std=c11", "-O3", "-march=native", "-fopenmp-simd"]
#: the kernel's fixed buffers (MAX_BYTES, MAX_QUERIES in the source)
MAX_ROW_BYTES = 256
MAX_QUERIES = 64
MAX_DIM = 512  # head size of a pre-RoPE state's rebuilt keys
#: the most outputs a KernelCall allocates at once (KernelCall._output), and the most bytes that
#: block may take beyond one output: a caller that keeps an output keeps its block alive
OUTPUTS_PER_BLOCK = 16
OUTPUT_BLOCK_BYTES = 64 * 1024
ROPE_BLOCK = 16  # positions per base angle of the rotation (ROPE_BLOCK in the source)
FLOAT_ROWS = 32  # the kernels' `bits` of float32 coefficients (FLOAT_ROWS in the source)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


class _Side(ctypes.Structure):
    """``struct coefficient_side`` of the source: one side (keys or values) of a state as stored."""

    _fields_ = [
        ("codes", _ptr), ("head_stride", _i64), ("width", _i64), ("rank", _i64),
        ("scale", _ptr), ("zero", _ptr), ("scale_head_stride", _i64), ("group", _i64),
    ]  # fmt: skip


class _RopeKeys(ctypes.Structure):
    """``struct rope_keys`` of the source: the rotation of a pre-RoPE state's keys (spec/rope.md P3)."""

    _fields_ = [
        ("order", _ptr), ("planes", _i64), ("inv_freq", _ptr), ("scaling", ctypes.c_double), ("first", _i64),
        ("offsets", _ptr), ("turns", _ptr),
    ]  # fmt: skip


class _Exact(ctypes.Structure):
    """``struct exact_tokens`` of the source: a windowed state's sinks and recent tokens (spec/window.md W3)."""

    _fields_ = [("keys", _ptr * 2), ("values", _ptr * 2), ("count", _i64 * 2), ("scale", ctypes.c_float)]


class _Unrotation(ctypes.Structure):
    """``struct key_unrotation`` of the source: the rotating planes of a pre-RoPE state's keys (spec/rope.md §1)."""

    _fields_ = [
        ("first", _ptr), ("second", _ptr), ("planes", _i64), ("inv_freq", _ptr), ("scaling", ctypes.c_double),
        ("scaling_squared", ctypes.c_double),
    ]  # fmt: skip


_SIGNATURES = {
    "coefficient_attention": [
        ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, ctypes.POINTER(_Side), _ptr, _i64, ctypes.POINTER(_RopeKeys),
        ctypes.POINTER(_Side), _ptr, _i64, ctypes.POINTER(_Exact), _ptr,
    ],
    "low_bit_rows": [ctypes.c_int, _i64, _i64, _i64, ctypes.POINTER(_Side), _ptr, _i64],
    "rope_tables": [_i64, _ptr, _ptr, _ptr],
    "softmax_exp": [_i64, _ptr, _ptr],
    "int8_store": [_i64, _i64, _i64, _ptr, ctypes.POINTER(_Side)],
    "low_bit_store_values": [ctypes.c_int, _i64, _i64, _i64, _ptr, ctypes.POINTER(_Side), ctypes.POINTER(ctypes.c_double)],
    "low_bit_store_keys": [ctypes.c_int, _i64, _i64, _i64, _ptr, _ptr, _ptr, ctypes.POINTER(_Side), ctypes.POINTER(ctypes.c_double)],
    "static_append": [
        ctypes.c_int, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, ctypes.POINTER(_Unrotation), _i64, _ptr, _ptr,
        ctypes.POINTER(_Side), ctypes.POINTER(_Side), ctypes.POINTER(ctypes.c_double),
    ],
}

def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build(flags: list[str] = FLAGS, stem: str = "coefficient_products") -> ctypes.CDLL:
    """The kernels built with ``flags`` (cached by ``host_build``) and loaded, their signatures
    declared. OSError or RuntimeError when they do not build. Tests build them for CPUs without
    AVX-512 too (``-march=x86-64-v3``: the AVX2 register paths; ``-march=x86-64``: the portable
    loops): every path must hold the same tolerance."""
    source = "\n".join(path.read_text() for path in SOURCES)
    lib = ctypes.CDLL(str(build_shared_library(source, compiler(), flags, stem)))
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


def _load() -> ctypes.CDLL | None:
    global _library, _failure
    if _library is not None:  # every decode step asks: no lock once loaded
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


def availability() -> tuple[bool, str]:
    """(True, "") when the kernels are built and loaded, else (False, why)."""
    return (True, "") if _load() is not None else (False, _failure or "")


def serves(q: torch.Tensor, state, dtype: torch.dtype) -> bool:
    """Whether a :class:`KernelCall` serves queries ``q`` (N, H_q, d) on the torch
    ``state`` in the work dtype ``dtype``: float32 work, int8 / int4 / int2 coefficients (or a
    pre-RoPE state's float32 ones: :func:`float_rows`), CPU
    tensors within the kernels' limits and lying as they read them, kernels available (the caller
    checks one chunk of bases, and that a pre-RoPE state is static). Elsewhere attend takes its
    torch-operations path."""
    lay = state.layout
    return (
        (lay.quantized or bool(lay.low_bits) or float_rows(state))
        and dtype == torch.float32
        and q.is_cpu
        and lay.key_coef.is_cpu
        and q.shape[1] // lay.key_coef.shape[1] <= MAX_QUERIES
        and max(lay.key_coef.shape[-1], lay.value_coef.shape[-1]) <= MAX_ROW_BYTES
        and (getattr(state.policy, "rope", None) is None or q.shape[-1] <= MAX_DIM)
        and _load() is not None
        and kernel_sides(lay) is not None
    )


def float_rows(state) -> bool:
    """Whether the kernels read ``state``'s coefficients as float32 rows (FLOAT_ROWS in the
    source): a pre-RoPE state (spec/rope.md P3) whose coefficients are not quantised."""
    lay = state.layout
    return getattr(state.policy, "rope", None) is not None and lay.key_coef.dtype == torch.float32 and lay.value_coef.dtype == torch.float32


def _bits(layout) -> int:
    """The kernels' ``bits`` of ``layout``'s coefficients: 4 or 2 (int4 / int2), 8 (int8), or
    FLOAT_ROWS (float32 rows)."""
    return layout.low_bits or (8 if layout.quantized else FLOAT_ROWS)


def _in_place(x: torch.Tensor | None) -> bool:
    """Whether the kernels read ``x`` (N, H, rows[, width]) where it lies: its last axis
    contiguous, its (N, H) heads evenly spaced and its rows back to back, as every array a state
    allocates is."""
    if x is None:
        return True
    N, H = x.shape[:2]
    return x.stride(-1) == 1 and (N == 1 or x.stride(0) == H * x.stride(1)) and (x.dim() == 3 or x.stride(2) == x.shape[3])


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise ValueError(
            f"{name}: shape beyond the CPU kernel's limits (row bytes <= {MAX_ROW_BYTES}, query heads per KV head <= {MAX_QUERIES}, "
            f"head size of pre-RoPE keys <= {MAX_DIM})"
        )


#: the store kernels' fixed buffers (MAX_RANK, MAX_GROUP in kernels/quantized_stores.c)
MAX_STORE_RANK = 512
MAX_STORE_GROUP = 128


def side_arrays(layout) -> tuple:
    """What the kernels read of ``layout``'s coefficients: (key codes, their scales, their
    zeros, value codes, their scales, their zeros), zeros None for int8 (spec A10), scales and
    zeros None for float32 rows (:func:`float_rows`)."""
    if not layout.low_bits:  # int8 with its scales, or float32 rows (FLOAT_ROWS) without
        return layout.key_coef, layout.key_scale, None, layout.value_coef, layout.value_scale, None
    return layout.key_coef, layout.key_group_scale, layout.key_group_zero, layout.value_coef, layout.value_token_scale, layout.value_token_zero


def kernel_sides(layout) -> tuple[_Side, _Side] | None:
    """The ``_Side`` of ``layout``'s key and of its value coefficients as stored: int8 codes
    with per-token float32 scales (spec A10); int4 / int2 codes with float16 scales and zeros
    per channel and group of keys, per value token (spec/quantization.md Q2); float32 rows
    without scales (:func:`float_rows`, strides counting floats). None when the
    arrays do not lie as the kernels read them (:func:`_in_place`); then the kernels serve
    nothing.

    They hold addresses and strides only, not the token count, so they are derived once per set
    of arrays and serve every decode step until an append grows them into new arrays: appends
    write tokens in place, and each call passes the count."""
    arrays = side_arrays(layout)
    keys, values = arrays[:3], arrays[3:]

    def side(arrays: tuple, rank: int, group: int) -> _Side:
        codes, scale, zero = arrays
        if zero is not None and (zero.stride(1) != scale.stride(1) or scale.dtype != torch.float16 or zero.dtype != torch.float16):
            raise ValueError(f"scale and zero must be float16 arrays of one layout (spec/quantization.md Q2), got {scale.dtype}, {zero.dtype}")
        pointer = lambda x: None if x is None else x.data_ptr()  # noqa: E731  (float rows have no scales, int8 no zeros)
        return _Side(codes.data_ptr(), codes.stride(1), codes.shape[-1], rank, pointer(scale), pointer(zero), 0 if scale is None else scale.stride(1), group)

    def build() -> tuple[_Side, _Side] | None:
        if not all(map(_in_place, keys + values)):
            return None
        return side(keys, layout.key_bases.shape[3], layout.group if layout.low_bits else 0), side(values, layout.value_bases.shape[3], 0)

    return layout.derived("kernel_sides", keys + values, build, writes=False)


class RopeKeys(NamedTuple):
    """The rotation of a pre-RoPE state's keys as a :class:`KernelCall` takes it
    (spec/rope.md P3), made by :func:`rope_keys`: ``order`` (d,) int32, the permutation of the
    dims that puts the m rotating planes' first dims first, their second dims next and the fixed
    dims last (the query map's columns are in this order); the planes' frequencies ``inv_freq``
    (m,) float64; ``scaling``, transformers' attention_scaling; ``first``, the position of
    compressed token 0 (spec/window.md W10); the kernels' tables of the rotation, ``offsets`` and
    ``turns`` (spec R14 step 2')."""

    order: torch.Tensor
    inv_freq: torch.Tensor
    scaling: float
    first: int
    offsets: torch.Tensor
    turns: torch.Tensor


class ExactTokens(NamedTuple):
    """A windowed state's exact tokens as a :class:`KernelCall` takes them (spec/window.md
    W3, W8), made by :func:`exact_tokens`: ``sinks`` and ``recent``, each (keys (N, H, count, d),
    values (N, H, count, d_v)) float32 contiguous (``sinks`` None without sinks), and their logit
    ``scale`` (no gamma: they are not projected)."""

    sinks: tuple[torch.Tensor, torch.Tensor] | None
    recent: tuple[torch.Tensor, torch.Tensor]
    scale: float


def rope_keys(order: torch.Tensor, inv_freq, scaling: float, first: int) -> RopeKeys:
    """The :class:`RopeKeys` of a rotation, its tables made once here rather than in every call."""
    inv_freq = torch.tensor(inv_freq, dtype=torch.float64)  # a copy: a RopeParams' array is read-only
    m = inv_freq.numel()
    offsets = torch.empty(2 * ROPE_BLOCK * m, dtype=torch.float32)
    turns = torch.empty(2 * m, dtype=torch.float64)
    _load().rope_tables(m, inv_freq.data_ptr(), offsets.data_ptr(), turns.data_ptr())
    return RopeKeys(order.to(torch.int32).contiguous(), inv_freq, float(scaling), int(first), offsets, turns)


def exact_tokens(window, scale: float) -> ExactTokens | None:
    """The :class:`ExactTokens` of a state's exact part (``state.window``, spec/window.md W1, W7)
    at logit ``scale``, float32, as a :class:`KernelCall` reads them; None without one."""
    if window is None:
        return None
    float32 = lambda x: x.to(torch.float32).contiguous()  # noqa: E731  (no copy for a float32 state's arrays)
    sinks = (float32(window.sink_keys), float32(window.sink_values)) if window.sink_keys is not None else None
    return ExactTokens(sinks, (float32(window.keys), float32(window.values)), float(scale))


class KernelCall:
    """Spec A2/A3 over a one-chunk int8 / int4 / int2 layout (or, pre-RoPE, float32 rows) in one
    call of the kernels' ``coefficient_attention``, its arguments that stay fixed over a decode
    loop prepared once: the queries' map ``query_map`` (N H, d, r) = gamma scale B^T -- or, with
    ``rope`` (a pre-RoPE state, spec/rope.md P3), each key rebuilt by ``query_map`` (N H, r, d)
    = gamma scale B, its dims in ``rope.order``, and turned to its position --, the value basis
    ``value_map`` (N H, r_v, d_v), and the coefficient arrays as stored (:func:`kernel_sides`).
    Made by :meth:`of`, which gives None where those arrays do not lie as the kernels read them.

    Each call passes what changes from step to step: the queries, the token count, the token
    tile, the unfinished key group's float tail (int4 / int2) and a windowed state's exact tokens
    (:func:`exact_tokens`; their logits join the one softmax: A3.1, spec/window.md W3). A decode
    step after the layers before it evicted the caches pays 15-25 us for every Python-level
    operation it starts (docs/benchmarks.md), so a call does nothing but read those and take its
    output, in its final shape, from a block allocated ahead (:meth:`_output`)."""

    def __init__(self, layout, query_map: torch.Tensor, value_map: torch.Tensor, rope: RopeKeys | None, sides: tuple[_Side, _Side]):
        self.bits = _bits(layout)
        self.kv_heads = layout.key_coef.shape[1]
        self.d_v = value_map.shape[2]
        self.rope = rope  # holds the rotation's arrays, as _held the maps: the pointers below point into them
        self._held = (query_map, value_map)  # (byref holds the structures)
        self._query_map, self._value_map = query_map.data_ptr(), value_map.data_ptr()
        self._keys, self._values = ctypes.byref(sides[0]), ctypes.byref(sides[1])
        self._group = layout.group if layout.low_bits else 0
        self._spare_outputs: dict[tuple, list[torch.Tensor]] = {}
        self._attention = _load().coefficient_attention
        self._rotation = None
        if rope is not None:
            self._rotation = ctypes.byref(
                _RopeKeys(rope.order.data_ptr(), rope.inv_freq.numel(), rope.inv_freq.data_ptr(), rope.scaling, rope.first, rope.offsets.data_ptr(), rope.turns.data_ptr())
            )

    @classmethod
    def of(cls, layout, query_map: torch.Tensor, value_map: torch.Tensor, rope: RopeKeys | None = None) -> "KernelCall | None":
        """The call over ``layout``'s arrays, or None when they do not lie as the kernels read
        them (:func:`kernel_sides`; :func:`serves` says so)."""
        sides = kernel_sides(layout)
        return None if sides is None else cls(layout, query_map, value_map, rope, sides)

    def __call__(self, q: torch.Tensor, layout, tile: int, exact: ExactTokens | None = None) -> torch.Tensor:
        """The attention output (N, H_q, d_v) float32 -- (H_q, d_v) for q (H_q, d) -- for queries
        q (N, H_q, d) (float32 work), H_q = g H, over ``layout``'s first ``num_tokens`` tokens
        (the layout this call was made for, or one whose arrays are the same: an append's),
        value sums per tile of ``tile`` tokens, then over tiles."""
        Hq, d = q.shape[-2:]
        N = q.shape[0] if q.dim() == 3 else 1
        T = layout.num_tokens
        if q.dtype != torch.float32 or not q.is_contiguous():
            q = q.to(torch.float32).contiguous()
        tail, tail_stride = None, 0
        if self._group and T % self._group:  # the unfinished group's keys, kept in float (spec/quantization.md Q2)
            tail = layout.key_tail
            if tail.dtype != torch.float32 or not _in_place(tail):
                tail = tail[:, :, : T % self._group].to(torch.float32).contiguous()
            tail_stride = tail.stride(1)
        out = self._output(q.shape[:-1] + (self.d_v,))
        parts = None
        if exact is not None:
            held = [exact.sinks, exact.recent]
            count = [0 if part is None else part[0].shape[2] for part in held]
            pointer = lambda i, part: None if part is None or part[i].shape[2] == 0 else part[i].data_ptr()  # noqa: E731
            parts = ctypes.byref(
                _Exact((_ptr * 2)(*(pointer(0, part) for part in held)), (_ptr * 2)(*(pointer(1, part) for part in held)), (_i64 * 2)(*count), exact.scale)
            )
        rc = self._attention(
            self.bits, N * self.kv_heads, Hq // self.kv_heads, T, tile, q.data_ptr(), d, self._query_map, self._keys,
            None if tail is None else tail.data_ptr(), tail_stride, self._rotation, self._values, self._value_map, self.d_v, parts, out.data_ptr(),
        )  # fmt: skip
        _check(rc, "coefficient_attention")
        return out

    def _output(self, shape: tuple) -> torch.Tensor:
        """A float32 array of ``shape`` that no earlier call returned: one of the disjoint views
        of a block allocated at once (up to OUTPUTS_PER_BLOCK outputs in OUTPUT_BLOCK_BYTES).
        After the layers before it have evicted the caches, one ``torch.empty`` costs a decode
        step 60-100 us, as much as a third of the Python around the kernel (docs/benchmarks.md).
        A block made in inference mode holds inference tensors, which the caller could not
        update in place outside it, so each mode has its own."""
        key = (shape, torch.is_inference_mode_enabled())
        spare = self._spare_outputs.get(key)
        if not spare:
            count = max(1, min(OUTPUTS_PER_BLOCK, OUTPUT_BLOCK_BYTES // (4 * math.prod(shape))))
            spare = self._spare_outputs[key] = list(torch.empty((count, *shape), dtype=torch.float32).unbind(0))
        return spare.pop()


def reads_low_bit(layout, dtype: torch.dtype) -> bool:
    """Whether :func:`low_bit_rows` reads ``layout``'s int4 / int2 coefficients into ``dtype``:
    float32 rows of CPU tensors that lie as the kernels read them, kernels available."""
    return (
        bool(layout.low_bits)
        and dtype == torch.float32
        and layout.key_coef.is_cpu
        and _load() is not None
        and kernel_sides(layout) is not None
    )


def low_bit_rows(layout, which: str, a: int, b: int) -> torch.Tensor:
    """Spec Q2: the int4 / int2 coefficients of tokens [a, b) of every head of ``layout``, (N, H,
    b - a, r) float32, as the oracle reads them (``quantization.read_low_bit``): fl32(code s + z),
    keys of whole groups with their group's per-channel scales and zeros and the unfinished
    group from its float tail, values with their token's."""
    N, H = layout.key_coef.shape[:2]
    side = kernel_sides(layout)[0 if which == "key" else 1]
    complete = layout.num_tokens // layout.group * layout.group
    end = b if which == "value" else min(b, complete)
    out = torch.empty((N, H, b - a, side.rank), dtype=torch.float32)
    if end > a:
        _check(_load().low_bit_rows(layout.low_bits, N * H, a, end - a, ctypes.byref(side), out.data_ptr(), b - a), "low_bit_rows")
    if b > end:  # the unfinished key group, kept in float (spec/quantization.md Q2)
        out[:, :, max(a, end) - a :] = layout.key_tail[:, :, max(a, complete) - complete : b - complete]
    return out


def store_quantized(layout, which: str, a: int, b: int, coef: torch.Tensor) -> bool:
    """Coefficients ``coef`` (N, H, b - a, r) of tokens [a, b) quantised into ``layout``'s "key"
    or "value" side by the store kernels: int8 with per-token scales (spec A10) bit for bit as
    ``fd.quantize_rows``; int4 / int2 (spec Q2) bit for bit as
    ``subspace_ref.quantization.store_low_bit`` (keys: the groups completed, and a new
    ``key_tail`` holding the unfinished one). True when done; False, with nothing written, where
    the kernels do not serve it (float32 coefficients and tail, CPU tensors lying in place,
    kernels built, ranks and groups within their buffers), for the caller to store with array
    operations. int4 / int2 coefficients beyond float16's range raise the oracle's ValueError
    with nothing written."""
    if not ((layout.quantized or layout.low_bits) and coef.dtype == torch.float32 and coef.is_cpu and layout.key_coef.is_cpu):
        return False
    if which == "key" and layout.low_bits and (layout.key_tail.dtype != torch.float32 or not layout.key_tail.is_contiguous() or layout.group > MAX_STORE_GROUP):
        return False
    if _load() is None or coef.shape[-1] > MAX_STORE_RANK:
        return False
    sides = kernel_sides(layout)
    if sides is None:
        return False
    side = sides[0 if which == "key" else 1]
    N, H = coef.shape[:2]
    coef = coef.contiguous()
    if not layout.low_bits:
        _load().int8_store(N * H, a, b - a, coef.data_ptr(), ctypes.byref(side))
        return True
    magnitude = ctypes.c_double()
    if which == "value":
        rc = _load().low_bit_store_values(layout.low_bits, N * H, a, b - a, coef.data_ptr(), ctypes.byref(side), ctypes.byref(magnitude))
    else:
        tail = torch.zeros_like(layout.key_tail)  # the state's own tail is never written
        rc = _load().low_bit_store_keys(
            layout.low_bits, N * H, a, b - a, coef.data_ptr(), layout.key_tail.data_ptr(), tail.data_ptr(), ctypes.byref(side), ctypes.byref(magnitude)
        )
    if rc == -2:
        check_fp16_range(magnitude.value, magnitude.value)
    if rc != 0:
        raise RuntimeError(f"low_bit_store_{which}s returned {rc} for a layout it was told it serves")
    if which == "key":
        layout.key_tail = tail
    return True


#: the most tokens an append projects in the kernels: a decode step's few; a longer block (a
#: prefill) is one matmul, which a BLAS library does faster than the kernels' dot products
APPEND_TOKENS = 16


@functools.lru_cache(maxsize=64)
def _unrotation(rope, d: int) -> tuple[tuple[torch.Tensor, ...], _Unrotation]:
    """The ``struct key_unrotation`` of ``rope`` for head size d, with the arrays it points into."""
    pairs = rope.planes(d)[: rope.inv_freq.size]
    held = (
        torch.tensor(pairs[:, 0], dtype=torch.int32),
        torch.tensor(pairs[:, 1], dtype=torch.int32),
        torch.tensor(rope.inv_freq, dtype=torch.float64),
    )
    a = float(rope.attention_scaling)
    return held, _Unrotation(held[0].data_ptr(), held[1].data_ptr(), len(pairs), held[2].data_ptr(), a, a**2)


def static_append(layout, keys: torch.Tensor, values: torch.Tensor, rope, first: int) -> bool:
    """Spec A6 by the kernels (kernels/static_append.c): keys (N, H, n, d) and values (N, H, n,
    d_v) appended at tokens [T, T + n) of ``layout`` (T = its token count; rows past it are
    spare capacity, n <= :data:`APPEND_TOKENS`), projected on its bases as attention reads them
    and stored as :func:`store_quantized` stores (float32 coefficients as they are) -- for a
    pre-RoPE state (``rope``) each key first turned back to position 0 (spec/rope.md P2 step 1)
    from position first + T + t (spec/window.md W10). Writes only rows past T and, for int4 /
    int2, sets ``layout.key_tail`` to a new tail. True when done; False, with nothing written,
    where the kernels do not serve it (as :func:`store_quantized`: float32 work, so not a
    float64 state; blocks longer than APPEND_TOKENS). Coefficients beyond float16's range raise
    the oracle's ValueError with nothing the state reads changed."""
    T, n = layout.num_tokens, keys.shape[2]
    float32_work = layout.dtype in (torch.float32, torch.float16, torch.bfloat16)  # a float64 state computes in float64: the torch path
    rows = layout.key_coef.dtype == torch.float32 and layout.value_coef.dtype == torch.float32  # float32 coefficients, kept as they are
    if not ((layout.quantized or layout.low_bits or rows) and float32_work and n <= APPEND_TOKENS and keys.is_cpu and values.is_cpu and layout.key_coef.is_cpu):
        return False
    if layout.low_bits and (layout.key_tail.dtype != torch.float32 or not layout.key_tail.is_contiguous() or layout.group > MAX_STORE_GROUP):
        return False
    if _load() is None or max(layout.key_bases.shape[3], layout.value_bases.shape[3]) > MAX_STORE_RANK or (rope is not None and keys.shape[3] > MAX_DIM):
        return False
    sides = kernel_sides(layout)
    if sides is None:
        return False
    N, H, _, d = keys.shape
    d_v = values.shape[3]
    keys, values = keys.to(torch.float32).contiguous(), values.to(torch.float32).contiguous()
    key_basis = layout.decoded_bases("key", torch.float32)[:, :, 0].contiguous()  # (N, H, r, d), as attention reads them
    value_basis = layout.decoded_bases("value", torch.float32)[:, :, 0].contiguous()
    unrotation = None if rope is None else ctypes.byref(_unrotation(rope, d)[1])
    tail = torch.zeros_like(layout.key_tail) if layout.low_bits else None  # the state's own tail is never written
    magnitude = ctypes.c_double()
    rc = _load().static_append(
        _bits(layout), N * H, T, n, keys.data_ptr(), values.data_ptr(), d, d_v, key_basis.data_ptr(), value_basis.data_ptr(), unrotation,
        first, None if tail is None else layout.key_tail.data_ptr(), None if tail is None else tail.data_ptr(), ctypes.byref(sides[0]),
        ctypes.byref(sides[1]), ctypes.byref(magnitude),
    )  # fmt: skip
    if rc == -2:
        check_fp16_range(magnitude.value, magnitude.value)
    if rc != 0:
        raise RuntimeError(f"static_append returned {rc} for a layout it was told it serves")
    if tail is not None:
        layout.key_tail = tail
    return True


def softmax_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x (float32, contiguous) by the exponential of the kernels' softmax: for its tests."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    _load().softmax_exp(x.numel(), x.data_ptr(), out.data_ptr())
    return out
