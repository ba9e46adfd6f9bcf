"""Evaluation as RL papers report it: intervals over questions, paired changes, mean@k / maj@K /
pass@K, and the tables and plot that show them. Values are hand-computed."""

import json
import random

import pytest

from iteration.summary import change_from, plot_accuracy, table
from policy.evaluate import at_k_curves, per_question, summarise
from runtime.stats import bootstrap_interval, paired_difference


def test_bootstrap_interval_of_two_values_spans_the_resampled_means():
    # Resampling [0, 1]: the mean is 0 (1/4), 1/2 (1/2) or 1 (1/4); the 2.5% and 97.5%
    # percentiles of that distribution are 0 and 1.
    assert bootstrap_interval([0, 1]) == (0.0, 1.0)
    assert bootstrap_interval([1, 1, 1]) == (1.0, 1.0)


def test_bootstrap_interval_matches_the_normal_approximation_on_500_questions():
    values = [1.0] * 400 + [0.0] * 100  # accuracy 0.8: half-width 1.96 * sqrt(.8 * .2 / 500)
    lo, hi = bootstrap_interval(values)
    assert lo == pytest.approx(0.8 - 0.0351, abs=0.006) and hi == pytest.approx(0.8 + 0.0351, abs=0.006)
    assert bootstrap_interval(values) == (lo, hi)  # a fixed seed: the same interval every time


def test_paired_difference_is_tighter_than_two_separate_intervals():
    rng = random.Random(0)
    before = [float(rng.random() < 0.6) for _ in range(500)]
    after = [1.0 if b else float(rng.random() < 0.25) for b in before]  # fixes ~10 points
    d = paired_difference(before, after)
    assert d["diff"] == pytest.approx(sum(after) / 500 - sum(before) / 500)
    assert 0 < d["lo"] < d["diff"] < d["hi"]
    separate = bootstrap_interval(before)[1] - bootstrap_interval(before)[0]
    assert d["hi"] - d["lo"] < separate
    assert paired_difference(before, before) == {"diff": 0.0, "lo": 0.0, "hi": 0.0}
    with pytest.raises(ValueError, match="questions"):
        paired_difference([1.0], [1.0, 0.0])


def test_per_question_mean_maj_and_pass_at_k():
    values = per_question([True, False], [[True, False, False, False], [False, False, False, False]],
                          [False, False])
    assert values == {"greedy_accuracy": [1.0, 0.0], "mean_at_k": [0.25, 0.0],
                      "maj_accuracy": [0.0, 0.0], "pass_at_k": [1.0, 0.0]}
    metrics = summarise(values)
    assert metrics["eval/mean_at_k"] == 0.125 and metrics["eval/pass_at_k"] == 0.5
    assert metrics["eval/mean_at_k_lo"] == 0.0 and metrics["eval/mean_at_k_hi"] == 0.25


def test_pass_and_maj_at_every_k_by_hand():
    # One question, 4 samples: right, wrong "7", wrong "7", right (votes "5", "7", "7", "5").
    outcomes = {"sample_right": [[True, False, False, True]],
                "sample_votes": [["5", "7", "7", "5"]]}
    curves = at_k_curves(outcomes, [1, 2, 4])
    # pass@K = 1 - C(2, K) / C(4, K): 1 - 2/4, 1 - 1/6, 1.
    assert curves["pass"] == pytest.approx([0.5, 5 / 6, 1.0])
    # maj of the first K: "5" (right); "5" vs "7" tie -> first seen "5"; 2-2 tie -> "5".
    assert curves["maj"] == [1.0, 1.0, 1.0]
    outcomes["sample_votes"] = [["7", "7", None, "5"]]
    outcomes["sample_right"] = [[False, False, False, True]]
    assert at_k_curves(outcomes, [1, 4])["maj"] == [0.0, 0.0]


def _outcomes(path, questions, **values):
    path.write_text(json.dumps({"questions": questions, "k": 4, **values}))
    return path


def test_change_from_pairs_the_same_questions_and_reports_the_gap_closed(tmp_path):
    qs = [f"q{i}" for i in range(4)]
    before = _outcomes(tmp_path / "0.json", qs, greedy_accuracy=[1, 1, 0, 0],
                       mean_at_k=[0.5, 0.5, 0.25, 0.25], pass_at_k=[1, 1, 1, 0])
    after = _outcomes(tmp_path / "1.json", qs, greedy_accuracy=[1, 1, 1, 0],
                      mean_at_k=[0.75, 0.75, 0.5, 0.25], pass_at_k=[1, 1, 1, 0])
    change = change_from(before, after)
    assert change["greedy_accuracy"]["diff"] == 0.25 and change["pass_at_k"]["diff"] == 0.0
    # mean@k 0.375 -> 0.5625 against pass@k 0.75: 0.1875 of a 0.375 gap.
    assert change["gap_closed"] == pytest.approx(0.5)
    other = _outcomes(tmp_path / "2.json", qs[::-1], greedy_accuracy=[0, 0, 0, 0])
    with pytest.raises(ValueError, match="different questions"):
        change_from(before, other)


def test_table_and_plot_show_the_intervals(tmp_path):
    def entry(k, mean):
        ev = {}
        for name in ("greedy_accuracy", "mean_at_k", "maj_accuracy", "pass_at_k"):
            ev.update({name: mean, f"{name}_lo": mean - 0.05, f"{name}_hi": mean + 0.05})
        ev["questions"] = 500
        return {"iteration": k, "eval": ev}

    iterations = [entry(0, 0.6), entry(1, 0.7)]
    iterations[1]["change"] = {"mean_at_k": {"diff": 0.1, "lo": 0.07, "hi": 0.13},
                               "gap_closed": 0.4}
    text = table(iterations)
    assert "0.600 [0.55,0.65]" in text and "+0.100 [+0.07,+0.13]" in text
    assert "RL closed 40%" in text
    path = plot_accuracy(tmp_path / "accuracy.png", iterations)
    assert path.stat().st_size > 10_000


def test_majority_vote():
    from policy.evaluate import majority_answer

    texts = ["The answer is 4", "The answer is 4.0", "The answer is 5", "no answer", "#### 5",
             "The answer is 4"]
    assert majority_answer(texts) == "4"
    assert majority_answer(["nothing here"]) is None
