"""The exact window of spec/window.md W3 in the torch backend: the exact tokens' logits and
weighted values, merged by :func:`subspace_ref_torch.attend.attend` into the same softmax as the
coefficient logits (one max, one normaliser over all tokens: spec A3.1)."""

from __future__ import annotations

import math

import torch


def exact_logits(q: torch.Tensor, state, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """scale * q . k_t for the exact tokens (gamma = 1: they are not projected), (N, H, g, e)."""
    N, Hq, d = q.shape
    H = state.heads
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qg = q.reshape(N, H, Hq // H, d).to(dtype)
    return torch.matmul(qg, state.window.keys.to(dtype).mT) * s


def exact_values(weights: torch.Tensor, state) -> torch.Tensor:
    """sum_t w_t v_t over the exact tokens: weights (N, H, g, e) -> (N, H, g, d_v)."""
    return torch.matmul(weights, state.window.values.to(weights.dtype))
