"""Rows of the variants report (issue 11): each group of variants has one module here whose
``variants(ctx, record, svd)`` returns :class:`Variant` rows; ``subspace-kv variants`` scores
every row and the plain method it is compared with on the same held-out windows.

``record, svd`` are what :func:`subspace_ref.lab.experiments.calibrate.ensure_calibration` returns
(per-layer SVDs of post-RoPE calibration keys/values, tau calibrations, energy ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: Modules of variant groups, in report order.
GROUPS = ("rope", "storage", "sharing", "sketch", "ranks", "window")


@dataclass(frozen=True)
class Variant:
    """One row: a cache configuration scored against the plain method named ``plain``.

    ``factory`` is a state factory for :class:`subspace_ref.hf.SubspaceCache` (``StateSpec ->
    SubspaceState``), or ``None`` when ``scorer`` computes the row (a variant the cache cannot
    serve, e.g. an ablation by projection); ``scorer(model, ids) -> dict`` must then return the
    keys of :func:`subspace_ref.lab.experiments.ppl.score`. ``backend`` runs the cache (``"numpy"``
    for variants only the oracle implements). ``plain`` is a key of :func:`plain_rows` ("static", "adaptive" or "rotating").
    """

    name: str
    group: str
    plain: str
    factory: Callable | None = None
    scorer: Callable | None = None
    backend: str = "torch"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- the plain methods
def plain_rank(ctx, record: dict) -> int:
    """The rank every variant is compared at: the calibrated online rank nearest d/2 (32 of 64 on
    the shipped model, where post-RoPE keys start to hold: see docs/experiments.md)."""
    return min(record["online_ranks"], key=lambda r: abs(r - ctx.d / 2))


def static_bases(record: dict, svd: list[dict], rank: int, gamma: str = "unit") -> list:
    """One calibrated post-RoPE StaticBasis per layer at ``rank`` on both sides."""
    from subspace_ref.lab.experiments.calibrate import static_basis

    return [static_basis(record, svd, li, rank=rank, gamma=gamma) for li in range(len(svd))]


def adaptive_options(ctx, record: dict, rank: int, *, sketch_reset: bool = True) -> dict:
    """Keyword arguments of :class:`subspace_ref.hf.adaptive_states` for the plain adaptive row:
    tau calibrated per layer at the 95th residual percentile (``calibrate``), ``max_chunk`` of the
    profile, sketches reset at chunk boundaries (spec A7.1)."""
    tau = record["tau"]["by_rank"][str(rank)]
    tk, tv = list(tau["tau_k"]), list(tau["tau_v"])
    return dict(rank_k=rank, rank_v=rank, tau_k=lambda li: tk[li], tau_v=lambda li: tv[li],
                max_chunk=ctx.profile.max_chunk, sketch_reset=sketch_reset)


def rotating_options(ctx, rank: int) -> dict:
    """Keyword arguments of :class:`subspace_ref.hf.rotating_states` for the plain rotating row."""
    return dict(rank_k=rank, rank_v=rank, refresh_every=ctx.profile.refresh_every)


def plain_rows(ctx, record: dict, svd: list[dict]) -> dict[str, Callable]:
    """Name -> state factory of the plain methods the variants are compared with."""
    from subspace_ref.hf import adaptive_states, rotating_states, static_states

    r = plain_rank(ctx, record)
    return {
        "static": static_states(static_bases(record, svd, r)),
        "adaptive": adaptive_states(**adaptive_options(ctx, record, r)),
        "rotating": rotating_states(**rotating_options(ctx, r)),
    }
