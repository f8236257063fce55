"""Decode attention over a pre-RoPE static state (spec/rope.md P3) as one fused Triton kernel per
split of the token axis, merged by :func:`subspace_ref_triton.decode.merge_partials`.

A program owns one (sequence, KV head) and one split, and per tile of ``BLOCK_T`` tokens

1. rebuilds the keys from their coefficients, ``u_t = B^T c_t`` (int8 coefficients, spec A10,
   converted exactly in the kernel, their scales applied to the logits; int4/int2,
   spec/quantization.md Q2, unpacked and dequantised to float32 in the kernel), as three products with
   the basis columns of the planes' first dims, second dims and the fixed dims (the layout's
   planes, ``RopeParams.planes``, become contiguous halves: no gather of the rebuilt key);
2. rotates them to their positions, ``R_t u_t``: cos/sin of ``t theta_i`` by angle addition of
   the tile's base angle (a float32 row of :func:`base_angles`, computed on the host in float64,
   2m numbers per tile) and the offsets ``k theta_i`` (float64, once per program);
3. takes the logits with the g query heads of the GQA group (``gamma_h * scale`` applied to the
   float32 logits), and runs the one-pass softmax of spec A3 with the values kept in coefficient
   space (``g x r_v`` accumulator), mapped through ``E`` once per split.

Rebuilding the key (not rotating the query per token) serves all g query heads with one
``O(r d)`` product per token: spec/roofline.md R13. On a GPU, when the bases are 16-bit and the
coefficients are of the bases' dtype or int8 (``NATIVE16``), the rebuild runs on the tensor
cores with the operands as stored: a product of two 16-bit numbers is exact in float32 (int8
codes are exact in either 16-bit type), and the sums accumulate in float32, so it computes what
the float32 ``ieee`` product computes up to the order of the sums. Everything else is float32
(``ieee`` products), and so is the rebuild of float32 and int4/int2 states and the interpreter's
(whose 16-bit ``tl.dot`` multiplies bit patterns). The float32 rebuild of a bf16 state is many
times SDPA's time on an H100 (docs/gpu.md, "Measured on an H100").
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from subspace_ref_triton._common import Launch, cdiv, interpreting, pow2_at_least
from subspace_ref_triton._tl import MAX_COMBINE as _MAX
from subspace_ref_triton._tl import SUM_COMBINE as _SUM
from subspace_ref_triton._tl import low_bit_keys, low_bit_values
from subspace_ref_triton.decode import DOT_ROWS, default_split_len, merge_partials, side_formats

# Tokens per tile and warps, chosen by H100 timing although ptxas spills with them: the compile
# report lists this default as spilling by choice (SPILLS_MEASURED); the timings are in docs/gpu.md.
BLOCK_T = 32
NUM_WARPS = 4
SPILLS_MEASURED = ("spills; timed faster on an H100 (bf16 float, int8, int4; fp32 and int2 not timed) than the largest configuration that does not "
                   "(16-token tiles, 8 warps): docs/gpu.md")


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

    E = tl.load(vb_ptr + n * svb_n + h * svb_h + offs_rv[:, None] * svb_r + offs_dv[None, :],
                mask=rv_mask[:, None] & (offs_dv < d_v)[None, :], other=0.0).to(tl.float32)
    o_i = tl.dot(acc, E, input_precision="ieee")
    row = (n * H + h) * group + offs_g
    tl.store(pm_ptr + row * num_splits + s, m_i, mask=g_mask)
    tl.store(pz_ptr + row * num_splits + s, z_i, mask=g_mask)
    tl.store(po_ptr + (row * num_splits + s)[:, None] * d_v + offs_dv[None, :], o_i, mask=g_mask[:, None] & (offs_dv < d_v)[None, :])


def split_launch(q, layout, rope, scale: float, split_len: int, first_position: int = 0, *, block_t: int | None = None, num_warps: int | None = None,
                 native: bool | None = None):
    """The split kernel's launch (not run) and the partials (m, Z, N) it fills, float32, in the
    format of :func:`subspace_ref_triton.decode.split_launch` (m includes gamma * scale).
    ``layout``: a one-chunk layout of torch tensors (a static state's, bases decoded);
    ``first_position``: the position of compressed token 0 (spec/window.md W10: the sinks).
    ``block_t`` (a power of two >= 16), ``num_warps`` and ``native`` (False: the float32 rebuild
    even where :func:`native16` allows the tensor cores) override the defaults, for the
    benchmark's sweep."""
    N, Hq, d = q.shape
    H = layout.key_coef.shape[1]
    group = Hq // H
    # ranks from the bases: int4/int2 coefficient rows are packed narrower (spec/quantization.md Q2)
    r, r_v, d_v = layout.key_bases.shape[3], layout.value_bases.shape[3], layout.value_bases.shape[4]
    T = int(layout.num_tokens)
    S = cdiv(T, split_len)
    dev = q.device
    pm = torch.empty((N, Hq, S), dtype=torch.float32, device=dev)
    pz = torch.empty((N, Hq, S), dtype=torch.float32, device=dev)
    po = torch.empty((N, Hq, S, d_v), dtype=torch.float32, device=dev)
    kc, vc = layout.key_coef, layout.value_coef
    kb, vb = layout.key_bases[:, :, 0], layout.value_bases[:, :, 0]
    sides = side_formats(layout)
    ks, vs, kz, vz, tail = sides.operands
    m = rope.inv_freq.size
    pairs = rope.planes(d)
    order = torch.as_tensor([*pairs[:m, 0], *pairs[:m, 1], *pairs[m:].reshape(-1)], dtype=torch.int32, device=dev)
    freq = torch.tensor(rope.inv_freq, dtype=torch.float64, device=dev)
    f = d - 2 * m
    bt = block_t or BLOCK_T
    tiles = cdiv(int(split_len), bt)
    args = (
        q, kc, vc, kb, vb, layout.gamma.contiguous(), ks, vs, kz, vz, tail, order, freq, base_angles(freq, S, int(split_len), bt, first_position, rope.attention_scaling),
        pm, pz, po,
        H, group, T, int(split_len), S, float(scale), tiles,
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
    return Launch(_rope_split_kernel, (N * H, S), args, constexprs, num_warps or NUM_WARPS), (pm, pz, po)


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
    T = int(layout.num_tokens)
    if split_len is None:
        split_len = default_split_len(T, q.shape[0] * layout.key_coef.shape[1], q.device)
        block_t = launch.get("block_t") or BLOCK_T
        split_len = cdiv(split_len, block_t) * block_t
    split, partials = split_launch(q, layout, rope, scale, split_len, first_position, **launch)
    split.run()
    return partials


def decode_attention(q, layout, rope, scale: float | None = None, split_len: int | None = None, **launch):
    """Spec/rope.md P3 of q (N, H_q, d) over a pre-RoPE static state's ``layout``: (N, H_q, d_v)
    in q's dtype, float32 inside."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    pm, pz, po = attention_partials(q, layout, rope, scale, split_len, **launch)
    return merge_partials(pm, pz, po, q.dtype)


__all__ = ["BLOCK_T", "attention_partials", "decode_attention", "native16", "split_launch"]
