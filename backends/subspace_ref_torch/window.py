"""The exact tokens of spec/window.md W3 and W8 in the torch backend (the sinks, then the recent
window): their logits and weighted values, merged by :func:`subspace_ref_torch.attend.attend`
into the same softmax as the coefficient logits (one max, one normaliser over all tokens:
spec A3.1)."""

from __future__ import annotations

import math

import torch


def exact_rows(state, side: str) -> torch.Tensor:
    """The exact keys (side "keys") or values ("values"), (N, H, s + e, dim): sinks first.

    Parameters
    ----------
    state : SubspaceState
        A windowed state.
    side : {"keys", "values"}

    Returns
    -------
    torch.Tensor
    """
    win = state.window
    recent = getattr(win, side)
    if win.sink_keys is None:
        return recent
    return torch.cat([getattr(win, f"sink_{side}"), recent], dim=2)


def exact_logits(q: torch.Tensor, state, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """scale * q . k_t for the exact tokens (gamma = 1: they are not projected), (N, H, g, s + e).

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) queries.
    state : SubspaceState
        A windowed state.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    dtype : torch.dtype
        The work dtype.

    Returns
    -------
    torch.Tensor
        (N, H, g, s + e).
    """
    N, Hq, d = q.shape
    H = state.heads
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qg = q.reshape(N, H, Hq // H, d).to(dtype)
    return torch.matmul(qg, exact_rows(state, "keys").to(dtype).mT) * s


def exact_values(weights: torch.Tensor, state) -> torch.Tensor:
    """sum_t w_t v_t over the exact tokens: weights (N, H, g, s + e) -> (N, H, g, d_v).

    Parameters
    ----------
    weights : torch.Tensor
        (N, H, g, s + e) softmax weights of the exact tokens.
    state : SubspaceState
        A windowed state.

    Returns
    -------
    torch.Tensor
        (N, H, g, d_v).
    """
    return torch.matmul(weights, exact_rows(state, "values").to(weights.dtype))
