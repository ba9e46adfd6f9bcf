"""Group-relative advantages (DeepSeekMath §4.1.2 outcome, §4.1.3 process) as pure functions.

Samples are laid out group by group: rows [q*G, (q+1)*G) are the G samples of question q.
Groups whose rewards are all equal get advantage 0 (never NaN); so do groups whose reward std is
at or below an optional floor `min_std` (default 0, the paper's formula): dividing by a tiny std
turns a reward model's noise into full-size advantages.
"""

from __future__ import annotations

import torch


def _normalise(values: torch.Tensor, valid: torch.Tensor, scale_by_std: bool, unbiased: bool,
               eps: float, min_std: float = 0.0) -> torch.Tensor:
    """(v - mean) / (std + eps) over the valid entries of each row of `values` [Q, K]; rows
    whose std is <= `min_std` get 0."""
    valid = valid.to(values.dtype)
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = (values * valid).sum(-1, keepdim=True) / count
    centred = (values - mean) * valid
    dof = (count - 1).clamp(min=1) if unbiased else count
    std = (centred.square().sum(-1, keepdim=True) / dof).sqrt()
    # A zero-std group carries no signal (its centred values are exactly 0), nor does one whose
    # spread is within the floor.
    scaled = centred / (std + eps) if scale_by_std else centred
    return torch.where(std > min_std, scaled, torch.zeros_like(centred))


def outcome_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                       unbiased: bool = False, eps: float = 1e-6,
                       min_std: float = 0.0) -> torch.Tensor:
    """(r - mean) / std within each group of G samples.

    rewards: [Q*G] one scalar per sample. Returns [Q*G]; every token of sample i gets entry i.
    """
    grouped = rewards.view(-1, group_size)
    valid = torch.ones_like(grouped, dtype=torch.bool)
    return _normalise(grouped, valid, scale_by_std, unbiased, eps, min_std).view(-1)


def rejection_sampling_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Online rejection-sampling fine-tuning (DeepSeekMath §5.2.1, gradient coefficient I(o)):
    1 for a sample judged right (reward >= 0.5: the rule's 1, an ORM's "right"), else 0. No
    baseline and no normalisation, so a wrong sample is ignored rather than pushed down.

    rewards: [Q*G]. Returns [Q*G]; every token of sample i gets entry i.
    """
    return (rewards >= 0.5).to(rewards.dtype)


def normalised_step_rewards(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                            group_size: int, *, scale_by_std: bool = True, unbiased: bool = False,
                            eps: float = 1e-6, min_std: float = 0.0) -> torch.Tensor:
    """All step rewards of each group normalised together: [Q*G, S] -> [Q*G, S] (0 on padding)."""
    n, s = step_rewards.shape
    grouped = step_rewards.reshape(-1, group_size * s)
    valid = step_mask.reshape(-1, group_size * s)
    return _normalise(grouped, valid, scale_by_std, unbiased, eps, min_std).view(n, s)


def process_advantages(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                       step_end_index: torch.Tensor, num_tokens: int, group_size: int, *,
                       scale_by_std: bool = True, unbiased: bool = False,
                       eps: float = 1e-6, min_std: float = 0.0) -> torch.Tensor:
    """Process-supervision advantages: a token gets the sum of the normalised rewards of its own
    step and every later step.

    step_rewards:   [Q*G, S] reward of each step (padding entries ignored).
    step_mask:      [Q*G, S] bool, True for real steps.
    step_end_index: [Q*G, S] completion-token index (0-based, inclusive) where each step ends.
    num_tokens:     T, the completion length of the returned tensor.
    All step rewards of a group (all its samples' steps together) are normalised by their mean
    and std; token t of a sample then gets sum_j norm_j over its steps j with end_j >= t.
    Tokens after a sample's last step end get 0. Returns [Q*G, T].
    """
    normalised = normalised_step_rewards(step_rewards, step_mask, group_size,
                                         scale_by_std=scale_by_std, unbiased=unbiased, eps=eps,
                                         min_std=min_std)
    return step_sums_to_tokens(normalised, step_mask, step_end_index, num_tokens)


def step_sums_to_tokens(normalised: torch.Tensor, step_mask: torch.Tensor,
                        step_end_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N, S] normalised step rewards -> [N, T]: token t gets the sum over steps ending at or
    after t (0 after the last step)."""
    token = torch.arange(num_tokens, device=normalised.device)
    covers = (step_end_index[:, None, :] >= token[None, :, None]) & step_mask[:, None, :]
    return (covers.to(normalised.dtype) * normalised[:, None, :]).sum(-1)
