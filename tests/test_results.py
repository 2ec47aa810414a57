"""tests/stats.py: the IQM and its stratified bootstrap intervals."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stats  # noqa: E402


# --- the IQM ---------------------------------------------------------------

def test_iqm_of_eight_values_is_the_mean_of_the_middle_four():
    # sorted 1..8; int(0.25 * 8) = 2 cut from each end: (3 + 4 + 5 + 6) / 4 = 4.5
    assert stats.iqm([8, 1, 7, 2, 6, 3, 5, 4]) == 4.5
    # sorted -50, 1, 2, 3, 4, 5, 6, 100: the outliers are cut, (2 + 3 + 4 + 5) / 4 = 3.5
    assert stats.iqm([100, -50, 1, 2, 3, 4, 5, 6]) == 3.5


def test_iqm_of_counts_not_divisible_by_four_cuts_as_trim_mean():
    # 10 values: int(2.5) = 2 cut from each end, the middle 6 kept:
    # sorted 0..8, 1000 -> 2, 3, 4, 5, 6, 7 -> 27 / 6 = 4.5
    assert stats.iqm([1000, *range(9)]) == 4.5
    # 7 values: int(1.75) = 1 cut from each end: 1, 2, 3, 4, 5 -> 3
    assert stats.iqm([70, 0, 1, 2, 3, 4, 5]) == 3
    # 5 values: int(1.25) = 1: sorted -10, 1, 2, 3, 10 -> (1 + 2 + 3) / 3 = 2
    assert stats.iqm([10, 1, 2, 3, -10]) == 2
    # 3 values: int(0.75) = 0, nothing cut: (1 + 2 + 9) / 3 = 4
    assert stats.iqm([1, 9, 2]) == 4
    scipy_stats = pytest.importorskip('scipy.stats')
    values = np.random.default_rng(0).normal(size=(6, 13))
    for n in range(1, 14):
        np.testing.assert_allclose(stats.iqm(values[:, :n]),
                                   scipy_stats.trim_mean(values[:, :n], 0.25, axis=1))


def test_iqm_along_an_axis():
    scores = np.array([[8, 1, 7, 2, 6, 3, 5, 4], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(stats.iqm(scores), [4.5, 1])
    np.testing.assert_array_equal(stats.iqm(scores.T, axis=0), [4.5, 1])


# --- the intervals ---------------------------------------------------------

def coverage(draw_tasks, truth, datasets=500, seed=0):
    """Share of `datasets` synthetic datasets whose 95% interval holds `truth`."""
    rng = np.random.default_rng(seed)
    hits = 0
    for index in range(datasets):
        _, low, high = stats.iqm_interval(draw_tasks(rng), reps=1000, seed=index)
        hits += low <= truth <= high
    return hits / datasets


def test_interval_covers_the_true_iqm_about_95_percent_of_the_time():
    # Exponential(1): quartiles a = ln(4/3), b = ln 4; the IQM is the mean of
    # x between them, 2 * integral_a^b x e^-x dx = 2 [(a + 1) e^-a - (b + 1) e^-b].
    a, b = np.log(4 / 3), np.log(4)
    truth = 2 * ((a + 1) * 0.75 - (b + 1) * 0.25)  # 0.7384
    assert abs(stats.iqm(np.random.default_rng(1).exponential(size=10**6)) - truth) < 0.005
    share = coverage(lambda rng: [rng.exponential(size=32)], truth)
    assert 0.90 <= share <= 0.985, share


def test_stratified_interval_covers_the_pooled_iqm_about_95_percent_of_the_time():
    # Three tasks of other shapes, scales and seed counts; the truth: the IQM of
    # a huge sample with the same share of each task.
    draws = [lambda rng, n: rng.normal(size=n), lambda rng, n: 3 * rng.exponential(size=n),
             lambda rng, n: rng.uniform(1, 2, size=n)]
    counts = [16, 32, 12]
    big = np.random.default_rng(123)
    truth = stats.iqm(np.concatenate([draw(big, n * 50000) for draw, n in zip(draws, counts)]))
    share = coverage(lambda rng: [draw(rng, n) for draw, n in zip(draws, counts)], truth)
    assert 0.90 <= share <= 0.985, share


def test_the_bootstrap_resamples_each_task_within_itself():
    tasks = [np.arange(4.0), 100 + np.arange(6.0)]
    draws = stats.stratified_resample(tasks, 500, np.random.default_rng(0))
    assert draws.shape == (500, 10)
    assert np.isin(draws[:, :4], tasks[0]).all() and np.isin(draws[:, 4:], tasks[1]).all()
    # Two constant tasks of 4 seeds each: every stratified resample has four 0s
    # and four 10s, IQM (0 + 0 + 10 + 10) / 4 = 5, so the interval is [5, 5];
    # resampling the 8 seeds together would move it.
    assert stats.iqm_interval([np.zeros(4), np.full(4, 10.0)]) == (5, 5, 5)
    pooled = np.concatenate([np.zeros(4), np.full(4, 10.0)])
    together = stats.iqm(pooled[np.random.default_rng(0).integers(0, 8, (500, 8))])
    assert together.min() < 5 < together.max()


def test_a_constant_sample_has_a_zero_width_interval():
    assert stats.iqm_interval([np.full(32, 3.5)]) == (3.5, 3.5, 3.5)
    middle, low, high = stats.curve_band(np.full((5, 8), 2.0))
    for band in (middle, low, high):
        np.testing.assert_array_equal(band, np.full(5, 2.0))


def test_curve_band_is_per_evaluation_point():
    curve = np.random.default_rng(0).normal(size=(7, 16)) + np.arange(7)[:, None]
    middle, low, high = stats.curve_band(curve)
    assert middle.shape == low.shape == high.shape == (7,)
    assert (low <= middle).all() and (middle <= high).all() and (low < high).all()
    np.testing.assert_array_equal(middle, stats.iqm(curve, axis=1))


def test_normalised_scores():
    np.testing.assert_allclose(stats.normalised([20, 500, 260], 20, 500), [0, 1, 0.5])
