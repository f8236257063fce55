"""Percentile bootstrap 95% intervals for accuracies (fixed seed)."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(correct, groups=None, reps: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """95% percentile interval of the mean of 0/1 ``correct``. With ``groups`` (one label per item)
    whole groups are resampled (cluster bootstrap: items of one window are correlated)."""
    x = np.asarray(correct, dtype=np.float64).ravel()
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    if groups is None:
        idx = rng.integers(0, x.size, size=(reps, x.size))
        means = x[idx].mean(axis=1)
    else:
        g = np.asarray(groups).ravel()
        labels = np.unique(g)
        sums = np.array([x[g == k].sum() for k in labels])
        counts = np.array([(g == k).sum() for k in labels], dtype=np.float64)
        idx = rng.integers(0, labels.size, size=(reps, labels.size))
        means = sums[idx].sum(axis=1) / counts[idx].sum(axis=1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))
