"""What the cupy backend supports (subspace_ref.capabilities), declared apart from its kernels."""

from __future__ import annotations

from subspace_ref.capabilities import SKETCH_VARIANTS, Capabilities
from subspace_ref.formats import MIXED_FORMATS, UNIFORM_FORMATS


def declared(dtypes: tuple[str, ...]) -> Capabilities:
    """The declaration for the kernel ``dtypes`` usable here. CuPy arrays and torch CUDA tensors
    (viewed through DLPack); native bases only (spec/storage.md S7); exact recent windows and
    attention sinks (spec/window.md W3, W7-W8: kernels/decode_attention.cu exact_partial, merged
    with the compressed splits); pre-RoPE static states (spec/rope.md P3, decode_rope_partial, positions
    from S per W10); float, int8, int4 or int2 coefficients (spec/quantization.md; int4/int2 are read
    by both decode kernels, plain and pre-RoPE; appends to them are refused before any change), for
    both sides or a format per side ("int4/int8", spec/quantization.md Q0: the kernels take the key
    and value coefficient types apart, KeyT and ValT, so every pair is one launch; appends to a
    pair without an int4/int2 side run the oracle's token loop). Adaptive and rotating appends run the oracle's token loop
    on CuPy arrays, so every sketch variant but lookahead (a window option) runs."""
    return Capabilities(
        array_families=("cupy", "torch"), devices=("cuda",), dtypes=dtypes, coefficient_formats=UNIFORM_FORMATS + MIXED_FORMATS, basis_formats=("native",),
        window=True, sinks=True, rope=True,
        sketch_variants=tuple(v for v in SKETCH_VARIANTS if v != "lookahead"),
    )
