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
loop of <= 16 iterations, for float32 accuracy: see :data:`VALUE_TILE`. On CPU tensors in
float32, int8/int4/int2 coefficients are read by :mod:`subspace_ref_torch.cpu_kernels`, which
dequantise in registers: spec R14.) States with J > 1
gather each token's projected query; that and the per-chunk value sums run over tiles of
tokens (a loop over at most T / tile iterations, with tile chosen so a tile's gathered
(N, H, tile, g, max(r, r_v)) block holds about TILE_ELEMENTS numbers) to bound memory.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from subspace_ref.window import first_compressed_position
from subspace_ref_torch import cpu_kernels, fd, window

TILE_ELEMENTS = 1 << 22
# Token tiles of the value sums sum_t w_t d_t: summing tile partials bounds float32 rounding by
# ~(tile + T / tile) eps instead of ~T eps (one BLAS call accumulates sequentially). Tiles are
# VALUE_TILE tokens, or longer so that there are at most MAX_VALUE_TILES of them: each tile is
# one batched matmul call (~50-100 us of overhead on a CPU), and at T = 64k, 16 tiles of 4096
# keep the error below the oracle's (per-query BLAS gemv) while 64 tiles of 1024 cost ~30%.
VALUE_TILE = 1024
MAX_VALUE_TILES = 16
# Rebuilt keys of a tile, N H tile d numbers, are as many per token as an exact cache holds and
# pass through the rotation several times: tiles of this many numbers (512 KiB in float32, a
# CPU core's L2) keep those passes out of DRAM.
ROPE_TILE_ELEMENTS = 1 << 17
# On a GPU a tile costs about ten kernel launches and a host-to-device copy of its base angles,
# whatever its size: 128-token tiles took 209 ms at T = 128k on an H100 (docs/gpu.md). Tiles of
# this many numbers (64 MiB in float32) make it a handful.
ROPE_TILE_ELEMENTS_GPU = 1 << 24


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
    if lay.side_format(which).low_bits:  # int4/int2: dequantised first (spec/quantization.md Q2), on a CPU by the kernels
        if cpu_kernels.reads_low_bit(lay, dtype):
            return cpu_kernels.low_bit_rows(lay, which, a, b)
        from subspace_ref.quantization import read_low_bit

        return read_low_bit(lay, which, a, b, dtype, lay.num_tokens)
    coef = getattr(lay, f"{which}_coef")[:, :, a:b]
    scale = getattr(lay, f"{which}_scale", None)
    if scale is None:
        return coef.to(dtype)
    return fd.dequantize_rows(coef, scale[:, :, a:b], dtype)


def token_tiles(T: int) -> range:
    """Starts of the token tiles of the one-chunk paths: VALUE_TILE tokens, or longer so that
    there are at most MAX_VALUE_TILES of them (see :data:`VALUE_TILE`)."""
    return range(0, T, max(VALUE_TILE, -(-T // MAX_VALUE_TILES)))


def scales_after(state, dtype: torch.dtype) -> bool:
    """Whether int8 scales are applied to logits and weights (one multiply per token) instead
    of to the coefficients. Below float64 this is a change of rounding order within the
    oracle's float32 error; in float64 the oracle's dequantised value fl32(q s) differs from
    q s by 2^-24 relative, far above float64 rounding, so float64 dequantises as the oracle.
    Only for int8 on both sides: a side of a mixed layout is read dequantised (:func:`raw_tiles`)."""
    return state.layout.quantized and dtype != torch.float64


def raw_tiles(state, which: str, T: int, dtype: torch.dtype, starts: range | None = None):
    """(a, b, rows) over the token tiles of :func:`token_tiles`: rows (N, H, b - a, r) of the
    stored coefficients in ``dtype``, WITHOUT int8 scales (spec A10: c_t = s_t q_t; callers
    apply s_t to the logits or the weights, one multiply per token instead of r). Float
    coefficients in ``dtype`` are views; int8 ones are converted tile by tile into one reused
    buffer (exact: |q| <= 127), so no full-size float copy is ever made. In float64 int8 rows
    come dequantised (:func:`scales_after`)."""
    coef = getattr(state.layout, f"{which}_coef")
    fmt = state.layout.side_format(which)
    starts = token_tiles(T) if starts is None else starts
    buffer = None
    for a in starts:
        b = min(T, a + starts.step)
        if fmt.low_bits or (fmt.per_token_scale and not scales_after(state, dtype)):
            # int4/int2 (spec/quantization.md Q2) and float64 int8: dequantised per tile
            yield a, b, coefficient_rows(state, which, a, b, dtype)
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
        return one_chunk_logits(q_proj[:, :, 0], state)
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


def one_chunk_logits(q0: torch.Tensor, state) -> torch.Tensor:
    """Logits (N, H, g, T) of a one-chunk state from projected queries q0 (N, H, g, r): one
    matmul over float coefficients of the work dtype, else one per token tile (int8 converted
    per tile, scales applied per token: :func:`raw_tiles`)."""
    lay = state.layout
    T = lay.num_tokens
    if lay.key_coef.dtype == q0.dtype:
        return torch.matmul(q0, lay.key_coef[:, :, :T].mT)
    N, H, g, r = q0.shape
    q3 = q0.reshape(N * H, g, r)
    logits = torch.empty((N * H, g, T), dtype=q0.dtype, device=q0.device)
    for a, b, rows in raw_tiles(state, "key", T, q0.dtype):
        torch.bmm(q3, rows.reshape(N * H, b - a, r).mT, out=logits[..., a:b])  # written in place, no copy
    logits = logits.view(N, H, g, T)
    if scales_after(state, q0.dtype):
        logits.mul_(lay.key_scale[:, :, None, :T])
    return logits


@functools.lru_cache(maxsize=16)
def _rope_order(rope, d: int, device: torch.device) -> torch.Tensor:
    """A permutation of the d dims: the first dims of the m rotating planes, their second dims,
    then the fixed dims. Applied to the basis columns and the query alike (a dot product is
    invariant under it), it turns the rotation of any layout into two contiguous halves."""
    pairs = rope.planes(d)
    m = rope.inv_freq.size
    order = np.concatenate([pairs[:m, 0], pairs[:m, 1], pairs[m:].reshape(-1)])
    return torch.as_tensor(order, device=device)


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
    angle, ~|t theta| 2^-53, which float64 outputs resolve."""
    if dtype == torch.float64:
        cos, sin = rope.cos_sin(np.arange(a, a + n))
        return torch.as_tensor(cos, device=device), torch.as_tensor(sin, device=device)
    # the table for the next power of two >= n, sliced: the last tile's length changes with every
    # decode step, and a table per length missed the cache each step (0.7 ms of a 12 ms step of the
    # shipped model at 1k tokens)
    ck, sk = (x[:n] for x in _rope_offsets(rope, 1 << max(4, (n - 1).bit_length()), dtype, device))
    base = a * rope.inv_freq
    ca = torch.as_tensor(rope.attention_scaling * np.cos(base), dtype=dtype, device=device)
    sa = torch.as_tensor(rope.attention_scaling * np.sin(base), dtype=dtype, device=device)
    return ck * ca - sk * sa, sk * ca + ck * sa


def rope_logits(q: torch.Tensor, state, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Spec/rope.md P3 steps 1-2 on a (one-chunk) pre-RoPE static state: logits (N, H, g, T).

    Per tile of tokens: the keys rebuilt, u_t = B^T c_t (one batched matmul over sequences and
    heads), rotated to their positions t (R_t, from :func:`rope_tables`), and multiplied with
    the g query heads of the group, gamma_h * scale folded into the queries. Rebuilding the
    key serves all g query heads; rotating the query instead costs the O(r d) per token once
    per query head (spec/roofline.md R13)."""
    lay = state.layout
    rope = state.policy.rope
    N, Hq, d = q.shape
    H = lay.key_coef.shape[1]
    T = lay.num_tokens
    m = rope.inv_freq.size
    order = _rope_order(rope, d, q.device)
    g = Hq // H
    # 3-D batched products over N * H (torch.matmul on 4-D operands takes a slower CPU path)
    qg = (q.reshape(N, H, g, d).to(dtype)[..., order] * logit_scale(state, d, scale, dtype)[None, :, None, None]).reshape(N * H, g, d)
    B = lay.basis("key", (slice(None), slice(None), 0), dtype)[..., order].reshape(N * H, -1, d)  # (N H, r, d)
    logits = torch.empty((N * H, g, T), dtype=dtype, device=q.device)
    tile = max(16, (ROPE_TILE_ELEMENTS if q.device.type == "cpu" else ROPE_TILE_ELEMENTS_GPU) // (N * H * d))
    first = first_compressed_position(state)  # spec/window.md W10: positions start after the sinks
    for a, b, rows in raw_tiles(state, "key", T, dtype, range(0, T, tile)):
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


def softmax_weights(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(logits - max) and their sum (N, H, g, 1), max over all tokens of a query head (A3.1).
    Overwrites ``logits``. The sum divides the output once, after the value sums, as spec A3
    does: normalising every weight first (torch.softmax, one fused pass, 80 us instead of 130 at
    8 x 16k logits) rounds each weight once more; it failed the slow harness case
    rotating-d64-T3000 in float32 (1.15x the derived tolerance) and, before the value sums were
    blocked, reached 2.75x the oracle's own error against 2.0x this way (T = 2100, 24 draws)."""
    m = logits.amax(dim=-1, keepdim=True)
    w = logits.sub_(m).exp_()
    return w, w.sum(dim=-1, keepdim=True)


#: Tokens per block of :func:`blocked_products`.
VALUE_BLOCK = 64


def blocked_products(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """w (B, g, n) times rows (B, n, r) as a sum of VALUE_BLOCK-token products: one batched
    product over the blocks, then torch's sum over them, and the remainder. One BLAS product over
    a tile accumulates its n tokens in sequence (rounding ~n eps); on values whose weighted sum
    cancels to a few percent of its terms that left the slow harness cases (T = 16k, 8200) at
    1.0-1.2x the derived tolerance, in float32 and float64 alike."""
    B, g, n = w.shape
    nb = n // VALUE_BLOCK
    if nb < 2:
        return torch.bmm(w, rows)
    m = nb * VALUE_BLOCK
    blocks_w = w[..., :m].reshape(B, g, nb, VALUE_BLOCK).transpose(1, 2).reshape(B * nb, g, VALUE_BLOCK)
    out = torch.bmm(blocks_w, rows[:, :m].reshape(B * nb, VALUE_BLOCK, -1)).view(B, nb, g, -1).sum(1)
    return out if m == n else out.baddbmm_(w[..., m:], rows[:, m:])


def chunk_value_coefficients(weights: torch.Tensor, state, num_chunks: int, chunk_index: torch.Tensor | None = None) -> torch.Tensor:
    """sum_{t in chunk j} w_t d_t for every chunk: (N, H, J, g, r_v), the coefficient-space
    numerators of spec A3 step 2.3 before the value bases are applied."""
    lay = state.layout
    N, H, g, T = weights.shape
    r_v = lay.value_bases.shape[3]
    dtype = weights.dtype
    if num_chunks == 1:
        # two-level sum over tokens: BLAS accumulates a long inner product sequentially in
        # float32 (error ~ T eps); tiles of VALUE_TILE tokens, then a sum over tiles
        # (3-D bmm: torch.matmul on the 4-D tiles takes a path several times slower on CPU for
        # tiles of ~1k tokens)
        if scales_after(state, dtype):
            weights = weights * lay.value_scale[:, :, None, :T]
        w = weights.reshape(N * H, g, T)
        acc = torch.zeros((N * H, g, r_v), dtype=dtype, device=weights.device) if T == 0 else None  # every token in the exact window
        for a, b, rows in raw_tiles(state, "value", T, dtype):
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


def one_chunk_maps(state, d: int, scale: float | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two maps of a one-chunk state, as (N H)-batched matrices in ``dtype``: gamma_h * scale
    * B_h^T (N H, d, r), from a query to its scaled projected query (spec A3 step 2.1 with the
    logit scale folded into the basis), and the value bases E_h (N H, r_v, d_v). Derived once and
    reused until the bases or gamma change."""
    lay = state.layout
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def build():
        B = lay.decoded_bases("key", dtype)[:, :, 0]  # (N, H, r, d)
        E = lay.decoded_bases("value", dtype)[:, :, 0]  # (N, H, r_v, d_v)
        scaled = B.mT * logit_scale(state, d, s, dtype)[None, :, None, None]
        return scaled.flatten(0, 1).contiguous(), E.flatten(0, 1).contiguous()

    return lay.derived(("one_chunk_maps", dtype, s), map_sources(lay), build)


def map_sources(lay) -> tuple:
    """What a one-chunk state's maps (:func:`one_chunk_maps`) are computed from: the stored
    bases, their scales and gamma."""
    return lay.key_bases, lay.key_basis_scale, lay.value_bases, lay.value_basis_scale, lay.gamma


def one_chunk_float(state, dtype: torch.dtype) -> bool:
    """Whether ``state`` takes :func:`attend_one_chunk`: one chunk of bases (static or rotating),
    no exact tokens, no RoPE, float coefficients already in the work dtype, at most VALUE_TILE
    tokens."""
    lay = state.layout
    return (
        state.window is None
        and state.policy.kind != "adaptive"
        and getattr(state.policy, "rope", None) is None
        and lay.key_coef.dtype == dtype
        and lay.value_coef.dtype == dtype
        # beyond one value tile the general path's tiles bound the rounding of the long sum over
        # tokens, which one fused SDPA over the coefficients did not (docs/benchmarks.md)
        and lay.num_tokens <= VALUE_TILE
    )


def attend_one_chunk(q: torch.Tensor, state, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Spec A2/A3 for the common decode case (:func:`one_chunk_float`) in a few tensor operations
    over all heads at once, so that a decode step costs a few kernel launches and degrades under
    contention as SDPA does. With one chunk, spec A3 is softmax attention whose queries are the
    scaled projected queries (gamma and the logit scale folded into the map) and whose keys and
    values are the coefficients: up to VALUE_TILE tokens as logits, softmax (with the global
    maximum, equal to A3's running rescaling by A3.1) and value sums, three batched operations.
    Then the value basis. The coefficients are read through (N H)-batched views made once per
    coefficient array."""
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


def kernel_attend(q: torch.Tensor, state, scale: float | None) -> torch.Tensor | None:
    """Spec A2/A3 of a one-chunk int8/int4/int2 state (or a pre-RoPE state's float32
    coefficients) on a CPU core (spec R14) in one call of the CPU kernels (:func:`kernel_call`),
    for q (N, H_q, d) or, unbatched, (H_q, d) -> the output of q's shape with d_v columns, in
    q's dtype: query map, logits, softmax, value sums and value basis, each code read once, the
    logits never leaving the core's cache; a windowed state's exact tokens (sinks, recent
    window) join the same softmax in the call (spec/window.md W3). No tensor operation but the
    output's allocation. None when the state's arrays no longer lie as the kernels read them.
    What a decode step runs (:func:`attend_route`)."""
    d = q.shape[-1]
    call = kernel_call(state, d, scale)
    if call is None:
        return None
    lay = state.layout
    exact = None if state.window is None else cpu_kernels.exact_tokens(state.window, 1.0 / math.sqrt(d) if scale is None else float(scale))
    out = call(q, lay, token_tiles(lay.num_tokens).step, exact)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def kernel_call(state, d: int, scale: float | None) -> cpu_kernels.KernelCall | None:
    """The :class:`~subspace_ref_torch.cpu_kernels.KernelCall` of a one-chunk state for head
    size d and logit scale ``scale``: its maps (:func:`kernel_maps`) and coefficient arrays
    prepared once, in one lookup per decode step that checks the bases (content: version
    counters) and the coefficient arrays (identity: appends write them in place, a growth
    replaces them). None where the arrays do not lie as the kernels read them."""
    lay = state.layout
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def build():
        query_map, value_map, rope = kernel_maps(state, d, scale)
        return cpu_kernels.KernelCall.of(lay, query_map, value_map, rope)

    return lay.derived(("kernel_call", d, s), map_sources(lay), build, views=cpu_kernels.side_arrays(lay))


def kernel_maps(state, d: int, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, cpu_kernels.RopeKeys | None]:
    """What the CPU kernels take for a one-chunk state besides its arrays: the query map, the
    value map (:func:`one_chunk_maps`) and, for a pre-RoPE state (spec/rope.md P3), the rotation
    of its keys, with gamma * scale * B (N H, r, d), its dims in the rotation's order, as the
    query map: each key is rebuilt by it and turned to its position in the kernel. Derived once
    per bases."""
    maps = one_chunk_maps(state, d, scale, torch.float32)
    rope = getattr(state.policy, "rope", None)
    if rope is None:
        return maps[0], maps[1], None
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def build():
        order = _rope_order(rope, d, torch.device("cpu"))
        rebuild = maps[0].mT[..., order].contiguous()  # (N H, r, d): gamma scale B, dims in rope order
        return rebuild, cpu_kernels.rope_keys(order, rope.inv_freq, rope.attention_scaling, first_compressed_position(state))

    rebuild, keys = state.layout.derived(("kernel_rope", s), (maps[0],), build, writes=False)
    return rebuild, maps[1], keys


def kernels_serve(q: torch.Tensor, state, dtype: torch.dtype, chunks: int) -> bool:
    """Whether :func:`attend` takes the CPU kernels (:func:`kernel_attend`) for q (N, H_q,
    d) in work dtype ``dtype`` over ``chunks`` chunks in use: one chunk, no RoPE but a static
    state's (spec/rope.md P3), coefficients the kernels serve (``cpu_kernels.serves``)."""
    return (
        chunks == 1
        and (getattr(state.policy, "rope", None) is None or state.policy.kind == "static")
        and not one_chunk_float(state, dtype)
        and cpu_kernels.serves(q, state, dtype)
    )


def attend_route(q: torch.Tensor, state):
    """The torch backend's ``Backend.attend_route``: :func:`kernel_attend` for queries like q
    (as the caller passes them) where :func:`attend` would take it -- a static (plain or
    pre-RoPE) or rotating (one chunk) int8/int4/int2 state, with or without exact tokens, that
    the CPU kernels serve -- else None. Every fact it decides on is fixed over the state's
    life, but the arrays' lying in place, which kernel_attend asks again."""
    batched = q if state.batched else q[None]
    fixed_chunks = state.policy.kind in ("static", "rotating")  # an adaptive state's may grow
    served = fixed_chunks and kernels_serve(batched, state, work_dtype(batched, state), 1)
    return kernel_attend if served else None


def attend(q: torch.Tensor, state, scale: float | None) -> torch.Tensor:
    """Spec A2/A3 for q (N, H_q, d) over a torch-family state -> (N, H_q, d_v) in q's dtype."""
    N, Hq, _ = q.shape
    dtype = work_dtype(q, state)
    if one_chunk_float(state, dtype):
        return attend_one_chunk(q, state, scale, dtype)
    J = used_chunks(state)
    if kernels_serve(q, state, dtype, J):
        out = kernel_attend(q, state, scale)
        if out is not None:
            return out
    rope = getattr(state.policy, "rope", None)
    index = token_chunk_index(state, J) if J > 1 else None
    H = state.layout.key_coef.shape[1]
    maps = one_chunk_maps(state, q.shape[-1], scale, dtype) if J == 1 and rope is None else None
    if rope is not None:  # spec/rope.md P3 (static: J = 1)
        logits = rope_logits(q, state, scale, dtype)
    elif maps is not None:  # one batched product with the cached map gamma * scale * B^T
        q_proj = torch.bmm(q.reshape(N * H, Hq // H, -1).to(dtype), maps[0])
        logits = one_chunk_logits(q_proj.view(N, H, Hq // H, -1), state)
    else:
        logits = coefficient_logits(project_queries(q, state, scale, J, dtype), state, index)
    T_c = state.layout.num_tokens
    if state.window is not None:  # spec/window.md W3: exact tokens join the same softmax
        logits = torch.cat([logits, window.exact_logits(q, state, scale, dtype)], dim=-1)
    weights, Z = softmax_weights(logits)
    sums = chunk_value_coefficients(weights[..., :T_c], state, J, index)
    if maps is not None:
        out = torch.bmm(sums.reshape(N * H, Hq // H, -1), maps[1]).view(N, H, Hq // H, -1)
    else:
        out = apply_value_bases(sums, state)
    if state.window is not None:
        out = out + window.exact_values(weights[..., T_c:], state)
    out = out / Z
    return out.reshape(N, Hq, -1).to(q.dtype)


__all__ = [
    "apply_value_bases",
    "attend_one_chunk",
    "attend_route",
    "kernel_attend",
    "kernel_call",
    "kernels_serve",
    "one_chunk_float",
    "one_chunk_maps",
    "one_chunk_logits",
    "raw_tiles",
    "rope_logits",
    "rope_tables",
    "scales_after",
    "token_tiles",
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
