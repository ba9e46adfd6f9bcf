"""Sample policy solutions to label, cached on disk so a resumed run labels the same solutions."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from policy.rollout import generate_groups
from process_supervision.label import Solution
from runtime.data import MathRecord
from runtime.engine import barrier, is_main
from runtime.prompts import PromptFormat
from runtime.rundir import atomic_write_text
from runtime.steps import split_steps


def sample_solutions(policy, tokenizer, records: list[MathRecord], fmt: PromptFormat,
                     per_question: int, max_new_tokens: int, temperature: float,
                     cache: Path | None = None, questions_per_batch: int = 32) -> list[Solution]:
    """`per_question` sampled solutions per record (those with at least one step, split on
    `fmt.step_separator`)."""
    by_id = {r.source_id: r for r in records}
    if cache is not None:  # rank 0 samples and writes the cache; every rank reads it
        if is_main() and not cache.exists():
            _sample(policy, tokenizer, records, fmt, per_question, max_new_tokens,
                    temperature, cache, questions_per_batch)
        barrier()
        rows = [json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines()]
        return [Solution(by_id[r["source_id"]], tuple(r["steps"])) for r in rows]
    return _sample(policy, tokenizer, records, fmt, per_question, max_new_tokens,
                   temperature, None, questions_per_batch)


def _sample(policy, tokenizer, records, fmt, per_question, max_new_tokens,
            temperature, cache, questions_per_batch) -> list[Solution]:
    solutions = []
    for start in tqdm(range(0, len(records), questions_per_batch), desc="sample", leave=False):
        chunk = records[start:start + questions_per_batch]
        rollout = generate_groups(policy, tokenizer, fmt.prompts(tokenizer, chunk), per_question, max_new_tokens=max_new_tokens,
                                  temperature=temperature)
        for i, text in enumerate(rollout.texts):
            steps = split_steps(text, fmt.step_separator)
            if steps:
                solutions.append(Solution(chunk[i // per_question], tuple(steps)))
    if cache is not None:
        atomic_write_text(cache, "".join(
            json.dumps({"source_id": s.record.source_id, "steps": list(s.steps)}) + "\n"
            for s in solutions))
    return solutions
