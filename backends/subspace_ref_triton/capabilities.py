"""What the triton backend supports (subspace_ref.capabilities), declared apart from its kernels."""

from __future__ import annotations

from subspace_ref.capabilities import Capabilities
from subspace_ref.formats import MIXED_FORMATS, UNIFORM_FORMATS
from subspace_ref_triton._common import (
    MAX_GROUP,
    MAX_HEAD_SIZE,
    MAX_RANK,
    SUPPORTED_DTYPES,
)


def declared(devices: tuple[str, ...]) -> Capabilities:
    """The declaration on ``devices`` (the CPU only under TRITON_INTERPRET=1). Attend decodes
    encoded bases before the launch (spec/storage.md S2); appends of adaptive and rotating
    states run the torch backend's, so no sketch variant; exact windows and sinks
    (spec/window.md W3, W7-W8) through window_decode.py; pre-RoPE states (spec/rope.md P2-P3) through rope_decode.py; the decode kernels read float,
    int8 (spec A10) and int4/int2 coefficients (spec/quantization.md Q2, unpacked and dequantised
    in the kernel; their appends are the torch backend's), and every pair of them with a format
    per side (spec/quantization.md Q0: the kernels take the key side's and the value side's
    format as separate constexprs, one launch per split as for one format; appends are the torch
    backend's); tiles bound the head sizes, ranks and group."""
    return Capabilities(
        array_families=("torch",), devices=devices, dtypes=SUPPORTED_DTYPES, coefficient_formats=UNIFORM_FORMATS + MIXED_FORMATS,
        max_head_size=MAX_HEAD_SIZE, max_rank=MAX_RANK, max_query_group=MAX_GROUP, rope=True, window=True, sinks=True, sketch_variants=("trigger", "byte_ceiling", "track"),
    )
