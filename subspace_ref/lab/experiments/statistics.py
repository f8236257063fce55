"""Intervals by resampling the independent unit (an evaluation window, a needle instance).

Tokens of one window share their context, so they are not independent draws: resampling 64-token
blocks pooled over windows understates the spread whenever windows differ (stock perplexity
varies 1.3-3.3 between windows of the shipped model). Every interval the generated pages print
resamples whole units with replacement and recomputes the statistic on the pooled tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

LEVEL = 0.95
REPS = 2000


def _units(per_unit: Sequence[np.ndarray], name: str) -> list[np.ndarray]:
    units = [np.asarray(u, dtype=np.float64).ravel() for u in per_unit]
    if not units:
        raise ValueError(f"{name} must hold at least one unit (window or instance), got none")
    return units


def _sums_counts(units: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([u.sum() for u in units]), np.array([u.size for u in units], dtype=np.float64)


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    a = (1 - level) / 2
    return float(np.quantile(draws, a)), float(np.quantile(draws, 1 - a))


def mean_interval(per_unit: Sequence[np.ndarray], reps: int = REPS, seed: int = 0, level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of the pooled mean of ``per_unit`` (one array of per-item values per
    unit, e.g. 0/1 recall per needle instance or NLL per token of a window), whole units resampled."""
    sums, counts = _sums_counts(_units(per_unit, "per_unit"))
    idx = np.random.default_rng(seed).integers(0, sums.size, size=(reps, sums.size))
    return _percentiles(sums[idx].sum(1) / counts[idx].sum(1), level)


def relative_perplexity_interval(
    method_nll: Sequence[np.ndarray], reference_nll: Sequence[np.ndarray], reps: int = REPS, seed: int = 0, level: float = LEVEL
) -> tuple[float, float]:
    """Percentile interval of ppl(method) / ppl(reference) - 1 on the same windows, paired: one
    resample of window indices is applied to both, and each side's perplexity is exp of its pooled
    mean NLL over the drawn windows. ``method_nll[i]`` and ``reference_nll[i]`` are the per-token
    NLLs (nats) of window i."""
    a = _units(method_nll, "method_nll")
    b = _units(reference_nll, "reference_nll")
    if len(a) != len(b) or any(x.size != y.size for x, y in zip(a, b)):
        raise ValueError("method_nll and reference_nll must hold the same windows with the same token counts (paired)")
    sa, counts = _sums_counts(a)
    sb, _ = _sums_counts(b)
    idx = np.random.default_rng(seed).integers(0, counts.size, size=(reps, counts.size))
    n = counts[idx].sum(1)
    return _percentiles(np.expm1((sa[idx].sum(1) - sb[idx].sum(1)) / n), level)


def paired_difference_interval(
    a_units: Sequence[np.ndarray], b_units: Sequence[np.ndarray], reps: int = REPS, seed: int = 0, level: float = LEVEL
) -> tuple[float, float]:
    """Percentile interval of mean(a) - mean(b) over paired units (e.g. recall with and without
    the needle on the same instances), whole units resampled together."""
    a = _units(a_units, "a_units")
    b = _units(b_units, "b_units")
    if len(a) != len(b):
        raise ValueError(f"a_units and b_units must be paired: {len(a)} units against {len(b)}")
    sa, ca = _sums_counts(a)
    sb, cb = _sums_counts(b)
    idx = np.random.default_rng(seed).integers(0, ca.size, size=(reps, ca.size))
    return _percentiles(sa[idx].sum(1) / ca[idx].sum(1) - sb[idx].sum(1) / cb[idx].sum(1), level)


def resampled_interval(units: Sequence[Sequence], statistic, reps: int = 200, seed: int = 0, level: float = LEVEL) -> tuple[float, float] | None:
    """Percentile interval of ``statistic(pooled records)`` with whole units (lists of records, e.g.
    the states built from one captured window) resampled with replacement; None when fewer than two
    units or the statistic is undefined on every draw. For statistics that are not means (a rank
    correlation), where records of one unit share their window and are not independent draws."""
    units = [list(u) for u in units if len(u)]
    if len(units) < 2:
        return None
    rng = np.random.default_rng(seed)
    draws = []
    for idx in rng.integers(0, len(units), size=(reps, len(units))):
        value = statistic([rec for i in idx for rec in units[i]])
        if value is not None and np.isfinite(value):
            draws.append(value)
    return _percentiles(np.asarray(draws), level) if draws else None


def bootstrap_ci(correct, groups=None, reps: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """95% percentile interval of the mean of 0/1 ``correct`` (the accuracy tasks). Without
    ``groups`` every item is its own unit (a needle instance); with ``groups`` (one label per
    item) whole groups are resampled (items of one window are correlated): :func:`mean_interval`."""
    x = np.asarray(correct, dtype=np.float64).ravel()
    if x.size == 0:
        return (float("nan"), float("nan"))
    if groups is None:
        units = list(x[:, None])
    else:
        g = np.asarray(groups).ravel()
        units = [x[g == k] for k in np.unique(g)]
    return mean_interval(units, reps=reps, seed=seed, level=level)
