"""Adaptive bases with residual-triggered chunking (spec A7; seed 001 §5)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class AdaptivePolicy:
    """FD sketches per head; a new chunk, with bases snapshotted from the sketches, starts after a
    token whose relative residual exceeds ``tau_k``/``tau_v`` or when a chunk reaches ``max_chunk``.
    The first min(``warmup``, rank) tokens of each side are stored exactly (spec A7 step 0).
    ``trigger``: "reproject" opens the new chunk AT the firing token, after the FD update, and
    stores that token with the new bases (spec A7.2, what bounds every stored token); "paper"
    keeps seed 001's order (snapshot before the FD update, the firing token stays in the old
    chunk with its residual). A file saved before the option existed holds no ``trigger`` and
    loads with this dataclass's neutral value, "paper", the order it was written with
    (spec/persistence.md); :meth:`SubspaceState.adaptive` defaults to "reproject". ``byte_ceiling``
    (spec A7.3): likewise neutral ``inf`` in files, 1.0 by default in the constructor. With ``sketch_reset`` the
    sketches restart at every chunk boundary (spec A7 step 3b), so each snapshot summarises the
    chunk that just closed instead of the whole history.

    Online-sketch variants (spec/sketch_variants.md, seed 001 §7, §9, §14), neutral by default:
    ``ring_warm_start`` W > 0 takes each new chunk's bases from FD of the last W sketch rows kept
    in ring buffers (S1); ``fd_stride`` m feeds only tokens t with t mod m = 0 to the sketches
    (S2); ``reuse_angle`` keeps the open chunk when a trigger's snapshot lies within that largest
    principal angle of the open bases, on keys and values (S3).

    ``track`` (spec A7.4; neutral False in files, True by default in the constructor under
    "reproject"): a side over tau / 2 with a free basis row takes the token's residual as that row
    instead of opening a chunk, and a chunk that opens takes, per side, the sketch's snapshot only
    where it holds the firing token within tau, else the token's direction with free rows after it
    and a sketch restarted from the token. Every stored token is then within tau (statement
    A7.4.1) except those a refused trigger leaves over it, which the state counts
    (``tokens_over_tau``)."""

    rank_k: tuple[int, ...]
    rank_v: tuple[int, ...]
    ell_k: int
    ell_v: int
    tau_k: float
    tau_v: float
    max_chunk: int
    warmup: int
    sketch_reset: bool = False
    # optional in saved files: written only when not neutral (spec/persistence.md version 2)
    ring_warm_start: int = field(default=0, metadata={"optional": True})
    fd_stride: int = field(default=1, metadata={"optional": True})
    reuse_angle: float | None = field(default=None, metadata={"optional": True})
    trigger: str = field(default="paper", metadata={"optional": True})
    # spec A7.3: a multiple of the full cache's bytes; neutral in files: math.inf (no ceiling, seed
    # 001's policy, what files written before the option hold); SubspaceState.adaptive's default is 1.0
    byte_ceiling: float = field(default=float("inf"), metadata={"optional": True})
    # spec A7.4 (drift tracking, needs trigger="reproject"); neutral in files: False, the policy
    # files written before the option were appended with; SubspaceState.adaptive's default is True
    track: bool = field(default=False, metadata={"optional": True})

    kind = "adaptive"

    def __post_init__(self):
        if self.track and self.trigger != "reproject":  # A7.4 stores the firing token in the new chunk
            raise ValueError(f'track=True needs trigger="reproject" (spec A7.4), got trigger={self.trigger!r}')


def sketch_options(ring_warm_start, fd_stride, reuse_angle, sketch_reset: bool) -> tuple[int, int, float | None]:
    """The online-sketch options checked (spec/sketch_variants.md S1-S3): ring_warm_start an
    int >= 0, fd_stride an int >= 1, reuse_angle None or radians in (0, pi/2). A ring replaces
    the running sketches, so it does not combine with sketch_reset (S1.4)."""
    import math

    from subspace_ref import _checks

    ring = _checks.integer("ring_warm_start", ring_warm_start)
    if ring < 0:
        raise ValueError(f"ring_warm_start must be an int >= 0 (0: no ring), got {ring}")
    if ring and sketch_reset:
        raise ValueError(
            "ring_warm_start > 0 rebuilds the sketches from the ring at each trigger; it does not combine with sketch_reset=True (spec/sketch_variants.md S1.4)"
        )
    stride = _checks.positive_int("fd_stride", fd_stride)
    if reuse_angle is not None:
        reuse_angle = _checks.real("reuse_angle", reuse_angle)
        if not 0.0 < reuse_angle < math.pi / 2:
            raise ValueError(f"reuse_angle must be None or radians in the open interval (0, pi/2), got {reuse_angle}")
    return ring, stride, reuse_angle


TRIGGER_ORDERS = ("reproject", "paper")


def trigger_order(trigger) -> str:
    """The trigger order checked: "reproject" (spec A7.2) or "paper" (seed 001 §5 verbatim)."""
    if trigger not in TRIGGER_ORDERS:
        raise ValueError(f"trigger must be one of {TRIGGER_ORDERS}, got {trigger!r}")
    return trigger


def track_option(track, trigger: str) -> bool:
    """``track`` checked (spec A7.4): None means True under the reproject trigger and False under
    "paper" (whose firing token stays in the old chunk); True needs "reproject"."""
    if track is None:
        return trigger == "reproject"
    if not isinstance(track, (bool, np.bool_)):
        raise TypeError(f"track must be True, False or None (None: True under trigger='reproject'), got {track!r}")
    if track and trigger != "reproject":
        raise ValueError(f'track=True needs trigger="reproject" (spec A7.4: the firing token is stored in the new chunk), got trigger={trigger!r}')
    return bool(track)
