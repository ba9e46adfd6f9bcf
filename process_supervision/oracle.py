"""A perfect process reward for the synthetic task: each step's true correctness.

It satisfies the policy's `RewardFn` contract like a PRM does, so process advantages can be run,
tested and used as a control (a PRM with 100% step accuracy) without training a reward model.
"""

from __future__ import annotations

import torch

from policy.rewards import Scores, grade_samples
from policy.generation.rollout import Rollout
from runtime.steps import pad_steps, split_steps, step_end_token_indices
from runtime.data import MathRecord
from tasks.synthetic import step_correctness


class StepOracleReward:
    """Step reward 1 for a step still on the true solution path, 0 once it went wrong."""

    reads_gold = True
    """Its rewards are gold (`policy.rewards.gold_read`)."""

    def __init__(self, tokenizer, timeout_s: int = 2):
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        correct = grade_samples(records, rollout.texts, self.timeout_s)
        values, ends = [], []
        for i, (rec, text) in enumerate(zip(records, rollout.texts)):
            ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
            steps = split_steps(text)
            truth = step_correctness(rec.question, steps) if steps else []
            values.append([float(t) for t in truth])
            ends.append(step_end_token_indices(self.tokenizer, ids, text))
        step_rewards, step_mask, step_end = pad_steps(values, ends)
        # Solution score: the min over steps (Math-Shepherd's aggregation); 0 with no step.
        masked = step_rewards.masked_fill(~step_mask, float("inf")).min(-1).values
        rewards = torch.where(step_mask.any(-1), masked, torch.zeros_like(masked))
        return Scores(rewards=rewards, correct=correct, step_rewards=step_rewards,
                      step_mask=step_mask, step_end_index=step_end)
