"""Rows of the variants report (issue 11): each group of variants has one module here whose
``variants(ctx, record, svd)`` returns :class:`Variant` rows; ``subspace-kv variants`` scores
every row and the plain method it is compared with on the same held-out windows.

``record, svd`` are what :func:`subspace_ref.experiments.calibrate.ensure_calibration` returns
(per-layer SVDs of post-RoPE calibration keys/values, tau calibrations, energy ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: Modules of variant groups, in report order.
GROUPS = ("rope", "storage", "sharing", "sketch", "window")


@dataclass(frozen=True)
class Variant:
    """One row: a cache configuration scored against the plain method named ``plain``.

    ``factory`` is a state factory for :class:`subspace_ref.hf.SubspaceCache` (``StateSpec ->
    SubspaceState``), or ``None`` when ``scorer`` computes the row (a variant the cache cannot
    serve, e.g. an ablation by projection); ``scorer(model, ids) -> dict`` must then return the
    keys of :func:`subspace_ref.experiments.ppl.score`. ``backend`` runs the cache (``"numpy"``
    for variants only the oracle implements). ``plain`` names a row of :func:`plain_rows`.
    """

    name: str
    group: str
    plain: str
    factory: Callable | None = None
    scorer: Callable | None = None
    backend: str = "torch"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
