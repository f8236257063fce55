"""Unit-level resampling (subspace_ref/lab/experiments/statistics.py)."""

import numpy as np
import pytest

from subspace_ref.lab.experiments.statistics import mean_interval, paired_difference_interval, relative_perplexity_interval


def test_identical_units_give_a_point_interval():
    units = [np.full(10, 2.0), np.full(30, 2.0)]
    assert mean_interval(units) == (2.0, 2.0)


def test_window_resampling_is_wider_than_token_resampling_when_windows_differ():
    rng = np.random.default_rng(1)
    windows = [rng.normal(mu, 0.05, 256) for mu in (0.3, 0.8, 1.2, 0.5)]
    lo, hi = mean_interval(windows)
    pooled = np.concatenate(windows)
    token_lo, token_hi = mean_interval([[x] for x in pooled])
    assert hi - lo > 5 * (token_hi - token_lo)


def test_relative_perplexity_of_a_constant_nll_shift():
    rng = np.random.default_rng(2)
    ref = [rng.normal(1.0, 0.2, 64) for _ in range(6)]
    method = [x + 0.1 for x in ref]
    lo, hi = relative_perplexity_interval(method, ref)
    assert lo == pytest.approx(np.expm1(0.1)) and hi == pytest.approx(np.expm1(0.1))


def test_paired_inputs_must_match():
    with pytest.raises(ValueError, match="paired"):
        relative_perplexity_interval([np.ones(3)], [np.ones(4)])
    with pytest.raises(ValueError, match="paired"):
        paired_difference_interval([np.ones(3)], [np.ones(3), np.ones(3)])
    with pytest.raises(ValueError, match="at least one unit"):
        mean_interval([])


def test_resampled_interval_of_a_rank_correlation_by_window():
    from subspace_ref.lab.experiments.statistics import resampled_interval

    rng = np.random.default_rng(4)
    windows = [[(x, 2 * x + rng.normal(0, 0.1)) for x in rng.normal(size=20)] for _ in range(5)]

    def rho(recs):
        a, b = np.array(recs).T
        return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])

    lo, hi = resampled_interval(windows, rho)
    assert 0.9 < lo <= hi <= 1.0
    assert resampled_interval(windows[:1], rho) is None  # one window cannot say how windows vary


def coverage(n_windows: int, studies: int = 200, seed: int = 5) -> tuple[float, float]:
    """Share of simulated studies whose window-resampled interval covers the true ratio, and the
    median width. Windows have their own difficulty (stock NLL varies between windows) and a
    per-window effect, as on the shipped model."""
    rng = np.random.default_rng(seed)
    true, hits, widths = np.expm1(0.05), 0, []
    for _ in range(studies):
        ref = [rng.normal(rng.uniform(0.3, 1.2), 0.5, 256) for _ in range(n_windows)]
        method = [x + rng.normal(0.05, 0.03) for x in ref]
        lo, hi = relative_perplexity_interval(method, ref, reps=500)
        hits += lo <= true <= hi
        widths.append(hi - lo)
    return hits / studies, float(np.median(widths))


@pytest.mark.slow
def test_twelve_windows_give_intervals_that_cover_and_four_do_not():
    """Why the full profile scores 12 windows: with 4 a percentile bootstrap over windows covers
    the true ratio in only about three studies of four (simulated: 0.77), with 12 in about nine of
    ten, and the interval narrows roughly as 1/√n."""
    cov4, width4 = coverage(4)
    cov12, width12 = coverage(12)
    assert cov4 < 0.85 <= cov12
    assert width12 < width4 * np.sqrt(4 / 12) * 1.5
