"""INT8 coefficients with one scale per token and head (spec A10; seed 001 §10, seed 003
"Quantization combination"). The CUDA and Triton kernels dequantise by the same definition."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref.arrays import array_family, namespace


def quantize_rows(x: Any) -> tuple[Any, Any]:
    """Spec A10: per row (the last axis), s = max|x| / 127 and q = round(x / s) as int8.

    A zero row gets s = 0 and q = 0. Returns (q, s) with s in float32, one per row.
    """
    if array_family(x) == "torch":
        import torch

        # divide in float64 for float64 input, as the NumPy branch does, so both round alike
        wide = x.double() if x.dtype == torch.float64 else x.float()
        scale = (wide.abs().amax(dim=-1) / 127.0).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(wide.dtype)
        q = torch.round(wide / safe[..., None]).clamp_(-127, 127).to(torch.int8)
        return q, scale
    xp = namespace(x)
    scale = (xp.abs(x).max(axis=-1) / 127.0).astype(np.float32)
    safe = xp.where(scale > 0, scale, 1.0).astype(np.float32)
    q = xp.clip(xp.rint(x / safe[..., None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_rows(q: Any, scale: Any, dtype: Any) -> Any:
    """Spec A10: x_hat = q * s, in ``dtype``."""
    if array_family(q) == "torch":
        return (q.float() * scale[..., None]).to(dtype)
    return (q.astype(np.float32) * scale[..., None]).astype(dtype)
