"""Error bounds as code (spec/bounds.md): each statement of seed 001 §8 and seed 003 as a function
(:mod:`~subspace_ref.bounds.statements`), measured on a state by :func:`check`, swept over
synthetic streams and saved caches by ``python -m subspace_ref.bounds`` (:mod:`~subspace_ref.bounds.sweep`).
"""

from subspace_ref.bounds.check import BoundRow, BoundsReport, check
from subspace_ref.bounds.statements import CLAIMS, COUNTEREXAMPLES, Claim, Counterexample

__all__ = ["CLAIMS", "COUNTEREXAMPLES", "BoundRow", "BoundsReport", "Claim", "Counterexample", "check"]
