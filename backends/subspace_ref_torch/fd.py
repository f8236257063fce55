"""Frequent Directions (spec A4) and the small per-token helpers of spec A7 on torch tensors.

Line-by-line ports of :mod:`subspace_ref.frequent_directions` and the helpers at the top of
:mod:`subspace_ref.numpy_backend`, batched over any leading axes (sequences, heads) and kept on the
tensors' device. In float64 they agree with the oracle to rounding; every branch of the oracle
(the ``ell > d`` compaction, zero-row padding for zero singular values, the sign rule) is kept.
"""

from __future__ import annotations

from typing import Sequence

import torch

from subspace_ref.frequent_directions import insert_rows


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def compact(buffer: torch.Tensor, ell: int) -> torch.Tensor:
    """Spec A4 step 3: shrink every singular value by the ell-th one (a new tensor)."""
    _, sigma, wt = torch.linalg.svd(buffer, full_matrices=False)
    if sigma.shape[-1] < ell:  # ell > d: the buffer already has rank < ell, nothing to shrink
        delta = torch.zeros_like(sigma[..., :1])
    else:
        delta = sigma[..., ell - 1 : ell] ** 2
    shrunk = torch.sqrt(torch.clamp(sigma**2 - delta, min=0.0))
    out = torch.zeros_like(buffer)
    out[..., : wt.shape[-2], :] = shrunk[..., :, None] * wt
    return out


def insert_(buffer: torch.Tensor, filled: int, rows: torch.Tensor, ell: int) -> tuple[torch.Tensor, int]:
    """Spec A4 steps 1-2 for rows (..., n, d), in order, writing into ``buffer`` in place (the
    caller passes a private copy): the oracle's loop with torch's compaction."""
    return insert_rows(buffer, filled, rows, ell, compact)


def fix_signs(rows: torch.Tensor) -> torch.Tensor:
    """Each row's entry of largest magnitude made positive (first such entry on ties)."""
    pivot = torch.argmax(rows.abs(), dim=-1, keepdim=True)
    sign = torch.sign(torch.gather(rows, -1, pivot))
    return rows * torch.where(sign == 0, torch.ones_like(sign), sign)


def top_directions(buffer: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r right singular vectors of a stack of matrices, sign-fixed, zero rows for singular
    values that are zero to rounding (``frequent_directions.top_directions``)."""
    _, sigma, wt = torch.linalg.svd(buffer, full_matrices=False)
    if wt.shape[-2] < r:
        pad = torch.zeros(wt.shape[:-2] + (r - wt.shape[-2], wt.shape[-1]), dtype=wt.dtype, device=wt.device)
        wt = torch.cat([wt, pad], dim=-2)
        sigma = torch.cat([sigma, torch.zeros(sigma.shape[:-1] + (pad.shape[-2],), dtype=sigma.dtype, device=sigma.device)], dim=-1)
    tol = sigma[..., :1] * max(buffer.shape[-2:]) * eps(buffer.dtype)
    keep = (sigma[..., :r] > tol) & (sigma[..., :r] > 0)
    return fix_signs(wt[..., :r, :]) * keep[..., None].to(wt.dtype)


def relative_residual(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Spec A7 step 2: rho = sqrt(max(|x|^2 - |c|^2, 0)) / |x|, and 0 for x = 0."""
    norm2 = (x * x).sum(-1)
    res2 = torch.clamp(norm2 - (coef * coef).sum(-1), min=0.0)
    safe = torch.where(norm2 > 0, norm2, torch.ones_like(norm2))
    return torch.where(norm2 > 0, torch.sqrt(res2 / safe), torch.zeros_like(norm2))


def warmup_row(basis: torch.Tensor, x: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Spec A7 step 0: the unit residual of x against the basis rows, or zero when x is (to
    rounding, or to the storage error ``floor`` of encoded rows) already in their span, as the
    oracle's ``warmup_row``. basis (..., r, d), x (..., d) -> (..., d). The projection is removed
    twice ("twice is enough" for classical Gram-Schmidt)."""
    residual = x
    for _ in range(2):
        coef = torch.einsum("...rd,...d->...r", basis, residual)
        residual = residual - torch.einsum("...rd,...r->...d", basis, coef)
    norm = torch.sqrt((residual * residual).sum(-1, keepdim=True))
    floor = max(10 * eps(x.dtype), floor) * torch.sqrt((x * x).sum(-1, keepdim=True))
    unit = residual / torch.where(norm > 0, norm, torch.ones_like(norm))
    return torch.where(norm > floor, unit, torch.zeros_like(unit))


def rank_mask(ranks: Sequence[int], width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(H, width, 1) mask keeping each head's first rank rows (the zero-row padding of spec A9)."""
    rows = torch.arange(width, device=device)[None, :]
    limit = torch.tensor(list(ranks), device=device)[:, None]
    return (rows < limit).to(dtype)[:, :, None]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec A10 exactly as the NumPy branch of ``subspace_ref.quantization.quantize_rows``
    computes it: s = float32(max|x| / 127) with the maximum divided in x's dtype, and
    q = round_half_even(x / s) in x's dtype, clipped to [-127, 127]; a zero row gets s = 0, q = 0."""
    scale = (x.abs().amax(dim=-1) / 127.0).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe[..., None].to(x.dtype)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spec A10 reading, as the oracle: (q in float32 * s), then cast to ``dtype``."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)
