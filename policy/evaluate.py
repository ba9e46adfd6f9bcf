"""Policy evaluation on held-out questions: greedy, mean@k, maj@k and pass@k with 95% intervals,
and where the data has a step oracle (the synthetic task) trace accuracy and the lucky-answer rate.

Launch alone: `igrpo eval --config configs/tiny.yaml eval.checkpoint=runs/tiny/grpo/final`.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from tqdm import tqdm

from policy.generation.rollout import generate_groups
from runtime.data import MathRecord
from runtime.dist import is_main
from tasks.grading import answers_match, extract_final_answer
from tasks.prompts import PromptFormat
from runtime.rundir import atomic_write_json
from runtime.shards import map_chunks, my_chunks
from runtime.stats import bootstrap_interval, ratio_interval
from runtime.steps import split_steps

if TYPE_CHECKING:  # (annotations only: the evaluator's schedule, at the end of this file)
    from configs.schema import PolicyConfig
    from policy.engines import Sampler
    from policy.stage import Evaluation
    from runtime.training import StageLoop

StepOracle = Callable[[str, list[str]], list[bool]]
"""(question, steps of a solution) -> is each step still on the true path (tasks.synthetic's
`step_correctness`)."""


def _vote_key(answer: str | None) -> str | None:
    """Answers that are the same number vote together; others by their normalised text."""
    if answer is None:
        return None
    text = answer.replace(",", "").strip().rstrip(".")
    try:
        return str(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return " ".join(text.split())


def majority_key(keys: list[str | None]) -> str | None:
    """The most common vote key (ties: the first seen); None if no key is set."""
    counts = Counter(k for k in keys if k is not None)
    return counts.most_common(1)[0][0] if counts else None


def majority_of(answers: list[str | None]) -> str | None:
    """The most common of extracted final answers, as first written."""
    keys = [_vote_key(a) for a in answers]
    best = majority_key(keys)
    return None if best is None else next(a for k, a in zip(keys, answers) if k == best)


def _is_right(answer: str | None, gold: str, timeout_s: int) -> bool:
    return answer is not None and answers_match(answer, gold, timeout_s)


METRICS = ("greedy_accuracy", "mean_at_k", "maj_accuracy", "pass_at_k")
"""Per question: greedy right; mean@k (share of the k samples right, pass@1 averaged over k
samples as DeepSeek-R1 reports it); maj@k (the majority answer right); pass@k (any sample right)."""


TRACE_METRICS = ("trace_accuracy", "lucky_answer_rate")
"""With a step oracle: trace accuracy (per question, the share of the k samples whose final
answer is right and every step is on the true path); the lucky-answer rate (pooled over
questions: of all right samples, the share reached through a wrong step)."""


def trace_flags(step_oracle: StepOracle | None, question: str, texts: list[str],
                rights: list[bool], separator: str = "\n") -> list[bool] | None:
    """Per sample: its answer is right and every step of it is right (`step_oracle` on its
    steps, split as process rewards split them); None without an oracle."""
    if step_oracle is None:
        return None
    return [right and all(step_oracle(question, split_steps(text, separator)))
            for text, right in zip(texts, rights)]


def per_question(greedy: list[bool], samples: list[list[bool]] | None,
                 majority: list[bool] | None,
                 traces: list[list[bool]] | None = None) -> dict[str, list[float]]:
    """The per-question values of METRICS (greedy only when nothing was sampled), and trace
    accuracy where each sample's trace flag is known."""
    out = {"greedy_accuracy": [float(g) for g in greedy]}
    if samples is not None:
        out["mean_at_k"] = [sum(r) / len(r) for r in samples]
        out["maj_accuracy"] = [float(m) for m in majority]
        out["pass_at_k"] = [float(any(r)) for r in samples]
    if traces is not None:
        out["trace_accuracy"] = [sum(t) / len(t) for t in traces]
    return out


def lucky_counts(samples: list[list[bool]],
                 traces: list[list[bool]]) -> tuple[list[int], list[int]]:
    """Per question: (right samples with a wrong step, right samples)."""
    return ([sum(r and not t for r, t in zip(rs, ts)) for rs, ts in zip(samples, traces)],
            [sum(rs) for rs in samples])


def lucky_answer_rate(samples: list[list[bool]], traces: list[list[bool]],
                      seed: int = 0) -> dict[str, float]:
    """`eval/lucky_answer_rate`: of all right samples, the share whose trace is wrong, with its
    95% interval by a bootstrap over questions; {} when no sample is right (no such share)."""
    lucky, right = lucky_counts(samples, traces)
    if not sum(right):
        return {}
    rate, lo, hi = ratio_interval(lucky, right, seed=seed)
    return {"eval/lucky_answer_rate": rate, "eval/lucky_answer_rate_lo": lo,
            "eval/lucky_answer_rate_hi": hi}


def summarise(values: dict[str, list[float]], seed: int = 0) -> dict[str, float]:
    """`eval/<metric>` means with their 95% bootstrap intervals (`_lo`, `_hi`) over questions."""
    metrics = {}
    for name, xs in values.items():
        lo, hi = bootstrap_interval(xs, seed=seed)
        metrics.update({f"eval/{name}": sum(xs) / len(xs), f"eval/{name}_lo": lo,
                        f"eval/{name}_hi": hi})
    return metrics


@torch.no_grad()
def evaluate_policy(model, tokenizer, records: list[MathRecord], fmt: PromptFormat, *, k: int,
                    temperature: float, max_new_tokens: int, batch_size: int, timeout_s: int = 2,
                    sampled: bool = True, progress: bool = False,
                    outcomes_path: Path | None = None, seed: int = 0,
                    step_oracle: StepOracle | None = None,
                    step_separator: str = "\n") -> dict[str, float]:
    """Greedy accuracy, and with `sampled`: mean@k, maj@k and pass@k at `temperature`, each with
    its 95% interval over questions; with a `step_oracle` (None: the data has none) also
    TRACE_METRICS. `outcomes_path` receives every question's values (for paired comparisons of
    two policies on the same questions, and each sample's correctness, vote key and trace flag
    for maj@K and pass@K at every K up to k).

    The questions are spread over the ranks in chunks (`runtime.shards`), each chunk's samples
    seeded from (`seed`, chunk): any number of processes gives one process's numbers, and the
    same policy gets the same numbers wherever it is evaluated. Every rank must call it; each
    gets the metrics, the main rank writes `outcomes_path`."""
    per_batch = max(1, batch_size // max(k, 1))
    greedy_starts = list(range(0, len(records), batch_size))
    sample_starts = list(range(0, len(records), per_batch)) if sampled else []
    greedy_costs = [len(records[s:s + batch_size]) for s in greedy_starts]
    sample_costs = [len(records[s:s + per_batch]) * k for s in sample_starts]
    bar = tqdm(total=sum(greedy_costs[c] for c in my_chunks(greedy_costs))
               + sum(sample_costs[c] for c in my_chunks(sample_costs)),
               desc="eval", unit="gen", disable=not (progress and is_main()), leave=False)

    def greedy_chunk(c: int) -> tuple[list[bool], list[int]]:
        chunk = records[greedy_starts[c]:greedy_starts[c] + batch_size]
        greedy = generate_groups(model, tokenizer, fmt.prompts(tokenizer, chunk), 1,
                                 max_new_tokens=max_new_tokens, greedy=True)
        return ([_is_right(extract_final_answer(t), r.answer, timeout_s)
                 for t, r in zip(greedy.texts, chunk)], greedy.lengths.tolist())

    def sample_chunk(c: int) -> list[tuple]:
        chunk = records[sample_starts[c]:sample_starts[c] + per_batch]
        rollout = generate_groups(model, tokenizer, fmt.prompts(tokenizer, chunk), k,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
        out = []
        for q, rec in enumerate(chunk):
            texts = rollout.texts[q * k:(q + 1) * k]
            answers = [extract_final_answer(t) for t in texts]
            rights = [_is_right(a, rec.answer, timeout_s) for a in answers]
            out.append((rights, [_vote_key(a) for a in answers],
                        _is_right(majority_of(answers), rec.answer, timeout_s),
                        trace_flags(step_oracle, rec.question, texts, rights, step_separator)))
        return out

    greedy = map_chunks(len(greedy_starts), greedy_chunk, costs=greedy_costs,
                        done=lambda c: bar.update(greedy_costs[c]))
    rows = [row for part in map_chunks(len(sample_starts), sample_chunk, costs=sample_costs,
                                       seed_key=("eval", seed),
                                       done=lambda c: bar.update(sample_costs[c]))
            for row in part]
    bar.close()
    return _metrics(records, greedy, rows if sampled else None, k, temperature, outcomes_path)


def _metrics(records: list[MathRecord], greedy: list, rows: list | None, k: int,
             temperature: float, outcomes_path: Path | None) -> dict[str, float]:
    """`evaluate_policy`'s metrics from its chunks' results (greedy: (rights, lengths) per
    chunk; rows: (sample rights, vote keys, majority right, trace flags or None) per question,
    None when nothing was sampled), and the outcomes file, which the main rank writes."""
    greedy_right = [right for rights, _ in greedy for right in rights]
    lengths = [n for _, ns in greedy for n in ns]
    samples, votes, majority, traces = ([[row[i] for row in rows] for i in range(4)]
                                        if rows is not None else (None,) * 4)
    traces = traces if traces and traces[0] is not None else None  # None: no step oracle
    values = per_question(greedy_right, samples, majority, traces)
    metrics = summarise(values)
    if traces is not None:
        metrics.update(lucky_answer_rate(samples, traces))
    metrics.update({"eval/greedy_length": sum(lengths) / len(lengths),
                    "eval/questions": len(records)})
    if rows is not None:
        metrics["eval/k"] = k
    if outcomes_path is not None and is_main():
        atomic_write_json(Path(outcomes_path), {
            "questions": [r.source_id for r in records], "k": k if rows is not None else 0,
            "temperature": temperature, **values,
            **({"sample_right": samples, "sample_votes": votes} if rows is not None else {}),
            **({"sample_trace": traces} if traces is not None else {})})
    return metrics


def at_k_curves(outcomes: dict, ks: list[int]) -> dict[str, list[float]]:
    """Pass@K (the unbiased estimator over the k samples) and maj@K (the majority of the first K
    samples, which are as random as any K) for each K in `ks` up to k, from an outcomes file."""
    from math import comb

    rights, votes = outcomes["sample_right"], outcomes["sample_votes"]
    ks = [K for K in ks if K <= min(len(r) for r in rights)]
    out: dict[str, list[float]] = {"k": ks, "pass": [], "maj": []}
    for K in ks:
        pass_k = maj_k = 0.0
        for right, vote in zip(rights, votes):
            n, c = len(right), sum(right)
            pass_k += 1.0 - comb(n - c, K) / comb(n, K)
            best = majority_key(vote[:K])
            if best is not None:
                maj_k += next(r for r, v in zip(right, vote) if v == best)
        out["pass"].append(pass_k / len(rights))
        out["maj"].append(maj_k / len(rights))
    return out


# -- the held-out evaluation of a policy stage, and its schedule ---------------------------------

def make_evaluator(evaluation: Evaluation, sampler: Sampler, tokenizer,
                   eval_records: list[MathRecord], fmt, trainer: StageLoop, evaluate_ends: bool):
    """evaluate(sampled) -> held-out metrics, the questions spread over the ranks (every rank
    calls it). A stage at step 0 with `evaluate_ends` logs the starting policy's greedy metrics
    first, outside its wall-clock budget (`policy.max_minutes` is for training: a stage whose
    start is evaluated gets the steps one whose start is not would)."""
    def evaluate(sampled: bool) -> dict:
        with sampler.generating() as model:
            e = evaluation
            return evaluate_policy(
                model, tokenizer, eval_records, fmt, k=e.k, temperature=e.temperature,
                max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, timeout_s=e.timeout_s,
                sampled=sampled, seed=e.seed, step_oracle=e.step_oracle,
                step_separator=e.step_separator)
    if trainer.step == 0 and evaluate_ends:
        trainer.log(evaluate(sampled=False))
        trainer.restart_clock()
    return evaluate


def due_evaluation(trainer: StageLoop, g: PolicyConfig, evaluate, evaluate_ends: bool) -> dict:
    """The held-out metrics due after this step: greedy every `policy.eval_every` steps, and
    (`evaluate_ends`) the sampled ones after the last step, or the step a guard ended on."""
    metrics = {}
    if g.eval_every and trainer.step % g.eval_every == 0 and trainer.step < g.steps:
        metrics.update(evaluate(sampled=False))
        trainer.bar.set_postfix(acc=f"{metrics['eval/greedy_accuracy']:.3f}")
    if (trainer.step == g.steps or trainer.stopped) and evaluate_ends:
        metrics.update(evaluate(sampled=True))
    return metrics
