"""One basis per head refreshed every m tokens, stored coefficients rotated (spec A8; seed 003 SubSpace-A)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RotatingPolicy:
    """FD sketches per head; every ``refresh_every`` tokens the basis is replaced by the sketch's
    top directions and all stored coefficients are multiplied by the small r x r change of basis."""

    rank_k: tuple[int, ...]
    rank_v: tuple[int, ...]
    ell_k: int
    ell_v: int
    refresh_every: int
    warmup: int

    kind = "rotating"
