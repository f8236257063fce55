"""The projection step of appending (spec A6 step 1, A7 steps 1-2, A8 step 2) as one Triton
kernel, beside a pure-torch ``*_reference`` with the same signature.

One launch covers every sequence and head and both keys and values: grid
``(N * H, min(ceil(n / BLOCK_N), MAX_GRID_Y))``, one program per (sequence, head) and tile of new
tokens; above MAX_GRID_Y tiles (CUDA's limit on the second grid dimension, ~1.05M tokens) each
program strides over the tiles, so an append of any length is one launch. A program loads
the head's basis per tile (``B = bases[n, h, chunk[n, h]]``: with ``chunk =
num_chunks - 1`` that is the open chunk of spec A9, read in place, no gather copy), computes
``c_t = B k_t`` for its tokens in float32 (16-bit inputs on tensor cores: their products are exact
in float32, so this equals a float32 product of the stored values), writes the coefficients in
the output's dtype — straight into the state's buffer when the caller passes a view of it at the
right token offset — and, when asked, the relative residuals of spec A7 step 2 from the float32
coefficients (the torch backend computes them the same way, so both fire the same triggers).

Everything else an append does (warm-up rows, FD sketches, triggers, rotations) stays in torch:
it is sequential in the tokens, or an SVD.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from subspace_ref.quantization import quantize_rows
from subspace_ref_triton._common import Launch, cdiv, interpreting, pow2_at_least
from subspace_ref_triton._tl import MAX_COMBINE, SUM_COMBINE, to_storage

BLOCK_N = 16  # new tokens per program: the tl.dot minimum; decode appends one token anyway
BLOCK_D = 32  # columns per step of the projection
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (and .z)


def _block_d(dim: int) -> int:
    # the interpreter takes all of d at once: its cost is per operation, not per register
    return pow2_at_least(dim) if interpreting() else min(BLOCK_D, pow2_at_least(dim))


# 1.5 * 2^23: adding and subtracting it rounds a float32 of magnitude < 2^22 to the nearest
# integer, ties to even (the rounding of torch.round and numpy.rint), on the GPU and in NumPy.
_RINT_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _project_one(x_base, sx_t, b_base, sb_r, out_base, so_t, scale_base, ss_t, rho_base, tok, t_mask, dim, rank,
                 D: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WANT_RHO: tl.constexpr,
                 NATIVE: tl.constexpr, MANUAL_BF16: tl.constexpr, QUANT: tl.constexpr):
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    c = tl.full([BLOCK_N, R], 0.0, tl.float32)
    norm2 = tl.full([BLOCK_N], 0.0, tl.float32)
    # In slices of BLOCK_D columns: a float32 FMA product with all of d as its inner dimension
    # needs hundreds of registers per thread.
    for d0 in tl.static_range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < dim
        x = tl.load(x_base + tok[:, None] * sx_t + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        b = tl.load(b_base + offs_r[:, None] * sb_r + offs_d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        if NATIVE:
            c = tl.dot(x, tl.trans(b), acc=c)
        else:
            # float32 data, or the interpreter (whose bfloat16 tl.dot is wrong): float32 FMAs, no TF32
            c = tl.dot(x.to(tl.float32), tl.trans(b.to(tl.float32)), acc=c, input_precision="ieee")
        if WANT_RHO:
            xf = x.to(tl.float32)
            norm2 += tl.reduce(xf * xf, 1, SUM_COMBINE)
    if QUANT:
        # Spec A10, as subspace_ref.quantization: s = max|c| / 127, q = round(c / s) in
        # [-127, 127]; a zero row gets s = 0 and q = 0. From the float32 coefficients.
        s = tl.reduce(tl.abs(c), 1, MAX_COMBINE) / 127.0
        qv = c / tl.where(s > 0, s, 1.0)[:, None]
        qv = (qv + _RINT_MAGIC) - _RINT_MAGIC
        qv = tl.minimum(tl.maximum(qv, -127.0), 127.0)
        tl.store(out_base + tok[:, None] * so_t + offs_r[None, :], qv.to(tl.int8), mask=t_mask[:, None] & r_mask[None, :])
        tl.store(scale_base + tok * ss_t, s, mask=t_mask)
    else:
        tl.store(out_base + tok[:, None] * so_t + offs_r[None, :], to_storage(c, out_base, MANUAL_BF16),
                 mask=t_mask[:, None] & r_mask[None, :])
    if WANT_RHO:
        # Spec A7 step 2 by Pythagoras (the basis rows are orthonormal); max(., 0) absorbs rounding.
        res2 = tl.maximum(norm2 - tl.reduce(c * c, 1, SUM_COMBINE), 0.0)
        rho = tl.where(norm2 > 0, tl.sqrt(res2 / tl.where(norm2 > 0, norm2, 1.0)), 0.0)
        tl.store(rho_base + tok, rho, mask=t_mask)


@triton.jit
def _project_kernel(
    k_ptr, v_ptr, kb_ptr, vb_ptr, chunk_ptr, ok_ptr, ov_ptr, oks_ptr, ovs_ptr, rk_ptr, rv_ptr, row_ptr,
    H, n_new, d, d_v, r, r_v,
    sk_n, sk_h, sk_t, sv_n, sv_h, sv_t,
    skb_n, skb_h, skb_j, skb_r, svb_n, svb_h, svb_j, svb_r,
    sc_n, sc_h,
    sok_n, sok_h, sok_t, sov_n, sov_h, sov_t,
    soks_n, soks_h, soks_t, sovs_n, sovs_h, sovs_t,
    D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, RV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, WANT_RHO: tl.constexpr, NATIVE: tl.constexpr,
    MANUAL_BF16_K: tl.constexpr, MANUAL_BF16_V: tl.constexpr, QUANT: tl.constexpr, DEVICE_ROW: tl.constexpr,
):
    nh = tl.program_id(0).to(tl.int64)
    n = nh // H
    h = nh % H
    j = tl.load(chunk_ptr + n * sc_n + h * sc_h)
    # the outputs' first row: the token count on the device (a graph-captured append), else the caller's view
    row0 = tl.load(row_ptr).to(tl.int64) if DEVICE_ROW else 0
    # Grid-stride over the token tiles: the second grid dimension is capped at MAX_GRID_Y.
    for t0 in range(tl.program_id(1) * BLOCK_N, n_new, tl.num_programs(1) * BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        t_mask = tok < n_new
        _project_one(k_ptr + n * sk_n + h * sk_h, sk_t, kb_ptr + n * skb_n + h * skb_h + j * skb_j, skb_r,
                     ok_ptr + n * sok_n + h * sok_h + row0 * sok_t, sok_t, oks_ptr + n * soks_n + h * soks_h + row0 * soks_t, soks_t,
                     rk_ptr + nh * n_new, tok, t_mask, d, r, D, R, BLOCK_N, BLOCK_DK, WANT_RHO, NATIVE, MANUAL_BF16_K, QUANT)
        _project_one(v_ptr + n * sv_n + h * sv_h, sv_t, vb_ptr + n * svb_n + h * svb_h + j * svb_j, svb_r,
                     ov_ptr + n * sov_n + h * sov_h + row0 * sov_t, sov_t, ovs_ptr + n * sovs_n + h * sovs_h + row0 * sovs_t, sovs_t,
                     rv_ptr + nh * n_new, tok, t_mask, d_v, r_v, DV, RV, BLOCK_N, BLOCK_DV, WANT_RHO, NATIVE, MANUAL_BF16_V, QUANT)


def _check_unit_stride(**arrays):
    for name, x in arrays.items():
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit stride in its last dimension")


def project_append(keys, values, key_bases, value_bases, chunk, out_key, out_value, residuals: bool = False,
                   out_key_scale=None, out_value_scale=None, out_row=None):
    """Spec A6 step 1 / A7 steps 1-2 / A8 step 2 for a block of tokens, every head at once.

    keys (N, H, n, d), values (N, H, n, d_v); key_bases (N, H, J, r, d), value_bases
    (N, H, J, r_v, d_v) and chunk (N, H) integer: head (s, h) projects with
    ``key_bases[s, h, chunk[s, h]]``. Writes ``c = B k`` into out_key (N, H, n, r) and
    ``E v`` into out_value (N, H, n, r_v), in their dtypes; both may be views into a state's
    coefficient buffers (any strides, unit stride in the last dimension). With
    ``out_key_scale``/``out_value_scale`` (N, H, n) float32 the outputs are int8 and the
    coefficients are quantised per token (spec A10). ``out_row``: a one-element int64 tensor on
    the device, the row of the outputs (and scales) where token 0 goes, read by the kernel (a
    graph-captured append at the token count); None: row 0 of the views given. Returns float32
    ``(rho_k, rho_v)`` (N, H, n), from the unquantised coefficients, when ``residuals``, else None.
    """
    launch, rho = project_launch(keys, values, key_bases, value_bases, chunk, out_key, out_value, residuals, out_key_scale, out_value_scale, out_row)
    if launch is not None:
        launch.run()
    return rho


def project_launch(keys, values, key_bases, value_bases, chunk, out_key, out_value, residuals: bool = False,
                   out_key_scale=None, out_value_scale=None, out_row=None):
    """The launch of :func:`project_append` (not run; None when there is no token) and what it
    returns; without ``residuals`` it allocates nothing."""
    N, H, n_new, d = keys.shape
    r, r_v, d_v = key_bases.shape[3], value_bases.shape[3], value_bases.shape[4]
    _check_unit_stride(keys=keys, values=values, key_bases=key_bases, value_bases=value_bases, out_key=out_key, out_value=out_value)
    quant = out_key_scale is not None
    if quant != (out_value_scale is not None) or (out_key.dtype == torch.int8, out_value.dtype == torch.int8) != (quant, quant):
        raise ValueError("int8 outputs need both out_key_scale and out_value_scale, and int8 out_key/out_value (and float outputs neither)")
    ks, vs = (out_key_scale, out_value_scale) if quant else (out_key, out_value)  # never written unless quant
    dev = keys.device
    if out_row is not None and (out_row.dtype != torch.int64 or out_row.numel() != 1 or out_row.device != dev):
        raise ValueError("out_row must be a one-element int64 tensor on the keys' device")
    if residuals:
        rho_k = torch.empty((N, H, n_new), dtype=torch.float32, device=dev)
        rho_v = torch.empty((N, H, n_new), dtype=torch.float32, device=dev)
    else:  # never written: WANT_RHO is off
        rho_k = rho_v = keys
    rho = (rho_k, rho_v) if residuals else None
    if n_new == 0:
        return None, rho
    native = keys.dtype == key_bases.dtype and keys.dtype in (torch.float16, torch.bfloat16) and not interpreting()
    args = (
        keys, values, key_bases, value_bases, chunk, out_key, out_value, ks, vs, rho_k, rho_v, chunk if out_row is None else out_row,
        H, n_new, d, d_v, r, r_v,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        key_bases.stride(0), key_bases.stride(1), key_bases.stride(2), key_bases.stride(3),
        value_bases.stride(0), value_bases.stride(1), value_bases.stride(2), value_bases.stride(3),
        chunk.stride(0), chunk.stride(1),
        out_key.stride(0), out_key.stride(1), out_key.stride(2),
        out_value.stride(0), out_value.stride(1), out_value.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
    )
    constexprs = dict(
        D=pow2_at_least(d), DV=pow2_at_least(d_v), R=pow2_at_least(r), RV=pow2_at_least(r_v),
        BLOCK_N=BLOCK_N, BLOCK_DK=_block_d(d), BLOCK_DV=_block_d(d_v), WANT_RHO=bool(residuals), NATIVE=native,
        MANUAL_BF16_K=interpreting() and out_key.dtype == torch.bfloat16,
        MANUAL_BF16_V=interpreting() and out_value.dtype == torch.bfloat16,
        QUANT=quant,
        DEVICE_ROW=out_row is not None,
    )
    return Launch(_project_kernel, project_grid(N, H, n_new), args, constexprs, 4), rho


def project_grid(N: int, H: int, n_new: int) -> tuple[int, int]:
    """Grid of :func:`project_append`: one program per (sequence, head) and tile of BLOCK_N new
    tokens, at most MAX_GRID_Y tiles (the programs then stride over the rest)."""
    return (N * H, max(1, min(cdiv(n_new, BLOCK_N), MAX_GRID_Y)))


def relative_residual_reference(x, coef):
    """Spec A7 step 2 in float32: rho = sqrt(max(|x|^2 - |c|^2, 0)) / |x|, and 0 for x = 0."""
    return _relative_residual(x.to(torch.float32), coef.to(torch.float32))


def _relative_residual(x, coef):
    norm2 = (x * x).sum(-1)
    res2 = torch.clamp(norm2 - (coef * coef).sum(-1), min=0.0)
    return torch.where(norm2 > 0, torch.sqrt(res2 / torch.where(norm2 > 0, norm2, torch.ones_like(norm2))), torch.zeros_like(norm2))


def project_append_reference(keys, values, key_bases, value_bases, chunk, out_key, out_value, residuals: bool = False,
                             out_key_scale=None, out_value_scale=None, out_row=None):
    """:func:`project_append` in plain torch (float32 products, gathered bases; ``out_row`` read on the host)."""
    N, H, n = keys.shape[:3]
    if out_row is not None:
        row = int(out_row)
        out_key, out_value = out_key[:, :, row : row + n], out_value[:, :, row : row + n]
        if out_key_scale is not None:
            out_key_scale, out_value_scale = out_key_scale[:, :, row : row + n], out_value_scale[:, :, row : row + n]
    n_idx = torch.arange(N, device=keys.device)[:, None]
    h_idx = torch.arange(H, device=keys.device)[None, :]
    B = key_bases[n_idx, h_idx, chunk.long()].to(torch.float32)  # (N, H, r, d)
    E = value_bases[n_idx, h_idx, chunk.long()].to(torch.float32)
    c = torch.matmul(keys.to(torch.float32), B.mT)
    dv = torch.matmul(values.to(torch.float32), E.mT)
    if out_key_scale is not None:
        for coef, out, out_scale in ((c, out_key, out_key_scale), (dv, out_value, out_value_scale)):
            q, s = quantize_rows(coef)  # spec A10, the oracle's own quantiser
            out.copy_(q)
            out_scale.copy_(s)
    else:
        out_key.copy_(c)
        out_value.copy_(dv)
    if residuals:
        return relative_residual_reference(keys, c), relative_residual_reference(values, dv)
    return None


def project_window(keys, values, key_basis, value_basis):
    """The projection of one adaptive window of the torch backend's append, as a hook:
    keys (N, H, s, d), values (N, H, s, d_v) and the open bases (N, H, r, d), (N, H, r_v, d_v),
    all in the work dtype -> ``(c, d, rho_k, rho_v)``: coefficients (N, H, s, r), (N, H, s, r_v)
    and residuals (N, H, s) in that dtype, as ``torch.matmul`` and the oracle's ``relative_residual``
    would give them (spec A7 steps 1-2). float64 windows (float64 states) are computed by torch.
    """
    N, H, s, _ = keys.shape
    dtype = keys.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        c, dv = torch.matmul(keys, key_basis.mT), torch.matmul(values, value_basis.mT)
        return c, dv, _relative_residual(keys, c), _relative_residual(values, dv)
    out_k = torch.empty((N, H, s, key_basis.shape[2]), dtype=dtype, device=keys.device)
    out_v = torch.empty((N, H, s, value_basis.shape[2]), dtype=dtype, device=keys.device)
    chunk = torch.zeros((N, H), dtype=torch.int64, device=keys.device)
    kb, vb = key_basis.contiguous()[:, :, None], value_basis.contiguous()[:, :, None]
    rho_k, rho_v = project_append(keys.contiguous(), values.contiguous(), kb, vb, chunk, out_k, out_v, residuals=True)
    return out_k, out_v, rho_k.to(dtype), rho_v.to(dtype)
