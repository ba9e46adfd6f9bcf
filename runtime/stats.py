"""95% intervals by bootstrap over questions: of an accuracy, of a share pooled over questions
(a ratio of sums), and of a paired difference of either.

A held-out accuracy is a mean over questions, and its noise is the question sample's: resampling
questions with replacement (percentile bootstrap, a fixed seed) gives the interval RL papers
report. Two policies scored on the same questions are compared question by question (a paired
bootstrap of the per-question difference), which is far tighter than two separate intervals.
A pooled share (of right answers, those reached through a wrong step) resamples questions with
their counts, since its denominator varies with the question.
"""

from __future__ import annotations

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95


def bootstrap_interval(values, *, seed: int = 0, resamples: int = RESAMPLES,
                       level: float = LEVEL) -> tuple[float, float]:
    """Percentile interval of the mean of per-question `values`."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_interval: no values")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(lo), float(hi)


def paired_difference(before, after, *, seed: int = 0, resamples: int = RESAMPLES,
                      level: float = LEVEL) -> dict[str, float]:
    """Mean of `after - before` over the same questions, with its paired bootstrap interval."""
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: {a.shape} vs {b.shape} questions")
    lo, hi = bootstrap_interval(b - a, seed=seed, resamples=resamples, level=level)
    return {"diff": float((b - a).mean()), "lo": lo, "hi": hi}


def _resampled_ratios(numerators, denominators, index) -> np.ndarray:
    """sum(numerators) / sum(denominators) over each row of question indices `index`
    [resamples, questions]; NaN where a resample's denominator is 0."""
    num = np.asarray(numerators, dtype=np.float64)[index].sum(axis=-1)
    den = np.asarray(denominators, dtype=np.float64)[index].sum(axis=-1)
    return np.divide(num, den, out=np.full_like(num, np.nan), where=den > 0)


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.nanpercentile(draws, [tail, 100 - tail])
    return float(lo), float(hi)


def ratio_interval(numerators, denominators, *, seed: int = 0, resamples: int = RESAMPLES,
                   level: float = LEVEL) -> tuple[float, float, float]:
    """(ratio, lo, hi): a share pooled over questions, sum(numerators) / sum(denominators) (of
    all right answers, those reached through a wrong step), with the percentile interval of
    resampling questions, each with its numerator and denominator. A resample whose
    denominator is 0 has no ratio and is left out."""
    den = np.asarray(denominators, dtype=np.float64)
    if den.size == 0 or den.sum() <= 0:
        raise ValueError("ratio_interval: the denominators sum to 0")
    ratio = float(np.sum(np.asarray(numerators, dtype=np.float64)) / den.sum())
    index = np.random.default_rng(seed).integers(0, den.size, size=(resamples, den.size))
    return (ratio, *_percentiles(_resampled_ratios(numerators, den, index), level))


def paired_ratio_difference(before: tuple, after: tuple, *, seed: int = 0,
                            resamples: int = RESAMPLES, level: float = LEVEL) -> dict[str, float]:
    """Change of a pooled ratio between two evaluations of the same questions: `before` and
    `after` are (numerators, denominators) per question; the interval resamples questions,
    the same ones for both."""
    (b_num, b_den), (a_num, a_den) = before, after
    n = len(b_den)
    if not n == len(b_num) == len(a_num) == len(a_den):
        raise ValueError(f"paired_ratio_difference: {n} vs {len(a_den)} questions")
    if sum(b_den) <= 0 or sum(a_den) <= 0:
        raise ValueError("paired_ratio_difference: the denominators sum to 0")
    everything = np.arange(n)
    diff = float(_resampled_ratios(a_num, a_den, everything)
                 - _resampled_ratios(b_num, b_den, everything))
    index = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    draws = _resampled_ratios(a_num, a_den, index) - _resampled_ratios(b_num, b_den, index)
    lo, hi = _percentiles(draws, level)
    return {"diff": diff, "lo": lo, "hi": hi}


# Two-sided 95% critical values of Student's t, by degrees of freedom (1-30).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_interval_over_seeds(values) -> dict[str, float]:
    """{"mean", "lo", "hi", "seeds"}: the mean of per-seed values (e.g. one arm minus another,
    paired by seed) with its 95% Student-t interval over seeds: the spread between training
    runs, which an interval over held-out questions leaves out. One seed has no interval
    (lo = hi = NaN)."""
    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if x.size < 2:
        return {"mean": mean, "lo": float("nan"), "hi": float("nan"), "seeds": int(x.size)}
    t = _T95[x.size - 2] if x.size - 1 <= len(_T95) else 1.96
    half = t * float(x.std(ddof=1)) / np.sqrt(x.size)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "seeds": int(x.size)}
