"""The sketch variants' hooks into the adaptive append (spec/sketch_variants.md S1-S3) and the
lookahead anchoring of windowed states (spec/window.md W4), in one place: what they change is
where a new chunk's bases come from and whether a fired head opens a chunk at all. Neutral
settings (no ring, no reuse, no lookahead) leave spec A7 verbatim. The stride (S2) and the
ring's filling (S1 step 1) act in the FD update, :meth:`OnlineRun.feed`."""

from __future__ import annotations

from typing import Any

import numpy as np

from subspace_ref import window
from subspace_ref.arrays import to_numpy
from subspace_ref.policies.online_run import OnlineRun, fd_insert


def length_capped(held: Any, policy) -> Any:
    """Spec A7 step 3's length trigger on the ``held`` tokens of the open chunk; S3.2: with reuse
    a chunk may outlive max_chunk, and the cap re-fires every max_chunk tokens."""
    if getattr(policy, "reuse_angle", None) is None:
        return held >= policy.max_chunk
    return (held > 0) & (held % policy.max_chunk == 0)


def snapshot_sources(run: OnlineRun, fn: Any, fh: Any, t: int, reproject: bool, following: Any, i: int) -> tuple[Any, Any]:
    """The sketch rows the fired heads (fn, fh) take their new bases from (spec A7 step 3).

    With a ring (S1 step 2): the fired heads' sketches rebuilt from the ring, the last rows
    offered before t (through t with reproject), oldest first, FD-inserted into empty buffers.
    Otherwise the sketches themselves, or with lookahead (W4) copies of them that also saw the
    next L_h (already held) tokens."""
    xp, policy = run.xp, run.policy
    if run.ring:
        offered = -(-(t + reproject) // run.stride)
        slots = [q % run.ring for q in range(offered - min(offered, run.ring), offered)]
        src_k, filled_src_k, n_k = fd_insert(
            xp.zeros((len(fn), 2 * policy.ell_k, run.open_B.shape[3]), dtype=run.buf_k.dtype), 0, run.ring_k[fn, fh][:, slots], policy.ell_k
        )
        src_v, filled_src_v, n_v = fd_insert(
            xp.zeros((len(fn), 2 * policy.ell_v, run.open_E.shape[3]), dtype=run.buf_v.dtype), 0, run.ring_v[fn, fh][:, slots], policy.ell_v
        )
        run.svds += (n_k + n_v) * len(fn)
        return src_k[:, :filled_src_k], src_v[:, :filled_src_v]
    snap_k, snap_fk, snap_v, snap_fv = window.anchor_buffers(run.buf_k, run.filled_k, run.buf_v, run.filled_v, policy, following, i)
    return snap_k[fn, fh, :snap_fk], snap_v[fn, fh, :snap_fv]


def reused(run: OnlineRun, fn: Any, fh: Any, new_B: Any, new_E: Any) -> tuple[Any, Any, Any, Any]:
    """S3 step 2: heads whose snapshot is within reuse_angle of the open bases on keys and values
    keep their open chunk; returns the heads that open one, with their new bases."""
    reuse = getattr(run.policy, "reuse_angle", None)
    if reuse is None:
        return fn, fh, new_B, new_E
    fresh = np.array(
        [
            max(largest_principal_angle(run.open_B[a, b], new_B[i]), largest_principal_angle(run.open_E[a, b], new_E[i])) >= reuse
            for i, (a, b) in enumerate(zip(to_numpy(fn).tolist(), to_numpy(fh).tolist()))
        ],
        dtype=bool,
    )
    fresh = run.xp.asarray(fresh)
    return fn[fresh], fh[fresh], new_B[fresh], new_E[fresh]


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
