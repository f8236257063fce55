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
    its byte from registers (``tl.gather``). Otherwise each code loads its own byte. With 16-bit
    bases the row reads timed faster on an H100 (docs/gpu.md, "int4/int2 tiles read as whole
    rows"); with float32 bases they were not timed, and Triton 3.9's ptxas spills them (8 warps on
    sm_80), so float32 bases keep the byte loads. ``tl.interleave`` of the nibble planes gave wrong
    attention on the H100 (Triton 3.6) when the tile fed a 16-bit tensor-core product at 16
    channels, although the interpreter agreed with the oracle (same section)."""
    P: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WIDTH: tl.constexpr = offs.shape[0]
    if ROWS:
        offs_b = tl.arange(0, WIDTH // P)
        packed = tl.load(base + tok[:, None] * stride + offs_b[None, :], mask=rows[:, None] & (offs_b * P < n)[None, :], other=0).to(tl.int32)  # sass: codes
        byte = tl.gather(packed, tl.broadcast_to((offs // P)[None, :], (packed.shape[0], WIDTH)), 1)
    else:
        byte = tl.load(base + tok[:, None] * stride + (offs // P)[None, :], mask=rows[:, None] & (offs < n)[None, :], other=0).to(tl.int32)  # sass: codes
    return (byte >> ((offs % P) * BITS)[None, :]) & MASK


@triton.jit
def _code_pair(words, SHIFT: tl.constexpr, BITS: tl.constexpr, COEF: tl.constexpr, INTERPRETED: tl.constexpr, RAW: tl.constexpr = False):
    """Codes ``SHIFT`` and ``SHIFT + 16 / BITS`` of each 32-bit word (``32 / BITS`` codes, code i
    in bits [i BITS, (i + 1) BITS)) minus M = 2^(BITS-1), as two ``COEF`` tensors: a code c ORed
    into the mantissa of B = 2^7 (bfloat16) or 2^10 (float16) is B + c, exactly, and one
    subtraction removes both (docs/gpu.md, "Static budgets"). ``RAW``: B + c, the subtraction left
    to the caller."""
    tl.static_assert(COEF == tl.bfloat16 or COEF == tl.float16)
    BASE: tl.constexpr = 128.0 if COEF == tl.bfloat16 else 1024.0  # float16: ORed into the mantissa of 2^10
    MAGIC: tl.constexpr = 0x43004300 if COEF == tl.bfloat16 else 0x64006400
    OFFSET: tl.constexpr = BASE + (1 << (BITS - 1))
    PAIR: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    h = ((words >> (BITS * SHIFT)) & PAIR) | MAGIC
    lo = (h & 0xFFFF).to(tl.uint16).to(COEF, bitcast=True)
    hi = (h >> 16).to(tl.uint16).to(COEF, bitcast=True)
    if RAW:
        return lo, hi
    elif INTERPRETED:  # the interpreter's bfloat16 arithmetic works on the bits: subtract in float32
        return (lo.to(tl.float32) - OFFSET).to(COEF), (hi.to(tl.float32) - OFFSET).to(COEF)
    else:
        return lo - OFFSET, hi - OFFSET


@triton.jit
def centred_words(base, tok, rows, stride_words, WIDTH: tl.constexpr, BITS: tl.constexpr, COEF: tl.constexpr, INTERPRETED: tl.constexpr):
    """``c - M`` (spec/quantization.md Q6, M = 2^(BITS-1)) of the WIDTH int4/int2 channels of the
    tokens ``tok`` whose ``rows`` are set, in ``COEF`` (exact), read as 32-bit words (``base`` a
    uint32 pointer, ``stride_words`` between rows), channels in the order :func:`word_order`."""
    offs_w = tl.arange(0, WIDTH * BITS // 32)
    # VEC words contiguous per load (int4: 8 bytes, int2: 4): the joins below took the fewest
    # instructions in the layouts of these loads (wider ones too are compiled into more)
    VEC: tl.constexpr = 2 if BITS == 4 else 1
    offs_w = offs_w % VEC + offs_w // VEC * VEC
    words = tl.load(base + tok[:, None] * stride_words + offs_w[None, :], mask=rows[:, None], other=0)  # sass: codes
    return _centred_decode(words, WIDTH, BITS, COEF, INTERPRETED)


@triton.jit
def centred_pair_words(base, tok, stride_words, OFFSET: tl.constexpr, WIDTH: tl.constexpr, BITS: tl.constexpr, COEF: tl.constexpr,
                       INTERPRETED: tl.constexpr, VEC: tl.constexpr = 2, RAW: tl.constexpr = False, WIDE: tl.constexpr = False):
    """:func:`centred_words` of two tokens a row, unmasked: row i holds the WIDTH channels of token
    ``tok[i]`` then those of token ``tok[i] + OFFSET`` (2 WIDTH columns; column p is channel
    ``word_order(p) % WIDTH`` of the token ``tok[i] + OFFSET * (p // WIDTH)``). ``WIDE``: each
    row's words read in pairs as 64-bit loads (rows and ``base`` 8-byte aligned, an even number of
    words a row); otherwise VEC words a load. ``RAW``: B + c (:func:`_code_pair`)."""
    WPR: tl.constexpr = WIDTH * BITS // 32
    if WIDE:  # pairs of words as one 64-bit load (rows 8-byte aligned), split in registers
        offs_d = tl.arange(0, WPR // 2)
        rows = (tok[:, None] + OFFSET * tl.arange(0, 2)[None, :]) * (stride_words // 2)
        dw = tl.load(base.to(tl.pointer_type(tl.uint64)) + rows[:, :, None] + offs_d[None, None, :])  # sass: codes
        words = tl.join((dw & 0xFFFFFFFF).to(tl.uint32), (dw >> 32).to(tl.uint32))
    else:
        offs_w = tl.arange(0, WPR)
        offs_w = offs_w % VEC + offs_w // VEC * VEC
        rows = (tok[:, None] + OFFSET * tl.arange(0, 2)[None, :]) * stride_words
        words = tl.load(base + rows[:, :, None] + offs_w[None, None, :])  # sass: codes
    return _centred_decode(tl.reshape(words, (tok.shape[0], 2 * WPR)), 2 * WIDTH, BITS, COEF, INTERPRETED, RAW)


@triton.jit
def _centred_decode(words, WIDTH: tl.constexpr, BITS: tl.constexpr, COEF: tl.constexpr, INTERPRETED: tl.constexpr, RAW: tl.constexpr = False):
    """The rows of 32-bit ``words`` as WIDTH channels ``c - M`` each (:func:`centred_words`; ``RAW``:
    B + c instead, exact too: :func:`_code_pair`)."""
    l0, h0 = _code_pair(words, 0, BITS, COEF, INTERPRETED, RAW)
    l1, h1 = _code_pair(words, 1, BITS, COEF, INTERPRETED, RAW)
    l2, h2 = _code_pair(words, 2, BITS, COEF, INTERPRETED, RAW)
    l3, h3 = _code_pair(words, 3, BITS, COEF, INTERPRETED, RAW)
    lo = tl.join(tl.join(l0, l1), tl.join(l2, l3))
    hi = tl.join(tl.join(h0, h1), tl.join(h2, h3))
    if BITS == 2:
        l4, h4 = _code_pair(words, 4, BITS, COEF, INTERPRETED, RAW)
        l5, h5 = _code_pair(words, 5, BITS, COEF, INTERPRETED, RAW)
        l6, h6 = _code_pair(words, 6, BITS, COEF, INTERPRETED, RAW)
        l7, h7 = _code_pair(words, 7, BITS, COEF, INTERPRETED, RAW)
        lo = tl.join(lo, tl.join(tl.join(l4, l5), tl.join(l6, l7)))
        hi = tl.join(hi, tl.join(tl.join(h4, h5), tl.join(h6, h7)))
    # (t, k, c0, c1[, c2], h) -> code c0 + 2 c1 [+ 4 c2] + 16 h / BITS of word k (word_order): a
    # word's two halves side by side, as the 32-bit pair the bit trick built
    y = tl.join(lo, hi)
    return tl.reshape(y, (words.shape[0], WIDTH))


@triton.jit
def int4_word_order(offs):
    """The channel at each position of an int4 row of :func:`centred_words`: bits 0 and 1 swapped."""
    return (offs & ~3) | ((offs & 1) << 1) | ((offs >> 1) & 1)


@triton.jit
def word_order(offs, BITS: tl.constexpr):
    """The channel at each position of :func:`centred_words`' rows: the low bits of the position
    within its word reversed (int4: 3 bits, int2: 4)."""
    if BITS == 4:
        out = (offs & ~7) | ((offs & 1) << 2) | (offs & 2) | ((offs >> 2) & 1)
    else:
        out = (offs & ~15) | ((offs & 1) << 3) | ((offs & 2) << 1) | ((offs >> 1) & 2) | ((offs >> 3) & 1)
    return out


@triton.jit
def low_bit_keys(kc_base, ks_base, kz_base, tail_base, tok, t_mask, offs_r, r_mask, complete, kgroup, skc_t, sks_t, stl_t, r,
                 BITS: tl.constexpr, ROWS: tl.constexpr):
    """Spec/quantization.md Q1-Q2 for the keys of the tokens ``tok`` of one tile (float32), an
    int4/int2 key side, x = code * s + z. code * s is exact in float32 (a BITS-bit integer times a
    float16), so the one rounding of the sum (FMA or not) is the oracle's float64 sum rounded to
    float32. Keys of complete groups from their codes with their group's per-channel scale and
    zero; keys of the unfinished group from ``key_tail`` (state dtype; its rows past T are never
    read). Zero points share the strides of their scales. Codes: :func:`tile_codes` (``ROWS``:
    whole-row reads)."""
    coded = tok < complete
    k_m = (t_mask & coded)[:, None] & r_mask[None, :]
    kcode = tile_codes(kc_base, tok, t_mask & coded, offs_r, r, skc_t, BITS, ROWS).to(tl.float32)
    grp = tok // kgroup
    k_sc = tl.load(ks_base + grp[:, None] * sks_t + offs_r[None, :], mask=k_m, other=0.0).to(tl.float32)
    k_ze = tl.load(kz_base + grp[:, None] * sks_t + offs_r[None, :], mask=k_m, other=0.0).to(tl.float32)
    tail_m = (t_mask & (tok >= complete))[:, None] & r_mask[None, :]
    k_tl = tl.load(tail_base + (tok - complete)[:, None] * stl_t + offs_r[None, :], mask=tail_m, other=0.0).to(tl.float32)
    return tl.where(coded[:, None], kcode * k_sc + k_ze, k_tl)


@triton.jit
def low_bit_values(vc_base, vs_base, vz_base, tok, t_mask, offs_rv, r_v, svc_t, svs_t, BITS: tl.constexpr, ROWS: tl.constexpr):
    """Spec/quantization.md Q1-Q2 for the values of the tokens ``tok`` of one tile (float32), an
    int4/int2 value side: per token, x = code * s + z (rounded once, as :func:`low_bit_keys`)."""
    vcode = tile_codes(vc_base, tok, t_mask, offs_rv, r_v, svc_t, BITS, ROWS).to(tl.float32)
    v_sc = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    v_ze = tl.load(vz_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    return vcode * v_sc[:, None] + v_ze[:, None]


@triton.jit
def split3(x, DT: tl.constexpr):
    """float32 ``x`` as hi + mid + lo in the 16-bit type ``DT``: their sum is x to float32's
    precision, so three 16-bit tensor-core products give a float32 product (docs/gpu.md)."""
    hi = x.to(DT)
    rest = x - hi.to(tl.float32)
    mid = rest.to(DT)
    lo = (rest - mid.to(tl.float32)).to(DT)
    return hi, mid, lo


@triton.jit
def split3_bits(x):
    """float32 ``x`` as hi + mid + lo in bfloat16, each the top 16 bits of what is left: exact
    (8 + 8 + 8 significant bits), and no rounding arithmetic, only masks and two subtractions."""
    hb = x.to(tl.uint32, bitcast=True) & 0xFFFF0000
    rest = x - hb.to(tl.float32, bitcast=True)
    mb = rest.to(tl.uint32, bitcast=True) & 0xFFFF0000
    lb = (rest - mb.to(tl.float32, bitcast=True)).to(tl.uint32, bitcast=True)
    return ((hb >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), (mb >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True),
            (lb >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def exp2_ftz(x, INTERPRETED: tl.constexpr):
    """2^x in float32 by one MUFU.EX2 (``ex2.approx.ftz``: results below 2^-126 flush to 0, far
    below a softmax weight's float32 resolution against its row's maximum of 1)."""
    if INTERPRETED:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def int8_as_f16(x, INTERPRETED: tl.constexpr):
    """int8 codes as float16, exactly, four per 32-bit word: each byte with its sign bit flipped
    (c + 128) put under the exponent of 1024 (1024 + c + 128), minus 1152 by pairs."""
    if INTERPRETED:
        return x.to(tl.float32).to(tl.float16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, k; xor.b32 t, $2, 0x80808080; mov.b32 k, 0x64806480; prmt.b32 $0, t, 0x64646464, 0x5140; "
            "prmt.b32 $1, t, 0x64646464, 0x5342; sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; }",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
