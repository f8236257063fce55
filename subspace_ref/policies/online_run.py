"""The running values of one append to an online state (adaptive, spec A7; rotating, spec A8),
and the steps both policies share: exact warm-up rows (A7 step 0), coefficients against the open
chunk's bases (A7 step 1 / A8 step 1) and the FD update (A7 step 4 / A8 step 3) with the sketch
variants' stride and ring (spec/sketch_variants.md S1, S2).

Nothing visible changes until :meth:`OnlineRun.commit`: new rows and chunks are written past the
live ranges, and whatever is rewritten (warm-up rows, rotated coefficients) is rewritten in copies
that replace the originals at the end.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from subspace_ref import frequent_directions as fd
from subspace_ref.arrays import namespace, to_numpy
from subspace_ref.basis_storage import row_error_bound
from subspace_ref.policies._online import warmup_rows


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
    floor = max(10 * float(xp.finfo(x.dtype).eps), floor) * xp.sqrt((x * x).sum(-1, keepdims=True))
    return xp.where(norm > floor, residual / xp.where(norm > 0, norm, 1.0), 0.0)


def rank_mask(ranks: tuple[int, ...], width: int, like: Any) -> Any:
    """(H, width, 1) mask keeping each head's first rank rows: the zero-row padding of spec A9."""
    xp = namespace(like)
    mask = np.arange(width)[None, :] < np.asarray(ranks)[:, None]
    return xp.asarray(mask[:, :, None].astype(np.dtype(str(like.dtype))))


def fd_insert(buffer: Any, filled: int, rows: Any, ell: int) -> tuple[Any, int, int]:
    """fd.insert (spec A4 steps 1-2) that also returns how many compactions (one SVD of every
    buffer of the stack each) it ran: the SVD counter of spec/sketch_variants.md S2.3."""
    count = [0]

    def counted(buf, ell_):
        count[0] += 1
        return fd.compact(buf, ell_)

    buffer, filled = fd.insert_rows(buffer.copy(), filled, rows, ell, counted)
    return buffer, filled, count[0]


class OnlineRun:
    """One append to an online state: copies of its sketches and chunk bookkeeping, the open
    chunk's decoded bases, and the layout being written (with room for n_new tokens and, for
    an adaptive state, as many new chunks)."""

    def __init__(self, state, keys: Any, values: Any):
        xp = self.xp = namespace(keys)
        policy = self.policy = state.policy
        self.T = T = state.layout.num_tokens
        self.n_new = n_new = keys.shape[2]
        self.lay = lay = state.layout.with_capacity(T + n_new, int(to_numpy(state.layout.num_chunks).max()) + (n_new if policy.kind == "adaptive" else 0))
        self.sketches = sk = state.sketches
        self.buf_k, self.filled_k, self.buf_v, self.filled_v = sk.keys.copy(), sk.filled_k, sk.values.copy(), sk.filled_v
        self.num_chunks = lay.num_chunks.copy()
        self.chunk_starts = lay.chunk_starts.copy()
        heads_n, heads_h = xp.meshgrid(xp.arange(lay.key_coef.shape[0]), xp.arange(lay.key_coef.shape[1]), indexing="ij")
        self.open_B = lay.basis("key", (heads_n, heads_h, self.num_chunks - 1), keys.dtype)  # (N, H, r, d), decoded copies
        self.open_E = lay.basis("value", (heads_n, heads_h, self.num_chunks - 1), values.dtype)
        self.mask_k = rank_mask(policy.rank_k, self.open_B.shape[2], self.open_B)
        self.mask_v = rank_mask(policy.rank_v, self.open_E.shape[2], self.open_E)
        self.warm_k, self.warm_v = (xp.asarray(w) for w in warmup_rows(policy))  # (H,) rows per side, spec A7 step 0
        self.private = policy.kind == "rotating" or T < policy.warmup or T == 0
        if self.private:
            # the only bases rewritten in place: the single rotating basis, or chunk 0 during
            # warm-up or while still empty; they are rewritten in private copies (and the
            # chunks open at the start when spec A7.4 grows them: tracking.grow)
            self.lay = self.lay.with_private_bases()
        self.first_new = self.num_chunks.copy()  # chunk slots >= this are spare: written in place
        # online-sketch variants (spec/sketch_variants.md S1-S2); neutral values keep A7/A8 verbatim
        self.stride = getattr(policy, "fd_stride", 1)
        self.ring = getattr(policy, "ring_warm_start", 0)
        self.ring_k = sk.ring_keys.copy() if self.ring else None
        self.ring_v = sk.ring_values.copy() if self.ring else None
        self.rows_inserted, self.svds = sk.rows_inserted, sk.svds
        self.over_tau = getattr(sk, "tokens_over_tau", 0)  # spec A7.4.1's counter
        self.stack = lay.key_coef.shape[0] * lay.key_coef.shape[1]  # sketches per array: one per head

    def warm(self, t: int, k: Any, v: Any) -> tuple[Any, Any]:
        """Spec A7 step 0 for token t: exact warm-up rows in chunk 0 while it is open, per side up
        to min(W, rank) (stored encoded at once; the open basis holds the decoded row:
        spec/storage.md S3). Returns the (N, H) masks of the heads still warming, per side."""
        in_chunk0 = self.num_chunks == 1
        warming_k, warming_v = in_chunk0 & (t < self.warm_k), in_chunk0 & (t < self.warm_v)
        if t < self.open_B.shape[2] and bool(warming_k.any()):
            self.open_B[:, :, t] = self._warm_row("key", t, self.open_B, k, warming_k)
        if t < self.open_E.shape[2] and bool(warming_v.any()):
            self.open_E[:, :, t] = self._warm_row("value", t, self.open_E, v, warming_v)
        return warming_k, warming_v

    def _warm_row(self, which: str, t: int, open_basis: Any, x: Any, warming: Any) -> Any:
        """Row t of chunk 0 of the heads still ``warming`` (N, H) on this side becomes x's unit
        residual (spec/storage.md S2.1 floor for encoded rows); the other heads' chunk-0 row t is
        padding (zero) and their open row t, possibly of a later chunk, is kept. Returns the open
        bases' new row t (decoded)."""
        xp = self.xp
        floor = 2 * row_error_bound(self.lay.basis_format, x.shape[-1])
        row = xp.where(warming[..., None], warmup_row(open_basis, x, floor), 0.0)
        decoded = self.lay.store_basis(which, (slice(None), slice(None), 0, t), row)
        return xp.where(warming[..., None], decoded, open_basis[:, :, t])

    def coefficients(self, k: Any, v: Any) -> tuple[Any, Any]:
        """Spec A7 step 1 / A8 step 1: c = B k, d = E v with the open chunk's bases."""
        return self.xp.einsum("nhrd,nhd->nhr", self.open_B, k), self.xp.einsum("nhrd,nhd->nhr", self.open_E, v)

    def feed(self, t: int, k: Any, v: Any) -> None:
        """The FD update of token t (A7 step 4 / A8 step 3): every stride-th token (S2), into the
        ring instead of the sketches when there is one (S1 step 1)."""
        if t % self.stride:
            return
        if self.ring:
            self.ring_k[:, :, (t // self.stride) % self.ring] = k
            self.ring_v[:, :, (t // self.stride) % self.ring] = v
        else:
            self.buf_k, self.filled_k, n_k = fd_insert(self.buf_k, self.filled_k, k[:, :, None], self.policy.ell_k)
            self.buf_v, self.filled_v, n_v = fd_insert(self.buf_v, self.filled_v, v[:, :, None], self.policy.ell_v)
            self.svds += (n_k + n_v) * self.stack
        self.rows_inserted += 1

    def commit(self, state) -> None:
        """Make the append visible: the new layout, chunk bookkeeping and sketches replace the old."""
        state.layout = replace(self.lay, num_chunks=self.num_chunks, chunk_starts=self.chunk_starts, num_tokens=self.T + self.n_new)
        state.sketches = replace(
            self.sketches,
            keys=self.buf_k,
            values=self.buf_v,
            filled_k=self.filled_k,
            filled_v=self.filled_v,
            rows_seen=self.sketches.rows_seen + self.n_new,
            ring_keys=self.ring_k,
            ring_values=self.ring_v,
            rows_inserted=self.rows_inserted,
            svds=self.svds,
            tokens_over_tau=self.over_tau,
        )
