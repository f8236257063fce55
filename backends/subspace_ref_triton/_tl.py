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
def tile_codes(base, tok, rows, offs, n, stride, BITS: tl.constexpr, ROWS: tl.constexpr):
    """The codes (int32) of channels ``offs`` (those < ``n`` read) of the tokens ``tok`` whose
    ``rows`` are set, from packed rows ``stride`` bytes apart (spec/quantization.md Q2: code i of a
    row in bits [(i % P) BITS, (i % P + 1) BITS) of byte i // P, P = 8 / BITS); 0 elsewhere.

    ``ROWS``: each token's row is loaded whole (contiguous, vectorised bytes) and every code takes
    its byte from registers (``tl.gather``). Otherwise each code loads its own byte. On an H100
    (2026-11-27, docs/gpu.md) the row reads took 0.58x the time with 16-bit bases (int4, N = 8,
    T = 128k); with float32 bases they were not timed, and Triton 3.9's ptxas spills them (8 warps
    on sm_80), so float32 bases keep the byte loads. ``tl.interleave`` of the nibble planes was
    faster than the gather and gave wrong attention on the H100 (Triton 3.6) when the tile fed a
    16-bit tensor-core product at 16 channels, although the interpreter agreed with the oracle."""
    P: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WIDTH: tl.constexpr = offs.shape[0]
    if ROWS:
        offs_b = tl.arange(0, WIDTH // P)
        packed = tl.load(base + tok[:, None] * stride + offs_b[None, :], mask=rows[:, None] & (offs_b * P < n)[None, :], other=0).to(tl.int32)
        byte = tl.gather(packed, tl.broadcast_to((offs // P)[None, :], (packed.shape[0], WIDTH)), 1)
    else:
        byte = tl.load(base + tok[:, None] * stride + (offs // P)[None, :], mask=rows[:, None] & (offs < n)[None, :], other=0).to(tl.int32)
    return (byte >> ((offs % P) * BITS)[None, :]) & MASK


@triton.jit
def low_bit_tile(kc_base, vc_base, ks_base, kz_base, vs_base, vz_base, tail_base, tok, t_mask, offs_r, r_mask, offs_rv, rv_mask,
                 complete, kgroup, skc_t, svc_t, sks_t, svs_t, stl_t, r, r_v, BITS: tl.constexpr, ROWS: tl.constexpr):
    """Spec/quantization.md Q1-Q2 for the tokens ``tok`` of one tile: the key and value
    coefficients (float32) of an int4/int2 layout, x = code * s + z. code * s is exact in float32
    (a BITS-bit integer times a float16), so the one rounding of the sum (FMA or not) is the
    oracle's float64 sum rounded to float32. Keys of complete groups from their codes with their
    group's per-channel scale and zero; keys of the unfinished group from ``key_tail`` (state
    dtype; its rows past T are never read); values per token. Zero points share the strides of
    their scales. Codes: :func:`tile_codes` (``ROWS``: whole-row reads)."""
    coded = tok < complete
    k_m = (t_mask & coded)[:, None] & r_mask[None, :]
    kcode = tile_codes(kc_base, tok, t_mask & coded, offs_r, r, skc_t, BITS, ROWS).to(tl.float32)
    grp = tok // kgroup
    k_sc = tl.load(ks_base + grp[:, None] * sks_t + offs_r[None, :], mask=k_m, other=0.0).to(tl.float32)
    k_ze = tl.load(kz_base + grp[:, None] * sks_t + offs_r[None, :], mask=k_m, other=0.0).to(tl.float32)
    tail_m = (t_mask & (tok >= complete))[:, None] & r_mask[None, :]
    k_tl = tl.load(tail_base + (tok - complete)[:, None] * stl_t + offs_r[None, :], mask=tail_m, other=0.0).to(tl.float32)
    keys = tl.where(coded[:, None], kcode * k_sc + k_ze, k_tl)
    vcode = tile_codes(vc_base, tok, t_mask, offs_rv, r_v, svc_t, BITS, ROWS).to(tl.float32)
    v_sc = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    v_ze = tl.load(vz_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    return keys, vcode * v_sc[:, None] + v_ze[:, None]
