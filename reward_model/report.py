"""`igrpo eval-rm`: a reward model's report on held-out data.

Step-level accuracy/F1/AUROC against labels, first-error accuracy where the first wrong step is
known, and best-of-N: on held-out questions with N policy samples each, the accuracy of the sample
each reward model picks, beside majority vote and a random pick.
"""

from __future__ import annotations

from typing import Callable

import torch

from policy.generation.rollout import generate_groups, rest
from process_supervision.formats import StepExample
from runtime.steps import split_steps
from reward_model.encoding import orm_example
from process_supervision.benchmarks import BenchmarkRows
from reward_model.evaluate import (best_of_n, f1_threshold, first_error_metrics, prm_score,
                                   step_metrics)
from reward_model.losses import STEP_AGGREGATORS
from reward_model.score import TagScorer, spread_score
from runtime.data import MathRecord
from runtime.memory import memory_phase
from tasks.grading import answers_match, extract_final_answer
from tasks.prompts import PromptFormat
from runtime.shards import map_chunks


def benchmark_report(scorer, bench: BenchmarkRows) -> dict[str, float]:
    """A PRM of any family on ProcessBench (per split: the F1 of first-error accuracy on the
    erroneous rows and no-error accuracy on the all-right ones, with both accuracies; and the
    average F1 over splits) or PRMBench (PRMScore overall and per classification). Steps past
    the reward model's `max_length` get no score: their errors cannot be found. The scoring is
    spread over the ranks (every rank calls it)."""
    report: dict[str, float] = {}
    scored = {}
    for split, examples in bench.splits.items():
        predicted = spread_score(scorer, examples)
        labels = [list(ex.labels) for ex in examples]
        if bench.name == "processbench":
            scored[split] = (predicted, labels)
            found = first_error_metrics(predicted, labels)
            report.update({f"processbench/{split}/f1": found["first_error_f1"],
                           f"processbench/{split}/error_accuracy": found["first_error_accuracy"],
                           f"processbench/{split}/correct_accuracy": found["no_error_accuracy"]})
            continue
        report.update({f"prmbench/{k}": v for k, v in prm_score(predicted, labels).items()})
        for category in sorted(set(bench.categories[split])):
            rows = [i for i, c in enumerate(bench.categories[split]) if c == category]
            report[f"prmbench/{category}/prm_score"] = prm_score(
                [predicted[i] for i in rows], [labels[i] for i in rows])["prm_score"]
    if bench.name == "processbench":
        f1s = [v for k, v in report.items() if k.endswith("/f1")]
        report["processbench/average_f1"] = sum(f1s) / len(f1s)
        report.update(tuned_threshold_report(scored))
    return report


def tuned_threshold_report(scored: dict[str, tuple[list, list]]) -> dict[str, float]:
    """ProcessBench's threshold for a scalar PRM, beside the fixed 0.5: the one with the best F1
    on its GSM8K split (`f1_threshold`), and each split's F1 under it
    (`processbench/<split>/f1_tuned`, their average). Nothing without a gsm8k split."""
    if "gsm8k" not in scored:
        return {}
    threshold = f1_threshold(*scored["gsm8k"])
    out = {"processbench/threshold": threshold}
    for split, (predicted, labels) in scored.items():
        out[f"processbench/{split}/f1_tuned"] = first_error_metrics(
            predicted, labels, threshold)["first_error_f1"]
    tuned = [v for k, v in out.items() if k.endswith("/f1_tuned")]
    out["processbench/average_f1_tuned"] = sum(tuned) / len(tuned)
    return out


def labelled_report(scorer: TagScorer, examples: list[StepExample]) -> dict[str, float]:
    """Step metrics and first-error metrics of `scorer` on labelled examples (the scoring spread
    over the ranks: every rank calls it)."""
    with memory_phase("evaluation: scoring"):
        predicted = spread_score(scorer, examples)
    labels = [list(ex.labels) for ex in examples]
    return {**step_metrics(predicted, labels), **first_error_metrics(predicted, labels)}


def solution_scores(scorer: TagScorer, kind: str, aggregate: str, question: str,
                    texts: list[str], separator: str = "\n", per_step: bool = False):
    """One score per solution text: the ORM's P(+), or the PRM's aggregated step scores (with
    `per_step`, also each solution's step scores: (scores, step scores))."""
    if kind == "orm":
        scores = [s[0] if s else 0.0
                  for s in scorer.score([orm_example(question, t) for t in texts])]
        return (scores, [[s] for s in scores]) if per_step else scores
    steps = [split_steps(t, separator) for t in texts]
    scored = iter(scorer.score([StepExample(question, tuple(s), (0.0,) * len(s))
                                for s in steps if s]))
    step_scores = [next(scored) if s else [] for s in steps]
    width = max([len(p) for p in step_scores] + [1])
    values = torch.tensor([p + [0.0] * (width - len(p)) for p in step_scores])
    mask = torch.tensor([[True] * len(p) + [False] * (width - len(p)) for p in step_scores])
    scores = STEP_AGGREGATORS[aggregate](values, mask).tolist()
    return (scores, step_scores) if per_step else scores


@torch.no_grad()
def best_of_n_report(policy, policy_tokenizer, records: list[MathRecord], fmt: PromptFormat,
                     scorers: dict[str, tuple[TagScorer, str]], aggregate: str, n: int,
                     temperature: float, max_new_tokens: int, timeout_s: int = 2,
                     questions_per_batch: int = 16, seed: int = 0,
                     oracle: Callable[[str, list[str]], list[bool]] | None = None
                     ) -> dict[str, float]:
    """Best-of-N accuracy for each scorer (`name -> (scorer, kind)`), majority vote and random.
    The questions are spread over the ranks in chunks, each chunk's samples seeded from
    (`seed`, chunk) (`runtime.shards`): every rank calls it and gets the report. With `oracle`
    (question, steps -> each step's true correctness: the synthetic task's), also each
    scorer's `<name>_step_accuracy` on the samples: a PRM's step scores against the oracle's
    steps, an ORM's score against the final answer's correctness (>= 0.5 is right), and its
    `<name>_per_question` (pick, in-group AUROC) pairs."""
    chunks = range(0, len(records), questions_per_batch)
    costs = [len(records[s:s + questions_per_batch]) for s in chunks]

    def chunk_samples(c: int) -> list[tuple]:
        chunk = records[c * questions_per_batch:(c + 1) * questions_per_batch]
        rollout = generate_groups(policy, policy_tokenizer, fmt.prompts(policy_tokenizer, chunk),
                                  n, max_new_tokens=max_new_tokens, temperature=temperature)
        out = []
        for q, rec in enumerate(chunk):
            texts = rollout.texts[q * n:(q + 1) * n]
            extracted = [extract_final_answer(t) for t in texts]
            right = [a is not None and answers_match(a, rec.answer, timeout_s) for a in extracted]
            truth = None
            if oracle is not None:
                truth = [[float(t) for t in oracle(rec.question, split_steps(text, fmt.step_separator))]
                         for text in texts]
            out.append((rec, texts, right, extracted, truth))
        return out

    def chunk_scores(c: int) -> list[tuple]:
        out = []
        for rec, texts, right, extracted, truth in sampled[c]:
            scored = {name: solution_scores(scorer, kind, aggregate, rec.question, texts,
                                            fmt.step_separator, per_step=True)
                      for name, (scorer, kind) in scorers.items()}
            out.append((right, extracted, {k: v[0] for k, v in scored.items()},
                        {k: v[1] for k, v in scored.items()}, truth))
        return out

    # Every sample first, then the scoring, with the sampler's memory freed in between (a vLLM
    # engine's KV pool is never held beside a reward model's forward).
    with memory_phase("evaluation: sampling"):
        sampled = map_chunks(len(chunks), chunk_samples, seed_key=("best-of-n", seed),
                             costs=costs)
    rest(policy)
    with memory_phase("evaluation: scoring"):
        rows = [row for part in map_chunks(len(chunks), chunk_scores, costs=costs)
                for row in part]
    return _best_of_n_metrics(rows, scorers, seed, oracle is not None)


def _best_of_n_metrics(rows: list[tuple], scorers: dict, seed: int, with_oracle: bool) -> dict:
    """`best_of_n_report`'s metrics from its rows (right, extracted answers, solution scores,
    step scores, the oracle's step truth), a question each."""
    correct, answers = [r[0] for r in rows], [r[1] for r in rows]
    report: dict[str, float] = {}
    for name, (_, kind) in scorers.items():
        result = best_of_n(correct, [r[2][name] for r in rows], answers, seed)
        report[f"{name}_pick"] = result["rm_pick"]
        report[f"{name}_group_auroc"] = result["group_auroc"]
        report.update({k: v for k, v in result.items()
                       if k not in ("rm_pick", "group_auroc", "per_question")})
        if with_oracle:
            report[f"{name}_per_question"] = result["per_question"]
            predicted = [p for r in rows for p in r[3][name]]
            labels = [t for r in rows for t in r[4]] if kind == "prm" else \
                [[float(ok)] for r in rows for ok in r[0]]
            report[f"{name}_step_accuracy"] = step_metrics(predicted, labels)["step_accuracy"]
    return report
