"""Every random stream of a run, derived from the run's seed in one place.

    derive_seed(run_seed, "questions")            # GRPO's order of the RL questions
    derive_seed(run_seed, "label", k)             # iteration k's Math-Shepherd sampling

A purpose named in `PURPOSES` keeps the form its seed has always had, so the shipped figures
(the demo's table, docs/replication.md, docs/recipes.md) stay reproducible bit for bit; any
other purpose gets a hash of the run seed, its name and its key (`runtime.shards.chunk_seed`),
as the outer loop's units already do (`iteration.manifest.seed_unit`).
"""

from __future__ import annotations

from typing import Callable

from runtime.shards import chunk_seed

PURPOSES: dict[str, Callable[..., int]] = {
    # the synthetic task's splits (runtime/data.py)
    "sft-questions": lambda s: s * 3 + 1,
    "rl-questions": lambda s: s * 3 + 2,
    "held-out-questions": lambda s: s * 3 + 3,
    "slips": lambda s: s * 7919 + 1,  # which SFT solutions are the slipping student's
    # policy stages: the order of questions and samples, and what a step draws
    "questions": lambda s: s * 7_919,  # a GRPO / PPO / DPO step's questions
    "refill": lambda s: s * 7_919 + 104_729,  # DAPO's extra rounds
    "token-budget": lambda s, step: s * 1_000_003 + step,  # C3PO's order of responses
    "window-stream": lambda s: s * 7_919 + 11,  # T-PPO's stream of samples
    "value-pretrain": lambda s: s + 31_337,  # VC-PPO's questions, apart from PPO's
    "sft-order": lambda s: s * 100_003,
    "rft-sampling": lambda s, step: s * 1_000_003 + step,
    "rft-order": lambda s: s * 7_919,
    # reward models and the outer loop
    "rm-order": lambda s: s * 31,
    "label": lambda s, k: s * 101 + k,  # iteration k's samples and their completions
    "label-shard": lambda s, shard: s * 1_000_003 + shard,  # s: the "label" seed
    "replay": lambda s, k: s * 1_000 + k,  # refresh k's draw from the replay pool
    "rm-report": lambda s: s + 1,  # held-out solutions with known first errors
    "refresh-check": lambda s: s + 7,  # the policy samples both reward models judge
}


def derive_seed(run_seed: int, purpose: str, *key: int | str) -> int:
    """The seed of `purpose`'s stream at `key` (a step, an iteration, a shard)."""
    form = PURPOSES.get(purpose)
    return form(run_seed, *key) if form is not None else chunk_seed(run_seed, purpose, *key)
