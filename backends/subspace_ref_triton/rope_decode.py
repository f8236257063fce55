"""Decode attention over a pre-RoPE static state (spec/rope.md P3) as one fused Triton kernel per
split of the token axis, merged by :func:`subspace_ref_triton.decode.merge_partials`.

Main loop (``_rope_mma_kernel``, the default; issue 38 items 2 and 6). A program owns one
(sequence, KV head) and one split, and per tile of ``BLOCK_T`` tokens, tokens on the MMAs' M
dimension (whole tiles of coded tokens without any mask; the split's partial last tile and the
unfinished key group, ``key_tail``, after them in masked tiles):

1. rebuilds the keys from their coefficients, ``u_t = B^T c_t``, on the tensor cores, float32
   accumulation: 16-bit coefficients as stored; int8 codes (spec A10) read as 32-bit words and made
   exact bfloat16 numbers by bit operations (:func:`subspace_ref_triton._rope_tl.int8_words`; with
   ``warp_softmax`` read per code and converted, which the compiler does in the product's operand
   layout: no decoded tile through shared memory);
   int4/int2 keys (spec/quantization.md Q1-Q2) read as words, ``c s + z`` in one fused float16
   multiply-add against float16 bases (:func:`subspace_ref_triton._rope_tl.low_bit_keys16`; rows
   not so aligned: float32 in two 16-bit parts; rows of both sides too short for 8-byte loads of
   a side's tile: both sides in one load, :func:`subspace_ref_triton._rope_tl.joint_low_bit_codes`),
   the scales and zero points of whole tiles read one row per key group
   (:func:`subspace_ref_triton._rope_tl.group_rows`).
   Products with the basis columns of the planes' first dims, second dims and the fixed dims
   (``RopeParams.planes``): the two halves of every plane land in the same fragment element of two
   accumulators, so the rotation needs no data movement;
2. rotates the keys by their in-tile offsets ``k theta_i`` only, from a small float32 table
   (:func:`offset_angles`, float64 on the host), and the g queries once per tile back by the
   tile's base angle (a float32 row of :func:`base_angles`, float64 on the host, ``a`` folded in):
   ``q . a R_p R_k u = (a R_p^T q) . (R_k u)``. No float64 in the kernel. With bfloat16 bases
   (one key part, below) the keys are rotated in packed bfloat16, ``fma.rn.bf16x2``
   (:func:`subspace_ref_triton._rope_tl.rotate_bf16`): they are rounded to bfloat16 for the
   logits anyway, and each instruction rotates two lanes. The rotation's minus sign is a packed
   negation of one product, not a negated copy of the sine table: one instruction per two lanes
   for 16 fewer registers a thread, which with :data:`MAX_REGISTERS` fits 3 programs per SM;
3. takes the logits ``(BLOCK_T, g)`` on the tensor cores, float32 operands in bfloat16 parts:
   the rotated queries (once per tile) in two (hi, rounded; lo: the exact rest, rounded) side by
   side on the MMA's N (the g query heads pad it anyway: one product takes both); the rotated keys
   in one (bfloat16, a few 2^-9 relative per element with the rotation's roundings: with bfloat16
   bases, whose own rounding the harness tolerance measures, well inside that tolerance on
   tests/test_rope_decode.py's states) or, with float16 bases (one part: a large share of it), two:
   hi + lo, ~2^-16 relative (``key_parts``); int8 key scales multiply the logits per token;
4. runs the one-pass softmax of spec A3 (its normaliser ``Z``, and ``sum_t w_t zeta_t`` below,
   kept per token slot of the tile and summed once per split: no sum across warps per tile) and
   the value sums on the tensor cores, ``acc^T = W^T D``: 16-bit value coefficients or int8 codes
   exact (words, as the keys'), int4/int2 codes in Q6's centred form
   (``c - M`` exact in bfloat16 from words; the scales ``tau_t`` folded into the weights,
   ``sum_t w_t (zeta_t + M tau_t)`` beside); the float32 weights in two 16-bit parts side by side
   on N (one product; ~2^-17 relative), their columns summed once per split; ``E`` once per split.
   With ``warp_softmax`` (``WARPS``: the warps) each warp's rows of the tile keep a max and value
   sums of their own, ``W^T D`` a product per warp, all merged once per split as spec A3.2 merges
   splits: no max across warps and no transpose of ``W`` through shared memory per tile (3
   barriers a tile instead of 7 in the float loop on sm_90; docs/gpu.md, "A softmax per warp in
   the pre-RoPE kernel").

Float32 bases (or ``native=False``) run the same loop with float32 (``ieee``) products. Under the
interpreter the 16-bit products are float32 products of the same 16-bit parts (``NATIVE16``
False); ``tests/test_rope_decode.py`` also runs the GPU's constexprs and 16-bit arithmetic there.

A device token count (``split_launch(num_tokens=...)``, ``DEVICE_T``) makes the launch graph-capturable
(spec/rope.md P3 over spec A3.2's splits): the kernel derives the split length from it and reads the
base angles from one row per tile of the capacity, so a CUDA graph replays it as the cache grows
(:class:`~subspace_ref_triton.workspace.DecodeWorkspace` with ``rope``).

``legacy=True`` launches the kernel before this form (``_rope_split_kernel``: float32 logits and
value sums on CUDA cores, per-element low-bit dequantisation, 32-token tiles on 4 warps that spill),
kept to time against it. Rebuilding the key (not rotating the query per token) serves all g
query heads with one ``O(r d)`` product per token: spec/roofline.md R13.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from subspace_ref_triton._common import check_device_count, Launch, cdiv, interpreting, pow2_at_least
from subspace_ref_triton._tl import MAX_COMBINE as _MAX
from subspace_ref_triton._tl import SUM_COMBINE as _SUM
from subspace_ref_triton._tl import int4_word_order, low_bit_keys, low_bit_values, tile_codes, word_order
from subspace_ref_triton._rope_tl import int8_words, joint_low_bit_codes, load_words, low_bit_keys16, low_bit_words, rotate_bf16
from subspace_ref_triton.decode import DOT_ROWS, MIN_SPLIT_TOKENS, merge_partials, side_formats, sized_launch

# Tokens per tile and warps of the tensor-core form with 16-bit bases, from the compiled code (not
# timed): at 64 tokens on 4 warps the rebuild is one warpgroup MMA and every warp owns 16 rows of
# the others, no spill on sm_90 or sm_80; 128-token tiles spill. Figures: docs/gpu.md.
BLOCK_T = 64
NUM_WARPS = 4
FP32_BLOCK_T = 32  # float32 bases: 155 registers, no spill on sm_90 (64-token tiles spill)
LEGACY_BLOCK_T = 32  # the kernel before the tensor-core form (split_launch(legacy=True))
LEGACY_NUM_WARPS = 4
# ptxas's register cap (Triton's maxnreg) of the default launch with bfloat16 bases where it compiles
# clean (default_max_registers): 3 programs of 4 warps per SM instead of 2, for a loop that waits
# rather than issues (docs/gpu.md, "Pre-RoPE kernel, three programs per SM"). Chosen from the
# compiled code, not timed.
MAX_REGISTERS = 168
# A softmax per warp (split_launch's ``warp_softmax``) by default wherever it can run: an H200 timed
# it under MAX_REGISTERS faster than one softmax a tile, capped or not, for float, int8 and int4 sides
# (docs/gpu.md, "Caps timed, and a softmax per warp by default").
WARP_SOFTMAX_DEFAULT = True
WARP_SOFTMAX_MEASURED = (
    "a softmax per warp under the pre-RoPE cap (WARP_SOFTMAX_DEFAULT, MAX_REGISTERS): timed faster on a GPU than one softmax "
    "a tile, capped or not (eager, d = 128, r = 32, g = 4, bfloat16 bases on an H200; other shapes untimed); its spills stay "
    "outside the sm_90 main loop: docs/gpu.md, \"Caps timed, and a softmax per warp by default\""
)


@triton.jit
def _rope_split_kernel(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, gamma_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, tail_ptr, order_ptr, freq_ptr, base_ptr,
    pm_ptr, pz_ptr, po_ptr,
    H, group, num_tokens, split_len, num_splits, scale, tiles_per_split,
    d, d_v, r, r_v, m, f,
    sq_n, sq_h,
    skc_n, skc_h, skc_t,
    svc_n, svc_h, svc_t,
    skb_n, skb_h, skb_r,
    svb_n, svb_h, svb_r,
    sks_n, sks_h, sks_t,
    svs_n, svs_h, svs_t,
    kgroup, stl_n, stl_h, stl_t,
    G: tl.constexpr, M: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, RV: tl.constexpr,
    BLOCK_T: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, HAS_FIXED: tl.constexpr, NATIVE16: tl.constexpr,
):
    nh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = nh // H
    h = nh % H

    offs_g = tl.arange(0, G)
    offs_m = tl.arange(0, M)
    offs_dv = tl.arange(0, DV)
    offs_r = tl.arange(0, R)
    offs_rv = tl.arange(0, RV)
    offs_t = tl.arange(0, BLOCK_T)
    g_mask = offs_g < group
    m_mask = offs_m < m
    r_mask = offs_r < r
    rv_mask = offs_rv < r_v

    # the dims of plane i: first dim order[i], second order[m + i]; fixed dims order[2m:]
    dim_a = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
    dim_b = tl.load(order_ptr + m + offs_m, mask=m_mask, other=0)
    q_rows = q_ptr + n * sq_n + (h * group + offs_g)[:, None] * sq_h
    qa = tl.load(q_rows + dim_a[None, :], mask=g_mask[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
    qb = tl.load(q_rows + dim_b[None, :], mask=g_mask[:, None] & m_mask[None, :], other=0.0).to(tl.float32)
    kb_rows = kb_ptr + n * skb_n + h * skb_h + offs_r[:, None] * skb_r
    COEF = kb_ptr.dtype.element_ty  # the rebuild's operand type: float32, or the 16-bit bases' (NATIVE16)
    ROWS: tl.constexpr = COEF != tl.float32  # low-bit codes read as whole rows with 16-bit bases (_tl.tile_codes)
    if not NATIVE16:
        COEF = tl.float32
    Ba = tl.load(kb_rows + dim_a[None, :], mask=r_mask[:, None] & m_mask[None, :], other=0.0).to(COEF)  # (R, M)
    Bb = tl.load(kb_rows + dim_b[None, :], mask=r_mask[:, None] & m_mask[None, :], other=0.0).to(COEF)
    if HAS_FIXED:
        offs_f = tl.arange(0, F)
        f_mask = offs_f < f
        dim_f = tl.load(order_ptr + 2 * m + offs_f, mask=f_mask, other=0)
        qf = tl.load(q_rows + dim_f[None, :], mask=g_mask[:, None] & f_mask[None, :], other=0.0).to(tl.float32)
        Bf = tl.load(kb_rows + dim_f[None, :], mask=r_mask[:, None] & f_mask[None, :], other=0.0).to(COEF)

    # cos/sin of k theta_i for the offsets k < BLOCK_T of a tile, in float64, once per program
    theta = tl.load(freq_ptr + offs_m, mask=m_mask, other=0.0)  # float64
    off_angle = offs_t.to(tl.float64)[:, None] * theta[None, :]
    ck = tl.cos(off_angle).to(tl.float32)
    sk = tl.sin(off_angle).to(tl.float32)

    kc_base = kc_ptr + n * skc_n + h * skc_h
    vc_base = vc_ptr + n * svc_n + h * svc_h
    ks_base = ks_ptr + n * sks_n + h * sks_h
    vs_base = vs_ptr + n * svs_n + h * svs_h
    # int4/int2 (spec/quantization.md Q2): zero points share the strides of their scales
    kz_base = kz_ptr + n * sks_n + h * sks_h
    vz_base = vz_ptr + n * svs_n + h * svs_h
    tail_base = tail_ptr + n * stl_n + h * stl_h
    complete = num_tokens // kgroup * kgroup  # keys below: codes; from here: key_tail (Q2.2)
    logit_scale = tl.load(gamma_ptr + h).to(tl.float32) * scale

    lo = s * split_len
    hi = tl.minimum(lo + split_len, num_tokens)
    m_i = tl.full([G], float("-inf"), tl.float32)
    z_i = tl.full([G], 0.0, tl.float32)
    acc = tl.full([G, RV], 0.0, tl.float32)
    for t0 in range(lo, hi, BLOCK_T):  # sass: main loop
        t_mask = t0 + offs_t < hi
        # each side in its own format (spec/quantization.md Q0); int8 codes through float32: exact
        # in every type (the interpreter turns int8 -> bfloat16 into a bit copy)
        if K_BITS == 0:
            c = tl.load(kc_base + (t0 + offs_t)[:, None] * skc_t + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0).to(tl.float32).to(COEF)  # sass: codes
        else:
            # spec/quantization.md Q1-Q2 in float32, kept in float32 like every other operand here
            c = low_bit_keys(kc_base, ks_base, kz_base, tail_base, t0 + offs_t, t_mask, offs_r, r_mask, complete, kgroup, skc_t, sks_t, stl_t, r, K_BITS, ROWS)
        if V_BITS == 0:
            dvals = tl.load(vc_base + (t0 + offs_t)[:, None] * svc_t + offs_rv[None, :], mask=t_mask[:, None] & rv_mask[None, :], other=0).to(tl.float32)  # sass: codes
        else:
            dvals = low_bit_values(vc_base, vs_base, vz_base, t0 + offs_t, t_mask, offs_rv, r_v, svc_t, svs_t, V_BITS, ROWS)
        # step 1: rebuild; step 2: rotate to positions S + t0 + k (spec/window.md W10: S sinks
        # before the compressed tokens; angle addition, scale a folded in)
        if NATIVE16:  # tensor cores, float32 sums of exact products (module docstring)
            ua = tl.dot(c, Ba)  # (BLOCK_T, M)
            ub = tl.dot(c, Bb)
        else:
            ua = tl.dot(c, Ba, input_precision="ieee")
            ub = tl.dot(c, Bb, input_precision="ieee")
        # the tile's base angle: a cos and sin row of the table built on the host (base_angles)
        row = base_ptr + (s * tiles_per_split + (t0 - lo) // BLOCK_T) * 2 * m
        ca = tl.load(row + offs_m, mask=m_mask, other=0.0)
        sa = tl.load(row + m + offs_m, mask=m_mask, other=0.0)
        cos_t = ck * ca[None, :] - sk * sa[None, :]
        sin_t = sk * ca[None, :] + ck * sa[None, :]
        ra = ua * cos_t - ub * sin_t
        rb = ua * sin_t + ub * cos_t
        # step 3: logits of the g query heads
        if HAS_FIXED:
            if NATIVE16:
                uf = tl.dot(c, Bf)
            else:
                uf = tl.dot(c, Bf, input_precision="ieee")
        logits = tl.dot(qa, tl.trans(ra), input_precision="ieee")
        logits = tl.dot(qb, tl.trans(rb), acc=logits, input_precision="ieee")
        if HAS_FIXED:
            logits = tl.dot(qf, tl.trans(uf), acc=logits, input_precision="ieee")
        logits = logits * logit_scale
        if K_INT8:  # spec A10: k_t = s_t R_t B^T q_t
            logits = logits * tl.load(ks_base + (t0 + offs_t) * sks_t, mask=t_mask, other=0.0)[None, :]
        logits = tl.where(t_mask[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(logits, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(logits - m_new[:, None])
        z_i = z_i * alpha + tl.reduce(w, 1, _SUM)
        if V_INT8:
            w = w * tl.load(vs_base + (t0 + offs_t) * svs_t, mask=t_mask, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(w, dvals, input_precision="ieee")
        m_i = m_new

    _write_partial(acc, m_i, z_i, vb_ptr + n * svb_n + h * svb_h + offs_rv[:, None] * svb_r, rv_mask, offs_dv, d_v, (n * H + h) * group + offs_g, g_mask,
                   pm_ptr, pz_ptr, po_ptr, num_splits, s)


@triton.jit
def _write_partial(acc, m_i, z_i, e_rows, rv_mask, offs_dv, d_v, row, g_mask, pm_ptr, pz_ptr, po_ptr, num_splits, s):
    """A split's partial (m, Z, N = acc E) of the query rows ``row``: E's rows at ``e_rows`` (pointers
    to the value basis rows in the order acc's columns hold them)."""
    E = tl.load(e_rows + offs_dv[None, :], mask=rv_mask[:, None] & (offs_dv < d_v)[None, :], other=0.0).to(tl.float32)
    o_i = tl.dot(acc, E, input_precision="ieee")
    tl.store(pm_ptr + row * num_splits + s, m_i, mask=g_mask)
    tl.store(pz_ptr + row * num_splits + s, z_i, mask=g_mask)
    tl.store(po_ptr + (row * num_splits + s)[:, None] * d_v + offs_dv[None, :], o_i, mask=g_mask[:, None] & (offs_dv < d_v)[None, :])


@triton.jit
def _dot16(a, b, acc, NATIVE16: tl.constexpr):
    """``acc + a @ b`` of 16-bit operands: on the tensor cores (float32 accumulation), or under the
    interpreter / a float32 launch as float32 products of the same 16-bit numbers (exact products)."""
    if NATIVE16:
        out = tl.dot(a, b, acc=acc)
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return out


@triton.jit
def _rope_mma_kernel(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, gamma_ptr, ks_ptr, vs_ptr, kz_ptr, vz_ptr, tail_ptr, order_ptr, off_ptr, base_ptr,
    pm_ptr, pz_ptr, po_ptr, ntok_ptr,
    H, group, num_tokens, split_len, num_splits, scale, tiles_per_split,
    d, d_v, r, r_v, m, f,
    sq_n, sq_h,
    skc_n, skc_h, skc_t,
    svc_n, svc_h, svc_t,
    skb_n, skb_h, skb_r,
    svb_n, svb_h, svb_r,
    sks_n, sks_h, sks_t,
    svs_n, svs_h, svs_t,
    kgroup, stl_n, stl_h, stl_t,
    G: tl.constexpr, M: tl.constexpr, F: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, RV: tl.constexpr,
    BLOCK_T: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, HAS_FIXED: tl.constexpr,
    NATIVE16: tl.constexpr, SPLIT: tl.constexpr, KEY_PARTS: tl.constexpr, RANKS_FULL: tl.constexpr, INTERPRETED: tl.constexpr,
    K_WORDS: tl.constexpr, V_WORDS: tl.constexpr, KGROUP: tl.constexpr, JOINT: tl.constexpr, GROUP_ROWS: tl.constexpr,
    DEVICE_T: tl.constexpr, MIN_SPLIT: tl.constexpr, WARPS: tl.constexpr,
):
    """The tensor-core form (module docstring, "Main loop"): tokens on the MMAs' M dimension."""
    nh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = nh // H
    h = nh % H
    PDT = tl.bfloat16  # parts of the float32 rotated keys and queries (float32's range)

    offs_g = tl.arange(0, G)
    offs_m = tl.arange(0, M)
    offs_dv = tl.arange(0, DV)
    offs_r = tl.arange(0, R)
    offs_rv = tl.arange(0, RV)
    g_mask = offs_g < group
    m_mask = offs_m < m
    if RANKS_FULL:  # r = R and r_v = RV: no rank masks (wide loads, fewer predicates)
        r_mask = tl.full([R], 1, tl.int1)
        rv_mask = tl.full([RV], 1, tl.int1)
    else:
        r_mask = offs_r < r
        rv_mask = offs_rv < r_v

    dim_a = tl.load(order_ptr + offs_m, mask=m_mask, other=0)
    dim_b = tl.load(order_ptr + m + offs_m, mask=m_mask, other=0)
    # the queries transposed, (M, G): the logits' second operand as built (no transpose in the loop)
    q_cols = q_ptr + n * sq_n + (h * group + offs_g)[None, :] * sq_h
    qa = tl.load(q_cols + dim_a[:, None], mask=m_mask[:, None] & g_mask[None, :], other=0.0).to(tl.float32)
    qb = tl.load(q_cols + dim_b[:, None], mask=m_mask[:, None] & g_mask[None, :], other=0.0).to(tl.float32)
    # int8 codes read as words come in this channel order (_rope_tl.int8_words): the bases' rows follow it
    # (keys with a softmax per warp: per code, as stored)
    key_r = int4_word_order(offs_r) if K_WORDS and K_INT8 and WARPS == 1 else offs_r
    if V_WORDS and V_BITS > 0 and not JOINT:  # int4/int2 values read as words: any channel order will do (_tl.word_order)
        val_rv = word_order(offs_rv, V_BITS)
    else:
        val_rv = int4_word_order(offs_rv) if V_WORDS and V_INT8 else offs_rv
    kb_rows = kb_ptr + n * skb_n + h * skb_h + key_r[:, None] * skb_r
    Ba = tl.load(kb_rows + dim_a[None, :], mask=r_mask[:, None] & m_mask[None, :], other=0.0)  # (R, M), as stored
    Bb = tl.load(kb_rows + dim_b[None, :], mask=r_mask[:, None] & m_mask[None, :], other=0.0)
    if HAS_FIXED:
        offs_f = tl.arange(0, F)
        f_mask = offs_f < f
        dim_f = tl.load(order_ptr + 2 * m + offs_f, mask=f_mask, other=0)
        qf = tl.load(q_cols + dim_f[:, None], mask=f_mask[:, None] & g_mask[None, :], other=0.0).to(tl.float32)  # (F, G)
        Bf = tl.load(kb_rows + dim_f[None, :], mask=r_mask[:, None] & f_mask[None, :], other=0.0)
        if SPLIT:  # the fixed dims' query parts, once per program (not rotated)
            qf = _query_parts(qf, PDT)
    else:
        qf = qa
        Bf = Ba
    if K_WORDS and K_BITS > 0:  # float16 int4/int2 keys (_rope_tl.low_bit_keys16): a float16 rebuild (bases exact in it)
        Ba = Ba.to(tl.float16)
        Bb = Bb.to(tl.float16)
        Bf = Bf.to(tl.float16)
    elif K_BITS > 0 and SPLIT:  # int4/int2 keys enter the rebuild in two parts side by side on K: every basis row twice
        Ba = _pair_rows(Ba)
        Bb = _pair_rows(Bb)
        Bf = _pair_rows(Bf)
    # cos/sin of k theta_i for the in-tile offsets k < BLOCK_T: a float32 table built on the host in float64 (offset_angles)
    offs_t = tl.arange(0, BLOCK_T)
    ck = tl.load(off_ptr + offs_t[:, None] * m + offs_m[None, :], mask=m_mask[None, :], other=0.0)  # (BLOCK_T, M)
    sk = tl.load(off_ptr + (BLOCK_T + offs_t)[:, None] * m + offs_m[None, :], mask=m_mask[None, :], other=0.0)

    kc_base = kc_ptr + n * skc_n + h * skc_h
    vc_base = vc_ptr + n * svc_n + h * svc_h
    ks_base = ks_ptr + n * sks_n + h * sks_h
    vs_base = vs_ptr + n * svs_n + h * svs_h
    kz_base = kz_ptr + n * sks_n + h * sks_h
    vz_base = vz_ptr + n * svs_n + h * svs_h
    tail_base = tail_ptr + n * stl_n + h * stl_h
    if DEVICE_T:
        # the token count read on the device and the split length derived from it (a multiple of the
        # tile, at least MIN_SPLIT), so a captured CUDA graph replays as the cache grows (decode.py's DEVICE_T)
        num_tokens = tl.load(ntok_ptr).to(tl.int32)
        split_len = (num_tokens + num_splits - 1) // num_splits
        split_len = tl.maximum((split_len + BLOCK_T - 1) // BLOCK_T * BLOCK_T, MIN_SPLIT)
    complete = num_tokens // KGROUP * KGROUP  # a constexpr group: shifts, not divisions; after the count's read
    logit_scale = tl.load(gamma_ptr + h).to(tl.float32) * scale

    lo = s * split_len
    hi = tl.minimum(lo + split_len, num_tokens)
    # WARPS softmaxes a tile (_mma_tile: one, or one per warp), each over RW of its tokens with a max
    # of its own; Z and zacc (int4/int2 values: sum_t w_t zeta_t, spec/quantization.md Q6) per token
    # slot of the tile at their softmax's max; all merged once after the loop
    RW: tl.constexpr = BLOCK_T // WARPS
    m_i = tl.full([WARPS, G], float("-inf"), tl.float32)
    z_i = tl.full([WARPS, RW, G], 0.0, tl.float32)
    zacc = tl.full([WARPS, RW, G], 0.0, tl.float32)
    # value-coefficient accumulator, transposed (tokens were on M); 16-bit bases: a column per weight part
    ACC_N: tl.constexpr = 2 * G if SPLIT else G
    acc2 = tl.full([WARPS, ACC_N, RV], 0.0, tl.float32)
    if DEVICE_T:  # one table over the capacity, a row per tile (lo a multiple of BLOCK_T): rope_tables
        base_row = base_ptr + (lo // BLOCK_T) * 2 * m
    else:  # a table per split
        base_row = base_ptr + s * tiles_per_split * 2 * m
    # whole tiles of coded tokens without masks; the split's last partial tile and the unfinished key
    # group (key_tail, spec/quantization.md Q2.2) after them, masked
    coded_hi = tl.minimum(hi, complete) if K_BITS > 0 else hi
    main_hi = lo + tl.maximum(coded_hi - lo, 0) // BLOCK_T * BLOCK_T
    for t0 in range(lo, main_hi, BLOCK_T):  # sass: main loop
        m_i, z_i, zacc, acc2 = _mma_tile(
            t0, hi, base_row + ((t0 - lo) // BLOCK_T) * 2 * m, m_i, z_i, zacc, acc2, qa, qb, qf, Ba, Bb, Bf, ck, sk, logit_scale,
            kc_base, vc_base, ks_base, vs_base, kz_base, vz_base, tail_base, complete, KGROUP, skc_t, svc_t, sks_t, svs_t, stl_t,
            r, r_v, m, r_mask, rv_mask, m_mask,
            G, BLOCK_T, K_INT8, V_INT8, K_BITS, V_BITS, HAS_FIXED, NATIVE16, SPLIT, KEY_PARTS, INTERPRETED, K_WORDS, V_WORDS, kb_ptr.dtype.element_ty, False, JOINT, WARPS, GROUP_ROWS)
    for t0 in range(main_hi, hi, BLOCK_T):
        m_i, z_i, zacc, acc2 = _mma_tile(
            t0, hi, base_row + ((t0 - lo) // BLOCK_T) * 2 * m, m_i, z_i, zacc, acc2, qa, qb, qf, Ba, Bb, Bf, ck, sk, logit_scale,
            kc_base, vc_base, ks_base, vs_base, kz_base, vz_base, tail_base, complete, KGROUP, skc_t, svc_t, sks_t, svs_t, stl_t,
            r, r_v, m, r_mask, rv_mask, m_mask,
            G, BLOCK_T, K_INT8, V_INT8, K_BITS, V_BITS, HAS_FIXED, NATIVE16, SPLIT, KEY_PARTS, INTERPRETED, K_WORDS, V_WORDS, kb_ptr.dtype.element_ty, True, JOINT, WARPS, False)

    # the softmaxes merged (spec A3.2 within the split): each at its max's distance from the split's
    m_s = tl.reduce(m_i, 0, _MAX)  # (G,)
    to_split = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - tl.where(m_s == float("-inf"), 0.0, m_s)[None, :]))  # (WARPS, G)
    if SPLIT:  # the weight parts' columns summed
        a_hi, a_lo = tl.split(tl.permute(tl.reshape(acc2, (WARPS, G, 2, RV)), (0, 1, 3, 2)))
        acc3 = a_hi + a_lo
    else:
        acc3 = acc2
    acc3 = (acc3 + tl.reduce(zacc, 1, _SUM)[:, :, None]) * to_split[:, :, None]  # (WARPS, G, RV)
    acc = tl.reduce(acc3, 0, _SUM)
    z_s = tl.reduce(tl.reduce(z_i, 1, _SUM) * to_split, 0, _SUM)
    _write_partial(acc, m_s, z_s, vb_ptr + n * svb_n + h * svb_h + val_rv[:, None] * svb_r, rv_mask, offs_dv, d_v, (n * H + h) * group + offs_g, g_mask,
                   pm_ptr, pz_ptr, po_ptr, num_splits, s)


@triton.jit
def _pair_rows(b):
    """(K, N) -> (2K, N), row 2j + p = row j: the operand of a product whose other side holds two
    parts of each column side by side."""
    return tl.reshape(tl.permute(tl.join(b, b), (0, 2, 1)), (2 * b.shape[0], b.shape[1]))


@triton.jit
def _query_parts(x, DT: tl.constexpr):
    """float32 ``x`` (K, G) as the MMA operand (K, 2G) of its two 16-bit parts, column 2g + p:
    hi (rounded) and lo (the exact rest, rounded), so one product takes both parts."""
    x_hi = x.to(DT)
    x_lo = (x - x_hi.to(tl.float32)).to(DT)
    return tl.reshape(tl.join(x_hi, x_lo), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def _mma_tile(t0, hi, angle_row, m_i, z_i, zacc, acc2, qa, qb, qf, Ba, Bb, Bf, ck, sk, logit_scale,
              kc_base, vc_base, ks_base, vs_base, kz_base, vz_base, tail_base, complete, kgroup, skc_t, svc_t, sks_t, svs_t, stl_t,
              r, r_v, m, r_mask, rv_mask, m_mask,
              G: tl.constexpr, BLOCK_T: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
              HAS_FIXED: tl.constexpr, NATIVE16: tl.constexpr, SPLIT: tl.constexpr, KEY_PARTS: tl.constexpr, INTERPRETED: tl.constexpr,
              K_WORDS: tl.constexpr, V_WORDS: tl.constexpr, CDT: tl.constexpr, MASKED: tl.constexpr, JOINT: tl.constexpr,
              WARPS: tl.constexpr, GROUP_ROWS: tl.constexpr = False):
    """One tile of ``BLOCK_T`` tokens from ``t0`` (module docstring, "Main loop"): returns the updated
    ``(m, Z, zacc, acc)``. ``MASKED``: tokens >= ``hi`` masked and keys past the coded groups read from
    ``key_tail``; otherwise every token counts and is coded."""
    PDT = tl.bfloat16
    ROWS: tl.constexpr = CDT != tl.float32
    offs_t = tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, r_mask.shape[0])
    offs_rv = tl.arange(0, rv_mask.shape[0])
    offs_m = tl.arange(0, m_mask.shape[0])
    tok = t0 + offs_t
    if MASKED:
        t_mask = tok < hi
    else:
        t_mask = tl.full([BLOCK_T], 1, tl.int1)
    # step 1: rebuild u_t = B^T c_t, tokens on M: 16-bit coefficients as stored; int8 codes exact in
    # 16 bits (read as words: _rope_tl.int8_words; with a softmax per warp per code); int4/int2 keys
    # read as words float16 (c s + z, _rope_tl.low_bit_keys16), otherwise float32 after Q1-Q2 in two
    # 16-bit parts side by side on K
    if K_BITS == 0:
        if K_INT8 and K_WORDS and WARPS == 1:  # (a softmax per warp: per code, converted in the product's operand layout)
            a = int8_words(kc_base, tok, t_mask, skc_t, offs_r.shape[0], K_WORDS, INTERPRETED).to(CDT)
        else:
            a = tl.load(kc_base + tok[:, None] * skc_t + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0)  # sass: codes
            if K_INT8:
                a = a.to(tl.float32).to(CDT)
    elif K_WORDS:
        k_rows = t_mask & (tok < complete) if MASKED else t_mask
        if JOINT:
            k_words, dv = joint_low_bit_codes(kc_base, vc_base, tok, k_rows, t_mask, skc_t, svc_t, offs_r.shape[0] * K_BITS // 32, min(K_WORDS, V_WORDS),
                                              K_BITS, CDT, INTERPRETED)
        else:
            k_words = load_words(kc_base, tok, k_rows, skc_t, offs_r.shape[0] * K_BITS // 32, K_WORDS)
        a = low_bit_keys16(k_words, ks_base, kz_base, tail_base, tok, t_mask, offs_r, complete, kgroup, sks_t, stl_t, K_BITS, INTERPRETED, MASKED,
                           t0, GROUP_ROWS)
    else:
        a = low_bit_keys(kc_base, ks_base, kz_base, tail_base, tok, t_mask, offs_r, r_mask, complete, kgroup, skc_t, sks_t, stl_t, r, K_BITS, ROWS)
        if SPLIT:
            a_hi = a.to(CDT)
            a = tl.reshape(tl.join(a_hi, (a - a_hi.to(tl.float32)).to(CDT)), (BLOCK_T, 2 * a.shape[1]))
    ua = _dot16(a, Ba, None, NATIVE16)
    ub = _dot16(a, Bb, None, NATIVE16)
    if HAS_FIXED:
        uf = _dot16(a, Bf, None, NATIVE16)
    # step 2: keys rotated by their in-tile offsets only (both halves of a plane in one fragment)
    if SPLIT and KEY_PARTS == 1 and CDT == tl.bfloat16:  # rounded to bfloat16 for the logits anyway: the rotation in packed bfloat16
        ua16 = ua.to(PDT)
        ub16 = ub.to(PDT)
        ck16 = ck.to(PDT)
        sk16 = sk.to(PDT)
        ra = rotate_bf16(ua16, ck16, ub16, sk16, True, INTERPRETED)
        rb = rotate_bf16(ua16, sk16, ub16, ck16, False, INTERPRETED)
    else:
        ra = ua * ck - ub * sk
        rb = ua * sk + ub * ck
    # the queries rotated back by the tile's base angle (a cos/sin of p theta, base_angles): q . R_p R_k u = (R_p^T q) . R_k u
    ca = tl.load(angle_row + offs_m, mask=m_mask, other=0.0)
    sa = tl.load(angle_row + m + offs_m, mask=m_mask, other=0.0)
    pa = qa * ca[:, None] + qb * sa[:, None]  # (M, G)
    pb = qb * ca[:, None] - qa * sa[:, None]
    # step 3: logits on the tensor cores, float32 operands in bfloat16 parts (module docstring): the
    # queries' two parts side by side on N (one product: columns 2g + p), the keys in KEY_PARTS
    if SPLIT:
        qpa = _query_parts(pa, PDT)  # (M, 2G)
        qpb = _query_parts(pb, PDT)
        if KEY_PARTS == 2:  # hi: the top 16 bits (truncation, exact in bfloat16), lo: the exact rest, rounded; smallest first
            ra_bits = ra.to(tl.uint32, bitcast=True) & 0xFFFF0000
            rb_bits = rb.to(tl.uint32, bitcast=True) & 0xFFFF0000
            l2 = _dot16((ra - ra_bits.to(tl.float32, bitcast=True)).to(PDT), qpa, None, NATIVE16)
            l2 = _dot16((rb - rb_bits.to(tl.float32, bitcast=True)).to(PDT), qpb, l2, NATIVE16)
            ra_hi = (ra_bits >> 16).to(tl.uint16).to(PDT, bitcast=True)
            rb_hi = (rb_bits >> 16).to(tl.uint16).to(PDT, bitcast=True)
            if HAS_FIXED:
                uf_hi = uf.to(PDT)
                l2 = _dot16((uf - uf_hi.to(tl.float32)).to(PDT), qf, l2, NATIVE16)
                l2 = _dot16(uf_hi, qf, l2, NATIVE16)
            l2 = _dot16(ra_hi, qpa, l2, NATIVE16)
        else:  # one part, rounded to nearest: ~2^-9 relative per key element (the default with bfloat16 bases)
            l2 = _dot16(ra.to(PDT), qpa, None, NATIVE16)
            if HAS_FIXED:
                l2 = _dot16(uf.to(PDT), qf, l2, NATIVE16)
            rb_hi = rb.to(PDT)
        l2 = _dot16(rb_hi, qpb, l2, NATIVE16)
        l_hi, l_lo = tl.split(tl.reshape(l2, (BLOCK_T, G, 2)))
        logits = l_lo + l_hi  # (BLOCK_T, G)
    else:
        logits = tl.dot(ra, pa, input_precision="ieee")
        logits = tl.dot(rb, pb, acc=logits, input_precision="ieee")
        if HAS_FIXED:
            logits = tl.dot(uf, qf, acc=logits, input_precision="ieee")
    if K_INT8:  # spec A10: k_t = s_t R_t B^T q_t
        logits = logits * (tl.load(ks_base + tok * sks_t, mask=t_mask, other=0.0) * logit_scale)[:, None]
    else:
        logits = logits * logit_scale
    if MASKED:
        logits = tl.where(t_mask[:, None], logits, float("-inf"))
    # WARPS softmaxes (one, or one per warp: warp_softmax), each over RW rows of the tile with its own
    # max and value sums, merged once per split (per warp: no max or transpose across warps per tile)
    RW: tl.constexpr = BLOCK_T // WARPS
    l3 = tl.reshape(logits, (WARPS, RW, G))
    m_new = tl.maximum(m_i, tl.reduce(l3, 1, _MAX))  # (WARPS, G)
    if MASKED:  # a softmax whose rows are all masked so far: -inf, exp's reference 0 (no NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp(m_i - m_ref)
    w = tl.exp(l3 - m_ref[:, None, :])  # (WARPS, RW, G)
    z_i = z_i * alpha[:, None, :] + w
    # values in coefficient space: sum_t w_t d_t with 16-bit exact codes and the scales in the weights
    if V_BITS == 0:
        if V_INT8 and V_WORDS:
            dv = int8_words(vc_base, tok, t_mask, svc_t, offs_rv.shape[0], V_WORDS, INTERPRETED).to(CDT)
        else:
            # read in the value product's shape (WARPS, RW, RV): a reshape would pass through shared memory
            tok3 = t0 + tl.arange(0, WARPS)[:, None, None] * RW + tl.arange(0, RW)[None, :, None]
            if MASKED:
                v_mask = (tok3 < hi) & rv_mask[None, None, :]
            else:
                v_mask = tl.full([WARPS, RW, 1], 1, tl.int1) & rv_mask[None, None, :]
            dv = tl.load(vc_base + tok3 * svc_t + offs_rv[None, None, :], mask=v_mask, other=0)  # sass: codes
            if V_INT8:
                dv = dv.to(tl.float32).to(CDT)
        if V_INT8:
            w = w * tl.reshape(tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0), (WARPS, RW))[:, :, None]
    else:
        # spec/quantization.md Q6: x = code tau_t + zeta_t; sum_t (w_t tau_t) code_t + sum_t w_t zeta_t
        # (words: the centred codes c - M, exact in bfloat16, and zeta_t + M tau_t beside)
        tau = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
        zeta = tl.load(vz_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
        if V_WORDS:
            if not JOINT:
                v_words = load_words(vc_base, tok, t_mask, svc_t, offs_rv.shape[0] * V_BITS // 32, V_WORDS)
                dv = low_bit_words(v_words, V_BITS, tl.bfloat16, INTERPRETED, True).to(CDT)
            zeta = zeta + (1 << (V_BITS - 1)) * tau
        else:
            dv = tile_codes(vc_base, tok, t_mask, offs_rv, r_v, svc_t, V_BITS, ROWS).to(tl.float32)
            if SPLIT:
                dv = dv.to(CDT)
        zacc = zacc * alpha[:, None, :] + w * tl.reshape(zeta, (WARPS, RW))[:, :, None]
        w = w * tl.reshape(tau, (WARPS, RW))[:, :, None]
    if len(dv.shape) == 3:
        dv3 = dv
    else:
        dv3 = tl.reshape(dv, (WARPS, RW, dv.shape[1]))
    if SPLIT:
        # the weights in two 16-bit parts side by side on N (columns 2g + p: one product); float16
        # parts only: a power-of-two unit per warp keeps the scaled weights <= 1 inside float16's
        # range (exact, undone below); bfloat16 parts have float32's range
        SCALED: tl.constexpr = (V_INT8 or V_BITS > 0) and CDT == tl.float16
        if SCALED:
            w_max = tl.reduce(tl.reduce(w, 2, _MAX), 1, _MAX)  # (WARPS,)
            w_unit = tl.exp2(tl.ceil(tl.log2(tl.where(w_max > 0, w_max, 1.0))))
            w = w / w_unit[:, None, None]
        w_hi = w.to(CDT)
        w_lo = (w - w_hi.to(tl.float32)).to(CDT)
        pv = _dot16(tl.permute(tl.reshape(tl.join(w_hi, w_lo), (WARPS, RW, 2 * G)), (0, 2, 1)), dv3, None, NATIVE16)  # (WARPS, 2G, RV)
        if SCALED:
            pv = pv * w_unit[:, None, None]
        acc2 = acc2 * tl.reshape(tl.join(alpha, alpha), (WARPS, 2 * G))[:, :, None] + pv
    else:
        acc2 = acc2 * alpha[:, :, None] + tl.dot(tl.permute(w, (0, 2, 1)), dv3.to(tl.float32), input_precision="ieee")
    return m_new, z_i, zacc, acc2


@dataclass(frozen=True, eq=False)  # compared by identity: tensor fields
class RopeTables:
    """What the pre-RoPE kernels read besides the layout (:func:`rope_tables`): ``order`` (int32, the
    planes' first dims, second dims, then the fixed dims), ``offsets`` (float32 :func:`offset_angles`;
    the legacy kernel: the float64 frequencies), ``bases`` (float32 rows of :func:`base_angles`, ``a``
    folded in), built for tiles of ``block_t`` tokens; ``split_len``: the split length of per-split rows,
    None for one row per tile over a capacity (a device token count: split lengths are the kernel's)."""

    order: torch.Tensor
    offsets: torch.Tensor
    bases: torch.Tensor
    block_t: int
    split_len: int | None


def rope_tables(rope, d: int, block_t: int, device, *, capacity: int | None = None, num_splits: int | None = None, split_len: int | None = None,
                first_position: int = 0, legacy: bool = False) -> RopeTables:
    """The :class:`RopeTables` of ``rope`` for heads of ``d`` dims and tiles of ``block_t`` tokens on
    ``device``; compressed token t at position ``first_position + t`` (spec/window.md W10). Either
    ``num_splits`` splits of ``split_len`` tokens (a host token count: a base row per tile of each
    split) or ``capacity`` tokens (a device token count: a base row per tile from token 0, every split
    starting on a tile, the kernel's ``DEVICE_T``). :func:`split_launch` takes them from
    :func:`cached_rope_tables` when not given; :class:`~subspace_ref_triton.workspace.DecodeWorkspace`
    builds its own once, so its step allocates nothing."""
    if (capacity is None) == (split_len is None) or (split_len is not None and num_splits is None):
        raise ValueError("rope_tables takes a capacity (a device token count) or split_len and num_splits (a host one)")
    m = rope.inv_freq.size
    pairs = rope.planes(d)
    order = torch.as_tensor([*pairs[:m, 0], *pairs[:m, 1], *pairs[m:].reshape(-1)], dtype=torch.int32, device=device)
    freq = torch.tensor(rope.inv_freq, dtype=torch.float64, device=device)
    if capacity is not None:  # row k: position first_position + k block_t (splits of the kernel's, tile multiples)
        bases = base_angles(freq, cdiv(int(capacity), block_t), block_t, block_t, first_position, rope.attention_scaling)
    else:
        bases = base_angles(freq, int(num_splits), int(split_len), block_t, first_position, rope.attention_scaling)
    return RopeTables(order, freq if legacy else offset_angles(freq, block_t), bases, int(block_t), None if capacity is not None else int(split_len))


# Tables of recent launches per RopeParams (compared by identity): an eager decode step reuses its
# tables instead of copying them from the host each call (TABLES_KEPT per rope, least recent dropped).
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
TABLES_KEPT = 8


def cached_rope_tables(rope, d: int, block_t: int, device, **kw) -> RopeTables:
    """:func:`rope_tables` of these arguments, built once and kept (TABLES_KEPT per ``rope``):
    what :func:`split_launch` takes when not given tables, so that a repeated eager launch reads no
    host array (a pageable copy per call). Refused (ValueError) while a CUDA graph is being
    captured: a kept table may be dropped later while the graph still reads it; a captured launch
    passes tables of its own (``tables=``, as :class:`~subspace_ref_triton.workspace.DecodeWorkspace` does)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError("a launch captured in a CUDA graph needs tables of its own (split_launch(tables=rope_tables(...)), or DecodeWorkspace)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (d, block_t, device, *sorted(kw.items()))
    kept = _TABLES.setdefault(rope, OrderedDict())
    tables = kept.pop(key, None)  # re-inserted last: the most recent
    if tables is None:
        tables = rope_tables(rope, d, block_t, device, **kw)
    kept[key] = tables
    while len(kept) > TABLES_KEPT:
        kept.popitem(last=False)
    return tables


def default_block_t(key_bases_dtype, legacy: bool = False) -> int:
    """The launch's tile by default: LEGACY_BLOCK_T for the legacy kernel, FP32_BLOCK_T with float32
    bases, BLOCK_T with 16-bit ones."""
    return LEGACY_BLOCK_T if legacy else FP32_BLOCK_T if key_bases_dtype == torch.float32 else BLOCK_T


def split_launch(q, layout, rope, scale: float, split_len: int, first_position: int = 0, *, block_t: int | None = None, num_warps: int | None = None,
                 native: bool | None = None, legacy: bool = False, key_parts: int | None = None, group_rows: bool | None = None,
                 num_tokens=None, num_splits: int | None = None, outputs=None, tables: RopeTables | None = None, max_registers: int | None = None,
                 warp_softmax: bool | None = None):
    """The split kernel's launch (not run) and the partials (m, Z, N) it fills, float32, in the
    format of :func:`subspace_ref_triton.decode.split_launch` (m includes gamma * scale).
    ``layout``: a one-chunk layout of torch tensors (a static state's, bases decoded);
    ``first_position``: the position of compressed token 0 (spec/window.md W10: the sinks).
    ``block_t`` (a power of two >= 16), ``num_warps``, ``max_registers`` (0: no cap; by default
    :data:`MAX_REGISTERS` where :func:`default_max_registers` says) and ``native`` (False: float32
    products throughout, even where :func:`native16` allows the tensor cores) override the defaults,
    for the benchmark's sweep; ``key_parts`` (1 or 2): bfloat16 parts of the rotated keys in the logits
    (default 1 with bfloat16 bases, 2 with float16: see the kernel's step 3); ``legacy``: the kernel before the tensor-core form (``_rope_split_kernel``,
    float32 logits and value sums, BLOCK_T/NUM_WARPS of before), kept for timing against it; ``group_rows``: int4/int2
    key scales and zero points read one row per key group wherever the tiles allow it (True), never
    (False), or by default where a tile holds two key groups (None; ``GROUP_ROWS`` below);
    ``warp_softmax``: each warp's rows of a tile keep a softmax of their own, merged once per split
    (``WARPS``; the module docstring's step 4): True needs 16-bit bases and at least 16 tokens a
    warp (ValueError otherwise), False takes one softmax a tile, None (default) the first wherever
    it can run (WARP_SOFTMAX_DEFAULT).

    ``num_tokens``, ``num_splits``, ``outputs``: as :func:`subspace_ref_triton.decode.split_launch`'s
    (a one-element int32 or int64 tensor on q's device holding T, read by the kernel, which derives the split
    length from it and ``num_splits``, required; the layout's ``num_tokens`` and ``split_len`` are then
    not read; preallocated ``(m, Z, N)``): a launch a CUDA graph captures and replays as the cache
    grows (:class:`~subspace_ref_triton.workspace.DecodeWorkspace`), the tensor-core kernel only.
    ``tables``: the launch's :func:`rope_tables` (``first_position`` is theirs), by default those
    :func:`cached_rope_tables` keeps; with them and ``outputs`` the launch allocates nothing."""
    N, Hq, d = q.shape
    H = layout.key_coef.shape[1]
    group = Hq // H
    device_t = num_tokens is not None
    if device_t:
        check_device_count(num_tokens, q)
    if device_t and num_splits is None:
        raise ValueError("a device-resident num_tokens needs num_splits (the grid does not depend on T)")
    if device_t and legacy:
        raise ValueError("the legacy kernel takes a host token count only (legacy=False for a device-resident num_tokens)")
    if warp_softmax and legacy:
        raise ValueError("warp_softmax is the tensor-core kernel's (legacy=False)")
    if warp_softmax is not None and not isinstance(warp_softmax, bool):
        raise ValueError(f"warp_softmax must be True, False or None, not {warp_softmax!r}")
    # ranks from the bases: int4/int2 coefficient rows are packed narrower (spec/quantization.md Q2)
    r, r_v, d_v = layout.key_bases.shape[3], layout.value_bases.shape[3], layout.value_bases.shape[4]
    T = 0 if device_t else int(layout.num_tokens)
    split_len = 0 if device_t else int(split_len)
    S = cdiv(T, split_len) if num_splits is None else int(num_splits)
    dev = q.device
    if outputs is None:
        outputs = (torch.empty((N, Hq, S), dtype=torch.float32, device=dev), torch.empty((N, Hq, S), dtype=torch.float32, device=dev),
                   torch.empty((N, Hq, S, d_v), dtype=torch.float32, device=dev))
    pm, pz, po = outputs
    kc, vc = layout.key_coef, layout.value_coef
    kb, vb = layout.key_bases[:, :, 0], layout.value_bases[:, :, 0]
    sides = side_formats(layout)
    ks, vs, kz, vz, tail = sides.operands
    m = rope.inv_freq.size
    f = d - 2 * m
    bt = block_t or default_block_t(kb.dtype, legacy)
    # checked before the tables are looked up, so a refused launch leaves their cache as it was:
    # the softmax per warp (warp_softmax): each warp's rows a softmax of their own, at least the 16
    # tokens a warp's value product takes (16-bit products: SPLIT below)
    nw = num_warps or NUM_WARPS
    # 16-bit bases: float32 operands of the products cut into 16-bit parts (also under the
    # interpreter, whose products of the parts are float32); float32 bases or native=False: float32
    split16 = kb.dtype in (torch.float16, torch.bfloat16) and native is not False
    per_warp = not legacy and split16 and bt % nw == 0 and bt // nw >= 16
    if warp_softmax is None:
        warp_softmax = WARP_SOFTMAX_DEFAULT and per_warp
    if warp_softmax and not per_warp:
        raise ValueError(f"warp_softmax needs 16-bit bases with 16-bit products (native not False) and at least 16 tokens a warp "
                         f"(block_t {bt} on {nw} warps, bases {kb.dtype}, native {native})")
    if key_parts is None:  # bfloat16 bases: one key part (well inside the harness tolerance; float16 bases: a large share of it)
        key_parts = 1 if kb.dtype == torch.bfloat16 else 2
    if key_parts not in (1, 2):
        raise ValueError(f"key_parts must be 1 or 2, not {key_parts!r}")
    if tables is None:
        tables = cached_rope_tables(rope, d, bt, dev, capacity=kc.shape[2] if device_t else None, num_splits=None if device_t else S,
                                    split_len=None if device_t else split_len, first_position=first_position, legacy=legacy)
    elif (tables.block_t != bt or tables.split_len != (None if device_t else split_len) or (tables.offsets.dtype == torch.float64) != legacy
          or tables.bases.shape[0] * bt < (kc.shape[2] if device_t else S * split_len)):
        raise ValueError(f"the rope tables (tiles of {tables.block_t}, split_len {tables.split_len}, {tables.bases.shape[0]} base rows) do not fit this launch "
                         f"(tiles of {bt}, {'a device token count over a capacity of ' + str(kc.shape[2]) if device_t else f'{S} splits of {split_len}'})")
    tiles = cdiv(split_len, bt)
    pointers = (q, kc, vc, kb, vb, layout.gamma.contiguous(), ks, vs, kz, vz, tail, tables.order, tables.offsets, tables.bases, pm, pz, po)
    args = (
        H, group, T, split_len, S, float(scale), tiles,
        d, d_v, r, r_v, m, f,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        kb.stride(0), kb.stride(1), kb.stride(2),
        vb.stride(0), vb.stride(1), vb.stride(2),
        *sides.strides(layout),
    )
    constexprs = {
        "G": pow2_at_least(group, DOT_ROWS), "M": pow2_at_least(m), "F": pow2_at_least(f), "DV": pow2_at_least(d_v),
        "R": pow2_at_least(r), "RV": pow2_at_least(r_v), "BLOCK_T": bt, **sides.constexprs(), "HAS_FIXED": f > 0,
    }
    constexprs["NATIVE16"] = native16(kc, kb, constexprs) and native is not False
    if legacy:
        return Launch(_rope_split_kernel, (N * H, S), pointers + args, constexprs, num_warps or LEGACY_NUM_WARPS, max_registers or None), outputs
    # the device token count (a stand-in when on the host: never read)
    args = pointers + (num_tokens if device_t else pm,) + args
    constexprs["DEVICE_T"] = device_t
    constexprs["MIN_SPLIT"] = cdiv(MIN_SPLIT_TOKENS, bt) * bt if device_t else 1  # a multiple of the tile: splits start on tiles
    constexprs["SPLIT"] = split16
    # low-bit keys enter the rebuild as 16-bit parts too: the coefficients' storage does not matter here
    constexprs["NATIVE16"] = constexprs["SPLIT"] and native16(kb, kb, constexprs)
    constexprs["RANKS_FULL"] = r == constexprs["R"] and r_v == constexprs["RV"]
    constexprs["KGROUP"] = int(layout.group) if sides.k_bits else 1
    constexprs["INTERPRETED"] = interpreting()
    # quantised codes read as 32-bit words (_rope_tl) where whole rows of a 16-bit-based state are
    # 4-byte aligned: the alignment in bytes (16, 8 or 4: wider loads); 0: per code
    for side, coef, rank, int8, bits in (("K", kc, r, sides.k_int8, sides.k_bits), ("V", vc, r_v, sides.v_int8, sides.v_bits)):
        row_bytes = rank if int8 else rank * bits // 8
        constexprs[side + "_WORDS"] = next((w for w in (16, 8, 4) if (int8 or bits) and constexprs["SPLIT"] and constexprs["RANKS_FULL"]
                                            and all(x % w == 0 for x in (row_bytes, *coef.stride()[:3], coef.data_ptr()))), 0)
    # int4/int2 rows of both sides so short that a side's tile gives each thread under 8 bytes: both
    # sides in one load (_rope_tl.joint_low_bit_codes)
    constexprs["JOINT"] = bool(sides.k_bits and sides.k_bits == sides.v_bits and r == r_v and constexprs["K_WORDS"] and constexprs["V_WORDS"]
                               and bt * r * sides.k_bits // 32 < 2 * 32 * nw)
    constexprs["WARPS"] = nw if warp_softmax else 1
    constexprs["KEY_PARTS"] = key_parts
    # int4/int2 keys read as words: the whole tiles' key scales and zero points one row per key group
    # (_rope_tl.group_rows), possible where every tile starts on a group boundary and holds whole groups
    # (or lies in one); by default where a tile holds two groups (64-token tiles, the default group of
    # 32), chosen from the compiled loop's counts (docs/gpu.md, "Pre-RoPE kernel, scales folded per
    # group"); otherwise a row per token
    kg = constexprs["KGROUP"]
    # (a device token count: splits of whole tiles)
    whole = bool(sides.k_bits and constexprs["K_WORDS"] and (bt % kg == 0 or kg % bt == 0) and (device_t or split_len % min(kg, bt) == 0))
    constexprs["GROUP_ROWS"] = whole and (bt == 2 * kg if group_rows is None else bool(group_rows))
    if max_registers is None:
        max_registers = default_max_registers(kb.dtype, max(d, d_v), nw, constexprs)
    return Launch(_rope_mma_kernel, (N * H, S), args, constexprs, nw, max_registers or None), outputs


def default_max_registers(key_bases_dtype, head_size: int, num_warps: int, constexprs: dict) -> int:
    """The tensor-core form's register cap by default (0: none): :data:`MAX_REGISTERS` where it was
    compiled without a spill, eager and graph-capturable: bfloat16 bases with one key part (the
    packed rotation), the default tile and warps, head size 128 rotated whole, the GQA group padded
    to 4 rows (g <= 4), both ranks 32, no int2 side. A group of 8, ranks of 8, 16 (int4, graph),
    24 or 64, partial rotary (int4), int2 or head size 256 spill under it (docs/gpu.md, "Pre-RoPE
    kernel, three programs per SM")."""
    c = constexprs
    default = key_bases_dtype == torch.bfloat16 and c["KEY_PARTS"] == 1 and c["BLOCK_T"] == BLOCK_T and num_warps == NUM_WARPS
    shape = head_size == 128 and not c["HAS_FIXED"] and c["G"] == 4 and c["RANKS_FULL"] and c["R"] == c["RV"] == 32
    return MAX_REGISTERS if default and shape and 2 not in (c["K_BITS"], c["V_BITS"]) else 0


def offset_angles(freq, block_t: int):
    """float32 ``cos(k theta_i)``, ``sin(k theta_i)`` (float64 inside) of the in-tile offsets
    ``k < block_t``, ``(2, block_t, m)``: the keys' rotation inside a tile (no float64 in the kernel)."""
    angle = torch.arange(block_t, dtype=torch.float64, device=freq.device)[:, None] * freq[None, :]
    return torch.stack([torch.cos(angle), torch.sin(angle)]).to(torch.float32).contiguous()


def base_angles(freq, num_splits: int, split_len: int, block_t: int, first_position: int, attention_scaling: float):
    """float32 ``a cos(p theta_i)``, ``a sin(p theta_i)`` (float64 inside) at the first position
    ``p`` of every tile of every split, ``(num_splits x tiles per split, 2, m)``: the kernel reads a
    row per tile instead of taking float64 cos/sin in its loop (docs/gpu.md, "Static budgets")."""
    tiles = cdiv(split_len, block_t)
    k = torch.arange(num_splits * tiles, dtype=torch.float64, device=freq.device)
    pos = first_position + torch.div(k, tiles, rounding_mode="floor") * split_len + torch.remainder(k, tiles) * block_t
    angle = pos[:, None] * freq[None, :]
    return (torch.stack([torch.cos(angle), torch.sin(angle)], 1) * attention_scaling).to(torch.float32).contiguous()


def native16(key_coef, key_bases, constexprs: dict) -> bool:
    """Whether the rebuild runs on the tensor cores (module docstring): a compiled launch, 16-bit
    bases, coefficients of their dtype or int8, and every dimension of the products at least the
    16 an MMA tile needs."""
    dims = [constexprs["BLOCK_T"], constexprs["R"], constexprs["M"]] + ([constexprs["F"]] if constexprs["HAS_FIXED"] else [])
    return (
        not interpreting()
        and key_bases.dtype in (torch.float16, torch.bfloat16)
        and key_coef.dtype in (key_bases.dtype, torch.int8)
        and min(dims) >= 16
    )


def attention_partials(q, layout, rope, scale: float, split_len: int | None = None, first_position: int = 0, **launch):
    """The split partials (m, Z, N) (spec A3.2) that :func:`decode_attention` merges (exact
    tokens add theirs: :mod:`subspace_ref_triton.window_decode`); compressed token t sits at
    position ``first_position + t`` (spec/window.md W10)."""
    # splits of whole tiles (BLOCK_T: a multiple of every default tile)
    split, partials = sized_launch(lambda s: split_launch(q, layout, rope, scale, s, first_position, **launch), q, layout, split_len,
                                   ("rope", rope.inv_freq.size), launch, launch.get("block_t") or BLOCK_T)
    split.run()
    return partials


def decode_attention(q, layout, rope, scale: float | None = None, split_len: int | None = None, **launch):
    """Spec/rope.md P3 of q (N, H_q, d) over a pre-RoPE static state's ``layout``: (N, H_q, d_v)
    in q's dtype, float32 inside."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pm, pz, po = attention_partials(q, layout, rope, scale, split_len, **launch)
    return merge_partials(pm, pz, po, q.dtype)


__all__ = ["BLOCK_T", "RopeTables", "attention_partials", "cached_rope_tables", "decode_attention", "default_block_t", "native16", "rope_tables", "split_launch"]
