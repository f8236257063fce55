"""Coefficient-space attention (spec A2, A3) on torch tensors, vectorised over heads and chunks.

The pieces are separate functions so that other torch-family backends (Triton) can reuse them
and replace only the hot loops:

* :func:`~subspace_ref_torch.maps.used_chunks` -- J, the largest chunk count over heads (1 for static/rotating states
  without looking at the device; one host sync for adaptive ones);
* :func:`project_queries` -- gamma_h * scale * B_j q for every chunk of every head at once:
  one batched matmul over the (N, H, J, r, d) bases -> (N, H, J, g, r);
* :func:`token_chunk_index` -- the chunk of every token, (N, H, T), by ``searchsorted`` over
  ``chunk_starts`` (spare slots masked);
* :func:`~subspace_ref_torch.rows.coefficient_rows` -- coefficients of a token range, dequantised (A10, Q2);
* :func:`coefficient_logits` -- one logit per token and query head, (N, H, g, T);
* :func:`softmax_weights` -- exp(logit - global max) and its sum, in the work dtype;
* :func:`chunk_value_coefficients` -- sum over the tokens of each chunk of w_t d_t, (N, H, J, g, r_v);
* :func:`apply_value_bases` -- sum_j (...)_j E_j: a batched matmul per chunk, then a sum over chunks.

Softmax with the global maximum over all chunks equals spec A3's running rescaling by A3.1
(the same m at the end, every exponent <= 0, the term attaining m equal to 1, so Z >= 1).

Layout of query heads (grouped-query attention): q (N, H_q, d) with H_q = g H is viewed as
(N, H, g, d); query head h_q = h g + i reads KV head h.

Work dtype, as the oracle's: the promotion of q's dtype, the state's and float32 (half inputs
are widened once, all products and sums accumulate in float32). The result has q's dtype.

Routes (:func:`subspace_ref_torch.plan.plan_attend`): one chunk of float coefficients in a few
batched operations (:func:`attend_one_chunk`); the C kernel (:mod:`subspace_ref_torch.cpu_kernels`);
and the general path (:func:`attend_general`), whose sums over tokens run in tiles that bound
memory and float32 rounding (docs/benchmarks.md, "value tiles").
"""

from __future__ import annotations

import torch

from subspace_ref_torch import cpu_kernels, window
from subspace_ref_torch.maps import logit_scale, one_chunk_maps, used_chunks, work_dtype
from subspace_ref_torch.plan import Way, plan_attend
from subspace_ref_torch.rotary import rope_logits
from subspace_ref_torch.rows import coefficient_rows, raw_tiles, scales_after

#: Numbers in a tile of gathered projected queries of the J > 1 path: bounds its memory.
TILE_ELEMENTS = 1 << 22


def project_queries(q: torch.Tensor, state, scale: float | None = None, num_chunks: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Spec A3 step 2.1 for every chunk at once, with the logit scale folded in:
    gamma_h * scale * B_j q -> (N, H, J, g, r) in ``dtype`` (default: :func:`work_dtype`).
    Entries for a head's unused slots (j >= its num_chunks) are garbage and must not be read;
    :func:`token_chunk_index` never points at them.

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) queries.
    state : SubspaceState
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    num_chunks : int or None
        J (None: :func:`~subspace_ref_torch.maps.used_chunks`).
    dtype : torch.dtype or None
        Work dtype.

    Returns
    -------
    torch.Tensor
        (N, H, J, g, r).
    """
    lay = state.layout
    N, Hq, d = q.shape
    H = lay.key_coef.shape[1]
    J = used_chunks(state) if num_chunks is None else num_chunks
    dtype = work_dtype(q, state) if dtype is None else dtype
    qg = q.reshape(N, H, 1, Hq // H, d).to(dtype)
    qt = torch.matmul(qg, lay.decoded_bases("key", dtype)[:, :, :J].mT)  # (N, H, J, g, r)
    return qt * logit_scale(state, d, scale, dtype)[None, :, None, None, None]


def token_chunk_index(state, num_chunks: int | None = None) -> torch.Tensor:
    """The chunk j of every token t < T, (N, H, T) int64: the last j < num_chunks with
    chunk_starts[j] <= t. Spare chunk slots (j >= num_chunks) are never read.

    Parameters
    ----------
    state : SubspaceState
    num_chunks : int or None
        J (None: :func:`~subspace_ref_torch.maps.used_chunks`).

    Returns
    -------
    torch.Tensor
        (N, H, T) int64.
    """
    lay = state.layout
    N, H = lay.key_coef.shape[:2]
    T = lay.num_tokens
    J = used_chunks(state) if num_chunks is None else num_chunks
    device = lay.chunk_starts.device
    starts = lay.chunk_starts[:, :, :J]
    valid = torch.arange(J, device=device) < lay.num_chunks[..., None]
    starts = torch.where(valid, starts, torch.full_like(starts, T)).contiguous()
    positions = torch.arange(T, device=device).expand(N, H, T).contiguous()
    return torch.searchsorted(starts, positions, right=True) - 1


def _tile(state, g: int) -> int:
    lay = state.layout
    N, H = lay.key_coef.shape[:2]
    width = max(lay.key_bases.shape[3], lay.value_bases.shape[3])
    return max(1, TILE_ELEMENTS // max(1, N * H * g * width))


def coefficient_logits(q_proj: torch.Tensor, state, chunk_index: torch.Tensor | None = None, kernel_rows: bool = False) -> torch.Tensor:
    """Spec A3 step 2.1: logits (N, H, g, T) from projected queries (N, H, J, g, r).

    J = 1: one matmul with the coefficients. J > 1: each token's projected query gathered by
    ``chunk_index`` (from :func:`token_chunk_index`), in tiles of tokens.

    Parameters
    ----------
    q_proj : torch.Tensor
        (N, H, J, g, r) projected queries (:func:`project_queries`).
    state : SubspaceState
    chunk_index : torch.Tensor or None
        (N, H, T) chunk of every token; None for J = 1.
    kernel_rows : bool
        Read int4 / int2 rows by the kernels.

    Returns
    -------
    torch.Tensor
        (N, H, g, T) logits.
    """
    lay = state.layout
    N, H, J, g, _ = q_proj.shape
    T = lay.num_tokens
    dtype = q_proj.dtype
    if J == 1:
        return one_chunk_logits(q_proj[:, :, 0], state, kernel_rows)
    device = q_proj.device
    n_idx = torch.arange(N, device=device)[:, None, None]
    h_idx = torch.arange(H, device=device)[None, :, None]
    logits = torch.empty((N, H, g, T), dtype=dtype, device=device)
    tile = _tile(state, g)
    for a in range(0, T, tile):  # one iteration unless the gathered block would be large
        b = min(T, a + tile)
        q_tok = q_proj[n_idx, h_idx, chunk_index[:, :, a:b]]  # (N, H, b - a, g, r)
        coef = coefficient_rows(state, "key", a, b, dtype, kernel_rows)[..., None]  # (N, H, b - a, r, 1)
        logits[:, :, :, a:b] = torch.matmul(q_tok, coef)[..., 0].transpose(-1, -2)
    return logits


def one_chunk_logits(q0: torch.Tensor, state, kernel_rows: bool = False) -> torch.Tensor:
    """Logits (N, H, g, T) of a one-chunk state from projected queries q0 (N, H, g, r): one
    matmul over float coefficients of the work dtype, else one per token tile (int8 converted
    per tile, scales applied per token: :func:`raw_tiles`).

    Parameters
    ----------
    q0 : torch.Tensor
        (N, H, g, r) projected queries.
    state : SubspaceState
    kernel_rows : bool
        Read int4 / int2 rows by the kernels.

    Returns
    -------
    torch.Tensor
        (N, H, g, T) logits.
    """
    lay = state.layout
    T = lay.num_tokens
    if lay.key_coef.dtype == q0.dtype:
        return torch.matmul(q0, lay.key_coef[:, :, :T].mT)
    N, H, g, r = q0.shape
    q3 = q0.reshape(N * H, g, r)
    logits = torch.empty((N * H, g, T), dtype=q0.dtype, device=q0.device)
    for a, b, rows in raw_tiles(state, "key", T, q0.dtype, kernel_rows=kernel_rows):
        torch.bmm(q3, rows.reshape(N * H, b - a, r).mT, out=logits[..., a:b])  # written in place, no copy
    logits = logits.view(N, H, g, T)
    if scales_after(state, q0.dtype):
        logits.mul_(lay.key_scale[:, :, None, :T])
    return logits


def softmax_weights(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(logits - max) and their sum (N, H, g, 1), max over all tokens of a query head (A3.1).
    Overwrites ``logits``. The sum divides the output once, after the value sums, as spec A3
    does: normalising every weight first rounds each weight once more, beyond the derived
    tolerance on long states (docs/benchmarks.md, "value tiles").

    Parameters
    ----------
    logits : torch.Tensor
        (N, H, g, T), overwritten.

    Returns
    -------
    tuple of torch.Tensor
        The weights (N, H, g, T) and their sum (N, H, g, 1).
    """
    m = logits.amax(dim=-1, keepdim=True)
    w = logits.sub_(m).exp_()
    return w, w.sum(dim=-1, keepdim=True)


#: Tokens per block of :func:`blocked_products`.
VALUE_BLOCK = 64


def blocked_products(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """w (B, g, n) times rows (B, n, r) as a sum of VALUE_BLOCK-token products: one batched
    product over the blocks, then torch's sum over them, and the remainder: one BLAS product over
    a tile accumulates its n tokens in sequence (rounding ~n eps), too much where the weighted
    sum cancels (docs/benchmarks.md, "value tiles").

    Parameters
    ----------
    w : torch.Tensor
        (B, g, n) weights.
    rows : torch.Tensor
        (B, n, r) rows.

    Returns
    -------
    torch.Tensor
        (B, g, r).
    """
    B, g, n = w.shape
    nb = n // VALUE_BLOCK
    if nb < 2:
        return torch.bmm(w, rows)
    m = nb * VALUE_BLOCK
    blocks_w = w[..., :m].reshape(B, g, nb, VALUE_BLOCK).transpose(1, 2).reshape(B * nb, g, VALUE_BLOCK)
    out = torch.bmm(blocks_w, rows[:, :m].reshape(B * nb, VALUE_BLOCK, -1)).view(B, nb, g, -1).sum(1)
    return out if m == n else out.baddbmm_(w[..., m:], rows[:, m:])


def chunk_value_coefficients(weights: torch.Tensor, state, num_chunks: int, chunk_index: torch.Tensor | None = None, kernel_rows: bool = False) -> torch.Tensor:
    """sum_{t in chunk j} w_t d_t for every chunk: (N, H, J, g, r_v), the coefficient-space
    numerators of spec A3 step 2.3 before the value bases are applied.

    Parameters
    ----------
    weights : torch.Tensor
        (N, H, g, T) softmax weights.
    state : SubspaceState
    num_chunks : int
        J.
    chunk_index : torch.Tensor or None
        (N, H, T) chunk of every token; None for J = 1.
    kernel_rows : bool
        Read int4 / int2 rows by the kernels.

    Returns
    -------
    torch.Tensor
        (N, H, J, g, r_v).
    """
    lay = state.layout
    N, H, g, T = weights.shape
    r_v = lay.value_bases.shape[3]
    dtype = weights.dtype
    if num_chunks == 1:
        # two-level sum over tokens (tiles, then over tiles) bounds float32 rounding; 3-D bmm,
        # torch.matmul's 4-D CPU path being slower (docs/benchmarks.md, "value tiles")
        if scales_after(state, dtype):
            weights = weights * lay.value_scale[:, :, None, :T]
        w = weights.reshape(N * H, g, T)
        acc = torch.zeros((N * H, g, r_v), dtype=dtype, device=weights.device) if T == 0 else None  # every token in the exact window
        for a, b, rows in raw_tiles(state, "value", T, dtype, kernel_rows=kernel_rows):
            part = blocked_products(w[..., a:b], rows.reshape(N * H, b - a, r_v))
            acc = part if acc is None else acc.add_(part)
        return acc.view(N, H, 1, g, r_v)
    device = weights.device
    J = num_chunks
    base = (torch.arange(N, device=device)[:, None] * H + torch.arange(H, device=device)[None, :]) * J
    flat = chunk_index + base[..., None]  # (N, H, T): row of (n, h, j) in the flattened sums
    sums = torch.zeros((N * H * J, g, r_v), dtype=dtype, device=device)
    tile = _tile(state, g)
    for a in range(0, T, tile):
        b = min(T, a + tile)
        contrib = weights[:, :, :, a:b].transpose(-1, -2)[..., None] * coefficient_rows(state, "value", a, b, dtype, kernel_rows)[:, :, :, None, :]
        sums.index_add_(0, flat[:, :, a:b].reshape(-1), contrib.reshape(-1, g, r_v))
    return sums.view(N, H, J, g, r_v)


def apply_value_bases(chunk_sums: torch.Tensor, state) -> torch.Tensor:
    """sum_j chunk_sums_j E_j -> (N, H, g, d_v): one batched matmul over chunks, then a sum over
    chunks (torch's reduction, not a BLAS inner product of length J r_v, which accumulates
    sequentially and loses ~J r_v eps on long chunk lists). Chunk slots a head does not use
    (j >= its num_chunks) are skipped whatever they hold.

    Parameters
    ----------
    chunk_sums : torch.Tensor
        (N, H, J, g, r_v) from :func:`chunk_value_coefficients`.
    state : SubspaceState

    Returns
    -------
    torch.Tensor
        (N, H, g, d_v).
    """
    N, H, J, g, r_v = chunk_sums.shape
    lay = state.layout
    E = lay.decoded_bases("value", chunk_sums.dtype)[:, :, :J]  # (N, H, J, r_v, d_v)
    if J == 1:
        return torch.matmul(chunk_sums[:, :, 0], E[:, :, 0])
    # heads with fewer than J chunks: their slots >= num_chunks are spare capacity, whose
    # content is undefined (0 * NaN would be NaN), so they are replaced, not multiplied by 0
    valid = torch.arange(J, device=E.device) < lay.num_chunks[..., None]
    E = torch.where(valid[..., None, None], E, torch.zeros((), dtype=E.dtype, device=E.device))
    return torch.matmul(chunk_sums, E).sum(dim=2)


def attend_one_chunk(q: torch.Tensor, state, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Spec A2/A3 of a one-chunk float state (the plan's one-chunk route) in a few batched
    operations over all heads: with one chunk, spec A3 is softmax attention whose queries are the
    scaled projected queries and whose keys and values are the coefficients (A3.1: the global
    maximum equals the running rescaling), then the value basis.

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) queries.
    state : SubspaceState
        A state the plan routes here (:class:`~subspace_ref_torch.plan.Way` ONE_CHUNK).
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    dtype : torch.dtype
        The work dtype, that of the coefficients.

    Returns
    -------
    torch.Tensor
        (N, H_q, d_v) in q's dtype.
    """
    lay = state.layout
    N, Hq, d = q.shape
    maps, E = one_chunk_maps(state, d, scale, dtype)
    keys_t, values = lay.derived(
        "one_chunk_views", (lay.key_coef, lay.value_coef), lambda: (lay.key_coef.flatten(0, 1).mT, lay.value_coef.flatten(0, 1)), writes=False
    )
    T = lay.num_tokens
    qg = q.reshape(maps.shape[0], -1, d)
    qt = torch.bmm(qg if qg.dtype == dtype else qg.to(dtype), maps)  # (N H, g, r)
    sums = torch.bmm(torch.softmax(torch.bmm(qt, keys_t[:, :, :T]), dim=-1), values[:, :T])  # (N H, g, r_v)
    out = torch.bmm(sums, E).view(N, Hq, -1)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def attend(q: torch.Tensor, state, scale: float | None) -> torch.Tensor:
    """Spec A2/A3 on the torch backend, by the route :func:`~subspace_ref_torch.plan.plan_attend` picks.

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) queries.
    state : SubspaceState
        A state holding torch tensors.
    scale : float or None
        Logit scale (None: 1/sqrt(d)).

    Returns
    -------
    torch.Tensor
        (N, H_q, d_v) in q's dtype.
    """
    route = plan_attend(q, state)
    if route.way is Way.ONE_CHUNK:
        return attend_one_chunk(q, state, scale, work_dtype(q, state))
    if route.way is Way.KERNEL:
        out = cpu_kernels.kernel_attend(q, state, scale)
        if out is not None:
            return out
    return attend_general(q, state, scale, route.chunks, route.kernel_rows)


def attend_general(q: torch.Tensor, state, scale: float | None, chunks: int, kernel_rows: bool = False) -> torch.Tensor:
    """Spec A2/A3 by torch operations, any state.

    Parameters
    ----------
    q : torch.Tensor
        (N, H_q, d) queries.
    state : SubspaceState
    scale : float or None
        Logit scale (None: 1/sqrt(d)).
    chunks : int
        J, the chunks in use (:func:`~subspace_ref_torch.maps.used_chunks`).
    kernel_rows : bool
        Whether int4 / int2 sides are read by the kernels (the plan's ``kernel_rows``).

    Returns
    -------
    torch.Tensor
        (N, H_q, d_v) in q's dtype.
    """
    N, Hq, _ = q.shape
    dtype = work_dtype(q, state)
    J = chunks
    rope = getattr(state.policy, "rope", None)
    index = token_chunk_index(state, J) if J > 1 else None
    H = state.layout.key_coef.shape[1]
    maps = one_chunk_maps(state, q.shape[-1], scale, dtype) if J == 1 and rope is None else None
    if rope is not None:  # spec/rope.md P3 (static: J = 1)
        logits = rope_logits(q, state, scale, dtype, kernel_rows)
    elif maps is not None:  # one batched product with the cached map gamma * scale * B^T
        q_proj = torch.bmm(q.reshape(N * H, Hq // H, -1).to(dtype), maps[0])
        logits = one_chunk_logits(q_proj.view(N, H, Hq // H, -1), state, kernel_rows)
    else:
        logits = coefficient_logits(project_queries(q, state, scale, J, dtype), state, index, kernel_rows)
    T_c = state.layout.num_tokens
    if state.window is not None:  # spec/window.md W3: exact tokens join the same softmax
        logits = torch.cat([logits, window.exact_logits(q, state, scale, dtype)], dim=-1)
    weights, Z = softmax_weights(logits)
    sums = chunk_value_coefficients(weights[..., :T_c], state, J, index, kernel_rows)
    if maps is not None:
        out = torch.bmm(sums.reshape(N * H, Hq // H, -1), maps[1]).view(N, H, Hq // H, -1)
    else:
        out = apply_value_bases(sums, state)
    if state.window is not None:
        out = out + window.exact_values(weights[..., T_c:], state)
    out = out / Z
    return out.reshape(N, Hq, -1).to(q.dtype)


__all__ = [
    "TILE_ELEMENTS",
    "apply_value_bases",
    "attend",
    "attend_general",
    "attend_one_chunk",
    "blocked_products",
    "chunk_value_coefficients",
    "coefficient_logits",
    "one_chunk_logits",
    "project_queries",
    "softmax_weights",
    "token_chunk_index",
]
