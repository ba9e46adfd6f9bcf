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
    iterations[1]["grpo"] = {"reward/mean": 0.617, "train/kl": 0.0016}
    text = table(iterations)
    assert "0.600 [0.55,0.65]" in text and "+0.100 [+0.07,+0.13]" in text
    assert "RL closed 40%" in text
    # the reward models' table: GRPO's mean reward and KL of the iteration
    assert " 0.617 " in text and " 0.0016" in text
    path = plot_accuracy(tmp_path / "accuracy.png", iterations)
    assert path.stat().st_size > 10_000


def test_majority_vote():
    from by_hand import majority_answer

    texts = ["The answer is 4", "The answer is 4.0", "The answer is 5", "no answer", "#### 5",
             "The answer is 4"]
    assert majority_answer(texts) == "4"
    assert majority_answer(["nothing here"]) is None


def test_ratio_interval_pools_counts_and_resamples_questions_with_them():
    from runtime.stats import paired_ratio_difference, ratio_interval

    # Two questions, (numerator, denominator) (1, 1) and (0, 3): pooled 1/4, not the mean of
    # the per-question shares (1/2). Resampling 2 questions: both the first 2/2, one of each
    # 1/4 (half the time), both the second 0/6: the 2.5% and 97.5% percentiles are 0 and 1.
    assert ratio_interval([1, 0], [1, 3]) == (0.25, 0.0, 1.0)
    # A question with denominator 0 (no right sample) adds nothing; a resample of it alone has
    # no ratio and is left out, so every other resample gives 1/2.
    assert ratio_interval([1, 0], [2, 0]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="sum to 0"):
        ratio_interval([0, 0], [0, 0])
    # Paired, the same resampled questions for both: after - before is 0 - 1, 0 - 1/4, 0 - 0.
    d = paired_ratio_difference(([1, 0], [1, 3]), ([0, 0], [1, 3]))
    assert d == {"diff": -0.25, "lo": -1.0, "hi": 0.0}
    assert paired_ratio_difference(([1, 0], [1, 3]), ([1, 0], [1, 3])) == \
        {"diff": 0.0, "lo": 0.0, "hi": 0.0}
    with pytest.raises(ValueError, match="questions"):
        paired_ratio_difference(([1], [1]), ([1, 0], [1, 1]))


# Hand-written samples of three synthetic questions (k = 4), each step checked by the task's
# step oracle. Q1: 27 + 5 = 32, 32 - 8 = 24, 24 * 2 = 48.
Q1 = "Start with 27. Add 5. Subtract 8. Multiply by 2."
Q1_RIGHT = "Add 5: 27+5=32\nSubtract 8: 32-8=24\nMultiply by 2: 24*2=48\nThe answer is 48"
# Forgets to carry (32 -> 22), then to borrow (22 - 8 -> 24): two slips that cancel.
Q1_CANCELLING = "Add 5: 27+5=22\nSubtract 8: 22-8=24\nMultiply by 2: 24*2=48\nThe answer is 48"
Q1_WRONG = "Add 5: 27+5=22\nSubtract 8: 22-8=14\nMultiply by 2: 14*2=28\nThe answer is 28"
# Q2: 7 + 3 = 10, 10 * 2 = 20.
Q2 = "Start with 7. Add 3. Multiply by 2."
Q2_RIGHT = "Add 3: 7+3=10\nMultiply by 2: 10*2=20\nThe answer is 20"
Q2_SLIP_THEN_GOLD = "Add 3: 7+3=10\nMultiply by 2: 10*2=21\nThe answer is 20"  # right, lucky
Q2_WRONG = "Add 3: 7+3=11\nMultiply by 2: 11*2=22\nThe answer is 22"
Q2_UNFINISHED = "Add 3: 7+3=10"  # every step right, but no answer: not a right trace
# Q3: 12 - 4 = 8; every sample wrong.
Q3 = "Start with 12. Subtract 4."
Q3_WRONG = "Subtract 4: 12-4=9\nThe answer is 9"
HAND_BUILT = [(Q1, "48", [Q1_RIGHT, Q1_CANCELLING, Q1_WRONG, Q1_RIGHT]),
              (Q2, "20", [Q2_RIGHT, Q2_WRONG, Q2_UNFINISHED, Q2_SLIP_THEN_GOLD]),
              (Q3, "8", [Q3_WRONG] * 4)]


def _hand_built_outcomes(step_oracle):
    from policy.evaluate import trace_flags
    from tasks.grading import answers_match, extract_final_answer

    rights, traces = [], []
    for question, gold, texts in HAND_BUILT:
        answers = [extract_final_answer(t) for t in texts]
        right = [a is not None and answers_match(a, gold, 2) for a in answers]
        rights.append(right)
        traces.append(trace_flags(step_oracle, question, texts, right))
    return rights, traces


def test_trace_accuracy_and_lucky_answer_rate_by_hand():
    from policy.evaluate import lucky_answer_rate
    from tasks.synthetic import step_correctness

    rights, traces = _hand_built_outcomes(step_correctness)
    assert rights == [[True, True, False, True], [True, False, False, True], [False] * 4]
    # Right and every step right: Q1's two clean samples, Q2's first.
    assert traces == [[True, False, False, True], [True, False, False, False], [False] * 4]
    values = per_question([False] * 3, rights, [True, True, False], traces)
    # Trace accuracy per question 2/4, 1/4, 0/4; mean over questions 0.25 (mean@k 5/12).
    assert values["trace_accuracy"] == [0.5, 0.25, 0.0]
    metrics = summarise(values)
    assert metrics["eval/trace_accuracy"] == 0.25
    assert metrics["eval/trace_accuracy"] <= metrics["eval/mean_at_k"] == pytest.approx(5 / 12)
    # Lucky answers: right samples with a wrong step over right samples, pooled over questions:
    # Q1 1 of 3 (the cancelling slips), Q2 1 of 2 (a slip, then the gold answer line), Q3 0 of
    # 0: 2 / 5 = 0.4 (not the mean of 1/3 and 1/2).
    lucky = lucky_answer_rate(rights, traces)
    assert lucky["eval/lucky_answer_rate"] == 0.4
    assert lucky["eval/lucky_answer_rate_lo"] < 0.4 < lucky["eval/lucky_answer_rate_hi"]
    # No right sample, no share: the metric is absent rather than 0.
    assert lucky_answer_rate([[False, False]], [[False, False]]) == {}


def test_evaluation_without_a_step_oracle_has_no_trace_keys(monkeypatch):
    import policy.evaluate as evaluate_module
    from configs.loader import load_config
    from iteration import stages
    from iteration.resolve import resolve
    from tasks.synthetic import step_correctness

    rights, traces = _hand_built_outcomes(None)
    assert traces == [None, None, None]
    values = per_question([False] * 3, rights, [True, True, False], None)
    assert not any(key.startswith(("trace", "lucky")) for key in summarise(values))
    # The stage passes the data's oracle: the synthetic task's, none for GSM8K, and then says so.
    seen = {}

    def fake_evaluate_policy(*args, step_oracle, **kwargs):
        seen["oracle"] = step_oracle
        return {"eval/mean_at_k": 0.5}

    monkeypatch.setattr(evaluate_module, "evaluate_policy", fake_evaluate_policy)
    synthetic = stages.evaluate(resolve(load_config("configs/tiny.yaml", [])), None, None, [])
    assert seen["oracle"] is step_correctness and "eval/trace_metrics" not in synthetic
    gsm8k = stages.evaluate(resolve(load_config("configs/tiny.yaml", ["data.source=gsm8k"])), None,
                            None, [])
    assert seen["oracle"] is None and gsm8k["eval/trace_metrics"] == "no step oracle"


def test_change_from_pairs_trace_accuracy_and_the_lucky_answer_rate(tmp_path):
    # Two questions, k = 2. Before: traces [T, F], [F, F] of rights [T, T], [T, F]: trace
    # accuracy 0.5, 0; lucky 2 of 3. After: traces [T, T], [T, F]: 1, 0.5; lucky 0 of 3.
    rights = [[True, True], [True, False]]
    before = _outcomes(tmp_path / "0.json", ["a", "b"], trace_accuracy=[0.5, 0.0],
                       sample_right=rights, sample_trace=[[True, False], [False, False]])
    after = _outcomes(tmp_path / "1.json", ["a", "b"], trace_accuracy=[1.0, 0.5],
                      sample_right=rights, sample_trace=[[True, True], [True, False]])
    change = change_from(before, after)
    assert change["trace_accuracy"]["diff"] == 0.5
    assert change["lucky_answer_rate"]["diff"] == pytest.approx(-2 / 3)
    assert change["lucky_answer_rate"]["lo"] <= -2 / 3 <= change["lucky_answer_rate"]["hi"]
    plain = _outcomes(tmp_path / "2.json", ["a", "b"], greedy_accuracy=[1, 0])
    assert "lucky_answer_rate" not in change_from(plain, plain)


def _trace_entry(k, trace, lucky):
    ev = {}
    for name, value in (("greedy_accuracy", 0.6), ("mean_at_k", 0.6), ("maj_accuracy", 0.6),
                        ("pass_at_k", 0.8), ("trace_accuracy", trace),
                        ("lucky_answer_rate", lucky)):
        ev.update({name: value, f"{name}_lo": value - 0.05, f"{name}_hi": value + 0.05})
    return {"iteration": k, "eval": {**ev, "questions": 500}}


def test_table_shows_trace_columns_or_says_there_is_no_step_oracle():
    iterations = [_trace_entry(0, 0.58, 0.08), _trace_entry(1, 0.73, 0.03)]
    iterations[1]["change"] = {"trace_accuracy": {"diff": 0.15, "lo": 0.12, "hi": 0.18},
                               "lucky_answer_rate": {"diff": -0.05, "lo": -0.07, "hi": -0.03}}
    text = table(iterations)
    header = text.splitlines()[0]
    assert header.split()[-3:] == ["trace", "lucky", "questions"]
    assert "0.580 [0.53,0.63]     0.080 [0.03,0.13]" in text
    assert "+0.150 [+0.12,+0.18]  -0.050 [-0.07,-0.03]" in text
    no_oracle = [{"iteration": 0, "eval": {"mean_at_k": 0.6, "trace_metrics": "no step oracle"}}]
    text = table(no_oracle)
    assert "lucky" not in text.splitlines()[0] and "no step oracle" in text


def test_t_interval_over_seeds_by_hand():
    """Three seeds' differences 1, 2, 3: mean 2, sd 1, t(2 df) = 4.303, half-width 4.303/sqrt(3)
    = 2.484; one seed has no interval."""
    import math

    from runtime.stats import t_interval_over_seeds

    found = t_interval_over_seeds([1.0, 2.0, 3.0])
    assert found["mean"] == 2.0 and found["seeds"] == 3
    assert found["lo"] == pytest.approx(2 - 4.303 / math.sqrt(3), abs=1e-9)
    assert found["hi"] == pytest.approx(2 + 4.303 / math.sqrt(3), abs=1e-9)
    assert math.isnan(t_interval_over_seeds([0.5])["lo"])
