"""Coefficient-space attention (spec A2, A3) on torch tensors, vectorised over heads and chunks.

The pieces are separate functions so that other torch-family backends (Triton) can reuse them
and replace only the hot loops:

* :func:`used_chunks` -- J, the largest chunk count over heads (1 for static/rotating states
  without looking at the device; one host sync for adaptive ones);
* :func:`project_queries` -- gamma_h * scale * B_j q for every chunk of every head at once:
  one batched matmul over the (N, H, J, r, d) bases -> (N, H, J, g, r);
* :func:`token_chunk_index` -- the chunk of every token, (N, H, T), by ``searchsorted`` over
  ``chunk_starts`` (spare slots masked);
* :func:`coefficient_rows` -- coefficients of a token range, dequantised for int8 layouts (A10);
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

States with J = 1 (static, rotating, adaptive with a single chunk) take a fast path: the logits
are one batched matmul (N, H, g, r) x (N, H, r, T) and the value side one (g, T) x (T, r_v)
matmul then (g, r_v) x (r_v, d_v): no per-token index, no gathered queries. (For T > VALUE_TILE
the (g, T) x (T, r_v) product is summed over at most MAX_VALUE_TILES = 16 tiles of tokens, a
loop of <= 16 iterations, for float32 accuracy: see :data:`VALUE_TILE`.) States with J > 1
gather each token's projected query; that and the per-chunk value sums run over tiles of
tokens (a loop over at most T / tile iterations, with tile chosen so a tile's gathered
(N, H, tile, g, max(r, r_v)) block holds about TILE_ELEMENTS numbers) to bound memory.
"""

from __future__ import annotations

import math

import torch

from subspace_ref_torch import fd, window

TILE_ELEMENTS = 1 << 22
# Token tiles of the value sums sum_t w_t d_t: summing tile partials bounds float32 rounding by
# ~(tile + T / tile) eps instead of ~T eps (one BLAS call accumulates sequentially). Tiles are
# VALUE_TILE tokens, or longer so that there are at most MAX_VALUE_TILES of them: each tile is
# one batched matmul call (~50-100 us of overhead on a CPU), and at T = 64k, 16 tiles of 4096
# keep the error below the oracle's (per-query BLAS gemv) while 64 tiles of 1024 cost ~30%.
VALUE_TILE = 1024
MAX_VALUE_TILES = 16


def work_dtype(q: torch.Tensor, state) -> torch.dtype:
    """The oracle's rule: the promotion of q's dtype, the state's and float32 -- float32 for
    half inputs, float64 as soon as either is float64."""
    return torch.promote_types(torch.promote_types(q.dtype, state.layout.dtype), torch.float32)


def used_chunks(state) -> int:
    """J = max chunks in use over (sequence, head); static and rotating states always have 1."""
    if state.policy.kind in ("static", "rotating"):
        return 1
    return int(state.layout.num_chunks.max())


def logit_scale(state, d: int, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """gamma_h * scale per KV head, (H,), scale defaulting to 1/sqrt(d)."""
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return state.layout.gamma.to(torch.float64).mul(s).to(dtype)


def project_queries(q: torch.Tensor, state, scale: float | None = None, num_chunks: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Spec A3 step 2.1 for every chunk at once, with the logit scale folded in:
    gamma_h * scale * B_j q -> (N, H, J, g, r) in ``dtype`` (default: :func:`work_dtype`).
    Entries for a head's unused slots (j >= its num_chunks) are garbage and must not be read;
    :func:`token_chunk_index` never points at them."""
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
    chunk_starts[j] <= t. Spare chunk slots (j >= num_chunks) are never read."""
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


def coefficient_rows(state, which: str, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    """Coefficients of tokens [a, b) of every head, (N, H, b - a, r), in ``dtype``: "key" or
    "value", dequantised as the oracle does (float32 q * s, then ``dtype``) for int8 layouts
    (spec A10)."""
    lay = state.layout
    if lay.low_bits:  # int4/int2: dequantised first (spec/quantization.md Q2)
        from subspace_ref.quantization import read_low_bit

        return read_low_bit(lay, which, a, b, dtype, lay.num_tokens)
    coef = getattr(lay, f"{which}_coef")[:, :, a:b]
    scale = getattr(lay, f"{which}_scale", None)
    if scale is None:
        return coef.to(dtype)
    return fd.dequantize_rows(coef, scale[:, :, a:b], dtype)


def _tile(state, g: int) -> int:
    lay = state.layout
    N, H = lay.key_coef.shape[:2]
    width = max(lay.key_bases.shape[3], lay.value_bases.shape[3])
    return max(1, TILE_ELEMENTS // max(1, N * H * g * width))


def coefficient_logits(q_proj: torch.Tensor, state, chunk_index: torch.Tensor | None = None) -> torch.Tensor:
    """Spec A3 step 2.1: logits (N, H, g, T) from projected queries (N, H, J, g, r).

    J = 1: one matmul with the coefficients. J > 1: each token's projected query gathered by
    ``chunk_index`` (from :func:`token_chunk_index`), in tiles of tokens."""
    lay = state.layout
    N, H, J, g, _ = q_proj.shape
    T = lay.num_tokens
    dtype = q_proj.dtype
    if J == 1:
        return torch.matmul(q_proj[:, :, 0], coefficient_rows(state, "key", 0, T, dtype).mT)
    device = q_proj.device
    n_idx = torch.arange(N, device=device)[:, None, None]
    h_idx = torch.arange(H, device=device)[None, :, None]
    logits = torch.empty((N, H, g, T), dtype=dtype, device=device)
    tile = _tile(state, g)
    for a in range(0, T, tile):  # one iteration unless the gathered block would be large
        b = min(T, a + tile)
        q_tok = q_proj[n_idx, h_idx, chunk_index[:, :, a:b]]  # (N, H, b - a, g, r)
        coef = coefficient_rows(state, "key", a, b, dtype)[..., None]  # (N, H, b - a, r, 1)
        logits[:, :, :, a:b] = torch.matmul(q_tok, coef)[..., 0].transpose(-1, -2)
    return logits


def softmax_weights(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(logits - max) and their sum (N, H, g, 1), max over all tokens of a query head (A3.1).
    Overwrites ``logits``."""
    m = logits.amax(dim=-1, keepdim=True)
    w = logits.sub_(m).exp_()
    return w, w.sum(dim=-1, keepdim=True)


def chunk_value_coefficients(weights: torch.Tensor, state, num_chunks: int, chunk_index: torch.Tensor | None = None) -> torch.Tensor:
    """sum_{t in chunk j} w_t d_t for every chunk: (N, H, J, g, r_v), the coefficient-space
    numerators of spec A3 step 2.3 before the value bases are applied."""
    lay = state.layout
    N, H, g, T = weights.shape
    r_v = lay.value_bases.shape[3]
    dtype = weights.dtype
    if num_chunks == 1:
        if T <= VALUE_TILE:
            return torch.matmul(weights, coefficient_rows(state, "value", 0, T, dtype))[:, :, None]  # (N, H, 1, g, r_v)
        # two-level sum over tokens: BLAS accumulates a long inner product sequentially in
        # float32 (error ~ T eps); tiles of VALUE_TILE tokens, then a sum over tiles
        # (3-D bmm: torch.matmul on the 4-D tiles takes a path several times slower on CPU for
        # tiles of ~1k tokens)
        tile = max(VALUE_TILE, -(-T // MAX_VALUE_TILES))
        w = weights.reshape(N * H, g, T)
        parts = [torch.bmm(w[..., a : a + tile], coefficient_rows(state, "value", a, min(T, a + tile), dtype).reshape(N * H, -1, r_v)) for a in range(0, T, tile)]
        return torch.stack(parts).sum(0).view(N, H, 1, g, r_v)
    device = weights.device
    J = num_chunks
    base = (torch.arange(N, device=device)[:, None] * H + torch.arange(H, device=device)[None, :]) * J
    flat = chunk_index + base[..., None]  # (N, H, T): row of (n, h, j) in the flattened sums
    sums = torch.zeros((N * H * J, g, r_v), dtype=dtype, device=device)
    tile = _tile(state, g)
    for a in range(0, T, tile):
        b = min(T, a + tile)
        contrib = weights[:, :, :, a:b].transpose(-1, -2)[..., None] * coefficient_rows(state, "value", a, b, dtype)[:, :, :, None, :]
        sums.index_add_(0, flat[:, :, a:b].reshape(-1), contrib.reshape(-1, g, r_v))
    return sums.view(N, H, J, g, r_v)


def apply_value_bases(chunk_sums: torch.Tensor, state) -> torch.Tensor:
    """sum_j chunk_sums_j E_j -> (N, H, g, d_v): one batched matmul over chunks, then a sum over
    chunks (torch's reduction, not a BLAS inner product of length J r_v, which accumulates
    sequentially and loses ~J r_v eps on long chunk lists). Chunk slots a head does not use
    (j >= its num_chunks) are skipped whatever they hold."""
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


def attend(q: torch.Tensor, state, scale: float | None) -> torch.Tensor:
    """Spec A2/A3 for q (N, H_q, d) over a torch-family state -> (N, H_q, d_v) in q's dtype."""
    N, Hq, _ = q.shape
    dtype = work_dtype(q, state)
    J = used_chunks(state)
    q_proj = project_queries(q, state, scale, J, dtype)
    index = token_chunk_index(state, J) if J > 1 else None
    logits = coefficient_logits(q_proj, state, index)
    T_c = state.layout.num_tokens
    if state.window is not None:  # spec/window.md W3: exact tokens join the same softmax
        logits = torch.cat([logits, window.exact_logits(q, state, scale, dtype)], dim=-1)
    weights, Z = softmax_weights(logits)
    sums = chunk_value_coefficients(weights[..., :T_c], state, J, index)
    out = apply_value_bases(sums, state)
    if state.window is not None:
        out = out + window.exact_values(weights[..., T_c:], state)
    out = out / Z
    return out.reshape(N, Hq, -1).to(q.dtype)


__all__ = [
    "apply_value_bases",
    "attend",
    "chunk_value_coefficients",
    "coefficient_rows",
    "coefficient_logits",
    "logit_scale",
    "project_queries",
    "softmax_weights",
    "token_chunk_index",
    "used_chunks",
    "work_dtype",
]
