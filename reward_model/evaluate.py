"""Reward-model evaluation: step accuracy/F1/AUROC, first-error F1, and best-of-N selection.

Pure functions over plain lists: predictions are P(+) per step (or per solution for an ORM),
labels are 0/1 (soft labels are thresholded at 0.5).
"""

from __future__ import annotations

import random


def auroc(scores: list[float], labels: list[bool]) -> float:
    """Area under the ROC curve: P(score of a random positive > score of a random negative)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    ranked = sorted((s, y) for s, y in zip(scores, labels))
    rank_sum, i = 0.0, 0
    while i < len(ranked):  # average ranks over ties
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        avg_rank = (i + 1 + j) / 2
        rank_sum += avg_rank * sum(1 for k in range(i, j) if ranked[k][1])
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def step_metrics(predicted: list[list[float]], labels: list[list[float]]) -> dict[str, float]:
    """Step-level accuracy, F1 of finding wrong steps, F1 of right steps, and AUROC.

    Steps without a prediction (cut off by max_length) are left out.
    """
    scores, truth = [], []
    for pred, lab in zip(predicted, labels):
        scores += pred
        truth += [y >= 0.5 for y in lab[:len(pred)]]
    guess = [s >= 0.5 for s in scores]
    tp_bad = sum(1 for g, t in zip(guess, truth) if not g and not t)
    fp_bad = sum(1 for g, t in zip(guess, truth) if not g and t)
    fn_bad = sum(1 for g, t in zip(guess, truth) if g and not t)
    tp_good = sum(1 for g, t in zip(guess, truth) if g and t)
    return {
        "step_accuracy": sum(g == t for g, t in zip(guess, truth)) / max(len(truth), 1),
        "error_f1": _f1(tp_bad, fp_bad, fn_bad),
        "correct_f1": _f1(tp_good, fn_bad, fp_bad),
        "auroc": auroc(scores, truth),
        "steps": float(len(truth)),
    }


def first_error(scores_or_labels: list[float], threshold: float = 0.5) -> int | None:
    """Index of the first step judged wrong (< `threshold`), None when all are right."""
    return next((k for k, v in enumerate(scores_or_labels) if v < threshold), None)


def first_error_metrics(predicted: list[list[float]], labels: list[list[float]],
                        threshold: float = 0.5) -> dict[str, float]:
    """ProcessBench-style: accuracy of the first-error index on erroneous solutions, accuracy of
    'no error' on correct ones, and their harmonic mean (F1); a step predicted wrong when its
    score is below `threshold` (the labels' own: 0.5)."""
    err_hit = err_n = ok_hit = ok_n = 0
    for pred, lab in zip(predicted, labels):
        truth, guess = first_error(lab), first_error(pred, threshold)
        if truth is None:
            ok_n += 1
            ok_hit += guess is None
        else:
            err_n += 1
            err_hit += guess == truth
    err_acc, ok_acc = err_hit / max(err_n, 1), ok_hit / max(ok_n, 1)
    f1 = 2 * err_acc * ok_acc / (err_acc + ok_acc) if err_acc + ok_acc else 0.0
    return {"first_error_accuracy": err_acc, "no_error_accuracy": ok_acc, "first_error_f1": f1}


def best_of_n(correct: list[list[bool]], scores: list[list[float]], answers: list[list[str | None]],
              seed: int = 0) -> dict[str, float]:
    """Accuracy of the sample picked by the reward model, beside majority vote and random.

    Per question: `correct[q][i]` (is sample i right), `scores[q][i]` (reward-model score),
    `answers[q][i]` (its extracted final answer, for the vote). Random is the expected accuracy
    of a uniform pick (the mean correctness) and one seeded draw. `group_auroc` is the mean, over
    questions with both right and wrong samples, of the AUROC of the scores within the question:
    what best-of-N and GRPO's group-normalised advantages use. A reward model that only knows
    which questions are hard ranks well pooled over questions and scores 0.5 here.
    `per_question`: (the pick's correctness, the AUROC within the question or NaN) of each.
    """
    from collections import Counter

    rng = random.Random(seed)
    picked = voted = drawn = expected = 0.0
    within, per_question = [], []
    for right, score, answer in zip(correct, scores, answers):
        pick = float(right[max(range(len(score)), key=score.__getitem__)])
        picked += pick
        group = auroc(score, list(right)) if 0 < sum(right) < len(right) else float("nan")
        per_question.append((pick, group))
        if 0 < sum(right) < len(right):
            within.append(group)
        counts = Counter(a for a in answer if a is not None)
        if counts:
            top = counts.most_common(1)[0][0]
            voted += right[answer.index(top)]
        drawn += right[rng.randrange(len(right))]
        expected += sum(right) / len(right)
    n = max(len(correct), 1)
    return {"rm_pick": picked / n, "majority": voted / n, "random": expected / n,
            "random_draw": drawn / n,
            "group_auroc": sum(within) / len(within) if within else float("nan"),
            "per_question": per_question}


def f1_threshold(predicted: list[list[float]], labels: list[list[float]],
                 candidates: int = 201) -> float:
    """The score threshold that maximises `first_error_metrics`' F1 on these rows (ProcessBench's
    recipe for a scalar PRM: chosen on its GSM8K split, then applied to the others), among 0.5
    and up to `candidates` quantiles of the predicted step scores (each taken as "wrong below
    it", and one just above the largest score); ties go to the one nearest 0.5."""
    values = sorted({v for row in predicted for v in row})
    if not values:
        return 0.5
    count = min(candidates, len(values))
    picks = {values[round(k * (len(values) - 1) / max(count - 1, 1))] for k in range(count)}
    options = sorted(picks | {0.5, values[-1] + 1e-6})
    return max(options, key=lambda t: (first_error_metrics(predicted, labels, t)
                                       ["first_error_f1"], -abs(t - 0.5)))


BON_METHODS = ("rm", "weighted_vote", "majority")
"""rm@N (the top-scored of N samples), the reward-weighted vote (the answer whose samples' scores
sum highest) and maj@N (the most frequent answer)."""


def _picks(right, scores, answers) -> tuple[float, float, float]:
    """Whether rm@N, the weighted vote and maj@N pick a right sample among these N (ties: the
    first of them; samples without an answer take no part in a vote)."""
    rm = float(right[max(range(len(scores)), key=scores.__getitem__)])
    weight: dict = {}
    count: dict = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            weight[answer] = weight.get(answer, 0.0) + scores[i]
            count[answer] = count.get(answer, 0) + 1

    def verdict(tally) -> float:
        if not tally:
            return 0.0
        top = max(tally, key=tally.__getitem__)  # (dicts keep the first of equals first)
        return float(right[answers.index(top)])
    return rm, verdict(weight), verdict(count)


def best_of_n_curve(groups: list[list[tuple[bool, float, str | None]]], ns: list[int], *,
                    draws: int = 256, seed: int = 0) -> dict[int, dict[str, list[float]]]:
    """Best-of-N as the field measures it, per N of `ns`: for each method of `BON_METHODS`, the
    accuracy over the questions (each question's (right, score, answer) samples) of its pick
    among N of the question's samples, as [mean, 95% bootstrap interval over questions]. A
    question's value is its expectation over the subsets of N of its samples: every subset
    where there are at most `draws` of them, else `draws` seeded draws. Questions with fewer
    than N samples sit out that N."""
    from itertools import combinations
    from math import comb

    from runtime.stats import bootstrap_interval

    rng, out = random.Random(seed), {}
    for n in ns:
        values = []
        for group in groups:
            if len(group) < n:
                continue
            subsets = combinations(range(len(group)), n) if comb(len(group), n) <= draws \
                else (rng.sample(range(len(group)), n) for _ in range(draws))
            picks = [_picks(*zip(*(group[i] for i in subset))) for subset in subsets]
            values.append([sum(col) / len(picks) for col in zip(*picks)])
        if values:
            out[n] = {method: [sum(v[k] for v in values) / len(values),
                               *bootstrap_interval([v[k] for v in values], seed=seed)]
                      for k, method in enumerate(BON_METHODS)}
    return out


def prm_score(predicted: list[list[float]], labels: list[list[float]]) -> dict[str, float]:
    """PRMBench's PRMScore: 0.5 x F1 of the right steps + 0.5 x F1 of the wrong steps (a step
    predicted right when its score is >= 0.5), with both F1s."""
    steps = step_metrics(predicted, labels)
    return {"prm_score": 0.5 * (steps["correct_f1"] + steps["error_f1"]),
            "correct_f1": steps["correct_f1"], "error_f1": steps["error_f1"],
            "steps": steps["steps"]}
