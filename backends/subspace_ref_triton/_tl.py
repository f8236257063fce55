"""Triton device helpers shared by the kernels (imported lazily: see ``_common.interpreting``)."""

from __future__ import annotations

import triton
import triton.language as tl

# The combine functions behind tl.max / tl.sum. ``tl.reduce(x, axis, MAX_COMBINE)`` is the same
# reduction as ``tl.max(x, axis)`` for float32, but the interpreter runs it in NumPy without a
# nested jit call: tl.max, tl.sum and tl.zeros are @triton.jit functions, and the interpreter
# re-patches triton.language on every call of one (most of the interpreted run time of a
# many-chunk state went there). Compiled kernels are unaffected either way.
MAX_COMBINE = getattr(tl.standard, "_elementwise_max", None)
SUM_COMBINE = getattr(tl.standard, "_sum_combine", None)
if MAX_COMBINE is None:  # a Triton without these private names: same results, slower interpreter

    @triton.jit
    def MAX_COMBINE(a, b):
        return tl.maximum(a, b)


if SUM_COMBINE is None:

    @triton.jit
    def SUM_COMBINE(a, b):
        return a + b


@triton.jit
def bf16_rtne(x):
    """float32 -> bfloat16, rounded to nearest even, by integer arithmetic on the bits.

    The GPU's ``x.to(tl.bfloat16)`` already rounds this way; the CPU interpreter truncates
    (and its explicit "rtne" mode mishandles mantissa carries), which would make interpreted
    results differ from torch's rounding by one unit in the last place. Finite inputs only.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_storage(x, ptr, MANUAL_BF16: tl.constexpr):
    """``x`` (float32) in the element type of ``ptr``, rounded to nearest even."""
    if MANUAL_BF16:
        out = bf16_rtne(x)
    else:
        out = x.to(ptr.dtype.element_ty)
    return out
