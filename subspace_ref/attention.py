"""``attend``: coefficient-space attention over a state, on any registered backend (spec A2, A3).

The operation lives in :mod:`subspace_ref.operations`; this module keeps its public name.
"""

from __future__ import annotations

from subspace_ref.operations import attend

__all__ = ["attend"]
