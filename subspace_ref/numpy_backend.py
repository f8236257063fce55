"""The NumPy oracle: spec A3 and A6-A8 written step by step (also runs on CuPy arrays via ``xp``).

Every accelerated backend is tested against these two functions. They favour a reader holding the
paper beside them over speed: attention loops over heads and chunks, appends over tokens.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from subspace_ref import frequent_directions as fd
from subspace_ref import window
from subspace_ref.arrays import namespace, to_numpy
from subspace_ref.backend import Availability
from subspace_ref.basis_storage import row_error_bound
from subspace_ref.policies._online import warmup_rows
from subspace_ref.blockwise_softmax import SoftmaxPartial
from subspace_ref.capabilities import SKETCH_VARIANTS, Capabilities, attend_reasons
from subspace_ref.quantization import (
    dequantize_rows,
    quantize_rows,
    read_low_bit,
    side_arrays,
    store_low_bit,
)
from subspace_ref.rope import rotate


def relative_residual(x: Any, coef: Any) -> Any:
    """Spec A7 step 2: rho = sqrt(max(|x|^2 - |c|^2, 0)) / |x|, and 0 for x = 0."""
    xp = namespace(x)
    norm2 = (x * x).sum(-1)
    res2 = xp.maximum(norm2 - (coef * coef).sum(-1), 0.0)
    safe = xp.where(norm2 > 0, norm2, 1.0)
    return xp.where(norm2 > 0, xp.sqrt(res2 / safe), 0.0)


def warmup_row(basis: Any, x: Any, floor: float = 0.0) -> Any:
    """Spec A7 step 0: the unit residual of x against the basis rows, or zero when x is (to
    rounding, or to the storage error ``floor`` of encoded rows, spec/storage.md S2.1) already
    in their span. basis (..., r, d), x (..., d) -> (..., d).

    The projection is removed twice: one pass of classical Gram-Schmidt loses orthogonality for
    nearly parallel tokens, two passes keep it to rounding ("twice is enough")."""
    xp = namespace(x)
    residual = x
    for _ in range(2):
        residual = residual - xp.einsum("...rd,...r->...d", basis, xp.einsum("...rd,...d->...r", basis, residual))
    norm = xp.sqrt((residual * residual).sum(-1, keepdims=True))
    floor = max(10 * np.finfo(np.dtype(str(x.dtype))).eps, floor) * xp.sqrt((x * x).sum(-1, keepdims=True))
    return xp.where(norm > floor, residual / xp.where(norm > 0, norm, 1.0), 0.0)


def rank_mask(ranks: tuple[int, ...], width: int, like: Any) -> Any:
    """(H, width, 1) mask keeping each head's first rank rows: the zero-row padding of spec A9."""
    xp = namespace(like)
    mask = np.arange(width)[None, :] < np.asarray(ranks)[:, None]
    return xp.asarray(mask[:, :, None].astype(np.dtype(str(like.dtype))))


def append_reference(state, keys: Any, values: Any, ahead: tuple | None = None) -> None:
    """Append keys (N, H, n, d), values (N, H, n, d_v) to ``state`` following spec A6/A7/A8.

    ``ahead``: (keys, values) of the L_h tokens that follow the block, for an adaptive state's
    lookahead anchoring (spec/window.md W4); None (or L_h = 0) is spec A7 verbatim.

    Nothing visible changes until the final commit: new rows and chunks are written past the
    live ranges, and whatever is rewritten (warm-up rows, rotated coefficients) is rewritten in
    copies that replace the originals at the end.
    """
    xp = namespace(keys)
    policy = state.policy
    n_new = keys.shape[2]
    T = state.layout.num_tokens
    lay = state.layout.with_capacity(T + n_new, int(to_numpy(state.layout.num_chunks).max()) + (n_new if policy.kind == "adaptive" else 0))

    every = (slice(None), slice(None), 0)  # chunk 0 of every sequence and head
    if policy.kind == "static":  # spec A6
        if policy.rope is not None:  # spec/rope.md P2 step 1: back to pre-RoPE at positions T..T+n-1
            keys = rotate(keys, np.arange(T, T + n_new), policy.rope, inverse=True)
        store(lay, "key", slice(T, T + n_new), xp.einsum("nhtd,nhrd->nhtr", keys, lay.basis("key", every, keys.dtype)))
        store(lay, "value", slice(T, T + n_new), xp.einsum("nhtd,nhrd->nhtr", values, lay.basis("value", every, values.dtype)))
        state.layout = replace(lay, num_tokens=T + n_new)
        return

    sk = state.sketches
    buf_k, filled_k, buf_v, filled_v = sk.keys.copy(), sk.filled_k, sk.values.copy(), sk.filled_v
    num_chunks = lay.num_chunks.copy()
    chunk_starts = lay.chunk_starts.copy()
    heads_n, heads_h = xp.meshgrid(xp.arange(lay.key_coef.shape[0]), xp.arange(lay.key_coef.shape[1]), indexing="ij")
    open_B = lay.basis("key", (heads_n, heads_h, num_chunks - 1), keys.dtype)  # (N, H, r, d), decoded copies
    open_E = lay.basis("value", (heads_n, heads_h, num_chunks - 1), values.dtype)
    mask_k = rank_mask(policy.rank_k, open_B.shape[2], open_B)
    mask_v = rank_mask(policy.rank_v, open_E.shape[2], open_E)
    W = policy.warmup
    warm_k, warm_v = (xp.asarray(w) for w in warmup_rows(policy))  # (H,) rows per side, spec A7 step 0
    reproject = getattr(policy, "trigger", "paper") == "reproject"  # spec A7.2; "paper": A7 step 3 verbatim
    if policy.kind == "rotating" or T < W or T == 0:
        # the only bases rewritten in place: the single rotating basis, or chunk 0 during warm-up
        # or while still empty; they are rewritten in private copies
        lay = lay.with_private_bases()
    following = window.lookahead_stream(keys, values, ahead)  # spec/window.md W4; None: A7 as is
    # online-sketch variants (spec/sketch_variants.md S1-S3); neutral values keep A7/A8 verbatim
    stride = getattr(policy, "fd_stride", 1)
    ring = getattr(policy, "ring_warm_start", 0)
    reuse = getattr(policy, "reuse_angle", None)
    ring_k = sk.ring_keys.copy() if ring else None
    ring_v = sk.ring_values.copy() if ring else None
    rows_inserted, svds = sk.rows_inserted, sk.svds
    stack = lay.key_coef.shape[0] * lay.key_coef.shape[1]  # sketches per array: one per head

    for i in range(n_new):
        t = T + i
        k, v = keys[:, :, i], values[:, :, i]
        # step 0: exact warm-up rows in chunk 0 while it is open, per side up to min(W, rank)
        # (stored encoded at once; the open basis holds the decoded row: spec/storage.md S3)
        in_chunk0 = num_chunks == 1
        warming_k, warming_v = in_chunk0 & (t < warm_k), in_chunk0 & (t < warm_v)
        if t < open_B.shape[2] and bool(warming_k.any()):
            open_B[:, :, t] = _warm(lay, "key", t, open_B, k, warming_k)
        if t < open_E.shape[2] and bool(warming_v.any()):
            open_E[:, :, t] = _warm(lay, "value", t, open_E, v, warming_v)
        # step 1: coefficients with the open chunk's bases
        c = xp.einsum("nhrd,nhd->nhr", open_B, k)
        dv = xp.einsum("nhrd,nhd->nhr", open_E, v)
        if policy.kind == "adaptive":
            # step 2: residuals from the coefficients; step 3: the trigger (a side that is still
            # warming is exact and does not fire; the length cap waits for both sides)
            rho_k, rho_v = relative_residual(k, c), relative_residual(v, dv)
            open_start = xp.take_along_axis(chunk_starts, (num_chunks - 1)[..., None], axis=2)[..., 0]
            length = t + 1 - open_start
            # S3.2: with reuse a chunk may outlive max_chunk, and the cap re-fires every max_chunk tokens
            capped = (length >= policy.max_chunk) if reuse is None else (length % policy.max_chunk == 0)
            fire = (~warming_k & (rho_k > policy.tau_k)) | (~warming_v & (rho_v > policy.tau_v)) | (~warming_k & ~warming_v & capped)
            if reproject:  # A7.2: the FD update first, so the new bases see the firing token
                buf_k, filled_k, buf_v, filled_v, ring_k, ring_v, rows_inserted, svds = _feed(
                    t, k, v, policy, stride, ring, buf_k, filled_k, buf_v, filled_v, ring_k, ring_v, rows_inserted, svds, stack
                )
            if bool(fire.any()):
                fn, fh = xp.nonzero(fire)
                if ring:
                    # S1 step 2: the fired heads' sketches rebuilt from the ring: the last rows
                    # offered before t (through t with reproject), oldest first, FD-inserted into empty buffers
                    offered = -(-(t + reproject) // stride)
                    slots = [q % ring for q in range(offered - min(offered, ring), offered)]
                    src_k, filled_src_k, n_k = _fd_insert(
                        xp.zeros((len(fn), 2 * policy.ell_k, open_B.shape[3]), dtype=buf_k.dtype), 0, ring_k[fn, fh][:, slots], policy.ell_k
                    )
                    src_v, filled_src_v, n_v = _fd_insert(
                        xp.zeros((len(fn), 2 * policy.ell_v, open_E.shape[3]), dtype=buf_v.dtype), 0, ring_v[fn, fh][:, slots], policy.ell_v
                    )
                    svds += (n_k + n_v) * len(fn)
                    src_k, src_v = src_k[:, :filled_src_k], src_v[:, :filled_src_v]
                else:
                    # spec/window.md W4: with lookahead, copies of the sketches that also saw the
                    # next L_h (already held) tokens; without, the sketches themselves
                    snap_k, snap_fk, snap_v, snap_fv = window.anchor_buffers(buf_k, filled_k, buf_v, filled_v, policy, following, i)
                    src_k, src_v = snap_k[fn, fh, :snap_fk], snap_v[fn, fh, :snap_fv]
                new_B = fd.top_directions(src_k, open_B.shape[2]) * mask_k[fh]
                new_E = fd.top_directions(src_v, open_E.shape[2]) * mask_v[fh]
                svds += 2 * len(fn)
                if reuse is not None:
                    # S3 step 2: heads whose snapshot is within reuse_angle of the open bases on
                    # keys and values keep their open chunk; only the others open one
                    fresh = np.array(
                        [
                            max(largest_principal_angle(open_B[a, b], new_B[i]), largest_principal_angle(open_E[a, b], new_E[i])) >= reuse
                            for i, (a, b) in enumerate(zip(to_numpy(fn).tolist(), to_numpy(fh).tolist()))
                        ],
                        dtype=bool,
                    )
                    fresh = xp.asarray(fresh)
                    fn, fh, new_B, new_E = fn[fresh], fh[fresh], new_B[fresh], new_E[fresh]
                # the snapshot goes into spare chunk slot j, encoded; the open basis is its decoding.
                # With reproject, an open chunk that is still empty (chunk 0 at t = 0 without
                # warm-up) takes the snapshot itself rather than staying an empty chunk
                j = num_chunks[fn, fh] - (reproject & (open_start[fn, fh] == t))
                new_B = lay.store_basis("key", (fn, fh, j), new_B)
                new_E = lay.store_basis("value", (fn, fh, j), new_E)
                chunk_starts[fn, fh, j] = t + 1 - reproject
                num_chunks[fn, fh] = j + 1
                open_B[fn, fh] = new_B
                open_E[fn, fh] = new_E
                if reproject:  # A7.2: the firing token is stored with the new chunk's bases
                    c[fn, fh] = xp.einsum("mrd,md->mr", new_B, k[fn, fh])
                    dv[fn, fh] = xp.einsum("mrd,md->mr", new_E, v[fn, fh])
                if policy.sketch_reset:
                    # step 3b: forget what the closing chunk summarised, unless it was too short
                    # to have taught the sketch a full basis (a reset then would thrash)
                    # (S2.4: "long" counts the rows the chunk fed to the sketches, tokens t' = 0 mod stride;
                    # with reproject the chunk ends at t - 1, and the firing token, the new chunk's first, is kept)
                    last = t - reproject
                    long = (last // stride - (-(-open_start[fn, fh] // stride)) + 1) >= max(policy.ell_k, policy.ell_v)
                    ln, lh = fn[long], fh[long]
                    buf_k[ln, lh] = 0.0
                    buf_v[ln, lh] = 0.0
                    if reproject and t % stride == 0:
                        buf_k[ln, lh, filled_k - 1] = k[ln, lh]
                        buf_v[ln, lh, filled_v - 1] = v[ln, lh]
        store(lay, "key", t, c)
        store(lay, "value", t, dv)
        if not (policy.kind == "adaptive" and reproject):
            # step 4 (A7) / step 3 (A8): the FD update
            buf_k, filled_k, buf_v, filled_v, ring_k, ring_v, rows_inserted, svds = _feed(
                t, k, v, policy, stride, ring, buf_k, filled_k, buf_v, filled_v, ring_k, ring_v, rows_inserted, svds, stack
            )
        if policy.kind == "rotating" and t >= W and (t + 1 - W) % policy.refresh_every == 0:
            # spec A8 step 4: new basis, and every stored coefficient moved into it by R = B B'^T
            # (R is taken between the decoded stored bases: spec/storage.md S3)
            new_B = lay.store_basis("key", every, fd.top_directions(buf_k, open_B.shape[2]) * mask_k)
            new_E = lay.store_basis("value", every, fd.top_directions(buf_v, open_E.shape[2]) * mask_v)
            lay = _rotated(lay, "key", t + 1, xp.einsum("nhrd,nhsd->nhrs", open_B, new_B))
            lay = _rotated(lay, "value", t + 1, xp.einsum("nhrd,nhsd->nhrs", open_E, new_E))
            open_B, open_E = new_B, new_E
            svds += 2 * stack

    state.layout = replace(lay, num_chunks=num_chunks, chunk_starts=chunk_starts, num_tokens=T + n_new)
    state.sketches = replace(
        sk,
        keys=buf_k,
        values=buf_v,
        filled_k=filled_k,
        filled_v=filled_v,
        rows_seen=sk.rows_seen + n_new,
        ring_keys=ring_k,
        ring_values=ring_v,
        rows_inserted=rows_inserted,
        svds=svds,
    )


def _feed(t, k, v, policy, stride, ring, buf_k, filled_k, buf_v, filled_v, ring_k, ring_v, rows_inserted, svds, stack):
    """The FD update of token t (A7 step 4 / A8 step 3): every stride-th token (S2), into the
    ring instead of the sketches when there is one (S1 step 1). Returns the updated running values."""
    if t % stride == 0:
        if ring:
            ring_k[:, :, (t // stride) % ring] = k
            ring_v[:, :, (t // stride) % ring] = v
        else:
            buf_k, filled_k, n_k = _fd_insert(buf_k, filled_k, k[:, :, None], policy.ell_k)
            buf_v, filled_v, n_v = _fd_insert(buf_v, filled_v, v[:, :, None], policy.ell_v)
            svds += (n_k + n_v) * stack
        rows_inserted += 1
    return buf_k, filled_k, buf_v, filled_v, ring_k, ring_v, rows_inserted, svds


def _warm(lay, which: str, t: int, open_basis: Any, x: Any, warming: Any) -> Any:
    """Spec A7 step 0 for token t: row t of chunk 0 of the heads still ``warming`` (N, H) on this
    side becomes x's unit residual (spec/storage.md S2.1 floor for encoded rows); the other heads'
    chunk-0 row t is padding (zero) and their open row t, possibly of a later chunk, is kept.
    Returns the open bases' new row t (decoded)."""
    xp = namespace(x)
    floor = 2 * row_error_bound(lay.basis_format, x.shape[-1])
    row = xp.where(warming[..., None], warmup_row(open_basis, x, floor), 0.0)
    decoded = lay.store_basis(which, (slice(None), slice(None), 0, t), row)
    return xp.where(warming[..., None], decoded, open_basis[:, :, t])


def _fd_insert(buffer: Any, filled: int, rows: Any, ell: int) -> tuple[Any, int, int]:
    """fd.insert (spec A4 steps 1-2) that also returns how many compactions (one SVD of every
    buffer of the stack each) it ran: the SVD counter of spec/sketch_variants.md S2.3."""
    count = [0]

    def counted(buf, ell_):
        count[0] += 1
        return fd.compact(buf, ell_)

    buffer, filled = fd.insert_rows(buffer.copy(), filled, rows, ell, counted)
    return buffer, filled, count[0]


def largest_principal_angle(A: Any, B: Any) -> float:
    """Largest principal angle (radians) between the row spans of two bases (r, d) whose
    non-zero rows are orthonormal (spec/sketch_variants.md S3.1); pi/2 when their numbers of
    non-zero rows differ (or both are zero), as spans of different dimension are never reused."""
    import scipy.linalg

    a, b = to_numpy(A), to_numpy(B)
    a = a[np.linalg.norm(a, axis=-1) > 0]
    b = b[np.linalg.norm(b, axis=-1) > 0]
    if len(a) != len(b) or len(a) == 0:
        return float(np.pi / 2)
    return float(np.max(scipy.linalg.subspace_angles(a.T, b.T)))


def store(lay, which: str, index: Any, coef: Any) -> None:
    """Write coefficients (N, H, ..., r) at token ``index`` into the layout, quantised to int8
    with per-token scales when the layout is (spec A10), to int4/int2 when it is low-bit
    (spec/quantization.md Q2)."""
    target = getattr(lay, f"{which}_coef")
    if lay.low_bits:
        a, b = (index, index + 1) if isinstance(index, (int, np.integer)) else (index.start, index.stop)
        store_low_bit(lay, which, a, b, coef[:, :, None] if isinstance(index, (int, np.integer)) else coef)
    elif lay.quantized:
        q, scale = quantize_rows(coef)
        target[:, :, index] = q
        getattr(lay, f"{which}_scale")[:, :, index] = scale
    else:
        target[:, :, index] = coef


def _rotated(lay, which: str, upto: int, R: Any):
    """Spec A8 step 4 on copies: C <- C R for the first ``upto`` tokens (int8 coefficients are
    dequantised, rotated and quantised again, which adds one rounding per refresh)."""
    coef = getattr(lay, f"{which}_coef")
    xp = namespace(coef)
    dtype = R.dtype
    if lay.low_bits:  # dequantised, rotated and quantised again (spec/quantization.md Q2)
        current = read_low_bit(lay, which, 0, upto, dtype, upto)
        new = replace(lay, **{name: getattr(lay, name).copy() for name in side_arrays(which)})
        store(new, which, slice(0, upto), xp.einsum("nhtr,nhrs->nhts", current, R))
        return new
    if lay.quantized:
        current = dequantize_rows(coef[:, :, :upto], getattr(lay, f"{which}_scale")[:, :, :upto], dtype)
    else:
        current = coef[:, :, :upto]
    rotated = xp.einsum("nhtr,nhrs->nhts", current, R)
    new = replace(lay, **{f"{which}_coef": coef.copy()})
    if lay.quantized:
        new = replace(new, **{f"{which}_scale": getattr(lay, f"{which}_scale").copy()})
    store(new, which, slice(0, upto), rotated)
    return new


def attend_reference(q: np.ndarray, state, scale: float | None) -> np.ndarray:
    """Spec A3 over every chunk of every head: q (N, H_q, d) -> (N, H_q, d_v) in q's dtype.

    Computes in float64 when q and the state are float64, else in float32 (a float16 input is
    widened, as the accelerated backends accumulate in float32).
    """
    lay = state.layout
    work = np.promote_types(np.promote_types(q.dtype, lay.dtype), np.float32)
    N, Hq, d = q.shape
    group = Hq // state.heads
    s = 1.0 / np.sqrt(d) if scale is None else float(scale)
    out = np.empty((N, Hq, state.d_v), dtype=work)
    rope = getattr(state.policy, "rope", None)
    for n in range(N):
        for hq in range(Hq):
            h = hq // group
            qv = q[n, hq].astype(work)
            partial = SoftmaxPartial.empty(state.d_v, work)
            for j, (a, b) in enumerate(state.chunk_bounds(h, n)):
                B_j = lay.basis("key", (n, h, j), work)
                if rope is None:
                    q_proj = B_j @ qv  # spec A3 step 2.1
                    logits = work.type(lay.gamma[h] * s) * (lay.coefficient_rows("key", n, h, a, b, work) @ q_proj)
                else:  # spec/rope.md P3: keys rebuilt and rotated to their positions, O(r d) per token
                    keys = rotate(lay.coefficient_rows("key", n, h, a, b, work) @ B_j, np.arange(a, b), rope)
                    logits = work.type(lay.gamma[h] * s) * (keys @ qv)
                partial.add_chunk(logits, lay.coefficient_rows("value", n, h, a, b, work), lay.basis("value", (n, h, j), work))
            if state.window is not None:  # spec/window.md W3: the exact tokens, one more chunk
                window.add_exact_chunk(partial, qv, state.window, n, h, s, work)
            out[n, hq] = partial.result()
    return out.astype(q.dtype)


class NumpyBackend:
    """The oracle as a backend: CPU, NumPy arrays, float32 and float64 (float16 widened)."""

    name = "numpy"
    array_family = "numpy"
    capabilities = Capabilities(
        array_families=("numpy",),
        devices=("cpu",),
        dtypes=("float16", "float32", "float64"),
        window=True,
        sinks=True,
        rope=True,
        sketch_variants=SKETCH_VARIANTS,
    )
    devices = capabilities.devices
    dtypes = capabilities.dtypes

    def availability(self) -> Availability:
        return Availability(True)

    def not_supported_reasons(self, q: Any, state) -> list[str]:
        return attend_reasons(self.name, self, q, state)

    def converter(self, device: Any = None, dtype: Any = None):
        if device not in (None, "cpu"):
            raise ValueError(f"device must be None or 'cpu' for the numpy backend, got {device!r}")

        def convert(x):
            x = np.array(to_numpy(x))
            return x.astype(dtype) if dtype is not None and x.dtype.kind == "f" else x

        return convert

    def append(self, state, keys, values, ahead=None) -> None:
        """``ahead``: the lookahead tokens after the block (spec/window.md W4), or None."""
        append_reference(state, keys, values, ahead)

    def attend(self, q, state, scale):
        return attend_reference(q, state, scale)
