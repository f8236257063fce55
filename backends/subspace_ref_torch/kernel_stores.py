"""The C kernels' appends: stores that quantise appended coefficients bit for bit as the other
paths do (``kernels/quantized_stores.c``: spec A10, spec/quantization.md Q1-Q2), and a decode
step's append to a static state, with projection and un-rotation of pre-RoPE keys before those
stores (``kernels/static_append.c``: spec A6, spec/rope.md P2). Each function returns False where
the kernels do not serve the call, for the caller's array operations (the same bits).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from subspace_ref.quantization import check_fp16_range
from subspace_ref_torch import kernel_library as lib

#: the store kernels' fixed buffers (MAX_RANK, MAX_GROUP in kernels/quantized_stores.c)
MAX_STORE_RANK = 512
MAX_STORE_GROUP = 128
#: the most tokens an append projects in the kernels: a decode step's few; a longer block (a
#: prefill) is one BLAS matmul (docs/benchmarks.md, "CPU kernels")
APPEND_TOKENS = 16


def store_quantized(layout, which: str, a: int, b: int, coef: torch.Tensor) -> bool:
    """Quantise coefficients into one side of ``layout`` by the store kernels.

    int8 with per-token scales (spec A10) bit for bit as ``subspace_ref.quantization.quantize_rows``; int4 / int2
    (spec Q2) bit for bit as ``subspace_ref.quantization.store_low_bit`` (keys: the groups
    completed, and a new ``key_tail`` holding the unfinished one). Each side in its own format.

    Parameters
    ----------
    layout : PackedLayout
    which : {"key", "value"}
    a, b : int
        The tokens [a, b) written.
    coef : torch.Tensor
        (N, H, b - a, r) coefficients.

    Returns
    -------
    bool
        True when done; False, with nothing written, where the kernels do not serve it (float
        sides, float32 coefficients and tail, CPU tensors lying in place, kernels built, ranks
        and groups within their buffers). int4 / int2 coefficients beyond float16's range raise
        the oracle's ValueError with nothing written.
    """
    fmt = layout.side_format(which)
    if not ((fmt.per_token_scale or fmt.low_bits) and coef.dtype == torch.float32 and coef.is_cpu and layout.key_coef.is_cpu):
        return False
    if which == "key" and fmt.low_bits and (layout.key_tail.dtype != torch.float32 or not layout.key_tail.is_contiguous() or layout.group > MAX_STORE_GROUP):
        return False
    kernels = lib.library()
    if kernels is None or coef.shape[-1] > MAX_STORE_RANK:
        return False
    sides = lib.kernel_sides(layout)
    if sides is None:
        return False
    side = sides[0 if which == "key" else 1]
    N, H = coef.shape[:2]
    coef = coef.contiguous()
    if not fmt.low_bits:
        kernels.int8_store(N * H, a, b - a, coef.data_ptr(), ctypes.byref(side))
        return True
    magnitude = ctypes.c_double()
    if which == "value":
        rc = kernels.low_bit_store_values(fmt.low_bits, N * H, a, b - a, coef.data_ptr(), ctypes.byref(side), ctypes.byref(magnitude))
    else:
        tail = torch.zeros_like(layout.key_tail)  # the state's own tail is never written
        rc = kernels.low_bit_store_keys(
            fmt.low_bits, N * H, a, b - a, coef.data_ptr(), layout.key_tail.data_ptr(), tail.data_ptr(), ctypes.byref(side), ctypes.byref(magnitude)
        )
    if rc == -2:
        check_fp16_range(magnitude.value, magnitude.value)
    if rc != 0:
        raise RuntimeError(f"low_bit_store_{which}s returned {rc} for a layout it was told it serves")
    if which == "key":
        layout.key_tail = tail
    return True


@functools.lru_cache(maxsize=64)
def _unrotation(rope, d: int) -> tuple[tuple[torch.Tensor, ...], lib.UnrotationStruct]:
    """The ``struct key_unrotation`` of ``rope`` for head size d, with the arrays it points into."""
    pairs = rope.planes(d)[: rope.inv_freq.size]
    held = (
        torch.tensor(pairs[:, 0], dtype=torch.int32),
        torch.tensor(pairs[:, 1], dtype=torch.int32),
        torch.tensor(rope.inv_freq, dtype=torch.float64),
    )
    a = float(rope.attention_scaling)
    return held, lib.UnrotationStruct(held[0].data_ptr(), held[1].data_ptr(), len(pairs), held[2].data_ptr(), a, a**2)


def static_append(layout, keys: torch.Tensor, values: torch.Tensor, rope, first: int) -> bool:
    """Spec A6 by the kernels (kernels/static_append.c) for a decode step's few tokens.

    Keys and values are appended at tokens [T, T + n) of ``layout`` (T its token count; rows past
    it are spare capacity), projected on its bases as attention reads them and stored as
    :func:`store_quantized` stores (float32 coefficients as they are); for a pre-RoPE state
    (``rope``) each key is first turned back to position 0 (spec/rope.md P2 step 1) from position
    first + T + t (spec/window.md W10). Writes only rows past T and, for int4 / int2 keys, sets
    ``layout.key_tail`` to a new tail. Each side in its own format.

    Parameters
    ----------
    layout : PackedLayout
    keys : torch.Tensor
        (N, H, n, d), n <= APPEND_TOKENS.
    values : torch.Tensor
        (N, H, n, d_v).
    rope : RopeParams or None
    first : int
        Position of compressed token 0.

    Returns
    -------
    bool
        True when done; False, with nothing written, where the kernels do not serve it (a
        float64 state, a float side not stored as float32, longer blocks, ...). Coefficients beyond float16's range
        raise the oracle's ValueError with nothing the state reads changed.
    """
    T, n = layout.num_tokens, keys.shape[2]
    float32_work = layout.dtype in (torch.float32, torch.float16, torch.bfloat16)  # a float64 state computes in float64: the torch path
    bits, value_bits = lib.side_bits(layout, "key"), lib.side_bits(layout, "value")
    if bits is None or value_bits is None or not (float32_work and n <= APPEND_TOKENS and keys.is_cpu and values.is_cpu and layout.key_coef.is_cpu):
        return False
    if layout.side_format("key").low_bits and (layout.key_tail.dtype != torch.float32 or not layout.key_tail.is_contiguous() or layout.group > MAX_STORE_GROUP):
        return False
    kernels = lib.library()
    if kernels is None or max(layout.key_bases.shape[3], layout.value_bases.shape[3]) > MAX_STORE_RANK or (rope is not None and keys.shape[3] > lib.MAX_DIM):
        return False
    sides = lib.kernel_sides(layout)
    if sides is None:
        return False
    N, H, _, d = keys.shape
    d_v = values.shape[3]
    keys, values = keys.to(torch.float32).contiguous(), values.to(torch.float32).contiguous()
    key_basis = layout.decoded_bases("key", torch.float32)[:, :, 0].contiguous()  # (N, H, r, d), as attention reads them
    value_basis = layout.decoded_bases("value", torch.float32)[:, :, 0].contiguous()
    unrotation = None if rope is None else ctypes.byref(_unrotation(rope, d)[1])
    tail = torch.zeros_like(layout.key_tail) if layout.side_format("key").low_bits else None  # the state's own tail is never written
    magnitude = ctypes.c_double()
    rc = kernels.static_append(
        bits, value_bits, N * H, T, n, keys.data_ptr(), values.data_ptr(), d, d_v, key_basis.data_ptr(), value_basis.data_ptr(), unrotation,
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


__all__ = ["APPEND_TOKENS", "MAX_STORE_GROUP", "MAX_STORE_RANK", "static_append", "store_quantized"]
