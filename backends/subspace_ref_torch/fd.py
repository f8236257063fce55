"""Frequent Directions (spec A4) and spec A10's int8 rows on torch tensors: the ports that remain.

The oracle's per-token helpers (``relative_residual``, ``warmup_row`` in
:mod:`subspace_ref.policies.online_run`) and FD's buffer insertion (``insert_rows``) run on torch
tensors unchanged through the array namespace (:func:`subspace_ref.arrays.namespace`), and the torch
append calls them. What is ported here creates arrays or needs torch's own routine where NumPy's
form would go wrong on a GPU tensor: ``compact`` and ``top_directions`` create their padding with
the input's device (NumPy-style ``zeros(shape, dtype)`` lands on the CPU) and run the batched
``torch.linalg.svd`` on it; ``fix_signs`` gathers with ``torch.gather`` (the namespace's
``take_along_axis`` is missing from older array-api-compat releases); ``rank_mask`` is built on the
state's device; the int8 rows follow NumPy's rounding and casting order exactly, which the
namespace's ``astype`` does not promise. Batched over any leading axes (sequences, heads); in
float64 they agree with the oracle to rounding, every branch kept (the ``ell > d`` compaction,
zero-row padding for zero singular values, the sign rule).
"""

from __future__ import annotations

from typing import Sequence

import torch

from subspace_ref.frequent_directions import insert_rows


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype``.

    Parameters
    ----------
    dtype : torch.dtype

    Returns
    -------
    float
    """
    return torch.finfo(dtype).eps


def compact(buffer: torch.Tensor, ell: int) -> torch.Tensor:
    """Spec A4 step 3: shrink every singular value by the ell-th one (a new tensor).

    Parameters
    ----------
    buffer : torch.Tensor
        (..., 2 ell, d) sketch buffers.
    ell : int
        Sketch rows kept.

    Returns
    -------
    torch.Tensor
    """
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
    caller passes a private copy): the oracle's loop with torch's compaction.

    Parameters
    ----------
    buffer : torch.Tensor
        (..., 2 ell, d), written in place.
    filled : int
        Rows in use.
    rows : torch.Tensor
        (..., n, d) rows inserted.
    ell : int

    Returns
    -------
    tuple of (torch.Tensor, int)
        The buffer and its rows in use.
    """
    return insert_rows(buffer, filled, rows, ell, compact)


def fix_signs(rows: torch.Tensor) -> torch.Tensor:
    """Each row's entry of largest magnitude made positive (first such entry on ties).

    Parameters
    ----------
    rows : torch.Tensor
        (..., k, d).

    Returns
    -------
    torch.Tensor
    """
    pivot = torch.argmax(rows.abs(), dim=-1, keepdim=True)
    sign = torch.sign(torch.gather(rows, -1, pivot))
    return rows * torch.where(sign == 0, torch.ones_like(sign), sign)


def top_directions(buffer: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r right singular vectors of a stack of matrices, sign-fixed, zero rows for singular
    values that are zero to rounding (``frequent_directions.top_directions``).

    Parameters
    ----------
    buffer : torch.Tensor
        (..., m, d).
    r : int

    Returns
    -------
    torch.Tensor
        (..., r, d).
    """
    _, sigma, wt = torch.linalg.svd(buffer, full_matrices=False)
    if wt.shape[-2] < r:
        pad = torch.zeros(wt.shape[:-2] + (r - wt.shape[-2], wt.shape[-1]), dtype=wt.dtype, device=wt.device)
        wt = torch.cat([wt, pad], dim=-2)
        sigma = torch.cat([sigma, torch.zeros(sigma.shape[:-1] + (pad.shape[-2],), dtype=sigma.dtype, device=sigma.device)], dim=-1)
    tol = sigma[..., :1] * max(buffer.shape[-2:]) * eps(buffer.dtype)
    keep = (sigma[..., :r] > tol) & (sigma[..., :r] > 0)
    return fix_signs(wt[..., :r, :]) * keep[..., None].to(wt.dtype)


def rank_mask(ranks: Sequence[int], width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(H, width, 1) mask keeping each head's first rank rows (the zero-row padding of spec A9).

    Parameters
    ----------
    ranks : sequence of int
        Per head.
    width : int
    dtype : torch.dtype
    device : torch.device

    Returns
    -------
    torch.Tensor
        (H, width, 1).
    """
    rows = torch.arange(width, device=device)[None, :]
    limit = torch.tensor(list(ranks), device=device)[:, None]
    return (rows < limit).to(dtype)[:, :, None]


