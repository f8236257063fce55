"""Percentile bootstrap 95% intervals for accuracies (fixed seed), by independent unit."""

from __future__ import annotations

import numpy as np

from subspace_ref.experiments.statistics import mean_interval


def bootstrap_ci(correct, groups=None, reps: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """95% percentile interval of the mean of 0/1 ``correct``. Without ``groups`` every item is
    its own unit (a needle instance); with ``groups`` (one label per item) whole groups are
    resampled (items of one window are correlated): :func:`~subspace_ref.experiments.statistics.mean_interval`."""
    x = np.asarray(correct, dtype=np.float64).ravel()
    if x.size == 0:
        return (float("nan"), float("nan"))
    if groups is None:
        units = list(x[:, None])
    else:
        g = np.asarray(groups).ravel()
        units = [x[g == k] for k in np.unique(g)]
    return mean_interval(units, reps=reps, seed=seed, level=level)
