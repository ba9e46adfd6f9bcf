"""A step's scoring: the reward function on the rollout (`score_step`), the controls and guards on
its rewards (shuffled, non-finite), and the sampled batch every algorithm learns from
(`Sampled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from configs.schema import PolicyConfig
from policy.generation.rollout import Rollout, concat_rollouts
from policy.math.shaping import add_to_last_step, overlong_penalty
from policy.rewards import LearnsOnline, RewardFn, Scores, concat_scores, gold_budget
from policy.stage import Shaping
from runtime.data import MathRecord
from runtime.memory import memory_phase


def shuffled_rewards(scores: Scores, rewards: torch.Tensor) -> tuple[Scores, torch.Tensor]:
    """The shuffled-reward control (`controls.shuffle_rewards`): the batch's solution rewards
    permuted over its samples (its final-answer checks `correct` with them: the anchored
    process credit trains on those) and, for process supervision, its step rewards permuted over
    all of its real steps, so that no reward belongs to its own sample or step any more (the same
    values, the same step layout)."""
    order = torch.randperm(len(rewards))
    rewards = rewards[order]
    if scores.correct is not None:
        scores = replace(scores, correct=scores.correct[order])
    if scores.members is not None:
        scores = replace(scores, members=scores.members[order])
    if scores.step_rewards is not None:
        steps = scores.step_rewards.clone()
        values = steps[scores.step_mask]
        steps[scores.step_mask] = values[torch.randperm(len(values))]
        scores = replace(scores, step_rewards=steps)
    return scores, rewards


def drop_nonfinite(scores: Scores, group_size: int) -> tuple[Scores, torch.Tensor]:
    """A reward model can return NaN/inf (a PRM on odd input). Every group holding such a value is
    left out of the step's loss (its values set to 0 so nothing non-finite propagates), and
    counted in `reward/nonfinite_groups`. Returns the cleaned scores and the [Q] broken-group mask.
    """
    bad = ~torch.isfinite(scores.rewards.float())
    if scores.step_rewards is not None:
        bad |= (~torch.isfinite(scores.step_rewards.float()) & scores.step_mask).any(-1)
    groups = bad.view(-1, group_size).any(-1)
    if not groups.any():
        return scores, groups
    rows = groups.repeat_interleave(group_size)
    step_rewards = None if scores.step_rewards is None else torch.where(
        rows[:, None] | ~torch.isfinite(scores.step_rewards), 0.0, scores.step_rewards.float())
    return replace(scores, rewards=torch.where(rows, 0.0, scores.rewards.float()),
                   step_rewards=step_rewards), groups


def score_step(reward_fn: RewardFn, records: list[MathRecord], rollout: Rollout,
               p: PolicyConfig, shaping: Shaping, group_size: int | None = None):
    """(scores, [N] rewards, [Q] broken groups): the reward callable's scores with non-finite
    groups zeroed, DAPO's overlong penalty added (under process supervision to the last step's
    reward too), with `controls.shuffle_rewards` the control's permutation applied, and under a
    gold budget (`grpo.gold_share` < 1) the questions whose check is readable marked
    (`Scores.revealed`). Each record has `group_size` samples (default `policy.group_size`;
    T-PPO scores single rows)."""
    group_size = group_size or p.group_size
    rows = [r for r in records for _ in range(group_size)]
    scores = reward_fn(rows, rollout)
    if shaping.gold_share < 1.0:  # the gold budget: the check readable on these questions only
        scores = replace(scores, revealed=gold_budget(rows, shaping.gold_share,
                                                      shaping.gold_seed))
    scores = scores.to(rollout.completion_ids.device)  # every tensor of the step on one device
    scores, broken = drop_nonfinite(scores, group_size)
    penalty = overlong_penalty(rollout.lengths, p.max_new_tokens, shaping.overlong_buffer,
                               shaping.overlong_penalty)
    rewards = scores.rewards.float() + penalty
    if scores.step_rewards is not None and bool(penalty.any()):
        scores = replace(scores, step_rewards=add_to_last_step(scores.step_rewards.float(),
                                                               scores.step_mask, penalty))
    if shaping.shuffle:
        scores, rewards = shuffled_rewards(scores, rewards)
    return scores, rewards, broken


@dataclass
class Sampled:
    """A step's questions, their G samples each (grouped question by question) and scores."""
    records: list[MathRecord]
    rollout: Rollout
    scores: Scores
    rewards: torch.Tensor
    """[N] solution rewards (the overlong penalty included)."""
    broken: torch.Tensor
    """[Q] groups holding a non-finite reward."""
    stats: dict = field(default_factory=dict)

    def groups(self, index: list[int]) -> "Sampled":
        """The question groups at `index`, in that order."""
        size = self.rollout.group_size
        rows = torch.tensor([q * size + j for q in index for j in range(size)], dtype=torch.long,
                            device=self.rewards.device)
        return Sampled([self.records[q] for q in index], self.rollout.rows(rows),
                       self.scores.rows(rows), self.rewards[rows],
                       self.broken[torch.tensor(index, dtype=torch.long,
                                                device=self.broken.device)])


def concat_sampled(parts: list[Sampled], pad_id: int) -> Sampled:
    return Sampled([r for p in parts for r in p.records],
                   concat_rollouts([p.rollout for p in parts], pad_id),
                   concat_scores([p.scores for p in parts]),
                   torch.cat([p.rewards for p in parts]), torch.cat([p.broken for p in parts]))


def learn_reward(online: LearnsOnline | None, sampled: Sampled, trainer, where: str) -> dict:
    """A reward that learns online (`rm.online`) takes its step on the step's samples, scored
    already, through the stage's `trainer` (`StageLoop.backward`); its metrics ({} for a fixed
    reward)."""
    if online is None:
        return {}
    rows = [rec for rec in sampled.records for _ in range(sampled.rollout.group_size)]
    with memory_phase("RM update"):  # (configs/memory.py's phase)
        return online.learn(rows, sampled.rollout, trainer.backward, where)


class UpdatedFirst:
    """PRIME's order for a reward that learns online (`rm.online_update=before`; verl's
    recipe/prime `update: before`): when a step's samples are scored, the learner first takes
    its step on their checks, then scores them with its updated weights (so every reward has
    seen its own sample's label, as in PRIME). Its step runs inside the scoring (vLLM asleep,
    through the stage's `StageLoop.backward`: `bind`); `learn`, called after the policy's update,
    only hands on that step's metrics. A `policy.rewards.LearnsOnline` like the learner it
    wraps (`reward_model/online.py`'s ORM or `implicit.py`'s PRM: `verdicts`, `score`)."""

    reads_gold = True

    def __init__(self, learner):
        self.learner, self.name = learner, learner.name
        self.trainer, self.metrics = None, {}

    def companions(self) -> dict:
        return self.learner.companions()

    def bind(self, trainer) -> None:
        """The stage's `StageLoop`, whose `backward` steps the learner's engine."""
        self.trainer = trainer

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        if self.trainer is None:
            raise RuntimeError("rm.online_update=before: the reward scores inside a GRPO stage, "
                               "which binds its trainer first (policy/algorithms/grpo.py "
                               "start_stage)")
        correct = self.learner.verdicts.grade(records, rollout.texts, self.learner.timeout_s)
        self.learner.companions()
        self.metrics = self.learner.learn(records, rollout, self.trainer.backward,
                                          f"step {self.trainer.step + 1}, before scoring")
        return self.learner.score(records, rollout, correct)

    def learn(self, records: list[MathRecord], rollout: Rollout, backward, where: str) -> dict:
        metrics, self.metrics = self.metrics, {}
        return metrics

    def export(self, folder, config_yaml: str) -> None:
        self.learner.export(folder, config_yaml)
