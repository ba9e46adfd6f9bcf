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
    if "sample_trace" in out:  # a step oracle: a right trace is a right answer with right steps
        check_trace_metrics(ev, out)


def check_trace_metrics(ev: dict, out: dict) -> None:
    """Trace accuracy and the lucky-answer rate agree with each sample's flags."""
    rights, traces = out["sample_right"], out["sample_trace"]
    assert all(r or not t for rs, ts in zip(rights, traces) for r, t in zip(rs, ts))
    assert out["trace_accuracy"] == [sum(ts) / len(ts) for ts in traces]
    assert ev["trace_accuracy"] == pytest.approx(sum(out["trace_accuracy"]) / len(traces))
    assert ev["trace_accuracy_lo"] <= ev["trace_accuracy"] <= ev["trace_accuracy_hi"]
    assert ev["trace_accuracy"] <= ev["mean_at_k"]
    right = sum(map(sum, rights))
    if right:
        lucky = sum(r and not t for rs, ts in zip(rights, traces) for r, t in zip(rs, ts))
        assert ev["lucky_answer_rate"] == pytest.approx(lucky / right)
        assert ev["lucky_answer_rate_lo"] <= ev["lucky_answer_rate"] <= ev["lucky_answer_rate_hi"]
    else:
        assert "lucky_answer_rate" not in ev
