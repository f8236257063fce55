"""Exact softmax attention over a full KV cache (spec A1): the ground truth every method is scored against."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref import _checks


def exact_attention(q: Any, K: Any, V: Any, scale: float | None = None) -> np.ndarray:
    """Softmax attention over a full KV cache (spec A1), the reference the methods are scored against.

    Grouped-query: query head h_q reads KV head h_q // (H_q/H). The softmax subtracts the row
    maximum, so logits of any finite size neither overflow nor give NaN.

    Parameters
    ----------
    q : array_like
        Queries (H_q, d), H_q a multiple of H; or (N, H_q, d) with a batch axis on all three.
    K, V : array_like
        Keys (H, T, d) and values (H, T, d_v), T >= 1.
    scale : float, optional
        Logit scale; defaults to 1/sqrt(d).

    Returns
    -------
    numpy.ndarray
        (H_q, d_v), or (N, H_q, d_v), in the result dtype of the inputs.

    Examples
    --------
    >>> import numpy as np
    >>> from subspace_ref import exact_attention
    >>> K, V = np.zeros((1, 3, 2)), np.arange(6.0).reshape(1, 3, 2)
    >>> exact_attention(np.ones((2, 2)), K, V)  # equal logits: the mean value, for both query heads
    array([[2., 3.],
           [2., 3.]])
    """
    q, K, V = np.asarray(q), np.asarray(K), np.asarray(V)
    batched = q.ndim == 3
    if not batched:
        q, K, V = q[None], K[None], V[None]
    _checks.shape("q", q, (None, None, None))
    n, hq, d = q.shape
    _checks.shape("K", K, (n, None, None, d))
    _checks.shape("V", V, (n, K.shape[1], K.shape[2], None))
    h, t = K.shape[1], K.shape[2]
    if hq % h:
        raise ValueError(f"q has {hq} heads; expected a multiple of the {h} KV heads")
    if t == 0:
        raise ValueError("K has no tokens; attention over an empty cache is undefined")
    for name, x in (("q", q), ("K", K), ("V", V)):
        _checks.finite(name, x)
    s = 1.0 / np.sqrt(d) if scale is None else float(scale)
    group = hq // h
    Kq = np.repeat(K, group, axis=1)
    Vq = np.repeat(V, group, axis=1)
    logits = s * np.einsum("nhd,nhtd->nht", q, Kq)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    out = np.einsum("nht,nhtv->nhv", weights, Vq) / weights.sum(axis=-1)[..., None]
    return out if batched else out[0]
