"""Reward shaping before the advantages: DAPO's soft overlong punishment, and how a
solution-level term reaches process rewards (added to the last step's reward)."""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to L_max - L_cache, then
    linearly down to -penalty at L_max (`buffer` = L_cache tokens)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    excess = (lengths.float() - (max_tokens - buffer)).clamp(min=0)
    return -penalty * (excess / buffer).clamp(max=1.0)


def add_to_last_step(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                     values: torch.Tensor) -> torch.Tensor:
    """[N, S] step rewards with `values` [N] added to each sample's last real step: how a
    solution-level term (DAPO's overlong penalty) reaches process advantages, where every token
    of the sample sums the normalised rewards of its step and the later ones. Samples without a
    step are left as they are."""
    positions = torch.arange(step_mask.shape[1], device=step_mask.device)
    last = torch.where(step_mask, positions, -1).amax(-1)
    hit = (positions[None, :] == last[:, None]) & step_mask
    return step_rewards + hit.to(step_rewards.dtype) * values[:, None].to(step_rewards.dtype)
