"""Exact tokens (spec/window.md W3: the recent window; W7-W8: attention sinks) in the Triton
decode: each exact segment is one more chunk of spec A3 with ``B = I``, ``E = I``, ``gamma = 1``,
reduced by :func:`exact_partials` to a split partial ``(m, Z, N)`` of spec A3.2, and merged with
the compressed part's split partials (:mod:`decode` or :mod:`rope_decode`) by the same
log-sum-exp merge (:func:`subspace_ref_triton.decode.merge_partials`): one softmax over all
tokens, no reweighting afterwards.

A program owns one (sequence, KV head) and all ``g`` query heads of its GQA group (the exact keys
are loaded once for them), and walks the segment in tiles of ``BLOCK_T`` tokens with the running
max, normaliser and a ``g x d_v`` accumulator, all float32; the products are float32 FMAs
(``ieee``) of the keys and values converted exactly from the state's dtype. A window holds a few
hundred tokens at most against the thousands of the compressed part, so tensor-core splitting
(:mod:`decode`) would buy nothing measurable here.

A graph-captured decode step of a windowed graph layer (spec/models.md M11.14 step 4) takes
:func:`exact_merge_launch` in place of the merge launch: the exact partial over the filled
prefix of the layer's sinks-and-ring array, its length read on the device, merged with the
compressed part's split partials and written in the query's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from subspace_ref_triton import decode
from subspace_ref_triton._common import Launch, interpreting, pow2_at_least
from subspace_ref_triton._tl import MAX_COMBINE as _MAX
from subspace_ref_triton._tl import SUM_COMBINE as _SUM
from subspace_ref_triton._tl import to_storage
from subspace_ref_triton.decode import MERGE_BLOCK_S, _merge_state  # the merge kernel's arithmetic, continued by the exact part

BLOCK_T = 16  # exact tokens per tile: a (16 x d) key tile and a (16 x d_v) value tile in float32
BLOCK_D = 32  # columns of q and the keys per step of the logits (the interpreter takes all d)


@triton.jit
def _exact_partial(q_ptr, k_ptr, v_ptr, n, h, kv, group, n_tok, scale, d, d_v, sq_n, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t,
                   G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Spec A3.2's partial (m, Z, N) of sequence ``n``'s query rows ``h * group ..`` (``G`` of
    them, the first ``group`` real) over exact tokens ``0 .. n_tok - 1`` (n_tok >= 1) of KV head
    row ``kv``: (G,), (G,), (G, DV), float32."""
    offs_g = tl.arange(0, G)
    offs_dv = tl.arange(0, DV)
    offs_t = tl.arange(0, BLOCK_T)
    g_mask = offs_g < group
    dv_mask = offs_dv < d_v
    q_rows = q_ptr + n * sq_n + (h * group + offs_g)[:, None] * sq_h
    k_base = k_ptr + n * sk_n + kv * sk_h
    v_base = v_ptr + n * sv_n + kv * sv_h
    m_i = tl.full([G], float("-inf"), tl.float32)
    z_i = tl.full([G], 0.0, tl.float32)
    acc = tl.full([G, DV], 0.0, tl.float32)
    for t0 in range(0, n_tok, BLOCK_T):
        t_mask = t0 + offs_t < n_tok
        # spec/window.md W3: logits s q . k_t, gamma = 1 (exact tokens are not projected), in
        # slices of BLOCK_D columns: a float32 FMA product over the whole d of 16-bit keys
        # converted in registers spilled ~250 bytes per thread at d = 128 (compile report)
        logits = tl.full([G, BLOCK_T], 0.0, tl.float32)
        for d0 in tl.static_range(0, D, BLOCK_D):
            offs_dd = d0 + tl.arange(0, BLOCK_D)
            qb = tl.load(q_rows + offs_dd[None, :], mask=g_mask[:, None] & (offs_dd < d)[None, :], other=0.0).to(tl.float32)
            kb = tl.load(k_base + (t0 + offs_t)[:, None] * sk_t + offs_dd[None, :], mask=t_mask[:, None] & (offs_dd < d)[None, :], other=0.0).to(tl.float32)
            logits = tl.dot(qb, tl.trans(kb), acc=logits, input_precision="ieee")
        logits = logits * scale
        v = tl.load(v_base + (t0 + offs_t)[:, None] * sv_t + offs_dv[None, :], mask=t_mask[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
        logits = tl.where(t_mask[None, :], logits, float("-inf"))
        # spec A3 steps 2.2-2.3; every tile holds a token, so m_new is finite and alpha never NaN
        m_new = tl.maximum(m_i, tl.reduce(logits, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(logits - m_new[:, None])
        z_i = z_i * alpha + tl.reduce(w, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(w, v, input_precision="ieee")
        m_i = m_new
    return m_i, z_i, acc


@triton.jit
def _exact_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pm_ptr,
    pz_ptr,
    po_ptr,
    H,
    group,
    n_tok,
    scale,
    d,
    d_v,
    col,
    num_cols,
    sq_n,
    sq_h,
    sk_n,
    sk_h,
    sk_t,
    sv_n,
    sv_h,
    sv_t,
    G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    nh = tl.program_id(0).to(tl.int64)
    n = nh // H
    h = nh % H
    m_i, z_i, acc = _exact_partial(q_ptr, k_ptr, v_ptr, n, h, h, group, n_tok, scale, d, d_v, sq_n, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t,
                                   G, D, DV, BLOCK_T, BLOCK_D)
    offs_g = tl.arange(0, G)
    offs_dv = tl.arange(0, DV)
    g_mask = offs_g < group
    dv_mask = offs_dv < d_v
    row = (n * H + h) * group + offs_g
    tl.store(pm_ptr + row * num_cols + col, m_i, mask=g_mask)
    tl.store(pz_ptr + row * num_cols + col, z_i, mask=g_mask)
    tl.store(po_ptr + (row * num_cols + col)[:, None] * d_v + offs_dv[None, :], acc, mask=g_mask[:, None] & dv_mask[None, :])


def exact_launch(q, keys, values, scale: float, outputs, col: int):
    """The launch (not run) writing column ``col`` of the partials ``outputs = (m, Z, N)`` (float32,
    (N, H_q, S), (N, H_q, S, d_v), contiguous) with the A3.2 partial of exact keys (N, H, n, d)
    and values (N, H, n, d_v), n >= 1, under query q (N, H_q, d)."""
    N, Hq, d = q.shape
    H, n_tok, d_v = keys.shape[1], keys.shape[2], values.shape[3]
    pm, pz, po = outputs
    for name, x in (("q", q), ("keys", keys), ("values", values)):
        if x.stride(-1) != 1:
            raise ValueError(f"exact {name} must have a unit stride in its last dimension")
    args = (
        q,
        keys,
        values,
        pm,
        pz,
        po,
        H,
        Hq // H,
        n_tok,
        float(scale),
        d,
        d_v,
        col,
        pm.shape[2],
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
    )
    D = pow2_at_least(d)
    constexprs = dict(G=pow2_at_least(Hq // H), D=D, DV=pow2_at_least(d_v), BLOCK_T=BLOCK_T, BLOCK_D=D if interpreting() else min(BLOCK_D, D))
    return Launch(_exact_kernel, (N * H,), args, constexprs, 4)


@triton.jit
def _exact_merge_kernel(
    q_ptr, k_ptr, v_ptr, heads_ptr, count_ptr, pm_ptr, pz_ptr, po_ptr, out_ptr,
    H, group, capacity, scale, d, d_v, num_splits,
    sq_n, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, so_n, so_h,
    HAS_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    nh = tl.program_id(0).to(tl.int64)
    n = nh // H
    h = nh % H
    # the filled slots are a prefix (spec/models.md M11.14 step 3): T tokens fill the first min(T, S + W) (step 4)
    n_tok = tl.minimum(tl.load(count_ptr), capacity)
    kv = tl.load(heads_ptr + h).to(tl.int64) if HAS_HEADS else h
    m_e, z_e, o_e = _exact_partial(q_ptr, k_ptr, v_ptr, n, h, kv, group, n_tok, scale, d, d_v, sq_n, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t,
                                   G, D, DV, BLOCK_T, BLOCK_D)
    # one program per query row, as the merge launch it replaces: the G rows' exact partial is
    # formed again by each of the group's programs (a few tiles of S + W tokens, L2-resident), so
    # each merges one row's splits, not the group's one after another
    i = tl.program_id(1)
    mine = tl.arange(0, G) == i
    m_x = tl.max(tl.where(mine, m_e, float("-inf")), 0)
    z_x = tl.sum(tl.where(mine, z_e, 0.0), 0)
    o_x = tl.sum(tl.where(mine[:, None], o_e, 0.0), 0)
    m_s, z_s, o_s = _merge_state(pm_ptr, pz_ptr, po_ptr, (n * H + h) * group + i, num_splits, d_v, 0, DV, BLOCK_S, "")
    # spec A3.2 over the two parts; the exact part holds a token (M11.14 step 4), so m is finite
    m = tl.maximum(m_s, m_x)
    a_s, a_x = tl.exp(m_s - m), tl.exp(m_x - m)
    o = (o_s * a_s + o_x * a_x) / (z_s * a_s + z_x * a_x)
    offs_dv = tl.arange(0, DV)
    tl.store(out_ptr + n * so_n + (h * group + i) * so_h + offs_dv, to_storage(o, out_ptr, MANUAL_BF16), mask=offs_dv < d_v)


def exact_merge_launch(q, keys, values, scale: float, partials, out, count, heads=None):
    """The launch (not run) of one decode step's exact part, merged with the split partials
    ``(m, Z, N)`` of the compressed part (spec A3.2; float32, contiguous, (N, H_q, S) and
    (N, H_q, S, d_v)) into ``out`` (N, H_q, d_v), for the query q (N, H_q, d) of a windowed graph
    layer's group (spec/models.md M11.14 step 4): the exact tokens are the first
    ``min(count, E)`` slots of ``keys`` (N, H_e, E, d) and ``values`` (N, H_e, E, d_v), ``count``
    the layer's token count T (a one-element int64 device tensor: nothing read on the host), and
    the group's KV head ``h`` reads exact row ``heads[h]`` (None: row ``h``; a contiguous 1-D
    integer tensor on q's device, each entry below H_e: not checked, that would read the
    device). T >= 1. One program per (sequence, query head), over all d_v columns (the merge
    launch, :func:`decode.merge_launch`, splits a row's columns over programs; each of these would
    form the exact partial again)."""
    N, Hq, d = q.shape
    pm, pz, po = partials
    H = keys.shape[1] if heads is None else heads.numel()
    d_v = values.shape[3]
    S = pm.shape[2]
    if (Hq % H or keys.shape[3] != d or values.shape[:3] != keys.shape[:3] or keys.shape[0] != N or pm.shape != (N, Hq, S) or pz.shape != (N, Hq, S)
            or po.shape != (N, Hq, S, d_v) or out.shape != (N, Hq, d_v)):
        raise ValueError(f"exact_merge_launch: q {tuple(q.shape)} over {H} KV heads, keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
                         f"partials {tuple(pm.shape)} / {tuple(pz.shape)} / {tuple(po.shape)} and out {tuple(out.shape)} do not agree "
                         f"(expected keys (N, H_e, E, d), values (N, H_e, E, d_v), (N, H_q, S) twice, (N, H_q, S, d_v), (N, H_q, d_v))")
    for name, x in (("q", q), ("keys", keys), ("values", values), ("out", out)):
        if x.stride(-1) != 1:
            raise ValueError(f"exact_merge_launch: {name} must have a unit stride in its last dimension")
    if not all(x.is_contiguous() and x.dtype == torch.float32 for x in partials):
        raise ValueError("exact_merge_launch: the partials must be contiguous float32 (the merge reads row s of row r at r * S + s)")
    if count.dtype != torch.int64 or count.numel() != 1 or count.device != q.device:
        raise ValueError("exact_merge_launch: count must be a one-element int64 tensor on q's device")
    if heads is not None and (heads.dim() != 1 or not heads.is_contiguous() or heads.is_floating_point() or heads.device != q.device):
        raise ValueError("exact_merge_launch: heads must be a contiguous 1-D integer tensor on q's device")
    args = (q, keys, values, keys if heads is None else heads, count, pm, pz, po, out,
            H, Hq // H, keys.shape[2], float(scale), d, d_v, pm.shape[2],
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            out.stride(0), out.stride(1))
    D = pow2_at_least(d)
    constexprs = dict(HAS_HEADS=heads is not None, G=pow2_at_least(Hq // H), D=D, DV=pow2_at_least(d_v), BLOCK_T=BLOCK_T,
                      BLOCK_D=D if interpreting() else min(BLOCK_D, D), BLOCK_S=min(MERGE_BLOCK_S, pow2_at_least(pm.shape[2], 1)),
                      MANUAL_BF16=interpreting() and out.dtype == torch.bfloat16)
    return Launch(_exact_merge_kernel, (N * H, Hq // H), args, constexprs, 4)


def exact_segments(state) -> list:
    """The exact (keys, values) segments of a state that attention reads, sinks first
    (spec/window.md W8), each with at least one token."""
    win = state.window
    if win is None:
        return []
    segments = [(win.sink_keys, win.sink_values), (win.keys, win.values)]
    return [(k.contiguous(), v.contiguous()) for k, v in segments if k is not None and k.shape[2] > 0]


def decode_attention(q, state, layout, scale: float | None = None, compressed=None):
    """Spec A3 with the exact tokens of spec/window.md W3/W8: q (N, H_q, d) -> (N, H_q, d_v) in q's
    dtype. ``compressed(q, layout, scale)`` returns the compressed part's split partials
    (m, Z, N) (:func:`subspace_ref_triton.decode.decode_partials` by default), called only
    when the compressed part holds tokens; each exact segment adds one partial column, and all
    are merged by log-sum-exp (spec A3.2)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    segments = exact_segments(state)
    N, Hq, _ = q.shape
    d_v = layout.value_bases.shape[4]
    parts = []
    if int(layout.num_tokens) > 0:
        parts.append(compressed(q, layout, scale))
    if segments:
        f32 = dict(dtype=torch.float32, device=q.device)
        S = len(segments)
        exact = (torch.empty((N, Hq, S), **f32), torch.empty((N, Hq, S), **f32), torch.empty((N, Hq, S, d_v), **f32))
        for col, (k, v) in enumerate(segments):
            exact_launch(q, k, v, scale, exact, col).run()
        parts.append(exact)
    if not parts:
        raise ValueError("attention over a state with no tokens is undefined (spec A3.1: Z = 0)")
    m, z, o = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
    return decode.merge_partials(m, z, o, q.dtype)


def decode_attention_reference(q, state, layout, scale: float | None = None):
    """:func:`decode_attention` in plain torch: one softmax (A3.1) over the compressed tokens'
    logits (:func:`subspace_ref_triton.decode.decode_partials_reference`, one split) and the
    exact tokens' logits, float32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    N, Hq, d = q.shape
    f32 = torch.float32
    parts = []
    T_c = int(layout.num_tokens)
    if T_c > 0:
        parts.append(decode.decode_partials_reference(q, layout, scale, T_c, 1))
    for k, v in exact_segments(state):
        H = k.shape[1]
        qg = q.to(f32).reshape(N, H, Hq // H, d)
        logits = torch.matmul(qg, k.to(f32).mT) * scale  # (N, H, g, n)
        m = logits.amax(dim=-1)
        w = torch.exp(logits - m[..., None])
        parts.append((m.reshape(N, Hq, 1), w.sum(-1).reshape(N, Hq, 1), torch.matmul(w, v.to(f32)).reshape(N, Hq, 1, -1)))
    m, z, o = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
    return decode.merge_partials_reference(m, z, o, q.dtype)


__all__ = ["BLOCK_T", "decode_attention", "decode_attention_reference", "exact_launch", "exact_merge_launch", "exact_segments"]
