"""Logits of a pre-RoPE static state on the torch general route (spec/rope.md P3): keys rebuilt
from their coefficients per tile of tokens and turned to their positions.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from subspace_ref.window import first_compressed_position
from subspace_ref_torch.maps import logit_scale, rope_order
from subspace_ref_torch.rows import raw_tiles, scales_after

#: Rebuilt keys per tile of the RoPE logits on a CPU: a core's L2 (docs/benchmarks.md, "RoPE tiles").
ROPE_TILE_ELEMENTS = 1 << 17
#: On a GPU a tile costs launches whatever its size, so tiles are large (docs/gpu.md).
ROPE_TILE_ELEMENTS_GPU = 1 << 24


@functools.lru_cache(maxsize=16)
def _rope_offsets(rope, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of k theta_i for offsets k < n, (n, m), computed in float64 then cast."""
    angles = np.arange(n, dtype=np.float64)[:, None] * rope.inv_freq[None, :]
    return (torch.as_tensor(np.cos(angles), dtype=dtype, device=device), torch.as_tensor(np.sin(angles), dtype=dtype, device=device))


def rope_tables(rope, a: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_s cos(t theta_i), a_s sin(t theta_i)) for positions t = a .. a + n - 1, (n, m), by the
    angle addition cos((a + k) theta) = cos(a theta) cos(k theta) - sin(a theta) sin(k theta):
    the tile's base angle in float64 (m values), the offsets from a cached table. No table of
    all T positions is kept or read (it would be T d/2 numbers per layer: bytes a fused kernel
    does not move). In float64 the tables are the oracle's own, cos(fl(t theta)) from
    :meth:`RopeParams.cos_sin`: the angle addition differs from them by the rounding of the
    angle, ~|t theta| 2^-53, which float64 outputs resolve.

    Parameters
    ----------
    rope : RopeParams
    a : int
        First position.
    n : int
        Positions.
    dtype : torch.dtype
    device : torch.device

    Returns
    -------
    tuple of torch.Tensor
        cos and sin tables, (n, m) each.
    """
    if dtype == torch.float64:
        cos, sin = rope.cos_sin(np.arange(a, a + n))
        return torch.as_tensor(cos, device=device), torch.as_tensor(sin, device=device)
    # one table per power of two, sliced: the last tile's length changes every step (docs/benchmarks.md, "RoPE tiles")
    ck, sk = (x[:n] for x in _rope_offsets(rope, 1 << max(4, (n - 1).bit_length()), dtype, device))
    base = a * rope.inv_freq
    ca = torch.as_tensor(rope.attention_scaling * np.cos(base), dtype=dtype, device=device)
    sa = torch.as_tensor(rope.attention_scaling * np.sin(base), dtype=dtype, device=device)
    return ck * ca - sk * sa, sk * ca + ck * sa


def rope_logits(q: torch.Tensor, state, scale: float | None, dtype: torch.dtype, kernel_rows: bool = False) -> torch.Tensor:
    """Spec/rope.md P3 steps 1-2 on a (one-chunk) pre-RoPE static state: logits (N, H, g, T).

    Per tile of tokens: the keys rebuilt, u_t = B^T c_t (one batched matmul over sequences and
    heads), rotated to their positions t (R_t, from :func:`rope_tables`), and multiplied with
    the g query heads of the group, gamma_h * scale folded into the queries. Rebuilding the
    key serves all g query heads; rotating the query instead costs the O(r d) per token once
    per query head (spec/roofline.md R13).

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) queries.
    state : SubspaceState
        A static pre-RoPE state.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    dtype : torch.dtype
        The work dtype.
    kernel_rows : bool
        Read int4 / int2 rows by the kernels.

    Returns
    -------
    torch.Tensor
        (N, H, g, T) logits.
    """
    lay = state.layout
    rope = state.policy.rope
    N, Hq, d = q.shape
    H = lay.key_coef.shape[1]
    T = lay.num_tokens
    m = rope.inv_freq.size
    order = rope_order(rope, d, q.device)
    g = Hq // H
    # 3-D batched products over N * H (torch.matmul on 4-D operands takes a slower CPU path)
    qg = (q.reshape(N, H, g, d).to(dtype)[..., order] * logit_scale(state, d, scale, dtype)[None, :, None, None]).reshape(N * H, g, d)
    B = lay.basis("key", (slice(None), slice(None), 0), dtype)[..., order].reshape(N * H, -1, d)  # (N H, r, d)
    logits = torch.empty((N * H, g, T), dtype=dtype, device=q.device)
    tile = max(16, (ROPE_TILE_ELEMENTS if q.device.type == "cpu" else ROPE_TILE_ELEMENTS_GPU) // (N * H * d))
    first = first_compressed_position(state)  # spec/window.md W10: positions start after the sinks
    for a, b, rows in raw_tiles(state, "key", T, dtype, range(0, T, tile), kernel_rows):
        keys = torch.bmm(rows.reshape(N * H, b - a, -1), B)  # (N H, b - a, d): planes' first dims, second dims, fixed dims
        cos, sin = rope_tables(rope, first + a, b - a, dtype, q.device)
        ua, ub = keys[..., :m], keys[..., m : 2 * m]
        rotated_a = ua * cos - ub * sin
        ub.mul_(cos).addcmul_(ua, sin)  # in place: ua is no longer needed after rotated_a
        ua.copy_(rotated_a)
        torch.bmm(qg, keys.mT, out=logits[..., a:b])
    logits = logits.view(N, H, g, T)
    if scales_after(state, dtype):
        logits.mul_(lay.key_scale[:, :, None, :T])
    return logits


__all__ = ["ROPE_TILE_ELEMENTS", "ROPE_TILE_ELEMENTS_GPU", "rope_logits", "rope_tables"]
