"""The reward-model replay buffer: every iteration's labelled data on disk, and the refresh set
that mixes the new data with a seeded draw of historical data (10% of the set by default)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from process_supervision.formats import StepExample
from runtime.rundir import atomic_write_text


def save_iteration(buffer_dir: Path, iteration: int, examples: list[StepExample]) -> Path:
    """Store an iteration's labelled examples (each row records its origin iteration)."""
    path = buffer_dir / f"iteration-{iteration}.jsonl"
    atomic_write_text(path, "".join(json.dumps({
        "origin": iteration, "question": ex.question, "steps": list(ex.steps),
        "labels": list(ex.labels), "source_id": ex.source_id}, ensure_ascii=False) + "\n"
        for ex in examples))
    return path


def load_iteration(buffer_dir: Path, iteration: int) -> list[tuple[int, StepExample]]:
    path = buffer_dir / f"iteration-{iteration}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [(r["origin"], StepExample(r["question"], tuple(r["steps"]), tuple(r["labels"]),
                                      r["source_id"])) for r in rows]


def historical_count(new_rows: int, fraction: float) -> int:
    """How many historical rows make `fraction` of a set that holds `new_rows` new ones."""
    if not 0 <= fraction < 1:
        raise ValueError(f"iterate.replay_fraction must lie in [0, 1), got {fraction}")
    return round(new_rows * fraction / (1 - fraction))


def refresh_set(buffer_dir: Path, iteration: int, fraction: float,
                seed: int) -> list[tuple[int, StepExample]]:
    """Iteration `iteration`'s new rows plus a seeded draw from all earlier iterations, so that
    historical rows are `fraction` of the result; each row keeps its origin iteration."""
    new = load_iteration(buffer_dir, iteration)
    history = [row for k in range(iteration) for row in load_iteration(buffer_dir, k)]
    want = min(historical_count(len(new), fraction), len(history))
    drawn = random.Random(seed * 1_000 + iteration).sample(history, want)
    return new + drawn
