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


@triton.jit
def unpack_codes(packed, BITS: tl.constexpr):
    """The codes of a tile of packed rows (spec/quantization.md Q2: code i of a row in bits
    [(i % P) BITS, (i % P + 1) BITS) of byte i // P, P = 8 / BITS), as int32, channels in order.

    The rows are loaded whole (contiguous bytes, vectorised) and each code picks its byte from
    registers (``tl.gather``). Loading one byte per code, as before, took 1.7x the time on an
    H100 (docs/gpu.md, 2026-11-27). ``tl.interleave`` of the nibble planes was faster still, but
    with Triton 3.6 on the H100 it gave wrong attention (errors ~0.5) when the tile fed a 16-bit
    tensor-core product at R = 16 (44 GPU tests failed; the interpreter agreed with the oracle);
    broadcasting and reshaping was correct and slower than the gather."""
    packed = packed.to(tl.int32)
    MASK: tl.constexpr = (1 << BITS) - 1
    P: tl.constexpr = 8 // BITS
    offs = tl.arange(0, packed.shape[1] * P)
    idx = tl.broadcast_to((offs // P)[None, :], (packed.shape[0], packed.shape[1] * P))
    codes = (tl.gather(packed, idx, 1) >> ((offs % P) * BITS)[None, :]) & MASK
    return codes


@triton.jit
def low_bit_tile(kc_base, vc_base, ks_base, kz_base, vs_base, vz_base, tail_base, tok, t_mask, offs_r, r_mask, offs_rv, rv_mask,
                 complete, kgroup, skc_t, svc_t, sks_t, svs_t, stl_t, r, r_v, BITS: tl.constexpr, R: tl.constexpr, RV: tl.constexpr):
    """Spec/quantization.md Q1-Q2 for the tokens ``tok`` of one tile: the key and value
    coefficients (float32) of an int4/int2 layout, x = code * s + z. code * s is exact in float32
    (a BITS-bit integer times a float16), so the one rounding of the sum (FMA or not) is the
    oracle's float64 sum rounded to float32. Keys of complete groups from their codes with their
    group's per-channel scale and zero; keys of the unfinished group from ``key_tail`` (state
    dtype; its rows past T are never read); values per token. Zero points share the strides of
    their scales. Codes are read as whole packed rows (R / P bytes per token, contiguous) and
    unpacked in registers (:func:`unpack_codes`)."""
    P: tl.constexpr = 8 // BITS
    coded = tok < complete
    k_m = (t_mask & coded)[:, None] & r_mask[None, :]
    offs_kb = tl.arange(0, R // P)
    kbytes = tl.load(kc_base + tok[:, None] * skc_t + offs_kb[None, :], mask=(t_mask & coded)[:, None] & (offs_kb * P < r)[None, :], other=0)
    kcode = unpack_codes(kbytes, BITS).to(tl.float32)
    grp = tok // kgroup
    k_sc = tl.load(ks_base + grp[:, None] * sks_t + offs_r[None, :], mask=k_m, other=0.0).to(tl.float32)
    k_ze = tl.load(kz_base + grp[:, None] * sks_t + offs_r[None, :], mask=k_m, other=0.0).to(tl.float32)
    tail_m = (t_mask & (tok >= complete))[:, None] & r_mask[None, :]
    k_tl = tl.load(tail_base + (tok - complete)[:, None] * stl_t + offs_r[None, :], mask=tail_m, other=0.0).to(tl.float32)
    keys = tl.where(coded[:, None], kcode * k_sc + k_ze, k_tl)
    offs_vb = tl.arange(0, RV // P)
    vbytes = tl.load(vc_base + tok[:, None] * svc_t + offs_vb[None, :], mask=t_mask[:, None] & (offs_vb * P < r_v)[None, :], other=0)
    vcode = unpack_codes(vbytes, BITS).to(tl.float32)
    v_sc = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    v_ze = tl.load(vz_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    return keys, vcode * v_sc[:, None] + v_ze[:, None]
