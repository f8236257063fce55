"""Decode attention over the chunked coefficient cache (spec A2, A3, A3.2 over the layout of A9),
as Triton kernels, each beside a pure-torch ``*_reference`` with the same signature.

Flash-decoding in two launches:

1. :func:`decode_partials` — grid ``(N * H, S)``: one program per (sequence, KV head) and split
   of the token axis. A program owns the ``g = H_q / H`` query heads of one GQA group, so every
   coefficient it loads serves all of them (the group is padded to a power of two, at least
   DOT_ROWS rows, inside the kernel). It walks the chunks that intersect its split (a split may
   straddle many chunks; a chunk may straddle many splits), and per chunk

   * projects the queries in-kernel, ``q~_j = B_j q`` (spec A3 step 2.1) — one
     ``(g x d) @ (d x r)`` product per chunk and split. Precomputing q~ for all chunks in torch
     would need an ``(N, H_q, J, r)`` temporary and a second launch, and saves nothing: the
     kernel reads ``B_j`` once per (chunk, split) either way, from L2 after the first split;
   * runs the one-pass softmax of spec A3 over tiles of ``BLOCK_T`` tokens with the running
     max ``m``, normaliser ``Z`` and a value-*coefficient* accumulator (``g x r_v``) in float32;
   * maps the accumulator through ``E_j`` once per chunk (spec A2 step 4), not per token; with
     16-bit bases the chunk's ``acc E_j`` is added to the split's own row of the partial ``N`` in
     memory, so no ``g x d_v`` tile stays in registers through the loops.

   It writes the split's partial ``(m, Z, N)`` of spec A3.2 in float32; an empty split writes the
   identity ``(-inf, 0, 0)``.
2. :func:`merge_partials` — one program per (sequence, query head) and block of MERGE_COLUMNS
   output columns merges the ``S`` partials by log-sum-exp (spec A3.2) and writes ``N / Z`` in
   the output dtype.

Optionally one launch (``decode_attention(..., fused_merge=True)``, :func:`fused_launch`; off by
default: timed slower than the two launches under a CUDA graph, faster eager; docs/gpu.md, "The
merge at N = 1"): each split
program counts its written partial on a per-(sequence, KV head) counter, and the one that writes
the last merges them by the same formula (``_merge_row``) over whole rows in steps of
MERGE_BLOCK_S splits; the merge launch's steps differ, and compiled, the fused sum runs on the
split kernel's warps, so float32 outputs may differ in the order of that sum
(tests/test_triton_fused_merge.py bounds it).

Precision. Everything the softmax sees is float32. For a float32 state the products are float32
FMAs (``input_precision="ieee"``, never TF32). For a 16-bit state the two per-token products
(logits ``q~ . c_t`` and the weighted sum ``w . D``) run on tensor cores: the 16-bit coefficients
are exact operands, and the float32 operand (``q~``, cut once per chunk; the weights, per tile)
is split into 16-bit parts whose sum is itself to float32 accuracy -- 2 parts of 11 bits for
float16, 3 parts of 8 bits for bfloat16 -- each multiplied with float32 accumulation. A plain
16-bit MMA would round ``q~`` and the weights to 8 (bfloat16) bits, a logit error of ~2^-9
|logit|; the split costs 2-3 MMAs where the kernel is bound by memory. The once-per-chunk
products (``B_j q``, ``acc E_j``) are float32 FMAs.

INT8 coefficients (spec A10: ``c_t = s_t q_t`` with one float32 scale per token and head) are
dequantised inside the kernel: with 16-bit bases ``q_t`` is converted exactly to float16 where it
is loaded (the products then take 2 float16 parts of the other operand, whatever the bases'
16-bit type), the key scales multiply the logits column by column, and the value scales are
folded into the softmax weights before the weighted sum. The cache then streams ``r + r_v`` bytes plus 8 bytes
of scales per token and head.

int4 and int2 coefficients with 16-bit bases take spec/quantization.md Q6's centred form
(:func:`centred_int4`; docs/gpu.md, "Static budgets"): the key scales of a tile's one group are
folded into the query and a bias, the value scales into the weights, and the codes enter the
bfloat16 tensor-core products as exact integers ``c - M`` (M = 8 or 2).

Under ``TRITON_INTERPRET=1`` the 16-bit MMAs are replaced by float32 products of the same 16-bit
parts (the interpreter's bfloat16 ``tl.dot`` is wrong; products of 16-bit numbers are exact in
float32, so the two agree up to summation order).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from subspace_ref_triton._common import check_device_count, Launch, cdiv, interpreting, pow2_at_least
from subspace_ref_triton.occupancy import GPU, full_wave_splits, resident_blocks
from subspace_ref_triton._tl import MAX_COMBINE as _MAX
from subspace_ref_triton._tl import SUM_COMBINE as _SUM
from subspace_ref_triton._tl import centred_pair_words, centred_words, exp2_ftz, int8_as_f16, low_bit_keys, low_bit_values, split3, split3_bits, to_storage, word_order


def _small_dots() -> bool:
    """Whether this Triton takes ``tl.dot`` operands with fewer than 16 rows (padding them itself)."""
    try:
        from triton.backends.nvidia.compiler import min_dot_size  # noqa: F401
    except ImportError:
        return False
    return True


BLOCK_T = 64  # tokens per split-length unit (splits stay tile-aligned); the tile itself is launch_config's
BLOCK_D = 32  # columns of q and B_j per step of the query projection (the interpreter takes all d)
# Rows of the query-head tile: the GQA group padded to a power of two, at least DOT_ROWS. Triton
# pads an MMA's M and N itself where its NVIDIA backend says so (min_dot_size): the softmax then
# runs on the group's rows, not 16 (docs/gpu.md, "Static budgets").
DOT_ROWS = 4 if _small_dots() else 16
MERGE_BLOCK_S = 16  # splits per step of the fused and exact merges, over whole rows: a (16 x d_v) float32 tile stays in registers
# The merge launch: MERGE_COLUMNS of d_v's columns per program, as many splits per step as fill a
# tile of MERGE_TILE float32 elements (128 at 32 columns), so up to 128 partials of a row are read
# in one step and its columns by d_v / 32 programs: timed 3.2x faster than whole rows of 16-split
# steps at N = 1 (docs/gpu.md, "The merge at N = 1").
MERGE_COLUMNS = 32
MERGE_TILE = 4096
# No split shorter than this: below, the per-split cost (query projection, partial write, merge)
# starts to dominate.
MIN_SPLIT_TOKENS = 256
# Resident split programs per SM when the compiled kernel cannot be asked: what the uncapped
# 16-bit defaults fit at the benchmark's shape (179-255 registers x 4 warps: 2 per SM on sm_90).
FALLBACK_RESIDENT = 2
# Register caps of the split kernel with 16-bit bases (launch_config, Triton's maxnreg), chosen
# by GPU timing: more resident programs per SM hide the loads' latency better than the registers
# ptxas would keep (docs/gpu.md, "Register caps", has the figures). The capped kernels spill a few
# dozen bytes per thread; the compile report lists them as spilling by choice.
QUANTISED_MAX_REGISTERS = 128
# int4's centred form with the tile's tokens on the MMA's M dimension (TOKENS_M): 539 instead of
# 647 instructions in the sm_90 main loop (bf16, r = 32, 2 warps), half the MMAs; not yet timed.
# split_launch(..., tokens_m=False) keeps the query-heads-on-M form for timing against it.
TOKENS_M_DEFAULT = True
# Warps of the int4/int2 split kernel in the centred form (centred_int4): fewest instructions per
# token in the compiled loop (docs/gpu.md, "Static budgets"); timed on one warp only, under caps.
CENTRED_WARPS = 1
# Code widths read in the centred form (centred_int4): int2 joined int4 there, as its words took
# fewer instructions in the compiled loop than the per-code c s + z reader (not yet timed).
CENTRED_BITS = (4, 2)
# bfloat16 parts of a_j = q~_j s_j and of the weights in the centred form: what the harness's
# tolerance of a low-bit state in the bases' dtype takes (tests/differential/tolerance.py), one
# part with bfloat16 bases, two (16 bits, more than float16's 11) with float16 bases. The hot loop
# of whole key-group pairs (PAIRS) takes the weights with float16 bases as one float16 part instead
# (_centred_pair_t: 11 bits rounded, about 8 bits better than one bfloat16 part truncated).
CENTRED_PARTS = {torch.bfloat16: 1, torch.float16: 2}
# Warps of the split kernel with int8 coefficients and 16-bit bases, on 64-token tiles: one warp
# runs a tile's softmax without reductions across warps (docs/gpu.md, "Static budgets"); uncapped,
# timed faster than 4 warps capped at QUANTISED_MAX_REGISTERS (docs/gpu.md, "Caps timed, and a softmax per warp by default").
INT8_WARPS = 1
# Warps of the split kernel with float coefficients and 16-bit bases, on 64-token tiles: within
# the float budget with no spill on sm_80 or sm_90 (one warp takes fewer instructions per token
# but spills at ptxas's 255-register limit); chosen from the compiled code alone, not timed.
FLOAT16_WARPS = 2
# The cap of the float configuration GPU-timed before the static budgets (32-token tiles, 4
# warps): for timing against FLOAT16_WARPS (split_launch(..., block_t=32, num_warps=4, max_registers=...)).
FLOAT16_MAX_REGISTERS = 96
# Register cap of the default two-warp float launch where it compiled with no spill (default_max_registers):
# 6 programs per SM instead of 4 (docs/gpu.md, "N in the partial"); chosen from the compiled code.
FLOAT16_WARPS_MAX_REGISTERS = 160
# Register cap of the default one-warp int4/int2 launch in the centred form (default_max_registers):
# timed fastest on an H200, against 176 (the cap chosen before from the compiled code) and no cap;
# the int8 one-warp launch timed fastest uncapped (docs/gpu.md, "Caps timed, and a softmax per warp by default").
CENTRED_MAX_REGISTERS = 168
INT8_UNCAPPED_MEASURED = (
    "int8 on one warp (INT8_WARPS) left uncapped: timed faster on a GPU than capped at 168 or 176 (d = 128, r = 32, g = 4 on an "
    "H200; other shapes untimed); the spills are ptxas's own at its 255-register limit, outside the main loop: docs/gpu.md, "
    "\"Caps timed, and a softmax per warp by default\""
)
REGISTER_CAPS_MEASURED = (
    "register cap (QUANTISED_MAX_REGISTERS, FLOAT16_MAX_REGISTERS, CENTRED_MAX_REGISTERS): timed faster on a GPU than the "
    "uncapped kernel (the centred cap for int4 at d = 128, r = 32, g = 4 on an H200; int2, rank 16 and sm_80 take it untimed), "
    "the figures in docs/gpu.md, \"Register caps\" and \"Caps timed, and a softmax per warp by default\""
)
# 16-bit pieces a float32 operand is cut into for a tensor-core product with exact 16-bit
# coefficients: 2 x 11 bits for float16, 3 x 8 bits for bfloat16 (float32 has 24).
_PARTS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


# ---------------------------------------------------------------------------------------- kernels


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    kb_ptr,
    vb_ptr,
    starts_ptr,
    nchunks_ptr,
    gamma_ptr,
    ks_ptr,
    vs_ptr,
    kz_ptr,
    vz_ptr,
    tail_ptr,
    pm_ptr,
    pz_ptr,
    po_ptr,
    ntok_ptr,
    H,
    group,
    num_tokens,
    split_len,
    num_splits,
    scale,
    d,
    d_v,
    r,
    r_v,
    sq_n,
    sq_h,
    skc_n,
    skc_h,
    skc_t,
    svc_n,
    svc_h,
    svc_t,
    skb_n,
    skb_h,
    skb_j,
    skb_r,
    svb_n,
    svb_h,
    svb_j,
    svb_r,
    sst_n,
    sst_h,
    snc_n,
    snc_h,
    sks_n,
    sks_h,
    sks_t,
    svs_n,
    svs_h,
    svs_t,
    kgroup,
    stl_n,
    stl_h,
    stl_t,
    cnt_ptr,
    out_ptr,
    so_n,
    so_h,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    R: tl.constexpr,
    RV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTS: tl.constexpr,
    NATIVE16: tl.constexpr,
    Q_NATIVE: tl.constexpr,
    K_INT8: tl.constexpr,
    V_INT8: tl.constexpr,
    K_BITS: tl.constexpr,
    V_BITS: tl.constexpr,
    MANUAL_BF16: tl.constexpr,
    DEVICE_T: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    CENTRED: tl.constexpr,
    INTERPRETED: tl.constexpr,
    TOKENS_M: tl.constexpr = True,
    RANKS_FULL: tl.constexpr = False,
    CPARTS: tl.constexpr = 3,
    Z_SLOTS: tl.constexpr = False,
    FUSED: tl.constexpr = False,
    MERGE_S: tl.constexpr = 16,
    OUT_BF16: tl.constexpr = False,
    PAIRS: tl.constexpr = False,
    WIDE_CODES: tl.constexpr = False,
):
    # Few nested @triton.jit calls in the loops (tl.max, tl.sum, tl.zeros are; see _tl.py): under
    # the interpreter each one re-patches triton.language, so the 16-bit split products are
    # written out inline (the int4 path's _centred_values serves its two loops: one per tile).
    nh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = nh // H
    h = nh % H
    # The dtype the per-token products run in: the bases' (int8 coefficients, spec A10, beside an
    # int4/int2 side are converted to it exactly: |q| <= 127 fits the 8-bit mantissa of bfloat16).
    COEF = kb_ptr.dtype.element_ty
    ROWS: tl.constexpr = COEF != tl.float32  # low-bit codes read as whole rows with 16-bit bases (_tl.tile_codes)
    # _tile16's product dtypes: int8 codes as float16 (exact, and 2 parts of q~ or the weights suffice), float coefficients their own
    KDT = tl.float16 if K_INT8 and PARTS > 1 and K_BITS == 0 and V_BITS == 0 else COEF
    VDT = tl.float16 if V_INT8 and PARTS > 1 and K_BITS == 0 and V_BITS == 0 else COEF
    # logits and m in log2 units (the logit scale times log2 e, 2^x by one ex2) in _tile16 and the
    # centred form with tokens on M; m back in natural units where the partials are written
    LOG2: tl.constexpr = PARTS > 1 and ((K_BITS == 0 and V_BITS == 0) or (CENTRED and TOKENS_M))

    offs_g = tl.arange(0, G)
    offs_dv = tl.arange(0, DV)
    # columns of E_j per step of the chunk's epilogue with 16-bit bases
    DV_SLICE: tl.constexpr = 32 if DV > 32 else DV
    offs_r = tl.arange(0, R)
    offs_rv = tl.arange(0, RV)
    g_mask = offs_g < group
    if RANKS_FULL:  # r = R and r_v = RV: no mask on the rank axis (wide loads, fewer predicates)
        r_mask = tl.full([R], 1, tl.int1)
        rv_mask = tl.full([RV], 1, tl.int1)
    else:
        r_mask = offs_r < r
        rv_mask = offs_rv < r_v
    if CENTRED:  # int4/int2 rows read as 32-bit words put the channels in this order (_tl.centred_words)
        key_r = word_order(offs_r, K_BITS)
        val_rv = word_order(offs_rv, K_BITS)
    else:
        key_r = offs_r
        val_rv = offs_rv

    # The g query heads of KV head h are rows h*g .. h*g+g-1 (spec notation); padded rows are 0,
    # so their logits are 0 and finite, and their outputs are never stored.
    # q is re-read (from L1/L2) for each chunk rather than held in registers across the loops.
    q_rows = q_ptr + n * sq_n + (h * group + offs_g)[:, None] * sq_h

    kc_base = kc_ptr + n * skc_n + h * skc_h
    vc_base = vc_ptr + n * svc_n + h * svc_h
    ks_base = ks_ptr + n * sks_n + h * sks_h
    vs_base = vs_ptr + n * svs_n + h * svs_h
    # int4/int2 (spec/quantization.md Q2): the key scales and zero points share the strides of
    # ks (per group), the value ones those of vs (per token); the launcher checks this
    kz_base = kz_ptr + n * sks_n + h * sks_h
    vz_base = vz_ptr + n * svs_n + h * svs_h
    tail_base = tail_ptr + n * stl_n + h * stl_h
    kb_base = kb_ptr + n * skb_n + h * skb_h
    vb_base = vb_ptr + n * svb_n + h * svb_h
    st_base = starts_ptr + n * sst_n + h * sst_h
    nj = tl.load(nchunks_ptr + n * snc_n + h * snc_h)
    logit_scale = tl.load(gamma_ptr + h).to(tl.float32) * scale

    if DEVICE_T:
        # The token count is read from the device and the split length derived from it, so a
        # captured CUDA graph replays correctly as the cache grows (grid fixed by the capacity).
        num_tokens = tl.load(ntok_ptr).to(tl.int32)
        split_len = (num_tokens + num_splits - 1) // num_splits
        split_len = tl.maximum((split_len + BLOCK_T - 1) // BLOCK_T * BLOCK_T, MIN_SPLIT)
    lo = s * split_len
    hi = tl.minimum(lo + split_len, num_tokens)
    # Keys of tokens below this are read from their group's codes, the rest from key_tail
    # (spec/quantization.md Q2.2); with DEVICE_T it follows the token count read above.
    complete = num_tokens // kgroup * kgroup

    # The chunk holding token lo: the last j < nj with starts[j] <= lo (starts[0] = 0). Entries
    # past num_chunks are spare capacity and are never read.
    a = nj * 0
    b = nj - 1
    while a < b:
        mid = (a + b + 1) // 2
        go_right = tl.load(st_base + mid) <= lo
        a = tl.where(go_right, mid, a)
        b = tl.where(go_right, b, mid - 1)
    j = a

    m_i = tl.full([G], float("-inf"), tl.float32)  # running max of spec A3
    z_i = tl.full([G], 0.0, tl.float32)
    m_o = tl.full([G], float("-inf"), tl.float32)  # the scale of N (spec A3)
    o_i = tl.full([G, DV], 0.0, tl.float32)  # N with float32 bases; 16-bit bases keep it in po
    row = (n * H + h) * group + offs_g  # (N, H_q) row of each query head
    if Z_SLOTS:
        z_t = tl.full([G, BLOCK_T], 0.0, tl.float32)  # _tile16's Z, per token slot
    else:
        z_t = z_i

    # token indices in int32 with 16-bit bases: 32-bit masks and loop counters (float32 bases keep
    # int64: ptxas spills their kernel on sm_80 otherwise)
    TOK = tl.int32 if PARTS > 1 else tl.int64
    start_j = tl.load(st_base + j).to(TOK)
    # An empty split (lo >= hi) never enters the loop and writes the identity (-inf, 0, 0).
    while (j < nj) & (start_j < hi) & (lo < hi):
        has_next = j + 1 < nj
        end_j = tl.where(has_next, tl.load(st_base + j + 1, mask=has_next, other=0).to(TOK), num_tokens)
        c_lo = tl.maximum(start_j, lo)
        c_hi = tl.minimum(end_j, hi)

        # Spec A3 step 2.1, once per (chunk, split) for all g heads of the group, in slices of
        # BLOCK_D columns: a float32 FMA product with the whole d as its inner dimension needs
        # hundreds of registers per thread. Same-dtype 16-bit q and B_j multiply on tensor cores
        # (their products are exact in float32). 2-D offsets are formed where used, never
        # hoisted: live across the loops they would cost a register per element.
        q_proj = tl.full([G, R], 0.0, tl.float32)
        for d0 in tl.static_range(0, D, BLOCK_D):
            offs_dd = d0 + tl.arange(0, BLOCK_D)
            qb = tl.load(q_rows + offs_dd[None, :], mask=g_mask[:, None] & (offs_dd < d)[None, :], other=0.0)
            Bb = tl.load(kb_base + j * skb_j + key_r[:, None] * skb_r + offs_dd[None, :], mask=r_mask[:, None] & (offs_dd < d)[None, :], other=0.0)
            if Q_NATIVE:
                q_proj = tl.dot(qb, tl.trans(Bb), acc=q_proj)
            else:
                q_proj = tl.dot(qb.to(tl.float32), tl.trans(Bb.to(tl.float32)), acc=q_proj, input_precision="ieee")
        if PARTS > 1:
            # q~ cut into 16-bit parts once per chunk (hi + mid [+ lo] = q~ to float32
            # accuracy), after a power-of-two rescaling that keeps the parts inside float16's
            # range whatever the size of q; exact, and undone on the float32 logits.
            q_abs = tl.reduce(tl.abs(q_proj), 1, _MAX)
            q_unit = tl.exp2(tl.ceil(tl.log2(tl.where(q_abs > 0, q_abs, 1.0))))
            q_proj = q_proj / q_unit[:, None]
            row_scale = q_unit * logit_scale
            if LOG2:
                row_scale = row_scale * 1.4426950408889634
            q_hi = q_proj.to(KDT)
            q_rest = q_proj - q_hi.to(tl.float32)
            q_mid = q_rest.to(KDT)
            q_lo = (q_rest - q_mid.to(tl.float32)).to(KDT)
            if not NATIVE16:
                q_hi = q_hi.to(tl.float32)
                q_mid = q_mid.to(tl.float32)
                q_lo = q_lo.to(tl.float32)
        else:
            row_scale = tl.full([G], 0.0, tl.float32) + logit_scale
            q_hi = q_proj  # unused: float32 bases take q~ whole
            q_mid = q_proj
            q_lo = q_proj

        acc = tl.full([G, RV], 0.0, tl.float32)  # value-coefficient accumulator, at scale m_i
        if CENTRED:
            # int4/int2 in spec/quantization.md Q6's centred form (centred_int4; docs/gpu.md, "Static budgets"):
            # tiles of one key group each (CT = group, tiles group-aligned; with PAIRS the hot loop
            # takes two of them, BLOCK_T = 2 CT), so a tile's key scales are one row, folded into the
            # query (a_j = q~_j s_j) and a bias per query head; the value scales go into the weights.
            # The codes enter the products as small integers.
            CT: tl.constexpr = BLOCK_T // 2 if PAIRS else BLOCK_T
            MID: tl.constexpr = 1 << (K_BITS - 1)
            zacc = tl.full([G], 0.0, tl.float32)  # sum_t w_t (zeta_t + M tau_t), at scale m_i
            # TOKENS_M: the tile's tokens on the MMA's M dimension (logits^T = codes @ a_j^T, and
            # acc^T = codes^T @ w^T), so the GQA group is the small N of both products, not M
            # padded to 16 rows; the accumulator is kept transposed (RV x G) until the chunk's end
            acc_t = tl.full([RV, G], 0.0, tl.float32)
            offs_ct = tl.arange(0, CT)
            t_first = c_lo // CT * CT
            coded_hi = tl.minimum(c_hi, complete)
            if TOKENS_M:
                # Z and zacc per token slot (CT x G, at scale m_i), summed once per chunk: no
                # reductions across lanes per tile
                m_start = m_i
                q_proj = q_proj * row_scale[:, None]  # the logit scale folded into q~ once per chunk
                z_s = tl.full([CT, G], 0.0, tl.float32)
                za_s = tl.full([CT, G], 0.0, tl.float32)
                # Tiles wholly inside [c_lo, coded_hi) without masks in the hot loop; the partial
                # first and last tiles after it, masked (spec A3.1: any order of the tiles).
                full_lo = (c_lo + CT - 1) // CT * CT
                full_hi = coded_hi // CT * CT
                if PAIRS:
                    # whole tiles two key groups at a time, as two softmax streams side by side on N
                    # (_centred_pair_t), merged into the one stream after the loop; an odd last whole tile alone
                    pair_hi = full_lo + (full_hi - full_lo) // BLOCK_T * BLOCK_T
                    offs_2r = tl.arange(0, 2 * R)
                    key_r2 = word_order(offs_2r, K_BITS) % R
                    # q~ in the channels' natural order (word_order is its own inverse), one row per (stream, head)
                    q_n = tl.gather(q_proj, tl.broadcast_to(word_order(offs_r, K_BITS)[None, :], (G, R)), 1)
                    q_n = tl.reshape(tl.broadcast_to(q_n[None, :, :], (2, G, R)), (2 * G, R))
                    m2 = tl.full([2 * G], float("-inf"), tl.float32)
                    z2 = tl.full([CT, 2 * G], 0.0, tl.float32)
                    za2 = tl.full([CT, 2 * G], 0.0, tl.float32)
                    acc2 = tl.full([2 * RV, 2 * G], 0.0, tl.float32)
                    for t0 in range(full_lo, pair_hi, BLOCK_T):  # sass: main loop
                        m2, z2, acc2, za2 = _centred_pair_t(t0, q_proj, q_n, key_r2, ks_base, kz_base, kc_base, sks_t, skc_t, vc_base, vs_base, vz_base,
                                                            svc_t, svs_t, m2, z2, acc2, za2, CT, R, RV, NATIVE16, INTERPRETED, CPARTS, K_BITS, WIDE_CODES)
                    if pair_hi < full_hi:
                        m_i, z_s, acc_t, za_s = _centred_tile_t(pair_hi, c_lo, coded_hi, q_proj, key_r, ks_base, kz_base, kc_base, sks_t, skc_t,
                                                                vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t, m_i, z_s, acc_t, za_s,
                                                                CT, NATIVE16, INTERPRETED, False, CPARTS, K_BITS)
                    if full_lo < pair_hi:  # the two streams into the one (spec A3.2's merge, per slot)
                        m_a, m_b = _halves(m2)
                        m_new = tl.maximum(m_i, tl.maximum(m_a, m_b))
                        sc = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_new))
                        sc_a = tl.where(m_a == float("-inf"), 0.0, tl.exp2(m_a - m_new))
                        sc_b = tl.where(m_b == float("-inf"), 0.0, tl.exp2(m_b - m_new))
                        z_a, z_b = _halves(z2)
                        z_s = z_s * sc[None, :] + z_a * sc_a[None, :] + z_b * sc_b[None, :]
                        za_a, za_b = _halves(za2)
                        za_s = za_s * sc[None, :] + za_a * sc_a[None, :] + za_b * sc_b[None, :]
                        rows_a, rows_b = _halves(tl.trans(acc2))  # (2G, RV): group A's channels, group B's
                        acc_a, _ = _halves(tl.trans(rows_a))
                        _, acc_b = _halves(tl.trans(rows_b))
                        acc_t = acc_t * sc[None, :] + acc_a * sc_a[None, :] + acc_b * sc_b[None, :]
                        m_i = m_new
                else:
                    for t0 in range(full_lo, full_hi, CT):  # sass: main loop
                        m_i, z_s, acc_t, za_s = _centred_tile_t(t0, c_lo, coded_hi, q_proj, key_r, ks_base, kz_base, kc_base, sks_t, skc_t,
                                                                vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t, m_i, z_s, acc_t, za_s,
                                                                CT, NATIVE16, INTERPRETED, False, CPARTS, K_BITS)
                last_t = (coded_hi - 1) // CT * CT
                for e in range(0, 2):
                    t0 = tl.where(e == 0, t_first, last_t)
                    partial = (t0 < c_lo) | (t0 + CT > coded_hi)
                    if (c_lo < coded_hi) & partial & ((e == 0) | (last_t != t_first)):
                        m_i, z_s, acc_t, za_s = _centred_tile_t(t0, c_lo, coded_hi, q_proj, key_r, ks_base, kz_base, kc_base, sks_t, skc_t,
                                                                vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t, m_i, z_s, acc_t, za_s,
                                                                CT, NATIVE16, INTERPRETED, True, CPARTS, K_BITS)
            else:
                for t0 in range(t_first, coded_hi, CT):  # sass: main loop
                    tok = t0 + offs_ct
                    t_mask = (tok >= c_lo) & (tok < coded_hi)
                    grp = t0 // CT
                    s_k = tl.load(ks_base + grp * sks_t + key_r, mask=r_mask, other=0.0).to(tl.float32)
                    z_k = tl.load(kz_base + grp * sks_t + key_r, mask=r_mask, other=0.0).to(tl.float32)
                    bias = tl.reduce(q_proj * (z_k + MID * s_k)[None, :], 1, _SUM)
                    u = q_proj * s_k[None, :]
                    # codes and a_j in bfloat16 whatever the bases' 16-bit type: float32's range, so no
                    # power-of-two rescaling per tile; a_j in 3 parts (float32 accuracy)
                    y = centred_words(kc_base.to(tl.pointer_type(tl.uint32)), tok, t_mask, skc_t // 4, R, K_BITS, tl.bfloat16, INTERPRETED)  # (BLOCK_T, R), exact
                    u_hi, u_mid, u_lo = split3(u, tl.bfloat16)
                    if NATIVE16:
                        yt = tl.trans(y)
                        logits = tl.dot(u_mid, yt)
                        logits = tl.dot(u_lo, yt, acc=logits)
                        logits = tl.dot(u_hi, yt, acc=logits)
                    else:
                        yt = tl.trans(y.to(tl.float32))
                        logits = tl.dot(u_mid.to(tl.float32), yt, input_precision="ieee")
                        logits = tl.dot(u_lo.to(tl.float32), yt, acc=logits, input_precision="ieee")
                        logits = tl.dot(u_hi.to(tl.float32), yt, acc=logits, input_precision="ieee")
                    logits = (logits + bias[:, None]) * row_scale[:, None]
                    m_i, z_i, acc, zacc = _centred_values(logits, tok, t_mask, m_i, z_i, acc, zacc, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t,
                                                          NATIVE16, INTERPRETED, K_BITS)
            # the unfinished group (spec/quantization.md Q2.2): float keys from key_tail, outside the hot loop
            for t0 in range(tl.maximum(t_first, complete), c_hi, CT):
                tok = t0 + offs_ct
                t_mask = (tok >= c_lo) & (tok < c_hi)
                k_tl = tl.load(tail_base + (tok - complete)[:, None] * stl_t + key_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
                if TOKENS_M:
                    lt = tl.dot(k_tl.to(tl.float32), tl.trans(q_proj), input_precision="ieee")
                    m_i, z_s, acc_t, za_s = _centred_values_t(lt, tok, t_mask, m_i, z_s, acc_t, za_s, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t,
                                                              NATIVE16, INTERPRETED, CPARTS, K_BITS)
                else:
                    logits = tl.dot(q_proj, tl.trans(k_tl.to(tl.float32)), input_precision="ieee") * row_scale[:, None]
                    m_i, z_i, acc, zacc = _centred_values(logits, tok, t_mask, m_i, z_i, acc, zacc, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t,
                                                          NATIVE16, INTERPRETED, K_BITS)
            if TOKENS_M:
                acc = tl.trans(acc_t)
                z_i = tl.where(m_start == float("-inf"), 0.0, z_i * tl.exp2(m_start - m_i)) + tl.reduce(z_s, 0, _SUM)
                zacc = tl.reduce(za_s, 0, _SUM)
            acc += zacc[:, None]
        else:
            # float or int8 coefficients with 16-bit bases (_tile16): whole tiles unmasked on the token
            # axis, then the split's partial last tile (if any). The others keep one masked loop: with
            # the two copies of the tile, int2 spilled in the loop at the cap and float32 bases spilled
            if K_BITS == 0 and V_BITS == 0 and PARTS > 1:
                full_hi = c_lo + (c_hi - c_lo) // BLOCK_T * BLOCK_T
                for t0 in range(c_lo, full_hi, BLOCK_T):  # sass: main loop
                    m_i, z_t, acc = _tile16(t0, c_hi, q_hi, q_mid, q_lo, row_scale, m_i, z_t, acc, kc_base, vc_base, ks_base, vs_base, skc_t, svc_t,
                                            sks_t, svs_t, r_mask, rv_mask, BLOCK_T, K_INT8, V_INT8, KDT, VDT, NATIVE16, INTERPRETED, False, Z_SLOTS)
                if full_hi < c_hi:
                    m_i, z_t, acc = _tile16(full_hi, c_hi, q_hi, q_mid, q_lo, row_scale, m_i, z_t, acc, kc_base, vc_base, ks_base, vs_base, skc_t,
                                            svc_t, sks_t, svs_t, r_mask, rv_mask, BLOCK_T, K_INT8, V_INT8, KDT, VDT, NATIVE16, INTERPRETED, True, Z_SLOTS)
            else:
                for t0 in range(c_lo, c_hi, BLOCK_T):  # sass: main loop
                    m_i, z_i, acc = _split_tile(t0, c_hi, kb_base, q_proj, q_hi, q_mid, q_lo, row_scale, m_i, z_i, acc, kc_base, vc_base, ks_base,
                                                vs_base, kz_base, vz_base, tail_base, skc_t, svc_t, sks_t, svs_t, stl_t, complete, kgroup, r, r_v,
                                                r_mask, rv_mask, BLOCK_T, PARTS, NATIVE16, K_INT8, V_INT8, K_BITS, V_BITS, MANUAL_BF16, ROWS, True)

        # Once per chunk, not per token: N <- N exp(m_o - m) + acc E_j (spec A2 step 4); m_o = -inf:
        # N is still 0 (and no -inf - -inf).
        o_scale = tl.where(m_o == float("-inf"), 0.0, tl.exp2(m_o - m_i) if LOG2 else tl.exp(m_o - m_i))
        if PARTS > 1:
            # 16-bit bases: N kept in this split's own row of po, not in registers across the loops
            # (a G x d_v float32 MMA tile held through the hot loop), and E_j taken DV_SLICE columns
            # at a time (docs/gpu.md, "N in the partial"). acc is cut into 16-bit parts as q~ above
            # (after a power-of-two rescaling per row: a chunk's weighted sum may exceed float16's
            # range), E_j exact: tensor cores.
            a_abs = tl.reduce(tl.abs(acc), 1, _MAX)
            a_unit = tl.exp2(tl.ceil(tl.log2(tl.where(a_abs > 0, a_abs, 1.0))))
            acc = acc / a_unit[:, None]
            a_hi = acc.to(COEF)
            a_rest = acc - a_hi.to(tl.float32)
            a_mid = a_rest.to(COEF)
            a_lo = (a_rest - a_mid.to(tl.float32)).to(COEF)
            o_seen = m_o > float("-inf")
            tl.debug_barrier()  # the previous chunk's stores to po precede the reads below, whichever thread made them
            for v0 in tl.static_range(0, DV, DV_SLICE):
                offs_v = v0 + tl.arange(0, DV_SLICE)
                E = tl.load(vb_base + j * svb_j + val_rv[:, None] * svb_r + offs_v[None, :], mask=rv_mask[:, None] & (offs_v < d_v)[None, :], other=0.0)
                if NATIVE16:
                    pe = tl.dot(a_mid, E)
                    if PARTS == 3:
                        pe = tl.dot(a_lo, E, acc=pe)
                    pe = tl.dot(a_hi, E, acc=pe)
                else:
                    ef = E.to(tl.float32)
                    pe = tl.dot(a_mid.to(tl.float32), ef, input_precision="ieee")
                    if PARTS == 3:
                        pe = tl.dot(a_lo.to(tl.float32), ef, acc=pe, input_precision="ieee")
                    pe = tl.dot(a_hi.to(tl.float32), ef, acc=pe, input_precision="ieee")
                o_ptrs = po_ptr + (row * num_splits + s)[:, None] * d_v + offs_v[None, :]
                o_mask = g_mask[:, None] & (offs_v < d_v)[None, :]
                o_prev = tl.load(o_ptrs, mask=o_mask & o_seen[:, None], other=0.0)
                tl.store(o_ptrs, o_prev * o_scale[:, None] + pe * a_unit[:, None], mask=o_mask)
        else:
            # float32 bases: N in registers, E_j whole (the form above took 204-255 registers here, not 112)
            E = tl.load(vb_base + j * svb_j + val_rv[:, None] * svb_r + offs_dv[None, :], mask=rv_mask[:, None] & (offs_dv < d_v)[None, :], other=0.0)
            o_i = tl.dot(acc, E.to(tl.float32), acc=o_i * o_scale[:, None], input_precision="ieee")
        m_o = m_i

        j += 1
        start_j = tl.load(st_base + j, mask=j < nj, other=0).to(TOK)

    if K_BITS == 0 and V_BITS == 0 and PARTS > 1:
        z_i = tl.reduce(z_t, 1, _SUM) if Z_SLOTS else z_t
    if LOG2:
        m_i = m_i * 0.6931471805599453
    tl.store(pm_ptr + row * num_splits + s, m_i, mask=g_mask)
    tl.store(pz_ptr + row * num_splits + s, z_i, mask=g_mask)
    o_mask = g_mask[:, None] & (offs_dv < d_v)[None, :]
    if PARTS > 1:  # an empty split's N is the identity's 0 (the chunks' epilogues wrote the others)
        o_mask = o_mask & (m_o == float("-inf"))[:, None]
    tl.store(po_ptr + (row * num_splits + s)[:, None] * d_v + offs_dv[None, :], o_i, mask=o_mask)
    if FUSED:
        # One launch for split + merge (spec A3.2): the program that writes the last partial of its
        # (sequence, KV head) merges them all, by the merge kernel's arithmetic (_merge_row).
        tl.debug_barrier()  # every thread's partial stores precede the release of the count below
        done = tl.atomic_add(cnt_ptr + nh, 1, sem="acq_rel")
        if done == num_splits - 1:
            for i in range(0, group):
                # .cg: the other programs' partials are read from L2, never from a stale L1 line
                merged = _merge_row(pm_ptr, pz_ptr, po_ptr, (n * H + h) * group + i, num_splits, d_v, 0, DV, MERGE_S, ".cg")
                tl.store(out_ptr + n * so_n + (h * group + i) * so_h + offs_dv, to_storage(merged, out_ptr, OUT_BF16), mask=offs_dv < d_v)
            tl.store(cnt_ptr + nh, 0)  # back to zero, so the next launch (or graph replay) reuses the counters


@triton.jit
def _centred_values(logits, tok, t_mask, m_i, z_i, acc, zacc, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t,
                    NATIVE16: tl.constexpr, INTERPRETED: tl.constexpr, BITS: tl.constexpr = 4):
    """One tile of the one-pass softmax (spec A3) with int4/int2 values in Q6's centred form:
    sum_t w_t x_t = sum_t (w_t tau_t)(c_t - M) + sum_t w_t (zeta_t + M tau_t), the first a product
    of the scaled weights with the small-integer codes (bfloat16, the weights in 3 parts), the
    second ``zacc``."""
    MID: tl.constexpr = 1 << (BITS - 1)
    logits = tl.where(t_mask[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(logits, 1, _MAX))
    alpha = tl.exp(m_i - m_new)
    w = tl.exp(logits - m_new[:, None])
    z_i = z_i * alpha + tl.reduce(w, 1, _SUM)
    tau = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    zeta = tl.load(vz_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    zacc = zacc * alpha + tl.reduce(w * (zeta + MID * tau)[None, :], 1, _SUM)
    wv = w * tau[None, :]
    y = centred_words(vc_base.to(tl.pointer_type(tl.uint32)), tok, t_mask, svc_t // 4, offs_rv.shape[0], BITS, tl.bfloat16, INTERPRETED)  # (BLOCK_T, RV), exact
    w_hi, w_mid, w_lo = split3(wv, tl.bfloat16)
    if NATIVE16:
        pv = tl.dot(w_mid, y)
        pv = tl.dot(w_lo, y, acc=pv)
        pv = tl.dot(w_hi, y, acc=pv)
    else:
        yf = y.to(tl.float32)
        pv = tl.dot(w_mid.to(tl.float32), yf, input_precision="ieee")
        pv = tl.dot(w_lo.to(tl.float32), yf, acc=pv, input_precision="ieee")
        pv = tl.dot(w_hi.to(tl.float32), yf, acc=pv, input_precision="ieee")
    return m_new, z_i, acc * alpha[:, None] + pv, zacc


@triton.jit
def _tile16(t0, t_hi, q_hi, q_mid, q_lo, row_scale, m_i, z_i, acc, kc_base, vc_base, ks_base, vs_base, skc_t, svc_t, sks_t, svs_t, r_mask, rv_mask,
            BLOCK_T: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr, KDT: tl.constexpr, VDT: tl.constexpr, NATIVE16: tl.constexpr,
            INTERPRETED: tl.constexpr, MASKED: tl.constexpr, Z_SLOTS: tl.constexpr):
    """One tile of ``BLOCK_T`` tokens from ``t0`` with 16-bit bases and float or int8 coefficients
    on each side (spec A3 steps 2.2-2.3, A10): returns the updated ``(m, Z, acc)``, logits and m
    in log2 units (``row_scale`` carries log2 e). The logits are products in ``KDT`` (q~ in 2
    float16 or 3 bfloat16 parts: float32 accuracy), the weighted sum in ``VDT``; int8 codes enter
    as float16 (exact, and 2 parts of the other operand suffice).
    ``MASKED``: tokens >= ``t_hi`` do not count; otherwise every token does and nothing is masked."""
    offs_t = tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, r_mask.shape[0])
    offs_rv = tl.arange(0, rv_mask.shape[0])
    tok = t0 + offs_t
    if MASKED:
        t_mask = tok < t_hi
        k_m = t_mask[:, None] & r_mask[None, :]
        v_m = t_mask[:, None] & rv_mask[None, :]
    else:
        k_m = r_mask[None, :]
        v_m = rv_mask[None, :]
    # int8 codes become float16 where they are loaded (_tl.int8_as_f16), before any layout change
    if K_INT8:
        c = int8_as_f16(tl.load(kc_base + tok[:, None] * skc_t + offs_r[None, :], mask=k_m, other=0), INTERPRETED)  # sass: codes
    else:
        c = tl.load(kc_base + tok[:, None] * skc_t + offs_r[None, :], mask=k_m, other=0)  # sass: codes
    if V_INT8:
        dv = int8_as_f16(tl.load(vc_base + tok[:, None] * svc_t + offs_rv[None, :], mask=v_m, other=0), INTERPRETED)  # sass: codes
    else:
        dv = tl.load(vc_base + tok[:, None] * svc_t + offs_rv[None, :], mask=v_m, other=0)  # sass: codes
    if NATIVE16:
        ct = tl.trans(c)
        logits = tl.dot(q_mid, ct)  # smallest parts first
        if KDT == tl.bfloat16:
            logits = tl.dot(q_lo, ct, acc=logits)
        logits = tl.dot(q_hi, ct, acc=logits)
    else:
        ct = tl.trans(c.to(tl.float32))
        logits = tl.dot(q_mid, ct, input_precision="ieee")
        if KDT == tl.bfloat16:
            logits = tl.dot(q_lo, ct, acc=logits, input_precision="ieee")
        logits = tl.dot(q_hi, ct, acc=logits, input_precision="ieee")
    if K_INT8:  # spec A10: q~ . c_t = s_t (q~ . q_t), one scale per token column
        if MASKED:
            k_s = tl.load(ks_base + tok * sks_t, mask=t_mask, other=0.0)
        else:
            k_s = tl.load(ks_base + tok * sks_t)
        logits = logits * (row_scale[:, None] * k_s[None, :])
    else:
        logits = logits * row_scale[:, None]
    if MASKED:
        logits = tl.where(t_mask[None, :], logits, float("-inf"))
    # Spec A3 steps 2.2-2.3 per tile (A3.1: any partition of the tokens gives the same result);
    # every tile has a valid token, so m_new is finite and alpha never NaN.
    m_new = tl.maximum(m_i, tl.reduce(logits, 1, _MAX))
    alpha = exp2_ftz(m_i - m_new, INTERPRETED)  # log2 units (LOG2)
    w = exp2_ftz(logits - m_new[:, None], INTERPRETED)
    if Z_SLOTS:  # Z per token slot, summed once at the end: no reduction across warps per tile
        z_i = z_i * alpha[:, None] + w
    else:
        z_i = z_i * alpha + tl.reduce(w, 1, _SUM)
    wv = w
    if V_INT8:
        # sum_t w_t s_t q_t: the value scales go into the weights; in float16 a power-of-two unit
        # keeps the scaled weights <= 2^15, the top of float16's range (exact, undone after)
        if MASKED:
            v_s = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0)
        else:
            v_s = tl.load(vs_base + tok * svs_t)
        if VDT == tl.float16:
            v_max = tl.reduce(v_s, 0, _MAX)
            v_unit = tl.exp2(tl.ceil(tl.log2(tl.where(v_max > 0, v_max, 1.0))) - 15.0)
            wv = w * (v_s / v_unit)[None, :]
        else:
            wv = w * v_s[None, :]
    if VDT == tl.bfloat16:
        w_hi, w_mid, w_lo = split3_bits(wv)
    else:
        w_hi = wv.to(VDT)
        w_mid = (wv - w_hi.to(tl.float32)).to(VDT)
    if NATIVE16:
        pv = tl.dot(w_mid, dv)
        if VDT == tl.bfloat16:
            pv = tl.dot(w_lo, dv, acc=pv)
        pv = tl.dot(w_hi, dv, acc=pv)
    else:
        df = dv.to(tl.float32)
        pv = tl.dot(w_mid.to(tl.float32), df, input_precision="ieee")
        if VDT == tl.bfloat16:
            pv = tl.dot(w_lo.to(tl.float32), df, acc=pv, input_precision="ieee")
        pv = tl.dot(w_hi.to(tl.float32), df, acc=pv, input_precision="ieee")
    if V_INT8 and VDT == tl.float16:
        pv = pv * v_unit
    return m_new, z_i, acc * alpha[:, None] + pv


@triton.jit
def _split_tile(t0, c_hi, kb_base, q_proj, q_hi, q_mid, q_lo, row_scale, m_i, z_i, acc, kc_base, vc_base, ks_base, vs_base, kz_base, vz_base, tail_base,
                skc_t, svc_t, sks_t, svs_t, stl_t, complete, kgroup, r, r_v, r_mask, rv_mask,
                BLOCK_T: tl.constexpr, PARTS: tl.constexpr, NATIVE16: tl.constexpr, K_INT8: tl.constexpr, V_INT8: tl.constexpr,
                K_BITS: tl.constexpr, V_BITS: tl.constexpr, MANUAL_BF16: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """One tile of ``BLOCK_T`` tokens from ``t0`` of the split kernel's main loop (float, int8 or
    int4/int2 read as ``c s + z``; spec A3 steps 2.2-2.3): returns the updated ``(m, Z, acc)``.
    ``MASKED``: the last, partial tile of a range (tokens >= ``c_hi`` masked); otherwise every token
    counts and nothing is masked on the token axis."""
    COEF = kb_base.dtype.element_ty
    offs_t = tl.arange(0, BLOCK_T)
    offs_r = tl.arange(0, r_mask.shape[0])
    offs_rv = tl.arange(0, rv_mask.shape[0])
    if MASKED:
        t_mask = t0 + offs_t < c_hi
    else:
        t_mask = tl.full([BLOCK_T], 1, tl.int1)
    # Each side in its own format (spec/quantization.md Q0): float, int8 (A10) or int4/int2 (Q2).
    if K_BITS == 0:  # packed rows are narrower than r: read below
        c = tl.load(kc_base + (t0 + offs_t)[:, None] * skc_t + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0)  # (BLOCK_T, R); sass: codes
    if V_BITS == 0:
        dvals = tl.load(vc_base + (t0 + offs_t)[:, None] * svc_t + offs_rv[None, :], mask=t_mask[:, None] & rv_mask[None, :], other=0)  # (BLOCK_T, RV); sass: codes
    # int8 through float32: the interpreter turns int8 -> bfloat16 into a bit copy
    if K_INT8:
        c = c.to(tl.float32).to(COEF)
    if V_INT8:
        dvals = dvals.to(tl.float32).to(COEF)
    # spec/quantization.md Q1-Q2 in float32 (_tl.low_bit_keys, low_bit_values); for 16-bit
    # bases rounded once more, to nearest even, to the bases' dtype, where the tensor-core
    # products below take it exactly (the oracle's reading in that dtype, up to a double-rounding tie)
    if K_BITS > 0:
        cf = low_bit_keys(kc_base, ks_base, kz_base, tail_base, t0 + offs_t, t_mask, offs_r, r_mask, complete, kgroup, skc_t, sks_t, stl_t, r, K_BITS, ROWS)
    if V_BITS > 0:
        df = low_bit_values(vc_base, vs_base, vz_base, t0 + offs_t, t_mask, offs_rv, r_v, svc_t, svs_t, V_BITS, ROWS)
    if K_BITS > 0:
        if PARTS == 1:
            c = cf
        elif MANUAL_BF16:
            # the interpreter truncates float32 -> bfloat16; round to nearest even by the
            # bits (written out: a nested jit call per tile is slow in the interpreter)
            cb = cf.to(tl.uint32, bitcast=True)
            c = ((cb + 0x7FFF + ((cb >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            c = cf.to(COEF)
    if V_BITS > 0:
        if PARTS == 1:
            dvals = df
        elif MANUAL_BF16:
            db = df.to(tl.uint32, bitcast=True)
            dvals = ((db + 0x7FFF + ((db >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            dvals = df.to(COEF)
    # Logits gamma * scale * q~ . c_t in float32 (see the module docstring).
    if PARTS == 1:
        logits = tl.dot(q_proj, tl.trans(c), input_precision="ieee")
    else:
        if NATIVE16:
            ct = tl.trans(c)
            logits = tl.dot(q_mid, ct)  # smallest parts first
            if PARTS == 3:
                logits = tl.dot(q_lo, ct, acc=logits)
            logits = tl.dot(q_hi, ct, acc=logits)
        else:
            ct = tl.trans(c.to(tl.float32))
            logits = tl.dot(q_mid, ct, input_precision="ieee")
            if PARTS == 3:
                logits = tl.dot(q_lo, ct, acc=logits, input_precision="ieee")
            logits = tl.dot(q_hi, ct, acc=logits, input_precision="ieee")
    logits = logits * row_scale[:, None]
    if K_INT8:
        # spec A10: c_t = s_t q_t, so q~ . c_t = s_t (q~ . q_t): one scale per token column
        k_s = tl.load(ks_base + (t0 + offs_t) * sks_t, mask=t_mask, other=0.0)
        logits = logits * k_s[None, :]
    logits = tl.where(t_mask[None, :], logits, float("-inf"))
    # Spec A3 steps 2.2-2.3 per tile (A3.1: any partition of the tokens gives the same
    # result). Every tile has a valid token, so m_new is finite and alpha never NaN.
    m_new = tl.maximum(m_i, tl.reduce(logits, 1, _MAX))
    alpha = tl.exp(m_i - m_new)
    w = tl.exp(logits - m_new[:, None])
    z_i = z_i * alpha + tl.reduce(w, 1, _SUM)
    # The weighted sum stays in coefficient space: r_v numbers per head (spec A2 step 4).
    acc = acc * alpha[:, None]
    wv = w
    if V_INT8:
        # sum_t w_t s_t q_t: the value scales go into the weights; a power-of-two unit
        # keeps the scaled weights <= 1 for the 16-bit parts below (exact, undone after).
        v_s = tl.load(vs_base + (t0 + offs_t) * svs_t, mask=t_mask, other=0.0)
        if COEF != tl.float16:  # float32's range (bfloat16 parts, float32): no unit needed
            wv = w * v_s[None, :]
        else:
            v_max = tl.reduce(v_s, 0, _MAX)
            v_unit = tl.exp2(tl.ceil(tl.log2(tl.where(v_max > 0, v_max, 1.0))))
            wv = w * (v_s / v_unit)[None, :]
    if PARTS == 1:
        pv = tl.dot(wv, dvals, input_precision="ieee")
    else:
        w_hi = wv.to(COEF)
        w_rest = wv - w_hi.to(tl.float32)
        w_mid = w_rest.to(COEF)
        if NATIVE16:
            pv = tl.dot(w_mid, dvals)
            if PARTS == 3:
                pv = tl.dot((w_rest - w_mid.to(tl.float32)).to(COEF), dvals, acc=pv)
            pv = tl.dot(w_hi, dvals, acc=pv)
        else:
            df = dvals.to(tl.float32)
            pv = tl.dot(w_mid.to(tl.float32), df, input_precision="ieee")
            if PARTS == 3:
                pv = tl.dot((w_rest - w_mid.to(tl.float32)).to(COEF).to(tl.float32), df, acc=pv, input_precision="ieee")
            pv = tl.dot(w_hi.to(tl.float32), df, acc=pv, input_precision="ieee")
    if V_INT8 and COEF == tl.float16:
        pv = pv * v_unit
    acc += pv
    return m_new, z_i, acc

@triton.jit
def _centred_tile_t(t0, t_lo, t_hi, q_proj, key_r, ks_base, kz_base, kc_base, sks_t, skc_t, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t,
                    m_i, z_i, acc_t, zacc, BLOCK_T: tl.constexpr, NATIVE16: tl.constexpr, INTERPRETED: tl.constexpr, MASKED: tl.constexpr,
                    CPARTS: tl.constexpr, BITS: tl.constexpr = 4):
    """One tile (one key group, starting at ``t0``) of the int4/int2 centred form with the tokens on the
    MMA's M dimension: the group's key scales folded into a_j = q~_j s_j and a bias per query head
    (spec/quantization.md Q6), logits^T = codes @ a_j^T in 3 bfloat16 parts of a_j, then
    :func:`_centred_values_t`. ``MASKED``: only tokens in [t_lo, t_hi) count (edge tiles);
    otherwise every token of the tile does and nothing is masked (whole ranks: r = R here)."""
    MID: tl.constexpr = 1 << (BITS - 1)
    tok = t0 + tl.arange(0, BLOCK_T)
    if MASKED:
        t_mask = (tok >= t_lo) & (tok < t_hi)
    else:
        t_mask = tl.full([BLOCK_T], 1, tl.int1)
    grp = t0 // BLOCK_T
    s_k = tl.load(ks_base + grp * sks_t + key_r).to(tl.float32)
    z_k = tl.load(kz_base + grp * sks_t + key_r).to(tl.float32)
    bias = tl.reduce(q_proj * (z_k + MID * s_k)[None, :], 1, _SUM)
    u = q_proj * s_k[None, :]
    # codes and a_j in bfloat16 whatever the bases' 16-bit type: float32's range, so no
    # power-of-two rescaling per tile; a_j in 3 parts (float32 accuracy)
    y = centred_words(kc_base.to(tl.pointer_type(tl.uint32)), tok, t_mask, skc_t // 4, key_r.shape[0], BITS, tl.bfloat16, INTERPRETED)  # (BLOCK_T, R), exact
    u_hi, u_mid, u_lo = split3_bits(u)
    lt = _dot_parts(y, u_hi, u_mid, u_lo, None, NATIVE16, CPARTS) + bias[None, :]
    return _centred_values_t(lt, tok, t_mask, m_i, z_i, acc_t, zacc, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t, NATIVE16, INTERPRETED, CPARTS, BITS)


@triton.jit
def _dot_parts(y, u_hi, u_mid, u_lo, acc, NATIVE16: tl.constexpr, CPARTS: tl.constexpr):
    """acc + y (u_hi + u_mid + u_lo)^T over the first CPARTS parts (acc None: from zero): the 16-bit
    codes times a_j split into bfloat16 parts (split3_bits), on the MMA natively or in float32."""
    if NATIVE16:
        lt = tl.dot(y, tl.trans(u_hi), acc=acc)
        if CPARTS > 1:
            lt = tl.dot(y, tl.trans(u_mid), acc=lt)
        if CPARTS > 2:
            lt = tl.dot(y, tl.trans(u_lo), acc=lt)
    else:
        yf = y.to(tl.float32)
        lt = tl.dot(yf, tl.trans(u_hi.to(tl.float32)), acc=acc, input_precision="ieee")
        if CPARTS > 1:
            lt = tl.dot(yf, tl.trans(u_mid.to(tl.float32)), acc=lt, input_precision="ieee")
        if CPARTS > 2:
            lt = tl.dot(yf, tl.trans(u_lo.to(tl.float32)), acc=lt, input_precision="ieee")
    return lt


@triton.jit
def _centred_pair_t(t0, q_proj, q_n, key_r2, ks_base, kz_base, kc_base, sks_t, skc_t, vc_base, vs_base, vz_base, svc_t, svs_t,
                    m2, z2, acc2, za2, BLOCK_T: tl.constexpr, R: tl.constexpr, RV: tl.constexpr, NATIVE16: tl.constexpr,
                    INTERPRETED: tl.constexpr, CPARTS: tl.constexpr, BITS: tl.constexpr, WIDE: tl.constexpr = False, VEC: tl.constexpr = 2):
    """Two whole key groups (tokens ``t0 .. t0 + 2 BLOCK_T``) of the centred form with the tokens on M,
    unmasked, as two softmax streams side by side on the MMA's N dimension (which pads the GQA group
    to 8 anyway): row i of the code tiles holds token ``t0 + i`` (group A, channels 0..R-1) and token
    ``t0 + BLOCK_T + i`` (group B, channels R..2R-1), and a_j = q~_j s_j is block-diagonal (rows
    0..G-1 over A's channels with A's scales, rows G..2G-1 over B's), so columns 0..G-1 of the logits
    are group A's and G..2G-1 group B's, each column with its own running max (spec A3.1: any
    partition of the tokens). The value accumulator ``acc2`` (2 RV x 2G) holds A's sums in its first
    RV rows and G columns, B's in the last RV rows and G columns (the other blocks are never read).
    Per column: ``m2``; per token slot and column: ``z2``, ``za2`` (:func:`_centred_values_t`).
    ``q_proj``: q~ (G x R, channels in word order); ``q_n``: q~ in natural channel order, twice
    (2G x R); ``key_r2``: the channel within its group of each of the 2R columns."""
    MID: tl.constexpr = 1 << (BITS - 1)
    tok = t0 + tl.arange(0, BLOCK_T)
    grp = t0 // BLOCK_T
    k_off = (grp + tl.arange(0, 2 * R) // R) * sks_t + key_r2
    s_k = tl.load(ks_base + k_off).to(tl.float32)
    G: tl.constexpr = q_proj.shape[0]
    # per stream, compact (G x 2R: q~ beside itself), then block-diagonal (2G x 2R) in bfloat16
    q_t = tl.reshape(tl.broadcast_to(q_proj[:, None, :], (G, 2, R)), (G, 2 * R))
    # the bias of each (stream, head) row, channels in their natural order: a (2G, R) tile whose rows
    # are whole scale rows (contiguous loads; the sum mostly within each thread)
    rows2 = tl.arange(0, 2 * G)
    n_off = (grp + rows2 // G)[:, None] * sks_t + tl.arange(0, R)[None, :]
    h_n = tl.load(kz_base + n_off).to(tl.float32) + MID * tl.load(ks_base + n_off).to(tl.float32)
    bias = tl.reduce(q_n * h_n, 1, _SUM)
    u_c = q_t * s_k[None, :]
    y = centred_pair_words(kc_base.to(tl.pointer_type(tl.uint32)), tok, skc_t // 4, BLOCK_T, R, BITS, tl.bfloat16, INTERPRETED, VEC, False, WIDE)  # (BLOCK_T, 2R)
    uc_hi, uc_mid, uc_lo = split3_bits(u_c)
    diag = (tl.arange(0, 2 * G) // G)[:, None] == (tl.arange(0, 2 * R) // R)[None, :]
    u_hi = tl.where(diag, tl.reshape(tl.broadcast_to(uc_hi[None, :, :], (2, G, 2 * R)), (2 * G, 2 * R)), 0.0)
    u_mid = u_hi
    u_lo = u_hi
    if CPARTS > 1:
        u_mid = tl.where(diag, tl.reshape(tl.broadcast_to(uc_mid[None, :, :], (2, G, 2 * R)), (2 * G, 2 * R)), 0.0)
    if CPARTS > 2:
        u_lo = tl.where(diag, tl.reshape(tl.broadcast_to(uc_lo[None, :, :], (2, G, 2 * R)), (2 * G, 2 * R)), 0.0)
    lt = _dot_parts(y, u_hi, u_mid, u_lo, tl.broadcast_to(bias[None, :], (BLOCK_T, 2 * G)), NATIVE16, CPARTS)
    G2: tl.constexpr = 2 * G
    m_new = tl.maximum(m2, tl.reduce(lt, 0, _MAX))
    alpha = exp2_ftz(m2 - m_new, INTERPRETED)  # log2 units
    w = exp2_ftz(lt - m_new[None, :], INTERPRETED)
    z2 = z2 * alpha[None, :] + w
    # the two tokens of each row: (BLOCK_T, 2) -> (BLOCK_T, 2G), column k G + g
    v_off = (tok[:, None] + BLOCK_T * tl.arange(0, 2)[None, :]) * svs_t
    tau = tl.load(vs_base + v_off).to(tl.float32)
    zeta = tl.load(vz_base + v_off).to(tl.float32)
    tau = tl.reshape(tl.broadcast_to(tau[:, :, None], (BLOCK_T, 2, G2 // 2)), (BLOCK_T, G2))
    zeta = tl.reshape(tl.broadcast_to(zeta[:, :, None], (BLOCK_T, 2, G2 // 2)), (BLOCK_T, G2))
    wv = w * tau
    # The value codes come as B + c = (c - M) + OFF (B = 128 in bfloat16, 1024 in float16): no
    # subtraction per code; OFF times the weights as the product sees them comes off with
    # zeta + M tau. With float16 bases (CPARTS > 1) the weights are one float16 part (11 bits,
    # rounded; float16's range: w <= 1 and tau a float16), with bfloat16 bases one bfloat16 part.
    if CPARTS > 1:
        VDT: tl.constexpr = tl.float16
        w_hi = wv.to(tl.float16)
        w_parts = w_hi.to(tl.float32)
    else:
        VDT: tl.constexpr = tl.bfloat16
        w_hi, w_mid, w_lo = split3_bits(wv)
        w_parts = (wv.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)  # w_hi, exactly
    OFF: tl.constexpr = (128.0 if VDT == tl.bfloat16 else 1024.0) + MID
    za2 = za2 * alpha[None, :] + (w * (zeta + MID * tau) - OFF * w_parts)
    yv = centred_pair_words(vc_base.to(tl.pointer_type(tl.uint32)), tok, svc_t // 4, BLOCK_T, RV, BITS, VDT, INTERPRETED, VEC, True, WIDE)  # (BLOCK_T, 2RV)
    acc2 = acc2 * alpha[None, :]
    if NATIVE16:
        acc2 = tl.dot(tl.trans(yv), w_hi, acc=acc2)
    else:
        acc2 = tl.dot(tl.trans(yv.to(tl.float32)), w_hi.to(tl.float32), acc=acc2, input_precision="ieee")
    return m_new, z2, acc2, za2


@triton.jit
def _halves(x):
    """The two halves of the last axis of ``x`` (its last axis split as 2 x half)."""
    shape: tl.constexpr = x.shape
    if len(shape) == 1:
        a, b = tl.split(tl.permute(tl.reshape(x, (2, shape[0] // 2)), (1, 0)))
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, (shape[0], 2, shape[1] // 2)), (0, 2, 1)))
    return a, b


@triton.jit
def _centred_values_t(lt, tok, t_mask, m_i, z_i, acc_t, zacc, vc_base, vs_base, vz_base, offs_rv, svc_t, svs_t,
                      NATIVE16: tl.constexpr, INTERPRETED: tl.constexpr, CPARTS: tl.constexpr = 3, BITS: tl.constexpr = 4):
    """:func:`_centred_values` with the tokens on the MMA's M dimension: ``lt`` the logits
    transposed (tokens x heads, in log2 units), ``acc_t`` the accumulator transposed (RV x heads),
    updated by acc^T += codes^T @ (w tau)^T (the codes' tile the A operand, the group the N
    dimension); ``z_i`` and ``zacc`` per token slot (BLOCK_T x heads), summed by the caller."""
    MID: tl.constexpr = 1 << (BITS - 1)
    lt = tl.where(t_mask[:, None], lt, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(lt, 0, _MAX))
    alpha = exp2_ftz(m_i - m_new, INTERPRETED)  # log2 units (LOG2)
    w = exp2_ftz(lt - m_new[None, :], INTERPRETED)
    z_i = z_i * alpha[None, :] + w  # per token slot
    tau = tl.load(vs_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    zeta = tl.load(vz_base + tok * svs_t, mask=t_mask, other=0.0).to(tl.float32)
    zacc = zacc * alpha[None, :] + w * (zeta + MID * tau)[:, None]
    wv = w * tau[:, None]
    y = centred_words(vc_base.to(tl.pointer_type(tl.uint32)), tok, t_mask, svc_t // 4, offs_rv.shape[0], BITS, tl.bfloat16, INTERPRETED)  # (BLOCK_T, RV), exact
    w_hi, w_mid, w_lo = split3_bits(wv)
    if NATIVE16:
        yt = tl.trans(y)
        pv = tl.dot(yt, w_hi)
        if CPARTS > 1:
            pv = tl.dot(yt, w_mid, acc=pv)
        if CPARTS > 2:
            pv = tl.dot(yt, w_lo, acc=pv)
    else:
        yt = tl.trans(y.to(tl.float32))
        pv = tl.dot(yt, w_hi.to(tl.float32), input_precision="ieee")
        if CPARTS > 1:
            pv = tl.dot(yt, w_mid.to(tl.float32), acc=pv, input_precision="ieee")
        if CPARTS > 2:
            pv = tl.dot(yt, w_lo.to(tl.float32), acc=pv, input_precision="ieee")
    return m_new, z_i, acc_t * alpha[None, :] + pv, zacc


@triton.jit
def _merge_row(pm_ptr, pz_ptr, po_ptr, row, num_splits, d_v, col0, DV: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Spec A3.2: the ``num_splits`` partials (m, Z, N) of (sequence, query head) ``row`` merged,
    N / Z in float32 over the DV columns from ``col0``; empty partials (-inf, 0, 0) are the
    identity. Shared by :func:`_merge_kernel` and the fused merge of :func:`_decode_split_kernel`
    (``CACHE``: the partials' load cache modifier)."""
    _, z_run, o_run = _merge_state(pm_ptr, pz_ptr, po_ptr, row, num_splits, d_v, col0, DV, BLOCK_S, CACHE)
    # Z >= 1 whenever a token was attended (spec A3.1); callers refuse T = 0.
    return o_run / z_run


@triton.jit
def _merge_state(pm_ptr, pz_ptr, po_ptr, row, num_splits, d_v, col0, DV: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Spec A3.2: the ``num_splits`` partials (m, Z, N) of ``row`` merged into one partial
    (m, Z, N): scalars and N's DV columns from ``col0``, float32; (-inf, 0, 0) when every
    partial is empty."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = col0 + tl.arange(0, DV)
    dv_mask = offs_dv < d_v

    m_run = tl.reduce(tl.full([BLOCK_S], float("-inf"), tl.float32), 0, _MAX)
    z_run = tl.reduce(tl.full([BLOCK_S], 0.0, tl.float32), 0, _SUM)
    o_run = tl.full([DV], 0.0, tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s_idx = s0 + offs_s
        s_mask = s_idx < num_splits
        m = tl.load(pm_ptr + row * num_splits + s_idx, mask=s_mask, other=float("-inf"), cache_modifier=CACHE)
        z = tl.load(pz_ptr + row * num_splits + s_idx, mask=s_mask, other=0.0, cache_modifier=CACHE)
        o = tl.load(po_ptr + (row * num_splits + s_idx)[:, None] * d_v + offs_dv[None, :], mask=s_mask[:, None] & dv_mask[None, :], other=0.0,
                    cache_modifier=CACHE)
        m_new = tl.maximum(m_run, tl.reduce(m, 0, _MAX))
        # Spec A3.2 with e^{-inf - m} := 0, also when every partial so far is empty (m_new = -inf).
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_run = tl.exp(m_run - ref)
        a = tl.exp(m - ref)
        z_run = z_run * a_run + tl.reduce(z * a, 0, _SUM)
        o_run = o_run * a_run + tl.reduce(o * a[:, None], 0, _SUM)
        m_run = m_new
    return m_run, z_run, o_run


@triton.jit
def _merge_kernel(pm_ptr, pz_ptr, po_ptr, out_ptr, num_splits, d_v, Hq, so_n, so_h, DV: tl.constexpr, BLOCK_S: tl.constexpr, MANUAL_BF16: tl.constexpr):
    # grid (rows, column blocks): a program merges DV of the row's d_v columns
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * DV
    n = row // Hq
    hq = row % Hq
    offs_dv = col0 + tl.arange(0, DV)
    out = _merge_row(pm_ptr, pz_ptr, po_ptr, row, num_splits, d_v, col0, DV, BLOCK_S, "")  # no default: Triton 3.6 passes an omitted str default unwrapped
    tl.store(out_ptr + n * so_n + hq * so_h + offs_dv, to_storage(out, out_ptr, MANUAL_BF16), mask=offs_dv < d_v)


# ---------------------------------------------------------------------------------------- launchers


def _shapes(q, layout):
    N, Hq, d = q.shape
    H = layout.key_coef.shape[1]
    # ranks from the bases: int4/int2 coefficient rows are packed narrower (spec/quantization.md Q2)
    return N, Hq, d, H, Hq // H, layout.key_bases.shape[3], layout.value_bases.shape[3], layout.value_bases.shape[4]


def default_split_len(num_tokens: int, programs: int, device, resident: int | None = None) -> int:
    """Tokens per split: enough splits that ``programs`` (= N x H) x S fill the device's resident
    program slots once (:func:`~subspace_ref_triton.occupancy.full_wave_splits`; ``resident``
    programs per SM, default that of the split kernel at the benchmark's shape), no split
    shorter than MIN_SPLIT_TOKENS. A multiple of BLOCK_T so that tiles of a static state stay
    aligned. The interpreter runs programs one after another: about 4 programs in all."""
    device = torch.device(device)
    if device.type == "cuda" and not interpreting():
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        splits = full_wave_splits(programs, num_tokens, resident or FALLBACK_RESIDENT, sms, MIN_SPLIT_TOKENS)
    else:
        splits = max(1, min(cdiv(num_tokens, MIN_SPLIT_TOKENS), cdiv(4, max(programs, 1))))
    return cdiv(cdiv(num_tokens, splits), BLOCK_T) * BLOCK_T


_RESIDENT: dict[tuple, int] = {}


def resident_programs(launch: Launch, device) -> int:
    """Programs of ``launch``'s kernel resident on one SM of ``device``, from the compiled kernel's
    registers and shared memory (compiled once per configuration, cached). The interpreter and
    any failure to read them give FALLBACK_RESIDENT."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return FALLBACK_RESIDENT
    key = (device.index, launch.kernel.fn.__name__, tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.max_registers)
    if key not in _RESIDENT:
        try:
            compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constexprs, **launch.options())
            compiled._init_handles()
            props = torch.cuda.get_device_properties(device)
            gpu = GPU(
                props.name,
                10 * props.major + props.minor,
                props.multi_processor_count,
                regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                max_warps_per_sm=getattr(props, "max_threads_per_multi_processor", 2048) // 32,
                smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 228 * 1024),
            )
            _RESIDENT[key] = max(1, resident_blocks(gpu, compiled.n_regs, launch.num_warps, compiled.metadata.shared).blocks_per_sm)
        except Exception:  # noqa: BLE001 - an occupancy query must never fail a decode
            _RESIDENT[key] = FALLBACK_RESIDENT
    return _RESIDENT[key]


# programs per SM of the last launch of a configuration (launch_signature): the next launch's first guess
_RESIDENT_SEEN: dict[tuple, int] = {}


def sized_launch(build, q, layout, split_len: int | None, kind: tuple, launch: dict, tile: int = 1):
    """``build(split_len)`` (a launch, not run, and its outputs) at ``split_len``, or when it is None
    at the default split length (:func:`default_split_len`, rounded up to a multiple of ``tile``)
    for the programs per SM of the launch as compiled (:func:`resident_programs`). The launch is
    built for the figure last seen for its configuration (:func:`launch_signature`: ``kind`` names
    the kernel, ``launch`` holds its keywords) and built again only where the compiled launch holds
    another. So a repeated call builds once, unless the launch sized for the compiled figure
    compiles to yet another (the fused merge's tile of partials follows the split count), or a
    keyword is not a plain value (a tensor: no figure is kept); then it builds twice."""
    if split_len is not None:
        return build(split_len)
    T, programs = int(layout.num_tokens), q.shape[0] * layout.key_coef.shape[1]
    sized = lambda resident: cdiv(default_split_len(T, programs, q.device, resident), tile) * tile  # noqa: E731
    sig = launch_signature(q, layout, kind, launch)
    seen = _RESIDENT_SEEN.get(sig, FALLBACK_RESIDENT) if sig else FALLBACK_RESIDENT
    built = build(sized(seen))
    compiled = resident_programs(built[0], q.device)
    if compiled != seen:
        if sig:
            _RESIDENT_SEEN[sig] = compiled
        built = build(sized(compiled))
    return built


def launch_signature(q, layout, kind: tuple, launch: dict) -> tuple | None:
    """What a compiled decode launch depends on, cheaply: dtypes, shapes (the GQA group, the ranks),
    formats, the alignments that choose word loads, ``kind`` (the kernel) and the ``launch``
    keywords; None where a keyword is not a plain value (None, bool, int, float, str): a tensor
    would be kept alive by the table and never seen again."""
    if not all(v is None or isinstance(v, (bool, int, float, str)) for v in launch.values()):
        return None
    kc, vc = layout.key_coef, layout.value_coef
    return (q.device, q.dtype, tuple(q.shape[1:]), kc.shape[1], layout.key_bases.dtype, tuple(layout.key_bases.shape[3:]), tuple(layout.value_bases.shape[3:]),
            *((c.dtype, c.data_ptr() % 16, *(x % 16 for x in c.stride())) for c in (kc, vc)), layout.key_format, layout.value_format, layout.group, kind,
            tuple(sorted(launch.items())))


def launch_config(d: int, d_v: int, dtype=None, int8: bool = False, bits: int = 0) -> dict:
    """Tile, warps and register cap of the split kernel for the bases' ``dtype`` and coefficient
    storage. Tile and warps are chosen from the compile report (``subspace-kv gpu-report``,
    docs/gpu.md) as the configuration with no spills on sm_80 and sm_90 and the most resident
    warps per SM, at d = 128, r = 32; the caps by GPU timing:

    * 16-bit float coefficients: 64-token tiles on FLOAT16_WARPS warps, from the instructions per
      token in the compiled loop (docs/gpu.md, "Static budgets"), not yet timed; the configuration
      timed before, 32-token tiles on 4 warps capped at FLOAT16_MAX_REGISTERS, is one
      ``split_launch`` argument set away;
    * int8 coefficients (spec A10) with 16-bit bases on both sides: 64-token tiles on INT8_WARPS
      warps, the fewest instructions per token in the compiled loop (docs/gpu.md, "Static
      budgets"), not yet timed; a side in int4/int2 takes the low-bit configuration below;
    * int4/int2 coefficients (spec/quantization.md Q2) with 16-bit bases: 64-token tiles, 4 warps
      (179-240 registers uncapped, 2 per SM; the fastest of an H100's tile and warp sweep,
      docs/gpu.md), capped at QUANTISED_MAX_REGISTERS; int4 and int2 in the centred form
      (:func:`centred_int4`) take tiles of two key groups instead (``PAIRS``; the default group:
      32 tokens, so 64-token tiles; one group with ``tokens_m=False``) on CENTRED_WARPS warps, a
      choice from the compiled code alone, not yet timed (docs/gpu.md, "Static budgets", fifth pass);
    * the caps here trade spills for resident programs because a GPU timed them faster
      (REGISTER_CAPS_MEASURED); the one- and two-warp launches above are capped by
      :func:`default_max_registers` where their main loop compiled clean under a cap;
    * float32 bases: 64-token tiles, 8 warps (114 registers: 2 programs of 8 warps; 4 warps take
      194; with int8 coefficients 180, where 4 warps spill 28 bytes on sm_90; int4/int2: 180-182);
    * head sizes above 128: 32-token tiles and 8 warps, which spill least at 256.

    ``benchmarks/decode_gpu.py`` times the alternatives on a GPU."""
    if max(d, d_v) > 128:
        return dict(block_t=32, num_warps=8, max_registers=None)
    if dtype == torch.float32:
        return dict(block_t=64, num_warps=8, max_registers=None)
    if int8 and not bits:
        return dict(block_t=64, num_warps=INT8_WARPS, max_registers=None)
    if int8 or bits:
        return dict(block_t=64, num_warps=4, max_registers=QUANTISED_MAX_REGISTERS)
    return dict(block_t=64, num_warps=FLOAT16_WARPS, max_registers=None)


def default_max_registers(bases_dtype, group: int, num_warps: int, constexprs: dict) -> int:
    """The register cap of a one- or two-warp default launch (0: none; split_launch applies it where
    launch_config gives none and no ``max_registers`` is passed): 16-bit bases, equal ranks without
    masks, head sizes up to 128, 64-token tiles, and

    * float coefficients on FLOAT16_WARPS warps, ranks 32, GQA groups of 2 to 4 (4 rows, ``G``):
      FLOAT16_WARPS_MAX_REGISTERS, compiled with no spill (with one query head a KV head it spills
      outside the loop);
    * int4/int2 in the centred form with two key groups a tile on CENTRED_WARPS warps, bfloat16
      bases, ranks 16 or 32, groups up to 4 (4 rows): CENTRED_MAX_REGISTERS, timed fastest on an
      H200 for int4 at r = 32, g = 4 (int2 and rank 16 untimed); spills outside the sm_90 loop,
      one local access in the sm_80 loop (Triton 3.9; untimed on sm_80); float16 bases spill in it.

    int8 on both sides on INT8_WARPS warps stays uncapped: timed faster than under any cap
    (INT8_UNCAPPED_MEASURED). The rows are the group padded to DOT_ROWS: a Triton that pads every
    group to 16 rows compiles other kernels, never checked under a cap, so they stay uncapped.

    Left uncapped: ranks of 64 or more and int4 with a group of 8 (local memory in the loop under a
    cap), float at rank 16 (fewer registers uncapped than the cap) (docs/gpu.md, "N in the
    partial", "Rank 16 and groups of 8 under the one-warp cap", "Caps timed, and a softmax per warp by default")."""
    c = constexprs
    ranks = c["R"] if c["R"] == c["RV"] and c["RANKS_FULL"] else 0
    if not (max(c["D"], c["DV"]) <= 128 and c["BLOCK_T"] == 64) or bases_dtype not in (torch.bfloat16, torch.float16):
        return 0
    if c["CENTRED"]:
        centred = c["PAIRS"] and num_warps == CENTRED_WARPS and bases_dtype == torch.bfloat16 and ranks in (16, 32) and c["G"] == 4
        return CENTRED_MAX_REGISTERS if centred else 0
    if c["K_BITS"] or c["V_BITS"] or c["K_INT8"] or c["V_INT8"]:
        return 0  # the per-code path: launch_config's cap; int8: INT8_UNCAPPED_MEASURED
    return FLOAT16_WARPS_MAX_REGISTERS if num_warps == FLOAT16_WARPS and ranks == 32 and group >= 2 and c["G"] == 4 else 0


def centred_int4(layout, parts: int) -> bool:
    """Whether the split kernel reads an int4 or int2 layout in spec/quantization.md Q6's centred
    form (``CENTRED``; docs/gpu.md, "Static budgets"): code widths in CENTRED_BITS, 16-bit bases
    (``parts`` > 1), power-of-two ranks of at least 16 (whole rows of 32-bit words of codes, no
    channel mask), rows and pointers 4-byte aligned, and key groups a power of two from 16 to 128
    tokens (one group per tile). Everything else reads each code as ``c s + z``
    (_tl.low_bit_keys): float32 bases, other ranks and groups."""
    if int(getattr(layout, "low_bits", 0) or 0) not in CENTRED_BITS or parts == 1:
        return False
    r, r_v, G = layout.key_bases.shape[3], layout.value_bases.shape[3], int(layout.group)
    kc, vc = layout.key_coef, layout.value_coef
    return (all(x >= 16 and x & (x - 1) == 0 for x in (r, r_v)) and 16 <= G <= 128 and G & (G - 1) == 0
            and all(x % 4 == 0 for x in (kc.stride(2), vc.stride(2), kc.data_ptr(), vc.data_ptr())))


def decode_partials(q, layout, scale: float, split_len: int, num_splits: int | None = None, **launch):
    split, outputs = partials_launch(q, layout, scale, split_len, num_splits, **launch)
    split.run()
    return outputs


def partials_launch(q, layout, scale: float, split_len: int, num_splits: int | None = None, *, block_t: int | None = None, num_warps: int | None = None,
                    max_registers: int | None = None, tokens_m: bool | None = None):
    """:func:`decode_partials`'s launch (not run) and outputs: :func:`split_launch` with the
    keywords an eager call takes."""
    return split_launch(q, layout, scale, split_len, num_splits, block_t=block_t, num_warps=num_warps, max_registers=max_registers, tokens_m=tokens_m)


@dataclass(frozen=True)
class SideFormats:
    """How the split kernels read each side of a layout (spec/quantization.md Q0): int8 per-token
    scales (spec A10) and int4/int2 code widths (Q2), key side and value side apart, and the
    operands (key scale, value scale, key zero, value zero, key tail). Operands a side's format
    does not read are stand-ins (any tensor will do: the kernels never load them)."""

    k_int8: bool
    v_int8: bool
    k_bits: int
    v_bits: int
    operands: tuple

    @property
    def int8(self) -> bool:
        """Whether a side is int8 (the launch configuration of quantised coefficients)."""
        return self.k_int8 or self.v_int8

    @property
    def bits(self) -> int:
        """The widest low-bit side's code width, 0 when neither side is int4/int2."""
        return max(self.k_bits, self.v_bits)

    def constexprs(self) -> dict:
        return dict(K_INT8=self.k_int8, V_INT8=self.v_int8, K_BITS=self.k_bits, V_BITS=self.v_bits)

    def strides(self, layout) -> tuple:
        """(sks_n, sks_h, sks_t, svs_n, svs_h, svs_t, key group, stl_n, stl_h, stl_t) of the launch."""
        ks, vs, _, _, tail = self.operands
        return (ks.stride(0), ks.stride(1), ks.stride(2) if self.k_int8 or self.k_bits else 0,
                vs.stride(0), vs.stride(1), vs.stride(2) if self.v_int8 or self.v_bits else 0,
                int(layout.group) if self.k_bits else 1, tail.stride(0), tail.stride(1), tail.stride(2) if self.k_bits else 0)


def side_formats(layout) -> SideFormats:
    """The :class:`SideFormats` of ``layout``: each side read in its own format, so a layout whose
    sides differ ("int4/int8", spec/quantization.md Q0) takes the same one launch per split."""
    kf, vf = layout.side_format("key"), layout.side_format("value")
    kc, vc = layout.key_coef, layout.value_coef
    ks = layout.key_scale if kf.per_token_scale else layout.key_group_scale if kf.low_bits else kc
    kz = layout.key_group_zero if kf.low_bits else kc
    tail = layout.key_tail if kf.low_bits else kc
    vs = layout.value_scale if vf.per_token_scale else layout.value_token_scale if vf.low_bits else vc
    vz = layout.value_token_zero if vf.low_bits else vc
    if (kf.low_bits and kz.stride() != ks.stride()) or (vf.low_bits and vz.stride() != vs.stride()):
        raise ValueError("the zero points of a low-bit layout must have the strides of its scales")
    return SideFormats(kf.per_token_scale, vf.per_token_scale, kf.low_bits, vf.low_bits, (ks, vs, kz, vz, tail))


def split_launch(
    q,
    layout,
    scale: float,
    split_len: int,
    num_splits: int | None = None,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
    max_registers: int | None = None,
    num_tokens=None,
    outputs=None,
    tokens_m: bool | None = None,
    fused: tuple | None = None,
):
    """Per-split partials ``(m, Z, N)`` (spec A3.2) of coefficient-space attention (spec A3).

    q (N, H_q, d); ``layout`` a :class:`~subspace_ref.layout.PackedLayout` of torch tensors
    (spec A9) with ``num_tokens >= 1``. Split ``s`` covers tokens
    ``[s * split_len, min((s + 1) * split_len, T))``; ``num_splits`` defaults to
    ``ceil(T / split_len)``, and splits past the end are empty. Returns float32
    ``m, Z`` (N, H_q, S) and ``N`` (N, H_q, S, d_v), with ``m`` including gamma * scale.
    ``block_t`` (a power of two >= 16), ``num_warps`` and ``max_registers`` (0: no cap) override
    :func:`launch_config`.

    ``num_tokens``: a one-element int32 or int64 tensor on q's device holding T (the layout's
    ``num_tokens`` is then not read); the kernel reads it and derives the split length from it
    and ``num_splits`` (required), so the launch can be captured in a CUDA graph and replayed as
    the cache grows (:class:`~subspace_ref_triton.workspace.DecodeWorkspace`). ``outputs``:
    preallocated ``(m, Z, N)`` to write instead of new tensors.

    ``tokens_m``: in the int4/int2 centred form, the tile's tokens on the MMA's M dimension (default,
    ``TOKENS_M``; fewer instructions in the compiled loop) or, ``False``, the query heads on M
    padded to the MMA's 16 rows (the form timed before; kept to time both). With tokens on M the
    default tile is two key groups (``PAIRS``: two softmax streams side by side on the MMA's N);
    an explicit ``block_t`` equal to the key group keeps one group a tile, any other the per-code path.

    ``fused``: ``(out, counters)`` to merge in the same launch (spec A3.2; :func:`fused_launch`):
    ``out`` (N, H_q, d_v) takes N / Z, ``counters`` (int32 zeros, one per (sequence, KV head))
    count the written partials, and the program that writes the last one merges them all and
    resets its counter to 0. Off by default (the two-launch path; the fused one timed slower under a CUDA graph).

    :func:`split_launch` returns the launch (not run) and the outputs it would fill, for
    ahead-of-time compile checks (``subspace_ref_triton.gpu_report``).
    """
    N, Hq, d, H, group, r, r_v, d_v = _shapes(q, layout)
    device_t = num_tokens is not None
    if device_t:
        check_device_count(num_tokens, q)
    if device_t and num_splits is None:
        raise ValueError("a device-resident num_tokens needs num_splits (the grid does not depend on T)")
    T = 0 if device_t else int(layout.num_tokens)
    S = cdiv(T, split_len) if num_splits is None else int(num_splits)
    dev = q.device
    if outputs is None:
        outputs = (
            torch.empty((N, Hq, S), dtype=torch.float32, device=dev),
            torch.empty((N, Hq, S), dtype=torch.float32, device=dev),
            torch.empty((N, Hq, S, d_v), dtype=torch.float32, device=dev),
        )
    pm, pz, po = outputs
    if fused is not None:
        out, counters = fused
        if out.shape != (N, Hq, d_v) or out.stride(-1) != 1:
            raise ValueError(f"the fused merge's output must be ({N}, {Hq}, {d_v}) with a unit last stride")
        if counters.dtype != torch.int32 or not counters.is_contiguous() or counters.numel() < N * H or counters.device != dev:
            raise ValueError(f"the fused merge's counters must be {N * H} contiguous int32 zeros on q's device")
    kc, vc, kb, vb = layout.key_coef, layout.value_coef, layout.key_bases, layout.value_bases
    st, nc = layout.chunk_starts, layout.num_chunks
    sides = side_formats(layout)
    int8, bits, (ks, vs, kz, vz, tail) = sides.int8, sides.bits, sides.operands
    for name, x in (
        ("q", q),
        ("key_coef", kc),
        ("value_coef", vc),
        ("key_bases", kb),
        ("value_bases", vb),
        ("chunk_starts", st),
        ("key_scale", ks),
        ("value_scale", vs),
        ("key_tail", tail),
    ):
        if x.stride(-1) != 1 and x.numel() > 0:  # a low-bit state below one key group has no group rows
            raise ValueError(f"{name} must have a unit stride in its last dimension")
    parts = _PARTS[kb.dtype]
    cfg = launch_config(d, d_v, kb.dtype, int8, bits)
    kgroup = int(layout.group) if sides.k_bits else 0
    centred = centred_int4(layout, parts)
    pairs = TOKENS_M_DEFAULT if tokens_m is None else bool(tokens_m)
    if centred and block_t is None:
        # one key group per tile (Q6's centred form, CENTRED below), two per hot-loop step with tokens on M
        # (PAIRS), on CENTRED_WARPS warps (docs/gpu.md, "Static budgets"); the cap is default_max_registers's
        cfg.update(block_t=2 * kgroup if pairs else kgroup, num_warps=CENTRED_WARPS, max_registers=None)
    cfg.update({k: v for k, v in (("block_t", block_t), ("num_warps", num_warps), ("max_registers", max_registers)) if v is not None})
    args = (
        q,
        kc,
        vc,
        kb,
        vb,
        st,
        nc,
        layout.gamma.contiguous(),
        ks,
        vs,
        kz,
        vz,
        tail,
        pm,
        pz,
        po,
        num_tokens if device_t else nc,
        H,
        group,
        T,
        0 if device_t else int(split_len),
        S,
        float(scale),
        d,
        d_v,
        r,
        r_v,
        q.stride(0),
        q.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        kb.stride(0),
        kb.stride(1),
        kb.stride(2),
        kb.stride(3),
        vb.stride(0),
        vb.stride(1),
        vb.stride(2),
        vb.stride(3),
        st.stride(0),
        st.stride(1),
        nc.stride(0),
        nc.stride(1),
        *sides.strides(layout),
        *((counters, out, out.stride(0), out.stride(1)) if fused is not None else (nc, pm, 0, 0)),  # stand-ins: never read unfused
    )
    # PAIRS only as the default tile: an explicit block_t keeps its meaning (the key group: one group a
    # tile; anything else: the per-code path), so benchmarks/decode_gpu.py's sweep times what it did
    cfg_pairs = centred and pairs and block_t is None and cfg["block_t"] == 2 * kgroup
    # int2 rows of whole 8-byte pairs of words, 8-byte aligned: PAIRS reads them as 64-bit loads (_tl.centred_pair_words)
    wide = cfg_pairs and sides.k_bits == 2 and all(x * 2 % 64 == 0 for x in (r, r_v)) and all(
        x % 8 == 0 for t in (kc, vc) for x in (t.stride(0), t.stride(1), t.stride(2), t.data_ptr()))
    cfg_centred = centred and (cfg["block_t"] == kgroup or cfg_pairs)
    constexprs = dict(
        # 16 rows where fewer measured worse: float32 bases (spill on sm_80), int2 and the other per-code reads (more instructions)
        G=pow2_at_least(group, DOT_ROWS if parts > 1 and (not bits or cfg_centred) else 16),
        D=pow2_at_least(d),
        DV=pow2_at_least(d_v),
        R=pow2_at_least(r),
        RV=pow2_at_least(r_v),
        BLOCK_T=cfg["block_t"],
        BLOCK_D=pow2_at_least(d) if interpreting() else min(BLOCK_D, pow2_at_least(d)),
        PARTS=parts,
        NATIVE16=parts > 1 and not interpreting(),
        Q_NATIVE=parts > 1 and q.dtype == kb.dtype and not interpreting(),
        **sides.constexprs(),
        MANUAL_BF16=bits > 0 and kb.dtype == torch.bfloat16 and interpreting(),
        DEVICE_T=device_t,
        MIN_SPLIT=MIN_SPLIT_TOKENS if device_t else 1,
        CENTRED=cfg_centred,
        PAIRS=cfg_pairs,
        WIDE_CODES=wide,
        TOKENS_M=TOKENS_M_DEFAULT if tokens_m is None else bool(tokens_m),
        RANKS_FULL=r == pow2_at_least(r) and r_v == pow2_at_least(r_v),
        CPARTS=CENTRED_PARTS[kb.dtype] if kb.dtype in CENTRED_PARTS else 3,
        Z_SLOTS=cfg["num_warps"] > 1 and parts > 1 and not bits,  # _tile16 only
        INTERPRETED=interpreting(),
    )
    if fused is not None:  # the merge's formula over whole rows, MERGE_BLOCK_S splits a step (merge_launch(columns=0, block_s=MERGE_BLOCK_S))
        constexprs.update(FUSED=True, MERGE_S=min(MERGE_BLOCK_S, pow2_at_least(S, 1)), OUT_BF16=interpreting() and out.dtype == torch.bfloat16)
    if cfg["max_registers"] is None:
        cfg["max_registers"] = default_max_registers(kb.dtype, group, cfg["num_warps"], constexprs)
    return Launch(_decode_split_kernel, (N * H, S), args, constexprs, cfg["num_warps"], cfg["max_registers"] or None), outputs


def merge_partials(m, z, o, dtype):
    """Spec A3.2: merge the S partials of every (sequence, query head); returns N / Z as
    (N, H_q, d_v) in ``dtype``. Empty partials (-inf, 0, 0) are the identity."""
    launch, out = merge_launch(m, z, o, dtype)
    launch.run()
    return out


def _power_of_two_or_none(name: str, value, least: int) -> int | None:
    """``value`` as an int: None, a power of two, or 0 where ``least`` is 0 (ValueError naming ``name`` otherwise)."""
    if value is None:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < least or (number and number & (number - 1)):
        raise ValueError(f"merge_launch: {name} must be None, {'0 or ' if least == 0 else ''}a power of two, got {value!r}")
    return number


def merge_launch(m, z, o, dtype, out=None, *, columns: int | None = None, block_s: int | None = None):
    """The launch of :func:`merge_partials` (not run) and its output (``out`` when given).

    ``columns``: d_v columns merged per program (a power of two; None: MERGE_COLUMNS, 0 for all
    of them), so a row's columns are spread over ``d_v / columns`` programs; ``block_s``: splits
    per step of each program's loop over the partials (a power of two; None: MERGE_TILE divided
    by the columns). Every shape merges by the same formula; the order of the float32 sums over
    splits follows ``block_s``."""
    columns, block_s = (_power_of_two_or_none("columns", columns, 0), _power_of_two_or_none("block_s", block_s, 1))
    N, Hq, S = m.shape
    d_v = o.shape[-1]
    columns = MERGE_COLUMNS if columns is None else columns
    DV = pow2_at_least(d_v) if columns == 0 else min(columns, pow2_at_least(d_v))
    out = torch.empty((N, Hq, d_v), dtype=dtype, device=m.device) if out is None else out
    args = (m.contiguous(), z.contiguous(), o.contiguous(), out, S, d_v, Hq, out.stride(0), out.stride(1))
    constexprs = dict(
        DV=DV,
        BLOCK_S=min(max(1, MERGE_TILE // DV) if block_s is None else block_s, pow2_at_least(S, 1)),
        MANUAL_BF16=interpreting() and dtype == torch.bfloat16,
    )
    return Launch(_merge_kernel, (N * Hq, cdiv(d_v, DV)), args, constexprs, 4), out


def attention_partials(q, layout, scale: float, split_len: int | None = None, num_splits: int | None = None, **launch):
    """The split partials (m, Z, N) of spec A3.2 that :func:`decode_attention` merges, with the
    default split length when ``split_len`` is None (:func:`sized_launch`; exact tokens, spec/window.md
    W3, add their own partials to these: :mod:`subspace_ref_triton.window_decode`)."""
    split, partials = sized_launch(lambda s: partials_launch(q, layout, scale, s, num_splits, **launch), q, layout, split_len, ("split",), launch)
    split.run()
    return partials


def new_counters(q, layout):
    """The fused merge's counters of q (N, H_q, d) over ``layout``: int32 zeros, one per (sequence,
    KV head); every fused launch leaves them at zero, so they can be reused (and graph-captured)."""
    return torch.zeros(q.shape[0] * layout.key_coef.shape[1], dtype=torch.int32, device=q.device)


def fused_launch(q, layout, scale: float, split_len: int, num_splits: int | None = None, *, counters=None, out=None, **launch):
    """One launch for split + merge (spec A3.2): :func:`split_launch` with ``fused``. Returns the
    launch (not run) and ``(out, counters, partials)``; ``counters`` from :func:`new_counters`
    when None, ``out`` (N, H_q, d_v) in q's dtype when None."""
    N, Hq, _, _, _, _, _, d_v = _shapes(q, layout)
    counters = new_counters(q, layout) if counters is None else counters
    out = torch.empty((N, Hq, d_v), dtype=q.dtype, device=q.device) if out is None else out
    split, partials = split_launch(q, layout, scale, split_len, num_splits, fused=(out, counters), **launch)
    return split, (out, counters, partials)


def decode_attention(q, layout, scale: float | None = None, split_len: int | None = None, num_splits: int | None = None, *, fused_merge: bool = False,
                     counters=None, **launch):
    """Coefficient-space attention (spec A2, A3) of q (N, H_q, d) over ``layout``: (N, H_q, d_v)
    in q's dtype, accumulated in float32. ``scale`` defaults to 1/sqrt(d).

    ``fused_merge``: split and merge (spec A3.2) in one launch (:func:`fused_launch`), the merge by
    the last program of each (sequence, KV head); ``counters`` (:func:`new_counters`, left at zero)
    may be passed to reuse. Off by default: the two-launch path; the fused one timed slower
    under a CUDA graph, faster eager (docs/gpu.md, "The merge at N = 1")."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if fused_merge:
        split, (out, _, _) = sized_launch(lambda s: fused_launch(q, layout, scale, s, num_splits, counters=counters, **launch), q, layout, split_len,
                                          ("fused",), launch)
        split.run()
        return out
    if counters is not None:
        raise ValueError("counters are the fused merge's: pass fused_merge=True")
    m, z, o = attention_partials(q, layout, scale, split_len, num_splits, **launch)
    return merge_partials(m, z, o, q.dtype)


# ---------------------------------------------------------------------------------------- references


def _token_chunks(starts, nj: int, T: int):
    """Chunk index of every token 0..T-1 (spec A9: chunk j covers [starts[j], starts[j+1]))."""
    tokens = torch.arange(T, device=starts.device)
    return torch.searchsorted(starts[:nj].contiguous(), tokens, right=True) - 1


def _coefficients(layout, which: str, n: int, h: int, T: int):
    """Rows 0..T-1 of one head's coefficients in float32, dequantised (spec A10) when int8, read
    by the oracle's own reader (spec/quantization.md Q2) when int4/int2."""
    if layout.side_format(which).low_bits:  # each side in its own format (spec/quantization.md Q0)
        from subspace_ref.quantization import read_low_bit

        return read_low_bit(layout, which, 0, T, torch.float32, T, index=(n, h))
    coef = getattr(layout, f"{which}_coef")[n, h, :T].to(torch.float32)
    scales = getattr(layout, f"{which}_scale", None)
    return coef if scales is None else coef * scales[n, h, :T, None]


def decode_partials_reference(q, layout, scale: float, split_len: int, num_splits: int | None = None):
    """:func:`decode_partials` in plain torch, float32, one (sequence, KV head) at a time.

    Written from spec A3.1 rather than A3: each token's value is reconstructed as ``d_t E_j``
    and each split's partial is an ordinary softmax over its tokens, so the kernel's chunk walk
    and once-per-chunk mapping are checked against a different route to the same numbers.
    """
    N, Hq, d, H, group, r, r_v, d_v = _shapes(q, layout)
    T = int(layout.num_tokens)
    S = cdiv(T, split_len) if num_splits is None else int(num_splits)
    f32 = torch.float32
    pm = torch.full((N, Hq, S), float("-inf"), dtype=f32, device=q.device)
    pz = torch.zeros((N, Hq, S), dtype=f32, device=q.device)
    po = torch.zeros((N, Hq, S, d_v), dtype=f32, device=q.device)
    for n in range(N):
        for h in range(H):
            nj = int(layout.num_chunks[n, h])
            chunk = _token_chunks(layout.chunk_starts[n, h], nj, T)
            B = layout.key_bases[n, h, :nj].to(f32)  # (J, r, d)
            E = layout.value_bases[n, h, :nj].to(f32)
            qg = q[n, h * group : (h + 1) * group].to(f32)  # (g, d)
            q_proj = torch.einsum("jrd,gd->jgr", B, qg)  # spec A3 step 2.1, every chunk
            c, dv = _coefficients(layout, "key", n, h, T), _coefficients(layout, "value", n, h, T)
            logits = float(layout.gamma[h]) * scale * torch.einsum("tgr,tr->gt", q_proj[chunk], c)
            v_hat = torch.einsum("tr,trd->td", dv, E[chunk])
            for s in range(S):
                a, b = s * split_len, min((s + 1) * split_len, T)
                if a >= b:
                    continue
                m = logits[:, a:b].max(dim=1).values
                w = torch.exp(logits[:, a:b] - m[:, None])
                rows = slice(h * group, (h + 1) * group)
                pm[n, rows, s] = m
                pz[n, rows, s] = w.sum(dim=1)
                po[n, rows, s] = w @ v_hat[a:b]
    return pm, pz, po


def merge_partials_reference(m, z, o, dtype):
    """:func:`merge_partials` in plain torch (spec A3.2)."""
    M = m.max(dim=-1, keepdim=True).values
    ref = torch.where(torch.isinf(M), torch.zeros_like(M), M)
    a = torch.exp(m - ref)  # exp(-inf) = 0 for empty partials
    return ((o * a[..., None]).sum(dim=2) / (z * a).sum(dim=2)[..., None]).to(dtype)


def decode_attention_reference(q, layout, scale: float | None = None, split_len: int | None = None, num_splits: int | None = None, **launch):
    """:func:`decode_attention` in plain torch."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if split_len is None:
        split_len = default_split_len(int(layout.num_tokens), q.shape[0] * layout.key_coef.shape[1], q.device)
    m, z, o = decode_partials_reference(q, layout, scale, split_len, num_splits)
    return merge_partials_reference(m, z, o, q.dtype)
