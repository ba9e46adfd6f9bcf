"""Training examples for the reward models: from a Math-Shepherd/TRL file, or generated from the
synthetic task (solutions whose first wrong step is known by construction)."""

from __future__ import annotations

import random

from process_supervision.formats import StepExample, read_step_rows
from reward_model.encoding import orm_example
from tasks import synthetic
from runtime.data import MathRecord
from tasks.grading import grade


def as_orm(examples: list[StepExample], separator: str = "\n") -> list[StepExample]:
    """PRM examples -> ORM examples: the whole solution (steps joined by `separator`, as the
    policy wrote them), labelled by its last step's label."""
    return [orm_example(ex.question, separator.join(ex.steps), ex.labels[-1]) for ex in examples]


def worked_examples(records: list[MathRecord]) -> list[StepExample]:
    """Worked solutions (e.g. the SFT set's) as PRM examples with true labels. A synthetic one is
    labelled step by step against the question (the SFT set may hold slipped solutions); any
    other is used only when its last step states the gold answer, every step then labelled right."""
    return [ex for _, ex in _worked_pairs(records)]


def _worked_pairs(records: list[MathRecord]) -> list[tuple[MathRecord, StepExample]]:
    out = []
    for r in records:
        steps = tuple(r.solution_steps)
        if not steps:
            continue
        if r.source_id.startswith("synthetic:"):
            labels = tuple(float(t) for t in synthetic.step_correctness(r.question, steps))
        elif steps[-1].strip().endswith(r.answer.strip()):
            labels = (1.0,) * len(steps)
        else:
            continue
        out.append((r, StepExample(r.question, steps, labels, r.source_id)))
    return out


def worked_orm_examples(records: list[MathRecord], timeout_s: int = 2,
                        separator: str = "\n") -> list[StepExample]:
    """Worked solutions as ORM examples (steps joined by `separator`, as the policy writes
    them) labelled by their final answer against the gold one, as the policy's samples are
    (process_supervision/label.py): a synthetic solution whose slips cancel is right for the
    ORM, though its steps are wrong for the PRM."""
    return [orm_example(ex.question, separator.join(ex.steps),
                        float(grade(ex.steps[-1], r.answer, timeout_s)))
            for r, ex in _worked_pairs(records)]


def synthetic_step_examples(records: list[MathRecord], seed: int, wrong_fraction: float = 0.5,
                            paired: bool = False) -> list[StepExample]:
    """Per synthetic record: its correct solution, or (with `wrong_fraction`) a corrupted one;
    with `paired`, both, one after the other (a minimal pair: the same question, one slip apart).
    Labels are the true step correctness."""
    rng = random.Random(seed)
    out = []
    for rec in records:
        problem = synthetic.Problem(rec.question, rec.solution_steps, int(rec.answer))
        versions = [problem.steps]
        if paired:
            versions.append(synthetic.corrupt_solution(problem, rng)[0])
        elif rng.random() < wrong_fraction:
            versions = [synthetic.corrupt_solution(problem, rng)[0]]
        for steps in versions:
            truth = synthetic.step_correctness(rec.question, steps)
            out.append(StepExample(rec.question, tuple(steps), tuple(float(t) for t in truth),
                                   rec.source_id))
    return out


def training_examples(rm, records: list[MathRecord], seed: int,
                      soft_labels: bool = False):
    """The examples `igrpo train-rm` trains on, for `rm.kind` (from an `RewardModelConfig`): a
    file's rows as `StepRows` (read once, parsed when used), or generated synthetic ones."""
    if rm.data_path:
        rows, skipped = read_step_rows(rm.data_path, rm.step_tag, use_soft=soft_labels)
        if skipped:
            print(f"[igrpo] skipped {skipped} malformed rows of {rm.data_path}")
        return rows.map(lambda ex: as_orm([ex])[0]) if rm.kind == "orm" else rows
    else:
        # Paired generation makes two solutions per question: as many solutions, half the questions.
        count = rm.synthetic_solutions // 2 if rm.group_by_question else rm.synthetic_solutions
        examples = synthetic_step_examples(records[:count], seed, paired=rm.group_by_question)
    return as_orm(examples) if rm.kind == "orm" else examples
