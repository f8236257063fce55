"""Unit-level resampling (subspace_ref/experiments/statistics.py)."""

import numpy as np
import pytest

from subspace_ref.experiments.statistics import mean_interval, paired_difference_interval, relative_perplexity_interval


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
