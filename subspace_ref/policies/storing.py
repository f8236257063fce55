"""Writing coefficients into a layout, as every policy's append does: spec A10 (int8 with per-token
scales), spec/quantization.md Q2 (int4/int2 with group scales), and spec A8 step 4's rotation of
the stored coefficients into a new basis."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from subspace_ref.arrays import namespace
from subspace_ref.quantization import dequantize_rows, quantize_rows, read_low_bit, store_low_bit


def store(lay, which: str, index: Any, coef: Any) -> None:
    """Write coefficients (N, H, ..., r) at token ``index`` into the layout, quantised to int8
    with per-token scales when the layout is (spec A10), to int4/int2 when it is low-bit
    (spec/quantization.md Q2)."""
    target = getattr(lay, f"{which}_coef")
    fmt = lay.side_format(which)
    if fmt.low_bits:
        a, b = (index, index + 1) if isinstance(index, (int, np.integer)) else (index.start, index.stop)
        store_low_bit(lay, which, a, b, coef[:, :, None] if isinstance(index, (int, np.integer)) else coef)
    elif fmt.per_token_scale:
        q, scale = quantize_rows(coef)
        target[:, :, index] = q
        getattr(lay, f"{which}_scale")[:, :, index] = scale
    else:
        target[:, :, index] = coef


def rotated(lay, which: str, upto: int, R: Any):
    """Spec A8 step 4 on copies: C <- C R for the first ``upto`` tokens (int8 coefficients are
    dequantised, rotated and quantised again, which adds one rounding per refresh)."""
    coef = getattr(lay, f"{which}_coef")
    xp = namespace(coef)
    dtype = R.dtype
    fmt = lay.side_format(which)
    if fmt.low_bits:  # dequantised, rotated and quantised again (spec/quantization.md Q2)
        current = read_low_bit(lay, which, 0, upto, dtype, upto)
        new = replace(lay, **{name: getattr(lay, name).copy() for name in lay.side_arrays(which)})
        store(new, which, slice(0, upto), xp.einsum("nhtr,nhrs->nhts", current, R))
        return new
    if fmt.per_token_scale:
        current = dequantize_rows(coef[:, :, :upto], getattr(lay, f"{which}_scale")[:, :, :upto], dtype)
    else:
        current = coef[:, :, :upto]
    out = xp.einsum("nhtr,nhrs->nhts", current, R)
    new = replace(lay, **{f"{which}_coef": coef.copy()})
    if fmt.per_token_scale:
        new = replace(new, **{f"{which}_scale": getattr(lay, f"{which}_scale").copy()})
    store(new, which, slice(0, upto), out)
    return new
