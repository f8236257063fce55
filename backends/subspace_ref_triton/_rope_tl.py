"""Triton device helpers of the pre-RoPE decode kernel (:mod:`subspace_ref_triton.rope_decode`):
coefficient codes read as 32-bit words and turned into exact 16-bit numbers by bit operations
(no per-code conversion instruction, no per-byte load); the keys' rotation in packed bfloat16."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_words(base, tok, rows, stride, NWORDS: tl.constexpr, ALIGN: tl.constexpr):
    """(T, NWORDS) uint32: the first NWORDS 32-bit words of the rows ``stride`` bytes apart from
    ``base`` of the tokens ``tok`` whose ``rows`` are set (0 elsewhere); ``ALIGN``: the bytes (4, 8
    or 16) that rows, their length and ``base`` are multiples of (wider loads)."""
    offs = tl.arange(0, NWORDS)
    step = tl.multiple_of(stride // 4, ALIGN // 4)
    return tl.load(base.to(tl.pointer_type(tl.uint32)) + tok[:, None] * step + offs[None, :], mask=rows[:, None], other=0)  # sass: codes


@triton.jit
def _int8_pair(words, INTERPRETED: tl.constexpr):
    """Bytes 0 and 2 of each 32-bit word, read as int8, as two bfloat16 tensors (exact): the low 7
    bits ORed into the mantissa of 2^7 are 128 + (q & 127), the sign bit gives 128 or 256, and
    one subtraction of the two is q."""
    MAGIC: tl.constexpr = 0x43004300
    a = (words & 0x007F007F) | MAGIC
    b = (words & 0x00800080) | MAGIC
    a_lo = (a & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    a_hi = (a >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    b_lo = (b & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    b_hi = (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if INTERPRETED:  # the interpreter's bfloat16 arithmetic works on the bits: subtract in float32
        return (a_lo.to(tl.float32) - b_lo.to(tl.float32)).to(tl.bfloat16), (a_hi.to(tl.float32) - b_hi.to(tl.float32)).to(tl.bfloat16)
    else:
        return a_lo - b_lo, a_hi - b_hi


@triton.jit
def int8_words(base, tok, rows, stride, WIDTH: tl.constexpr, ALIGN: tl.constexpr, INTERPRETED: tl.constexpr):
    """The WIDTH int8 codes (spec A10) of the tokens ``tok`` whose ``rows`` are set, as bfloat16
    (exact: |q| <= 128), read as words (:func:`load_words`, rows ``stride`` bytes apart), channels
    in the order of :func:`subspace_ref_triton._tl.int4_word_order` (in each 4: 0, 2, 1, 3; a
    register holds a subtraction's pair); 0 elsewhere."""
    words = load_words(base, tok, rows, stride, WIDTH // 4, ALIGN)
    e0, e2 = _int8_pair(words, INTERPRETED)
    o1, o3 = _int8_pair(words >> 8, INTERPRETED)
    # (t, w, i, j) -> byte i + 2j of word w, at position 4w + 2i + j
    return tl.reshape(tl.join(tl.join(e0, o1), tl.join(e2, o3)), (tok.shape[0], WIDTH))


@triton.jit
def _code_pair(words, SHIFT: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """Codes ``SHIFT`` and ``SHIFT + 16 / BITS`` of each 32-bit word (code i in bits [i BITS, (i + 1)
    BITS)) as two ``DT`` tensors, exact: a code ORed into the mantissa of 1024 (float16) or 128
    (bfloat16) is 1024 + c or 128 + c, and one subtraction leaves c (float16) or the centred
    c - 2^(BITS-1) (bfloat16, spec/quantization.md Q6)."""
    if DT == tl.float16:
        MAGIC: tl.constexpr = 0x64006400
        OFFSET: tl.constexpr = 1024.0
    else:
        MAGIC: tl.constexpr = 0x43004300
        OFFSET: tl.constexpr = 128.0 + (1 << (BITS - 1))
    PAIR: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    h = ((words >> (BITS * SHIFT)) & PAIR) | MAGIC
    lo = (h & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
    hi = (h >> 16).to(tl.uint16).to(DT, bitcast=True)
    if INTERPRETED:  # the interpreter's bfloat16 arithmetic works on the bits: subtract in float32 (exact either way)
        return (lo.to(tl.float32) - OFFSET).to(DT), (hi.to(tl.float32) - OFFSET).to(DT)
    else:
        return lo - OFFSET, hi - OFFSET


@triton.jit
def _pair(words, SHIFT: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    lo, hi = _code_pair(words, SHIFT, BITS, DT, INTERPRETED)
    return tl.join(lo, hi)


@triton.jit
def _word_codes(words, BITS: tl.constexpr, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The 32 / BITS codes of each 32-bit word as (..., 2, 2, 2[, 2]) in their stored order: each
    join appends an axis, so the innermost (the pair of codes c and c + 16 / BITS) is the most
    significant, (..., a, b, c) -> code 4a + 2b + c (int4; int2 likewise on four axes)."""
    if BITS == 4:
        y = tl.join(tl.join(_pair(words, 0, 4, DT, INTERPRETED), _pair(words, 2, 4, DT, INTERPRETED)),
                    tl.join(_pair(words, 1, 4, DT, INTERPRETED), _pair(words, 3, 4, DT, INTERPRETED)))
    else:
        tl.static_assert(BITS == 2)
        y = tl.join(tl.join(tl.join(_pair(words, 0, 2, DT, INTERPRETED), _pair(words, 4, 2, DT, INTERPRETED)),
                            tl.join(_pair(words, 2, 2, DT, INTERPRETED), _pair(words, 6, 2, DT, INTERPRETED))),
                    tl.join(tl.join(_pair(words, 1, 2, DT, INTERPRETED), _pair(words, 5, 2, DT, INTERPRETED)),
                            tl.join(_pair(words, 3, 2, DT, INTERPRETED), _pair(words, 7, 2, DT, INTERPRETED))))
    return y


@triton.jit
def low_bit_words(words, BITS: tl.constexpr, DT: tl.constexpr, INTERPRETED: tl.constexpr, PAIRED: tl.constexpr = False):
    """The int4 or int2 codes (spec/quantization.md Q2) of rows of 32-bit ``words`` (T, n), (T, n 32 /
    BITS) in their stored order, as :func:`_code_pair` gives them in ``DT`` (float16: c; bfloat16:
    c - 2^(BITS-1)). ``PAIRED``: in the order of :func:`subspace_ref_triton._tl.word_order` instead (each 32-bit register
    holds the two codes one bit operation gave: fewer instructions where any order will do)."""
    T: tl.constexpr = words.shape[0]
    WIDTH: tl.constexpr = words.shape[1] * 32 // BITS
    y = _word_codes(words, BITS, DT, INTERPRETED)
    if PAIRED:
        if BITS == 4:
            y = tl.permute(y, (0, 1, 4, 3, 2))
        else:
            y = tl.permute(y, (0, 1, 5, 4, 3, 2))
    return tl.reshape(y, (T, WIDTH))


@triton.jit
def _less(bits, DT: tl.constexpr, OFFSET: tl.constexpr, INTERPRETED: tl.constexpr):
    """uint16 ``bits`` read as ``DT``, less ``OFFSET`` (exact: the magic numbers' subtraction)."""
    x = bits.to(DT, bitcast=True)
    if INTERPRETED:  # the interpreter's 16-bit arithmetic works on the bits: subtract in float32 (exact either way)
        out = (x.to(tl.float32) - OFFSET).to(DT)
    else:
        out = x - OFFSET
    return out


@triton.jit
def _shift_bits(words, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """The codes of (T, n) 32-bit ``words`` in their stored order, (T, n 32 / BITS) uint16, each ORed
    into ``MAGIC``'s half (:func:`_code_pair`); one join only, so the codes may take any layout."""
    P: tl.constexpr = 16 // BITS  # a 32-bit word's pairs: codes j and j + P
    PAIR: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    shifts = (BITS * tl.arange(0, P)).to(tl.uint32)[None, None, :]
    h = ((words[:, :, None] >> shifts) & PAIR) | MAGIC  # (T, n, P)
    y = tl.permute(tl.join((h & 0xFFFF).to(tl.uint16), (h >> 16).to(tl.uint16)), (0, 1, 3, 2))  # (T, n, 2, P)
    return tl.reshape(y, (words.shape[0], words.shape[1] * 2 * P))


@triton.jit
def _token_pair_bits(words, BITS: tl.constexpr, MAGIC: tl.constexpr):
    """:func:`_shift_bits` with each 32-bit register holding one code of two neighbouring tokens (the
    pairs an MMA operand with tokens on K holds): the words' low halves of tokens 2i and 2i + 1 side
    by side, then their high halves, then one shift and mask per code."""
    T: tl.constexpr = words.shape[0]
    N: tl.constexpr = words.shape[1]
    P: tl.constexpr = 16 // BITS  # codes per 16-bit half
    PAIR: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    w0, w1 = tl.split(tl.permute(tl.reshape(words, (T // 2, 2, N)), (0, 2, 1)))  # tokens 2i, 2i + 1: (T / 2, N)
    halves = tl.join((w0 & 0xFFFF) | (w1 << 16), (w0 >> 16) | (w1 & 0xFFFF0000))  # (T / 2, N, 2)
    shifts = (BITS * tl.arange(0, P)).to(tl.uint32)[None, None, None, :]
    h = ((halves[:, :, :, None] >> shifts) & PAIR) | MAGIC  # (T / 2, N, 2, P)
    y = tl.join((h & 0xFFFF).to(tl.uint16), (h >> 16).to(tl.uint16))  # (T / 2, N, 2, P, 2): the token last
    return tl.reshape(tl.permute(y, (0, 4, 1, 2, 3)), (T, N * 2 * P))


@triton.jit
def joint_low_bit_codes(k_base, v_base, tok, k_rows, v_rows, k_stride, v_stride, NWORDS: tl.constexpr, ALIGN: tl.constexpr,
                        BITS: tl.constexpr, VDT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The int4/int2 key and value codes (spec/quantization.md Q2; both ``BITS`` wide, NWORDS 32-bit
    words a row, rows ``k_stride`` / ``v_stride`` bytes apart) of the tokens ``tok`` whose ``k_rows``
    / ``v_rows`` are set (0 elsewhere), in their stored order: keys float16 ``c``, values ``VDT`` ``c -
    2^(BITS-1)`` (:func:`_code_pair`). Both sides in one load, (T, 2, NWORDS): twice a side's words per
    thread, so 8-byte loads even where a side's tile would give each thread one word (``ALIGN``: as
    :func:`load_words`'); the values in neighbouring-token pairs (:func:`_token_pair_bits`)."""
    offs = tl.arange(0, NWORDS)[None, None, :]
    side = tl.arange(0, 2)[None, :, None]
    k_step = tl.multiple_of(k_stride // 4, ALIGN // 4)
    v_step = tl.multiple_of(v_stride // 4, ALIGN // 4)
    # the value rows as offsets from the key rows: a select of two pointers would lose their alignment
    gap = tl.multiple_of((v_base.to(tl.int64) - k_base.to(tl.int64)) // 4, ALIGN // 4)
    t = tok[:, None, None]
    ptrs = k_base.to(tl.pointer_type(tl.uint32)) + (t * k_step + side * (gap + t * (v_step - k_step)) + offs)
    mask = tl.where(side == 0, k_rows[:, None, None], v_rows[:, None, None])
    words = tl.load(ptrs, mask=mask, other=0)  # sass: codes
    k_words, v_words = tl.split(tl.permute(words, (0, 2, 1)))
    return key_codes16(k_words, BITS, INTERPRETED), value_codes(v_words, BITS, VDT, INTERPRETED)


@triton.jit
def key_codes16(words, BITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """The int4/int2 codes of (T, n) 32-bit ``words`` as float16 ``c`` (exact), (T, n 32 / BITS) in
    their stored order: one join, so they take the rebuild operand's layout without a copy."""
    return _less(_shift_bits(words, BITS, 0x64006400), tl.float16, 1024.0, INTERPRETED)


@triton.jit
def value_codes(words, BITS: tl.constexpr, DT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The int4/int2 codes of (T, n) 32-bit ``words`` centred, ``c - 2^(BITS-1)`` (spec/quantization.md
    Q6) in ``DT`` (float16 or bfloat16: exact), (T, n 32 / BITS) in their stored order, neighbouring
    tokens side by side in each register (:func:`_token_pair_bits`)."""
    MAGIC: tl.constexpr = 0x64006400 if DT == tl.float16 else 0x43004300
    OFFSET: tl.constexpr = (1024.0 if DT == tl.float16 else 128.0) + (1 << (BITS - 1))
    return _less(_token_pair_bits(words, BITS, MAGIC), DT, OFFSET, INTERPRETED)


@triton.jit
def group_rows(base, t0, kgroup, stride, offs, T: tl.constexpr):
    """(T, len(offs)): the per-channel rows (scales or zero points, ``stride`` elements apart, one per
    key group of ``kgroup`` tokens) of the T tokens from ``t0``, read once per key group and broadcast
    to its tokens: the tile's NG = ceil(T / kgroup) groups from ``t0 // kgroup`` on. Only for tiles of
    whole groups (``t0`` a multiple of ``kgroup`` and T of ``kgroup``) or inside one (``kgroup`` a
    multiple of T and ``t0`` of T), every group coded."""
    NG: tl.constexpr = (T + kgroup - 1) // kgroup
    PER: tl.constexpr = T // NG  # tokens of a group in the tile
    W: tl.constexpr = offs.shape[0]
    g = (tl.cast(t0, tl.uint32) // kgroup).to(tl.int32) + tl.arange(0, NG)  # t0 >= 0: unsigned (a shift for a power-of-two group)
    rows = tl.load(base + g[:, None] * stride + offs[None, :])  # (NG, W)
    return tl.reshape(tl.broadcast_to(rows[:, None, :], (NG, PER, W)), (T, W))


@triton.jit
def low_bit_keys16(words, ks_base, kz_base, tail_base, tok, t_mask, offs_r, complete, kgroup, sks_t, stl_t,
                   BITS: tl.constexpr, INTERPRETED: tl.constexpr, MASKED: tl.constexpr, t0=0, GROUP_ROWS: tl.constexpr = False):
    """float16 keys ``x = c s + z`` (spec/quantization.md Q1-Q2; one float16 rounding of the fused
    product and sum, ~2^-11 relative) of the tokens ``tok`` of one tile of an int4/int2 key side
    from their codes' 32-bit ``words`` (:func:`low_bit_words`) or the float16 codes themselves
    (:func:`joint_low_bit_codes`), channels ``offs_r`` (all, in their order). ``MASKED``: tokens
    outside ``t_mask`` read 0 and those of the unfinished group their ``key_tail`` row (their
    words: 0); otherwise every token is coded. ``GROUP_ROWS`` (unmasked tiles only): the tokens are
    ``t0 + arange`` with ``t0`` a multiple of ``min(kgroup, T)`` and ``kgroup`` a multiple or a divisor
    of the tile's T tokens, so the tile holds whole key groups (or lies in one): the scales and zero
    points are read once per group, one row each (:func:`group_rows`), not once per token."""
    if MASKED:
        coded = tok < complete
        rows = t_mask & coded
    else:
        rows = t_mask
    if words.dtype == tl.uint32:
        c = low_bit_words(words, BITS, tl.float16, INTERPRETED)
    else:  # decoded already (joint_low_bit_codes)
        c = words
    if GROUP_ROWS:
        k_sc = group_rows(ks_base, t0, kgroup, sks_t, offs_r, tok.shape[0]).to(tl.float16)
        k_ze = group_rows(kz_base, t0, kgroup, sks_t, offs_r, tok.shape[0]).to(tl.float16)
    else:
        grp = (tok.to(tl.uint32) // kgroup).to(tl.int32)  # tok >= 0: unsigned, a shift for a power-of-two group
        k_sc = tl.load(ks_base + grp[:, None] * sks_t + offs_r[None, :], mask=rows[:, None], other=0.0).to(tl.float16)
        k_ze = tl.load(kz_base + grp[:, None] * sks_t + offs_r[None, :], mask=rows[:, None], other=0.0).to(tl.float16)
    if INTERPRETED:  # one rounding, as the GPU's fused float16 multiply-add
        x = (c.to(tl.float32) * k_sc.to(tl.float32) + k_ze.to(tl.float32)).to(tl.float16)
    else:
        x = c * k_sc + k_ze
    if MASKED:
        tail_m = (t_mask & (tok >= complete))[:, None]
        k_tl = tl.load(tail_base + (tok - complete)[:, None] * stl_t + offs_r[None, :], mask=tail_m, other=0.0)
        x = tl.where(coded[:, None], x, k_tl.to(tl.float16))
    return x


@triton.jit
def rotate_bf16(a, x, b, y, SUBTRACT: tl.constexpr, INTERPRETED: tl.constexpr):
    """bfloat16 ``a x + b y`` (``SUBTRACT``: ``a x - b y``) as the GPU's packed ``fma.rn.bf16x2``
    gives it, two lanes an instruction: ``b y`` rounded, then ``a x`` added and rounded once (the
    interpreter: in float32, the products of bfloat16 numbers exact there). Rounding to nearest is
    odd in its argument, so ``a x - b y`` is ``a x + b (-y)`` bit for bit, without a negated table."""
    if INTERPRETED:
        by = (b.to(tl.float32) * y.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        out = (a.to(tl.float32) * x.to(tl.float32) + (-by if SUBTRACT else by)).to(tl.bfloat16)
    else:
        # Triton's bfloat16 arithmetic is per lane (repacked around each op): one packed FMA each instead
        out = tl.inline_asm_elementwise(_ROTATE_SUB if SUBTRACT else _ROTATE_ADD, "=r,r,r,r,r", [a, x, b, y], dtype=tl.bfloat16, is_pure=True, pack=2)
    return out


# rotate_bf16's packed form: b y rounded (plus -0, which keeps the product's sign of zero), negated
# for a x - b y, then a x added and rounded once
_ROTATE_ADD = tl.constexpr("{ .reg .b32 z, t; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $3, $4, z; fma.rn.bf16x2 $0, $1, $2, t; }")
_ROTATE_SUB = tl.constexpr("{ .reg .b32 z, t; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $3, $4, z; neg.bf16x2 t, t; fma.rn.bf16x2 $0, $1, $2, t; }")
