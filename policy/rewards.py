"""The reward contract of the GRPO loop, and the built-in rule-based reward.

A reward is any callable `(records, rollout) -> Scores`. Outcome rewards fill `rewards` (one
scalar per sample); process rewards also fill the per-step fields (what process advantages need).
The ORM/PRM scorers (reward_model/) and the step oracles (process_supervision/) satisfy the same
`RewardFn` protocol; the loop never imports them: `iteration/` and the CLI wire them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from policy.generation.rollout import Rollout
from runtime.data import MathRecord
from runtime.seeds import derive_seed
from tasks.grading import grade


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
    revealed: torch.Tensor | None = None
    """[N] bool: the samples whose `correct` the advantages may read (the gold budget,
    `gold_budget`); None: every sample's. `correct` itself stays whole, for the metrics."""
    members: torch.Tensor | None = None
    """[N, K] each ensemble member's own solution score (`rm.ensemble`, reward_model/ensemble.py;
    for the watch's per-member AUROC and shared error); None for a single reward."""

    def to(self, device) -> "Scores":
        """The same scores on `device` (reward callables may build them on the CPU)."""
        def moved(t):
            return None if t is None else t.to(device)

        return Scores(moved(self.rewards), moved(self.correct), moved(self.step_rewards),
                      moved(self.step_mask), moved(self.step_end_index), moved(self.revealed),
                      moved(self.members))

    def rows(self, index: torch.Tensor) -> "Scores":
        """The scores of the samples at `index` ([M] row indices), in that order."""
        def picked(t):
            return None if t is None else t[index]

        return Scores(picked(self.rewards), picked(self.correct), picked(self.step_rewards),
                      picked(self.step_mask), picked(self.step_end_index),
                      picked(self.revealed), picked(self.members))


def concat_scores(parts: list[Scores]) -> Scores:
    """One Scores from several batches' (rows in order; step fields padded to the widest)."""
    if len(parts) == 1:
        return parts[0]

    def joined(name, pad):
        tensors = [getattr(part, name) for part in parts]
        if any(t is None for t in tensors):
            return None
        if tensors[0].dim() == 1:
            return torch.cat(tensors)
        width = max(t.shape[1] for t in tensors)
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad)
                          for t in tensors])

    return Scores(joined("rewards", 0), joined("correct", False), joined("step_rewards", 0.0),
                  joined("step_mask", False), joined("step_end_index", 0),
                  joined("revealed", False), joined("members", 0.0))


class RewardFn(Protocol):
    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        """Score the samples of `rollout`; `records[i]` is the question of sample i."""


@runtime_checkable
class ValueSource(Protocol):
    """A reward that can seed a critic (`ppo.critic_init=reward_model`): the reward models."""

    def value_init(self) -> tuple[torch.nn.Module, torch.Tensor]:
        """(a backbone, [H] the direction of its final hidden state that is its score's logit):
        the critic starts as this backbone with that head, valuing every state as the reward
        model scores it."""
        ...


@runtime_checkable
class LearnsOnline(Protocol):
    """A reward that learns from the samples it scored (`rm.online`, reward_model/online.py):
    its engines are the stage's companions (saved and resumed with the policy), and after a
    step's samples are scored and the policy updated, `learn` takes its own optimizer step on
    them (in PRIME's order, `rm.online_update=before`, it stepped while scoring and `learn`
    hands on that step's metrics: policy/scoring.py `UpdatedFirst`)."""

    name: str

    def companions(self) -> dict:
        """name -> the training engine(s) the stage saves and restores with the policy."""
        ...

    def learn(self, records: list[MathRecord], rollout: Rollout, backward, where: str) -> dict:
        """One update on this rank's scored samples (`records[i]`: sample i's question), through
        `backward` (the stage's `StageLoop.backward`); returns its metrics."""
        ...

    def export(self, folder, config_yaml: str) -> None:
        """Save what it learned as a model any command reads."""
        ...


def gold_read(reward_fn: RewardFn, credit, metrics: dict) -> float:
    """The share of a step's samples whose exact final-answer check reached its advantages or
    its reward's training (`reward/gold_read`): 1 for a reward that is the check or learns from
    it (`reads_gold`: the rule, the step oracle, the online ORM); for a process credit form
    that reads the check (`credit.reads_check`: anchored) the gold budget's revealed share (the
    step's `metrics["reward/gold_revealed"]`, all without a budget); 0 for a frozen reward
    model, whose gold was spent on its labels before the stage. The watch reads the check too,
    but nothing it reads reaches a reward."""
    if getattr(reward_fn, "reads_gold", False):
        return 1.0
    if credit is not None and credit.reads_check:
        return metrics.get("reward/gold_revealed", 1.0)
    return 0.0


def gold_budget(records: list[MathRecord], share: float, seed: int) -> torch.Tensor:
    """[N] bool: which of `records` (one per sample) lie inside a gold budget of `share` of the
    questions: question q is in when a uniform draw keyed by (`seed`, its source id) falls under
    `share`, so a question is in or out whatever step, rank or iteration draws it."""
    return torch.tensor([derive_seed(seed, "gold-budget", rec.source_id) / 2**31 < share
                         for rec in records], dtype=torch.bool)


def grade_samples(records: list[MathRecord], texts: list[str], timeout_s: int = 2) -> torch.Tensor:
    """[N] bool: does each completion's final answer match its question's gold answer?"""
    return torch.tensor([grade(text, rec.answer, timeout_s) for rec, text in zip(records, texts)],
                        dtype=torch.bool)


class RuleReward:
    """1 if the final answer is equivalent to the gold answer, else 0 (the foundation's grader)."""

    reads_gold = True
    """Its rewards are the check (`gold_read`)."""

    def __init__(self, timeout_s: int = 2):
        self.timeout_s = timeout_s

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        correct = grade_samples(records, rollout.texts, self.timeout_s)
        return Scores(rewards=correct.float(), correct=correct)
