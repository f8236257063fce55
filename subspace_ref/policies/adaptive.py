"""Adaptive bases with residual-triggered chunking (spec A7; seed 001 §5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptivePolicy:
    """FD sketches per head; a new chunk, with bases snapshotted from the sketches, starts after a
    token whose relative residual exceeds ``tau_k``/``tau_v`` or when a chunk reaches ``max_chunk``.
    The first ``warmup`` tokens are stored exactly (spec A7 step 0). With ``sketch_reset`` the
    sketches restart at every chunk boundary (spec A7 step 3b), so each snapshot summarises the
    chunk that just closed instead of the whole history."""

    rank_k: tuple[int, ...]
    rank_v: tuple[int, ...]
    ell_k: int
    ell_v: int
    tau_k: float
    tau_v: float
    max_chunk: int
    warmup: int
    sketch_reset: bool = False

    kind = "adaptive"
