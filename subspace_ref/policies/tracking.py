"""Spec A7.4, drift tracking (``track=True``, the default under the reproject trigger): what a
token over tau does to its head's bases, shared by the oracle and the torch append through the
array namespace.

* a side (keys or values) whose token is over tau / 2 and whose open basis has a free row (a zero
  row below the head's rank) takes the token's normalised residual as that row: the token is
  stored exactly and no chunk opens (A7.4 step 1, "growth");
* a chunk that opens takes, per side, the sketch's snapshot when it holds the firing token
  within tau, else the token's own direction with every other row free (A7.4 step 2);
* the opening head's sketches then restart from the firing token, so they summarise the open
  chunk's tokens only (A7.4 step 3): after a subspace switch the next snapshot comes from the new
  subspace, and the switch is learnt by growth in one chunk instead of a chunk per token (A7.1's
  thrashing). A7.4.2 bounds the chunks of a piecewise-subspace stream.

Either way the firing token is stored within tau by construction (statement A7.4.1).
"""

from __future__ import annotations

from typing import Any

from subspace_ref.arrays import namespace
from subspace_ref.basis_storage import row_error_bound
from subspace_ref.policies.online_run import relative_residual, warmup_row


#: A7.4 step 1's growth threshold as a fraction of tau: a free row goes to a token whose relative
#: residual exceeds GROW * tau (docs/adaptive_policy.md: 1/2 measured best; lower builds rows from noise)
GROW = 0.5


def growing(rho: Any, warming: Any, tau: float) -> Any:
    """The tokens (any shape) that take a free row if their side has one (A7.4 step 1): not
    warming, relative residual above GROW * tau."""
    return ~warming & (rho > GROW * tau)


def full(open_basis: Any, mask: Any) -> Any:
    """(..., ) bool: whether every row of the open bases (..., r, d) below the head's rank (mask
    (..., r, 1), or (H, r, 1) broadcast against (N, H, r, d)) is in use, i.e. non-zero."""
    zero = ((open_basis * open_basis).sum(-1) == 0) & (mask[..., 0] > 0)
    return ~zero.any(-1)


def grow(lay, which: str, open_basis: Any, mask: Any, fn: Any, fh: Any, j: Any, x: Any) -> None:
    """A7.4 step 1 for heads (fn, fh) whose open chunk j has a free ``which`` row: that row
    becomes the unit residual of their token x (N, H, d) against the open bases (N, H, r, d), in
    place, encoded into ``lay``'s chunk j (which the caller has made private if it is visible)
    and decoded into ``open_basis``, as the warm-up's rows (spec/storage.md S3). ``mask``: the
    (H, r, 1) rank mask."""
    basis = open_basis[fn, fh]
    slot = first_free(basis, mask[fh])
    floor = 2 * row_error_bound(lay.basis_format, x.shape[-1])
    row = sign_fixed(warmup_row(basis, x[fn, fh], floor))
    open_basis[fn, fh, slot] = lay.store_basis(which, (fn, fh, j, slot), row)


def first_free(open_basis: Any, mask: Any) -> Any:
    """(M,) index of the first free row of each of M open bases (M, r, d) that has one."""
    zero = ((open_basis * open_basis).sum(-1) == 0) & (mask[..., 0] > 0)
    return namespace(open_basis).argmax(zero * 1, axis=-1)  # the first True (torch's argmax takes no bools)


def restart(buf: Any, filled: int, fn: Any, fh: Any, x: Any | None) -> None:
    """A7.4 step 3 on one side's FD buffers (N, H, 2 ell, d), in place: heads (fn, fh), which open
    a chunk at a token, forget every row but that token's, x (N, H, d) (the last row fed under
    A7.2; None when the token was not fed, spec/sketch_variants.md S2), so the sketches summarise
    the new chunk's tokens only."""
    buf[fn, fh] = 0.0
    if x is not None:
        buf[fn, fh, filled - 1] = x[fn, fh]


def spanning(snapshot: Any, x: Any, tau: float) -> Any:
    """A7.4 step 2 for M opening heads, one side: the snapshot (M, r, d) where it holds its token
    x (M, d) within tau, else x's direction in row 0 and free (zero) rows after it."""
    xp = namespace(x)
    rho = relative_residual(x, xp.einsum("mrd,md->mr", snapshot, x))
    norm = xp.sqrt((x * x).sum(-1, keepdims=True))
    own = xp.zeros_like(snapshot)
    own[:, 0] = sign_fixed(x / xp.where(norm > 0, norm, 1.0))
    return xp.where((rho > tau)[:, None, None], own, snapshot)


def sign_fixed(rows: Any) -> Any:
    """Rows (..., d) with each row's entry of largest magnitude made positive (the first such entry
    on ties; zero rows stay zero): spec A4's sign rule, so every stored row is deterministic. Built
    from the input alone (no index arrays), so it runs on every array family."""
    xp = namespace(rows)
    big = xp.abs(rows) == xp.max(xp.abs(rows), axis=-1, keepdims=True)
    pivot = big & (xp.cumsum(big * 1, axis=-1) == 1)
    return xp.where((rows * pivot).sum(-1, keepdims=True) < 0, -rows, rows)
