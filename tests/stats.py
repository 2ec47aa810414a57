"""The statistics of the results table (numpy only), after rliable (Agarwal
et al. 2021, "Deep RL at the Edge of the Statistical Precipice").

IQM: the interquartile mean, the mean of the middle 50% of the scores, as
scipy.stats.trim_mean(x, 0.25): int(0.25 * n) values are cut from each end
of the sorted scores (so 10 scores keep the middle 6).

Intervals: the percentile interval of a stratified bootstrap (rliable's
StratifiedBootstrap): each task's (env's) seeds are resampled with
replacement within that task, and the IQM is taken over all the resampled
scores together. Repetitions are an array axis, never a Python loop.
"""

import numpy as np

REPS = 2000  # bootstrap repetitions
LEVEL = 0.95


def iqm(scores, axis=-1):
    """Interquartile mean along `axis` (scipy.stats.trim_mean(scores, 0.25, axis))."""
    scores = np.sort(np.asarray(scores, float), axis=axis)
    n = scores.shape[axis]
    cut = int(0.25 * n)  # trim_mean's lowercut; the same count from the top
    return np.take(scores, np.arange(cut, n - cut), axis=axis).mean(axis=axis)


def stratified_resample(tasks, reps, rng):
    """[reps, sum of n_t]: block t of each row is n_t draws, with replacement,
    from task t's scores alone (a task keeps its own number of seeds)."""
    blocks = []
    for scores in tasks:
        scores = np.asarray(scores, float)
        blocks.append(scores[rng.integers(0, len(scores), size=(reps, len(scores)))])
    return np.concatenate(blocks, axis=1)


def iqm_interval(tasks, reps=REPS, seed=0, level=LEVEL):
    """(IQM of every task's scores together, low, high): the `level` percentile
    interval of the stratified bootstrap over `tasks` (a list of 1-D arrays of
    per-seed scores; one array for one row)."""
    point = iqm(np.concatenate([np.asarray(t, float) for t in tasks]))
    boot = iqm(stratified_resample(tasks, reps, np.random.default_rng(seed)))
    low, high = np.percentile(boot, [50 * (1 - level), 50 * (1 + level)])
    return float(point), float(low), float(high)


def curve_band(curve, reps=REPS, seed=0, level=LEVEL):
    """Per evaluation point of `curve` [points, seeds]: (IQM, low, high) over
    seeds, each [points]. One resample of the seeds serves every point, so the
    band is the bootstrap of whole learning curves (as rliable's)."""
    curve = np.asarray(curve, float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, curve.shape[1], size=(reps, curve.shape[1]))
    boot = iqm(curve[:, picks], axis=-1)  # [points, reps]
    low, high = np.percentile(boot, [50 * (1 - level), 50 * (1 + level)], axis=1)
    return iqm(curve, axis=1), low, high


def normalised(scores, random, baseline):
    """(score - random) / (baseline - random): 0 is the uniformly random
    policy, 1 the published baseline."""
    return (np.asarray(scores, float) - random) / (baseline - random)
