"""Error bounds as code (spec/bounds.md): each statement of seed 001 §8 and seed 003 as a function
(:mod:`~subspace_ref.lab.bounds.statements`), measured on a state by :func:`check`, swept over
synthetic streams and saved caches by ``python -m subspace_ref.lab.bounds`` (:mod:`~subspace_ref.lab.bounds.sweep`).
"""

from subspace_ref.lab.bounds.check import BoundRow, BoundsReport, check
from subspace_ref.lab.bounds.statements import CLAIMS, COUNTEREXAMPLES, Claim, Counterexample

__all__ = ["CLAIMS", "COUNTEREXAMPLES", "BoundRow", "BoundsReport", "Claim", "Counterexample", "check"]
