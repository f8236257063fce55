"""The CPU kernels of ``kernels/coefficient_products.c``: decode products over int8, int4 and int2
coefficients, dequantised in registers (spec R14). Built with the host C compiler at first use
(``subspace_ref.host_build``) and called through ctypes on CPU tensors.

Without a C compiler, or with ``SUBSPACE_REF_CPU_KERNELS=0``, :func:`availability` says why and
the attend path dequantises tiles with torch operations instead: the same numbers to within
float32 rounding order, several times slower (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import torch

from subspace_ref.host_build import build_shared_library

SOURCE = Path(__file__).resolve().parent / "kernels" / "coefficient_products.c"
FLAGS = ["-std=c11", "-O3", "-march=native", "-fopenmp-simd"]
#: the kernel's fixed buffers (MAX_BYTES, MAX_QUERIES in the source)
MAX_ROW_BYTES = 256
MAX_QUERIES = 64

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_SIGNATURES = {
    "int8_logits": [_i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "low_bit_logits": [ctypes.c_int, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64],
    "code_value_sums": [ctypes.c_int, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr],
}


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _load() -> ctypes.CDLL | None:
    global _library, _failure
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        if os.environ.get("SUBSPACE_REF_CPU_KERNELS", "1") == "0":
            _failure = "disabled by SUBSPACE_REF_CPU_KERNELS=0"
        elif compiler() is None:
            _failure = "no C compiler (cc, gcc, clang or $CC) to build kernels/coefficient_products.c"
        else:
            try:
                lib = ctypes.CDLL(str(build_shared_library(SOURCE.read_text(), compiler(), FLAGS, "coefficient_products")))
            except (OSError, RuntimeError) as e:
                _failure = f"kernels/coefficient_products.c did not build: {e}"
            else:
                for name, args in _SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes = args
                    fn.restype = ctypes.c_int
                _library = lib
        return _library


def availability() -> tuple[bool, str]:
    """(True, "") when the kernels are built and loaded, else (False, why)."""
    return (True, "") if _load() is not None else (False, _failure or "")


def applies(queries: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether the kernels serve float32 ``queries`` (N, H, g, ...) against ``codes`` (N, H, T, row
    bytes): CPU tensors within the kernels' limits, kernels available. Elsewhere attend takes
    its torch-operations path."""
    return (
        queries.device.type == "cpu"
        and codes.device.type == "cpu"
        and queries.dtype == torch.float32
        and queries.shape[2] <= MAX_QUERIES
        and codes.shape[-1] <= MAX_ROW_BYTES
        and _load() is not None
    )


def _heads(x: torch.Tensor, rows: int, packed: bool) -> tuple[torch.Tensor, int, int]:
    """(x', head stride, row stride) for an (N, H, >= rows, ...) operand: x itself when its last
    dim is contiguous, its (N, H) heads evenly spaced and (``packed``) its rows back to back, as
    the kernel reads them; else a contiguous copy of its first ``rows`` rows."""
    N, H = x.shape[:2]
    even = x.stride(-1) == 1 and (N == 1 or x.stride(0) == H * x.stride(1))
    if not even or (packed and x.dim() == 4 and x.stride(2) != x.shape[3]):
        x = x[:, :, :rows].contiguous() if packed else x.contiguous()
    return x, x.stride(1), x.stride(2) if x.dim() == 4 else 1


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise ValueError(f"{name}: shape beyond the CPU kernel's limits (row bytes <= {MAX_ROW_BYTES}, query heads per KV head <= {MAX_QUERIES})")


def int8_logits(q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, T: int) -> torch.Tensor:
    """Spec A10 logits (N, H, g, T): scale_t (q . code_t) for q (N, H, g, r) float32, codes
    (N, H, >= T, r) int8 and per-token scales (N, H, >= T) float32."""
    N, H, g, r = q.shape
    q = q.contiguous()
    out = torch.empty((N, H, g, T), dtype=torch.float32)
    codes, codes_stride, _ = _heads(codes, T, packed=True)
    scale, scale_stride, _ = _heads(scale, T, packed=True)
    rc = _load().int8_logits(N * H, g, r, T, q.data_ptr(), codes.data_ptr(), codes_stride, scale.data_ptr(), scale_stride, out.data_ptr(), g * T, T)
    _check(rc, "int8_logits")
    return out


def low_bit_logits(
    q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int, tokens: int, out: torch.Tensor
) -> None:
    """Spec Q2 logits of the first ``tokens`` (whole groups of ``group``) keys, written into
    ``out[..., :tokens]`` (out (N, H, g, >= tokens) float32, contiguous): q . fl32(code_t s_G + z_G)
    for q (N, H, g, r) float32, packed codes (N, H, >= tokens, width) uint8 and per-group,
    per-channel float16 scale and zero (N, H, >= tokens / group, r), widened in the kernel."""
    N, H, g, r = q.shape
    groups = tokens // group
    q = q.contiguous()
    scale, scale_stride, _ = _heads(scale, groups, packed=True)
    zero, zero_stride, _ = _heads(zero, groups, packed=True)
    if zero_stride != scale_stride or scale.dtype != torch.float16 or zero.dtype != torch.float16:
        raise ValueError(f"scale and zero must be float16 arrays of one layout (spec/quantization.md Q2), got {scale.dtype}, {zero.dtype}")
    codes, codes_stride, _ = _heads(codes, tokens, packed=True)
    rc = _load().low_bit_logits(
        bits, N * H, g, r, groups, group, q.data_ptr(), codes.data_ptr(), codes_stride, codes.shape[-1],
        scale.data_ptr(), zero.data_ptr(), scale_stride, out.data_ptr(), out.stride(1), out.stride(2),
    )  # fmt: skip
    _check(rc, "low_bit_logits")


def code_value_sums(
    w: torch.Tensor, codes: torch.Tensor, bits: int, rank: int, tile: int, scale: torch.Tensor | None = None, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_t w_t x_t (N, H, g, rank) float32 for weights w (N, H, g, T) float32 and codes (N, H,
    >= T, width): int8 (x = the codes; per-token scales already folded into w), or uint8 packing
    int4 / int2 codes, read as fl32(code s_t + z_t) with per-token float16 ``scale`` and ``zero``
    (N, H, >= T), widened in the kernel. Summed per tile of ``tile`` tokens, then over tiles."""
    N, H, g, T = w.shape
    w, w_head_stride, w_row_stride = _heads(w, T, packed=False)
    codes, codes_stride, _ = _heads(codes, T, packed=True)
    token_stride = 0
    if bits != 8:
        scale, token_stride, _ = _heads(scale, T, packed=True)
        zero, zero_stride, _ = _heads(zero, T, packed=True)
        if zero_stride != token_stride or scale.dtype != torch.float16 or zero.dtype != torch.float16:
            raise ValueError(f"scale and zero must be float16 arrays of one layout (spec/quantization.md Q2), got {scale.dtype}, {zero.dtype}")
    sums = torch.empty((N, H, g, rank), dtype=torch.float32)
    rc = _load().code_value_sums(
        bits, N * H, g, rank, T, w.data_ptr(), w_head_stride, w_row_stride, codes.data_ptr(), codes_stride, codes.shape[-1],
        None if bits == 8 else scale.data_ptr(), None if bits == 8 else zero.data_ptr(), token_stride, tile, sums.data_ptr(),
    )  # fmt: skip
    _check(rc, "code_value_sums")
    return sums
