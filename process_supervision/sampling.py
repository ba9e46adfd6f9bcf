"""Sample policy solutions to label, cached on disk so a resumed run labels the same solutions."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from policy.generation.rollout import generate_groups
from process_supervision.label import Solution
from runtime.data import MathRecord
from runtime.dist import barrier, broadcast_from_main, is_main
from tasks.prompts import PromptFormat
from runtime.rundir import atomic_write_text
from runtime.shards import map_chunks, my_chunks
from runtime.steps import split_steps


def sample_solutions(policy, tokenizer, records: list[MathRecord], fmt: PromptFormat,
                     per_question: int, max_new_tokens: int, temperature: float,
                     cache: Path | None = None, questions_per_batch: int = 32,
                     seed: int = 0) -> list[Solution]:
    """`per_question` sampled solutions per record (those with at least one step, split on
    `fmt.step_separator`). The questions are spread over the ranks in chunks of
    `questions_per_batch`, each chunk's samples seeded from (`seed`, chunk), so any number of
    processes samples what one does (every rank calls it). With `cache`, the main rank writes
    the solutions there and a later call reads them back instead of sampling."""
    by_id = {r.source_id: r for r in records}
    if cache is not None and broadcast_from_main(cache.exists()):  # the same answer on every rank
        rows = [json.loads(line) for line in cache.read_text(encoding="utf-8").splitlines()]
        return [Solution(by_id[r["source_id"]], tuple(r["steps"])) for r in rows]
    starts = list(range(0, len(records), questions_per_batch))
    costs = [len(records[s:s + questions_per_batch]) for s in starts]
    bar = tqdm(total=sum(costs[c] for c in my_chunks(costs)), desc="sample", unit="question",
               leave=False, disable=not is_main())

    def chunk_solutions(c: int) -> list[Solution]:
        chunk = records[starts[c]:starts[c] + questions_per_batch]
        rollout = generate_groups(policy, tokenizer, fmt.prompts(tokenizer, chunk), per_question,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
        return [Solution(chunk[i // per_question], tuple(steps))
                for i, text in enumerate(rollout.texts)
                if (steps := split_steps(text, fmt.step_separator))]

    solutions = [s for part in map_chunks(len(starts), chunk_solutions, costs=costs,
                                          seed_key=("label-samples", seed),
                                          done=lambda c: bar.update(costs[c]))
                 for s in part]
    bar.close()
    if cache is not None:
        if is_main():
            atomic_write_text(cache, "".join(
                json.dumps({"source_id": s.record.source_id, "steps": list(s.steps)}) + "\n"
                for s in solutions))
        barrier()
    return solutions
