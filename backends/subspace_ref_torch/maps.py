"""What every route of the torch ``attend`` shares (spec A2, A3): the work dtype, the chunks in
use, the token tiles of the value sums, and a one-chunk state's query and value maps, derived
once per bases. :mod:`subspace_ref_torch.plan` picks the route; :mod:`subspace_ref_torch.attend`
and :mod:`subspace_ref_torch.cpu_kernels` run it.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

#: Tokens per tile of the value sums sum_t w_t d_t; summing tile partials bounds float32
#: rounding by ~(tile + T / tile) eps instead of ~T eps (docs/benchmarks.md, "value tiles").
VALUE_TILE = 1024
#: At most this many tiles (longer tiles beyond 16 k tokens): each tile is one batched call.
MAX_VALUE_TILES = 16


def work_dtype(q: torch.Tensor, state) -> torch.dtype:
    """The oracle's work dtype: the promotion of q's dtype, the state's and float32.

    Parameters
    ----------
    q : torch.Tensor
        Queries, any shape.
    state : SubspaceState
        A torch-family state.

    Returns
    -------
    torch.dtype
        float32 for half inputs, float64 as soon as either is float64.
    """
    return torch.promote_types(torch.promote_types(q.dtype, state.layout.dtype), torch.float32)


def used_chunks(state) -> int:
    """J = max chunks in use over (sequence, head); static and rotating states always have 1
    (no host sync), adaptive ones are read from ``num_chunks`` (one host sync).

    Parameters
    ----------
    state : SubspaceState

    Returns
    -------
    int
    """
    if state.policy.kind in ("static", "rotating"):
        return 1
    return int(state.layout.num_chunks.max())


def logit_scale(state, d: int, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """gamma_h * scale per KV head, (H,), scale defaulting to 1/sqrt(d).

    Parameters
    ----------
    state : SubspaceState
    d : int
        Query head size.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    dtype : torch.dtype

    Returns
    -------
    torch.Tensor
        (H,).
    """
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return state.layout.gamma.to(torch.float64).mul(s).to(dtype)


def token_tiles(T: int) -> range:
    """Starts of the token tiles of the value sums: VALUE_TILE tokens, or longer so that there
    are at most MAX_VALUE_TILES of them; ``.step`` is the tile length.

    Parameters
    ----------
    T : int
        Tokens.

    Returns
    -------
    range
    """
    return range(0, T, max(VALUE_TILE, -(-T // MAX_VALUE_TILES)))


def map_sources(lay) -> tuple:
    """What a one-chunk state's maps (:func:`one_chunk_maps`) are computed from: the stored
    bases, their scales and gamma.

    Parameters
    ----------
    lay : PackedLayout

    Returns
    -------
    tuple
        The arrays, None entries allowed.
    """
    return lay.key_bases, lay.key_basis_scale, lay.value_bases, lay.value_basis_scale, lay.gamma


def one_chunk_maps(state, d: int, scale: float | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two maps of a one-chunk state as (N H)-batched matrices, derived once per bases.

    Parameters
    ----------
    state : SubspaceState
        A state with one chunk of bases.
    d : int
        Query head size.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    dtype : torch.dtype
        Dtype of the maps.

    Returns
    -------
    tuple of torch.Tensor
        gamma_h * scale * B_h^T (N H, d, r), a query to its scaled projected query (spec A3
        step 2.1), and the value bases E_h (N H, r_v, d_v).
    """
    lay = state.layout
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def make_maps():
        B = lay.decoded_bases("key", dtype)[:, :, 0]  # (N, H, r, d)
        E = lay.decoded_bases("value", dtype)[:, :, 0]  # (N, H, r_v, d_v)
        scaled = B.mT * logit_scale(state, d, s, dtype)[None, :, None, None]
        return scaled.flatten(0, 1).contiguous(), E.flatten(0, 1).contiguous()

    return lay.derived(("one_chunk_maps", dtype, s), map_sources(lay), make_maps)


@functools.lru_cache(maxsize=16)
def rope_order(rope, d: int, device: torch.device) -> torch.Tensor:
    """A permutation of the d dims: the first dims of the m rotating planes, their second dims,
    then the fixed dims. Applied to basis columns and query alike (a dot product is invariant
    under it), it turns any layout's rotation into two contiguous halves.

    Parameters
    ----------
    rope : RopeParams
    d : int
        Head size.
    device : torch.device

    Returns
    -------
    torch.Tensor
        (d,) int64.
    """
    pairs = rope.planes(d)
    m = rope.inv_freq.size
    order = np.concatenate([pairs[:m, 0], pairs[:m, 1], pairs[m:].reshape(-1)])
    return torch.as_tensor(order, device=device)


__all__ = ["MAX_VALUE_TILES", "VALUE_TILE", "logit_scale", "map_sources", "one_chunk_maps", "rope_order", "token_tiles", "used_chunks", "work_dtype"]
