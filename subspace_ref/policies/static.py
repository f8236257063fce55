"""Static basis calibrated offline (spec A6; seed 001 §10 "Static Subspace", seed 003 SubSpace-G)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StaticPolicy:
    """One fixed basis per head; ranks per head (zero rows pad the rest)."""

    rank_k: tuple[int, ...]
    rank_v: tuple[int, ...]

    kind = "static"
