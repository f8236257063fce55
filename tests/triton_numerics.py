"""The Triton interpreter computing 16-bit arithmetic as an NVIDIA GPU does, for the kernel tests
(tests/test_triton_kernels.py, tests/test_rope_decode.py)."""

from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def gpu_numerics(monkeypatch):
    """The interpreter computing 16-bit arithmetic as an NVIDIA GPU does: ``tl.dot`` of float16 /
    bfloat16 operands as exact products summed in float32 (the MMA with float32 accumulation,
    up to summation order), and float32 -> bfloat16 conversion rounded to nearest even (the
    interpreter multiplies bfloat16 bit patterns as integers, and truncates on conversion)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def as_float32(h):
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return h.data.astype(np.float32) if h.dtype.scalar == tl.float16 else h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if {a.dtype.scalar, b.dtype.scalar} & {tl.bfloat16, tl.float16}:
            return interpreter.TensorHandle(np.matmul(as_float32(a), as_float32(b), dtype=np.float32) + d.data, d.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.asarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            return interpreter.TensorHandle(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    with monkeypatch.context() as m:
        m.setattr(builder, "create_dot", create_dot)
        m.setattr(builder, "cast_impl", cast_impl)
        yield
