"""How the torch routes read a side's stored coefficients (spec A10, spec/quantization.md Q2):
dequantised rows of a token range, and raw rows over token tiles with int8 scales left to the
caller. Which reader serves int4 / int2 sides is the plan's ``kernel_rows``
(:func:`subspace_ref_torch.plan.plan_attend`).
"""

from __future__ import annotations

import torch

from subspace_ref.quantization import dequantize_rows
from subspace_ref_torch import cpu_kernels
from subspace_ref_torch.maps import token_tiles


def coefficient_rows(state, which: str, a: int, b: int, dtype: torch.dtype, kernel_rows: bool = False) -> torch.Tensor:
    """Coefficients of tokens [a, b) of every head of one side, dequantised as the oracle does.

    Parameters
    ----------
    state : SubspaceState
    which : {"key", "value"}
    a, b : int
        The token range.
    dtype : torch.dtype
        The work dtype.
    kernel_rows : bool
        Read an int4 / int2 side by the kernels (the plan's ``kernel_rows``, float32 work).

    Returns
    -------
    torch.Tensor
        (N, H, b - a, r) in ``dtype``: int8 as float32 q * s (spec A10), int4 / int2 as
        spec/quantization.md Q2, then ``dtype``.
    """
    lay = state.layout
    if lay.side_format(which).low_bits:
        if kernel_rows:
            return cpu_kernels.low_bit_rows(lay, which, a, b)
        from subspace_ref.quantization import read_low_bit

        return read_low_bit(lay, which, a, b, dtype, lay.num_tokens)
    coef = getattr(lay, f"{which}_coef")[:, :, a:b]
    scale = getattr(lay, f"{which}_scale", None)
    if scale is None:
        return coef.to(dtype)
    return dequantize_rows(coef, scale[:, :, a:b], dtype)


def scales_after(state, dtype: torch.dtype) -> bool:
    """Whether int8 scales are applied to logits and weights (one multiply per token) instead
    of to the coefficients. Below float64 this is a change of rounding order within the
    oracle's float32 error; in float64 the oracle's dequantised value fl32(q s) differs from
    q s by 2^-24 relative, far above float64 rounding, so float64 dequantises as the oracle.
    Only for int8 on both sides: a side of a mixed layout is read dequantised (:func:`raw_tiles`).

    Parameters
    ----------
    state : SubspaceState
    dtype : torch.dtype
        The work dtype.

    Returns
    -------
    bool
    """
    return state.layout.quantized and dtype != torch.float64


def raw_tiles(state, which: str, T: int, dtype: torch.dtype, starts: range | None = None, kernel_rows: bool = False):
    """(a, b, rows) over the token tiles of :func:`token_tiles`: rows (N, H, b - a, r) of the
    stored coefficients in ``dtype``, WITHOUT int8 scales (spec A10: c_t = s_t q_t; callers
    apply s_t to the logits or the weights, one multiply per token instead of r). Float
    coefficients in ``dtype`` are views; int8 ones are converted tile by tile into one reused
    buffer (exact: |q| <= 127), so no full-size float copy is ever made. In float64 int8 rows
    come dequantised (:func:`scales_after`).

    Parameters
    ----------
    state : SubspaceState
    which : {"key", "value"}
    T : int
        Tokens read.
    dtype : torch.dtype
        The work dtype.
    starts : range or None
        Tile starts (None: :func:`~subspace_ref_torch.maps.token_tiles`).
    kernel_rows : bool
        Read int4 / int2 rows by the kernels.

    Returns
    -------
    iterator of (int, int, torch.Tensor)
    """
    coef = getattr(state.layout, f"{which}_coef")
    fmt = state.layout.side_format(which)
    starts = token_tiles(T) if starts is None else starts
    buffer = None
    for a in starts:
        b = min(T, a + starts.step)
        if fmt.low_bits or (fmt.per_token_scale and not scales_after(state, dtype)):
            # int4/int2 (spec/quantization.md Q2) and float64 int8: dequantised per tile
            yield a, b, coefficient_rows(state, which, a, b, dtype, kernel_rows)
            continue
        rows = coef[:, :, a:b]
        if rows.dtype == dtype:
            yield a, b, rows
            continue
        if buffer is None:
            buffer = torch.empty(rows.shape, dtype=dtype, device=rows.device)
        tile = buffer[:, :, : b - a]
        tile.copy_(rows)
        yield a, b, tile


__all__ = ["coefficient_rows", "raw_tiles", "scales_after"]
