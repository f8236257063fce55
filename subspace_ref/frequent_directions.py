"""Frequent Directions sketches (spec A4).

The functions at the top work on a stack of sketches at once (any leading axes) and on NumPy or
CuPy arrays; :class:`FrequentDirections` is the one-matrix public face over them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref import _checks
from subspace_ref.arrays import namespace


def compact(buffer: Any, ell: int) -> Any:
    """Spec A4 step 3: shrink every singular value by the ell-th one, zeroing rows ell-1.. ."""
    xp = namespace(buffer)
    _, sigma, wt = xp.linalg.svd(buffer, full_matrices=False)
    if sigma.shape[-1] < ell:  # ell > d: the buffer already has rank < ell, nothing to shrink
        delta = xp.zeros_like(sigma[..., :1])
    else:
        delta = sigma[..., ell - 1 : ell] ** 2
    shrunk = xp.sqrt(xp.maximum(sigma**2 - delta, 0.0))
    out = xp.zeros_like(buffer)
    out[..., : wt.shape[-2], :] = shrunk[..., :, None] * wt
    return out


def insert(buffer: Any, filled: int, rows: Any, ell: int) -> tuple[Any, int]:
    """Spec A4 steps 1-2 for rows (..., n, d), in order. Returns a new buffer and its fill count."""
    return insert_rows(buffer.copy(), filled, rows, ell, compact)


def insert_rows(buffer: Any, filled: int, rows: Any, ell: int, compact_fn) -> tuple[Any, int]:
    """Spec A4 steps 1-2, writing into ``buffer`` in place until ``compact_fn`` (step 3, the
    array library's own) replaces it. Rows are written in runs that fill the buffer, so there is
    one SVD per ell + 1 rows at most, and a block gives the same writes and compactions as its
    rows one by one."""
    n = rows.shape[-2]
    i = 0
    while i < n:
        if filled == 2 * ell:
            buffer = compact_fn(buffer, ell)
            filled = ell - 1
        take = min(2 * ell - filled, n - i)
        buffer[..., filled : filled + take, :] = rows[..., i : i + take, :]
        filled += take
        i += take
    return buffer, filled


def sketch(buffer: Any, filled: int, ell: int) -> Any:
    """The ell x d sketch of spec A4: the buffer's first ell rows, compacted first when fuller."""
    if filled > ell:
        buffer = compact(buffer, ell)
    return buffer[..., :ell, :]


def _fix_signs(rows: Any) -> Any:
    """Make each row's entry of largest magnitude positive (spec A4), so bases are deterministic."""
    xp = namespace(rows)
    pivot = xp.argmax(xp.abs(rows), axis=-1)[..., None]
    sign = xp.sign(xp.take_along_axis(rows, pivot, axis=-1))
    return rows * xp.where(sign == 0, 1.0, sign).astype(rows.dtype)


def top_directions(buffer: Any, r: int) -> Any:
    """Top-r right singular vectors of a stack of matrices, sign-fixed; directions whose singular
    value is zero (to rounding) are returned as zero rows, the padding convention of spec A9."""
    xp = namespace(buffer)
    _, sigma, wt = xp.linalg.svd(buffer, full_matrices=False)
    if wt.shape[-2] < r:
        pad = xp.zeros(wt.shape[:-2] + (r - wt.shape[-2], wt.shape[-1]), dtype=wt.dtype)
        wt = xp.concatenate([wt, pad], axis=-2)
        sigma = xp.concatenate([sigma, xp.zeros(sigma.shape[:-1] + (pad.shape[-2],), dtype=sigma.dtype)], axis=-1)
    eps = np.finfo(np.dtype(str(buffer.dtype))).eps
    tol = sigma[..., :1] * max(buffer.shape[-2:]) * eps
    keep = (sigma[..., :r] > tol) & (sigma[..., :r] > 0)
    return _fix_signs(wt[..., :r, :]) * keep[..., None].astype(wt.dtype)


def complete_orthonormal(rows: np.ndarray) -> np.ndarray:
    """Replace the zero rows of a (r, d) matrix with orthonormal rows orthogonal to the others.

    Each new row is the standard basis vector with the largest component outside the span so far
    (lowest index on ties), orthogonalised: a choice that depends only on that span.
    """
    rows = rows.copy()
    zero = np.linalg.norm(rows, axis=-1) == 0
    kept = list(rows[~zero])
    for i in np.flatnonzero(zero):
        span = np.array(kept).reshape(-1, rows.shape[-1])
        outside = np.eye(rows.shape[-1]) - span.T @ span
        j = int(np.argmax(np.linalg.norm(outside, axis=0)))
        v = outside[:, j]
        v = v - span.T @ (span @ v)  # a second pass keeps orthogonality to rounding
        rows[i] = v / np.linalg.norm(v)
        kept.append(rows[i])
    return rows


class FrequentDirections:
    """Deterministic streaming sketch of a row stream A (spec A4).

    Guarantee (spec A4.1, B5): for the sketch S of every prefix and every k < ell,
    ``0 <= ||A^T A - S^T S||_2 <= ||A - A_k||_F^2 / (ell - k)``. Rows are buffered in a
    2*ell x d matrix, so one SVD serves ell + 1 rows (amortised), not one per row.

    Parameters
    ----------
    d : int
        Row width.
    ell : int
        Sketch size: the sketch keeps at most ell non-zero rows.
    dtype : numpy dtype
        float32 or float64 (the default).

    Examples
    --------
    >>> import numpy as np
    >>> from subspace_ref import FrequentDirections
    >>> fd = FrequentDirections(16, 4).update(np.random.default_rng(0).standard_normal((64, 16)))
    >>> fd
    FrequentDirections(d=16, ell=4, rows_seen=64)
    """

    def __init__(self, d: int, ell: int, dtype: Any = np.float64):
        self.d = _checks.positive_int("d", d)
        self.ell = _checks.positive_int("ell", ell)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {self.dtype}")
        self._buffer = np.zeros((2 * self.ell, self.d), dtype=self.dtype)
        self._filled = 0
        self.rows_seen = 0

    def update(self, rows: Any) -> "FrequentDirections":
        """Add rows (n, d) or one row (d,). Bad input leaves the sketch unchanged."""
        rows = np.asarray(_checks.as_array("rows", rows))
        if rows.ndim == 1:
            rows = rows[None, :]
        _checks.shape("rows", rows, (None, self.d))
        kept = rows.astype(self.dtype)
        _checks.finite_rows("rows", rows, kept)
        self._buffer, self._filled = insert(self._buffer, self._filled, kept, self.ell)
        self.rows_seen += rows.shape[0]
        return self

    @property
    def sketch(self) -> np.ndarray:
        """The (ell, d) sketch S (spec A4); reading it does not change the stream's state."""
        return sketch(self._buffer, self._filled, self.ell).copy()

    def basis(self, r: int) -> np.ndarray:
        """(r, d) orthonormal rows: the sketch's top-r right singular vectors (spec A4), completed
        deterministically by directions the stream never reached when its rank is below r."""
        r = _checks.positive_int("r", r)
        if r >= self.ell:
            raise ValueError(f"r must be < ell = {self.ell} (the sketch holds at most ell - 1 directions), got {r}")
        if r > self.d:
            raise ValueError(f"r must be <= d = {self.d}, got {r}")
        return complete_orthonormal(top_directions(self._buffer, r))

    def __repr__(self) -> str:
        return f"FrequentDirections(d={self.d}, ell={self.ell}, rows_seen={self.rows_seen})"
