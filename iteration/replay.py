"""The reward-model replay buffer: every iteration's labelled data on disk, and the refresh set
that mixes the new data with a seeded draw of historical data (10% of the set by default).

Historical data is everything the reward model trained on before: earlier iterations' labelled
samples and, where a run keeps them (`iterate.refresh_worked_solutions`), the worked solutions
of its first training. They share the replay fraction: the refresh set is the current policy's
new samples and `replay_fraction` of historical rows, as the paper's continual training with a
10% replay mechanism (DeepSeekMath §4.1.4) has it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from process_supervision.formats import StepExample
from runtime.rundir import atomic_write_text
from runtime.seeds import derive_seed


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


WORKED = -1
"""The origin of a worked solution in a refresh set (not an iteration's sample)."""


def refresh_set(buffer_dir: Path, iteration: int, fraction: float, seed: int,
                worked: list[StepExample] = ()) -> list[tuple[int, StepExample]]:
    """Iteration `iteration`'s new rows plus a seeded draw from the historical pool (all earlier
    iterations' rows, then `worked`, origin `WORKED`), so that historical rows are `fraction`
    of the result; each row keeps its origin."""
    new = load_iteration(buffer_dir, iteration)
    history = [row for k in range(iteration) for row in load_iteration(buffer_dir, k)]
    history += [(WORKED, ex) for ex in worked]
    want = min(historical_count(len(new), fraction), len(history))
    drawn = random.Random(derive_seed(seed, "replay", iteration)).sample(history, want)
    return new + drawn


def composition(rows: list[tuple[int, StepExample]], iteration: int) -> dict[str, int]:
    """{"new", "replayed", "worked"}: a refresh set's rows by origin (the current iteration's
    samples, earlier iterations' samples, worked solutions)."""
    origins = [origin for origin, _ in rows]
    return {"new": origins.count(iteration), "worked": origins.count(WORKED),
            "replayed": sum(1 for o in origins if o not in (iteration, WORKED))}
