"""The seed's worked example (../shared/seeds/003_69686f70371876c1.txt): G = 4, eps = 0.2,
per-token old and new probabilities, rewards 1, 1, 1, 0 (tests/test_advantages.py,
tests/test_losses.py)."""

import torch

from policy.math.advantages import outcome_advantages

OLD = [
    [0.30, 0.25, 0.40, 0.35, 0.45, 0.60, 0.80],
    [0.15, 0.40, 0.50, 0.45, 0.30, 0.40, 0.35, 0.25, 0.20, 0.60, 0.70, 0.80],
    [0.20, 0.30, 0.25, 0.70],
    [0.10, 0.25, 0.15, 0.40, 0.35, 0.10, 0.60, 0.20, 0.15, 0.45, 0.25, 0.75],
]
NEW = [
    [0.35, 0.28, 0.45, 0.32, 0.50, 0.65, 0.85],
    [0.12, 0.35, 0.55, 0.48, 0.25, 0.45, 0.40, 0.20, 0.15, 0.65, 0.75, 0.85],
    [0.25, 0.35, 0.30, 0.75],
    [0.08, 0.30, 0.18, 0.45, 0.40, 0.08, 0.65, 0.18, 0.12, 0.50, 0.20, 0.80],
]
REWARDS = [1.0, 1.0, 1.0, 0.0]


def padded(rows, fill=1.0):
    """[N, T] float64 values (right-padded with `fill`) and their mask."""
    width = max(len(r) for r in rows)
    values = torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows],
                        dtype=torch.float64)
    return values, mask


def seed_inputs():
    """(new log-probs, old log-probs, token advantages, mask, [4] advantages) of the example."""
    old, mask = padded(OLD)
    new, _ = padded(NEW)
    adv = outcome_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4)
    return new.log(), old.log(), adv[:, None] * mask, mask, adv
