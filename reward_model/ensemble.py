"""Reward-model ensembles (`rm.ensemble: K`; Coste et al., ICLR 2024, "Reward Model Ensembles Help
Mitigate Overoptimization"): K reward models of one kind, differing in seed and data order
(iteration/loop.py trains them), score every sample; GRPO is rewarded by their aggregate, step by
step for a PRM (before any credit form reads the steps), per solution for an ORM:

    mean         the members' mean
    worst        the members' minimum (Coste et al.'s worst-case optimisation, WCO)
    uncertainty  mean - lambda * variance over the members (their uncertainty-weighted
                 optimisation, UWO; `rm.ensemble_lambda`)

An ensemble only helps where its members err apart. `shared_error` measures where they err
together: the share of wrong samples that every member ranks above its own median right sample of
the group, which no aggregate can push back down (policy/watch.py `shared_error`). The watch logs
it each step with each member's in-group AUROC (`watch/shared_error`, `watch/member_auroc/K`).
"""

from __future__ import annotations

import torch

from policy.generation.rollout import Rollout
from policy.rewards import Scores
from runtime.data import MathRecord

ENSEMBLE_AGGREGATES = ("mean", "worst", "uncertainty")


def aggregate_members(values: torch.Tensor, how: str, lam: float = 1.0) -> torch.Tensor:
    """[K, ...] the members' values -> [...] their aggregate (module docstring); the variance is
    the population one over the K members."""
    values = values.float()
    if how == "mean":
        return values.mean(0)
    if how == "worst":
        return values.amin(0)
    if how == "uncertainty":
        return values.mean(0) - lam * values.var(0, unbiased=False)
    raise ValueError(f"rm.ensemble_aggregate={how}; expected one of {ENSEMBLE_AGGREGATES}")


class EnsembleReward:
    """GRPO's reward from K member rewards of one kind (`reward_model/score.py`'s `PRMReward`s or
    `ORMReward`s): one grading (the first member's, handed to the others), each member's
    scores, their aggregate (`aggregate_members`) per
    step and then per solution by the PRM's own step aggregate (`rm.aggregate`; `step_aggregate`)
    or per solution for ORMs. The members' own solution scores ride along (`Scores.members`)."""

    def __init__(self, members: list, how: str, lam: float = 1.0, step_aggregate=None):
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least 2 members, got {len(members)}")
        self.members, self.how, self.lam = members, how, lam
        self.step_aggregate = step_aggregate
        aggregate_members(torch.zeros(2, 1), how, lam)  # an unknown aggregate fails here

    def value_init(self):
        """`policy.rewards.ValueSource` (`ppo.critic_init=reward_model`): the first member's."""
        return self.members[0].value_init()

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        first = self.members[0](records, rollout)  # it grades the samples; the others reuse it
        correct = first.correct
        each = [first, *(member(records, rollout, correct=correct)
                         for member in self.members[1:])]
        own = torch.stack([s.rewards.float() for s in each], -1)  # [N, K]
        if each[0].step_rewards is None:  # ORMs: one score a solution
            return Scores(rewards=aggregate_members(own.T, self.how, self.lam), correct=correct,
                          members=own)
        width = max(s.step_rewards.shape[1] for s in each)

        def padded(t, value):
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        steps = torch.stack([padded(s.step_rewards.float(), 0.0) for s in each])  # [K, N, S]
        mask = torch.stack([padded(s.step_mask, False) for s in each]).all(0)
        # (steps one member's max_length cut are left out of every member's: the shared ones)
        step_rewards = torch.where(mask, aggregate_members(steps, self.how, self.lam), 0.0)
        widest = max(each, key=lambda s: s.step_rewards.shape[1])
        return Scores(rewards=self.step_aggregate(step_rewards, mask), correct=correct,
                      step_rewards=step_rewards, step_mask=mask,
                      step_end_index=padded(widest.step_end_index, 0), members=own)
