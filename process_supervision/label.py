"""Math-Shepherd automatic step labels, batched and resumable.

For each sampled solution and each step prefix (question + steps 1..k), a completer samples N
continuations to a final answer: the hard estimate of step k is 1 if any continuation reaches the
gold answer, the soft estimate is the fraction that do. The last step's label is the correctness of
the solution itself. All prefixes of a shard of solutions are completed together in large generate
batches (each prefix prefilled once for its N continuations); finished shards are written
atomically and never recomputed, so an interrupted labelling run resumes where it stopped.

Launch alone: `igrpo label --config configs/tiny.yaml label.completer=PATH label.num_completions=8`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from policy.generation.rollout import generate_groups
from process_supervision.formats import StepExample
from runtime.data import MathRecord
from runtime.dist import barrier, broadcast_from_main, world
from tasks.grading import grade
from tasks.prompts import PromptFormat
from runtime.rundir import atomic_write_text
from runtime.seeds import derive_seed
from runtime.shards import deal


@dataclass(frozen=True)
class Solution:
    """A solution to label: its question (with gold answer) and its steps."""

    record: MathRecord
    steps: tuple[str, ...]


@dataclass(frozen=True)
class LabelledSolution:
    record: MathRecord
    steps: tuple[str, ...]
    hard: tuple[float, ...]
    """1 if any continuation from the step's prefix reached the gold answer (last: the solution's
    own correctness)."""
    soft: tuple[float, ...]
    """Fraction of continuations that reached it (last: the solution's own correctness)."""

    def example(self, soft: bool) -> StepExample:
        return StepExample(self.record.question, self.steps, self.soft if soft else self.hard,
                           self.record.source_id)


def prefix_prompt(fmt: PromptFormat, tokenizer, question: str, steps: tuple[str, ...],
                  k: int) -> str:
    """The completer's prompt for step prefix k (steps 1..k): where the continuation starts."""
    return fmt.prompt(tokenizer, question) + fmt.prefix(steps[:k])


def estimates(prefix_text: str, continuations: list[str], gold: str,
              timeout_s: int = 2) -> tuple[float, float]:
    """(hard, soft) estimate of one step from its prefix's continuations."""
    hits = [grade(prefix_text + c, gold, timeout_s) for c in continuations]
    return float(any(hits)), sum(hits) / max(len(hits), 1)


class Labeller:
    """Labels solutions with a completer policy; counts its generate calls."""

    def __init__(self, completer, tokenizer, fmt: PromptFormat, num_completions: int,
                 max_new_tokens: int, temperature: float, timeout_s: int = 2,
                 prefixes_per_batch: int = 16):
        self.completer, self.tokenizer = completer, tokenizer
        self.fmt, self.n = fmt, num_completions
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.timeout_s, self.prefixes_per_batch = timeout_s, prefixes_per_batch
        self.generate_calls = 0
        self.prefixes_done = 0

    def _complete(self, prompts: list[str], greedy: bool) -> list[list[str]]:
        self.generate_calls += 1
        rollout = generate_groups(self.completer, self.tokenizer, prompts, self.n,
                                  max_new_tokens=self.max_new_tokens,
                                  temperature=self.temperature, greedy=greedy)
        return [rollout.texts[i * self.n:(i + 1) * self.n] for i in range(len(prompts))]

    def label(self, solutions: list[Solution], greedy: bool = False,
              batched: bool = True) -> list[LabelledSolution]:
        """Label `solutions`; `batched=False` completes one prefix per generate call (the slow
        reference the benchmark compares against)."""
        jobs = [(i, k) for i, s in enumerate(solutions) for k in range(1, len(s.steps))]
        if batched:
            # Bucket by steps left to write: a generate call runs until its longest
            # continuation ends, so prefixes with equally long continuations go together.
            jobs.sort(key=lambda job: len(solutions[job[0]].steps) - job[1])
        per_call = self.prefixes_per_batch if batched else 1
        results: dict[tuple[int, int], tuple[float, float]] = {}
        for start in range(0, len(jobs), per_call):
            chunk = jobs[start:start + per_call]
            prompts = [prefix_prompt(self.fmt, self.tokenizer, solutions[i].record.question,
                                     solutions[i].steps, k) for i, k in chunk]
            for (i, k), prompt, continuations in zip(chunk, prompts,
                                                      self._complete(prompts, greedy)):
                prefix_text = self.fmt.prefix(solutions[i].steps[:k])
                results[(i, k)] = estimates(prefix_text, continuations,
                                            solutions[i].record.answer, self.timeout_s)
            self.prefixes_done += len(chunk)
        out = []
        for i, s in enumerate(solutions):
            final = float(grade(self.fmt.join(s.steps), s.record.answer, self.timeout_s))
            hard = tuple(results[(i, k)][0] for k in range(1, len(s.steps))) + (final,)
            soft = tuple(results[(i, k)][1] for k in range(1, len(s.steps))) + (final,)
            out.append(LabelledSolution(s.record, s.steps, hard, soft))
        return out


def _shard_rows(labelled: list[LabelledSolution]) -> str:
    rows = [{"question": x.record.question, "answer": x.record.answer,
             "source_id": x.record.source_id, "steps": list(x.steps), "hard": list(x.hard),
             "soft": list(x.soft)} for x in labelled]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _read_shard(path: Path) -> list[LabelledSolution]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        record = MathRecord(r["question"], r["answer"], (), r["source_id"])
        out.append(LabelledSolution(record, tuple(r["steps"]), tuple(r["hard"]), tuple(r["soft"])))
    return out


def label_in_shards(labeller: Labeller, solutions: list[Solution], shard_dir: Path,
                    shard_size: int, progress: bool = True,
                    seed: int | None = None) -> list[LabelledSolution]:
    """Label in shards of `shard_size` solutions under `shard_dir`; finished shards are reused.

    The shards still to label are dealt to the ranks by their prefix count (each prefix is one
    set of completions: the work), so the ranks finish together (`runtime.shards.deal`). With
    `seed`, the sampling RNG is seeded per shard from (seed, shard index), so a resumed run, or
    one on another number of processes, labels each shard exactly as an uninterrupted one would
    have. Every rank calls it and gets every shard's labels."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    rank, world_size = world()
    shards = [(shard, solutions[start:start + shard_size], shard_dir / f"shard-{shard:05d}.jsonl")
              for shard, start in enumerate(range(0, len(solutions), shard_size))]
    # which shards are left, as the main rank sees them: one view for all
    todo = [shards[i] for i in broadcast_from_main([i for i, (_, _, path) in enumerate(shards)
                                                    if not path.exists()])]
    prefixes = [sum(len(x.steps) - 1 for x in chunk) for _, chunk, _ in todo]
    dealt = deal(prefixes, world_size)[rank]
    mine = [todo[i] for i in dealt]
    bar = tqdm(total=sum(prefixes[i] for i in dealt), desc="label", unit="prefix",
               disable=not progress)
    started = time.perf_counter()
    for shard, chunk, path in mine:
        if seed is not None:
            torch.manual_seed(derive_seed(seed, "label-shard", shard))
        atomic_write_text(path, _shard_rows(labeller.label(chunk)))
        bar.update(sum(len(x.steps) - 1 for x in chunk))
        rate = labeller.prefixes_done / max(time.perf_counter() - started, 1e-9)
        bar.set_postfix(prefixes_per_s=f"{rate:.1f}")
    bar.close()
    barrier()  # every rank's shards are written: read them all, in order
    return [x for _, _, path in shards for x in _read_shard(path)]


def label_statistics(labelled: list[LabelledSolution]) -> dict[str, float]:
    """Share of positive steps, mean steps per solution, hard-vs-soft agreement (soft >= 0.5)."""
    hard = [h for x in labelled for h in x.hard]
    soft = [s for x in labelled for s in x.soft]
    return {
        "label/solutions": float(len(labelled)),
        "label/positive_steps": sum(hard) / max(len(hard), 1),
        "label/steps_per_solution": len(hard) / max(len(labelled), 1),
        "label/hard_soft_agreement": sum((s >= 0.5) == bool(h) for h, s in zip(hard, soft))
        / max(len(hard), 1),
    }
