"""95% intervals by bootstrap over questions, for one accuracy and for a paired difference.

A held-out accuracy is a mean over questions, and its noise is the question sample's: resampling
questions with replacement (percentile bootstrap, a fixed seed) gives the interval RL papers
report. Two policies scored on the same questions are compared question by question (a paired
bootstrap of the per-question difference), which is far tighter than two separate intervals.
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
