"""Checks of evaluation numbers that a wrong computation fails (not just 0 <= x <= 1)."""

import json
from pathlib import Path

import pytest

METRICS = ("greedy_accuracy", "mean_at_k", "maj_accuracy", "pass_at_k")


def check_intervals(ev: dict, prefix: str = "") -> None:
    """Each metric inside its 95% interval; mean@k at most pass@k."""
    for m in METRICS:
        assert ev[f"{prefix}{m}_lo"] <= ev[f"{prefix}{m}"] <= ev[f"{prefix}{m}_hi"], m
    assert ev[f"{prefix}mean_at_k"] <= ev[f"{prefix}pass_at_k"]


def check_against_outcomes(ev: dict, outcomes_path: Path) -> None:
    """A summary's eval entry agrees with the per-question outcomes it was computed from, and
    those with each sample's correctness."""
    out = json.loads(Path(outcomes_path).read_text())
    assert len(out["questions"]) == ev["questions"] and out["k"] == ev["k"]
    for m in METRICS:
        assert ev[m] == pytest.approx(sum(out[m]) / len(out[m])), m
    for right, mean, passed in zip(out["sample_right"], out["mean_at_k"], out["pass_at_k"]):
        assert len(right) == ev["k"]
        assert mean == pytest.approx(sum(right) / len(right)) and passed == float(any(right))
    check_intervals(ev)
