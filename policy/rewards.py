"""The reward contract of the GRPO loop, and the built-in rule-based reward.

A reward is any callable `(records, rollout) -> Scores`. Outcome rewards fill `rewards` (one
scalar per sample); process rewards also fill the per-step fields (what process advantages need).
The ORM/PRM scorers (reward_model/) and the step oracles (process_supervision/) satisfy the same
`RewardFn` protocol; the loop never imports them: `iteration/` and the CLI wire them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from policy.rollout import Rollout
from runtime.data import MathRecord
from runtime.grading import grade


@dataclass(frozen=True)
class Scores:
    rewards: torch.Tensor
    """[N] one scalar per sample (for process rewards: the aggregated solution score)."""
    correct: torch.Tensor | None = None
    """[N] bool: the final answer checked against the gold answer, when known (for metrics)."""
    step_rewards: torch.Tensor | None = None
    """[N, S] reward of each step (process supervision)."""
    step_mask: torch.Tensor | None = None
    """[N, S] bool, True on real steps."""
    step_end_index: torch.Tensor | None = None
    """[N, S] completion-token index (inclusive) where each step ends."""

    def to(self, device) -> "Scores":
        """The same scores on `device` (reward callables may build them on the CPU)."""
        def moved(t):
            return None if t is None else t.to(device)

        return Scores(moved(self.rewards), moved(self.correct), moved(self.step_rewards),
                      moved(self.step_mask), moved(self.step_end_index))


class RewardFn(Protocol):
    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        """Score the samples of `rollout`; `records[i]` is the question of sample i."""
        ...


def grade_samples(records: list[MathRecord], texts: list[str], timeout_s: int = 2) -> torch.Tensor:
    """[N] bool: does each completion's final answer match its question's gold answer?"""
    return torch.tensor([grade(text, rec.answer, timeout_s) for rec, text in zip(records, texts)],
                        dtype=torch.bool)


class RuleReward:
    """1 if the final answer is equivalent to the gold answer, else 0 (the foundation's grader)."""

    def __init__(self, timeout_s: int = 2):
        self.timeout_s = timeout_s

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        correct = grade_samples(records, rollout.texts, self.timeout_s)
        return Scores(rewards=correct.float(), correct=correct)
