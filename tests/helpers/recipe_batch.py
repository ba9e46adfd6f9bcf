"""One batch for every recipe: 2 questions x G = 3 samples, completion lengths 3, 1, 2 | 2, 2, 1;
group 1 has rewards 1, 0, 0 (signal), group 2 rewards 1, 1, 1 (no signal). Used by the recipe,
advantage, loss and GRPO tests."""

import torch

from configs import load_config
from policy.generation.rollout import Rollout

LENGTHS = [3, 1, 2, 2, 2, 1]
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
WIDTH = 4


def batch_rollout(lengths=LENGTHS, width=WIDTH, truncated=None) -> Rollout:
    n = len(lengths)
    mask = torch.tensor([[1] * n_ + [0] * (width - n_) for n_ in lengths])
    return Rollout(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                   torch.ones(n, width, dtype=torch.long), mask, [""] * n,
                   torch.tensor(truncated or [False] * n), 3)


def recipe_config(name, *extra):
    """The recipe over the tiny config, at this batch's sizes."""
    return load_config("configs/tiny.yaml", ["policy.supervision=outcome", "policy.group_size=3",
                                             "policy.questions_per_step=2",
                                             "policy.max_new_tokens=4", *extra], recipe=name)
