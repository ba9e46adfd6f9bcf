"""Group-relative advantages (DeepSeekMath §4.1.2 outcome, §4.1.3 process) as pure functions.

Samples are laid out group by group: rows [q*G, (q+1)*G) are the G samples of question q.
Groups whose rewards are all equal get advantage 0 (never NaN), also when they are equal only up
to float rounding (`zero_spread`); so do groups whose reward std is at or below an optional floor
`min_std` (default 0, the paper's formula): dividing by a tiny std turns a reward model's noise
into full-size advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


SPREAD_ULPS = 8
"""Rewards of a group that differ by at most this many units in the last place of their dtype
(relative to the group's largest magnitude) are equal: 0.1 + 0.6 and 0.7 are one reward."""


def zero_spread(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[Q] bool: the valid entries of each row of `values` [Q, K] are equal up to float rounding
    of `values`' dtype (or there are none). A group with zero spread carries no signal."""
    lowest = torch.finfo(values.dtype).min
    high = torch.where(valid, values, lowest).amax(-1).double()
    low = torch.where(valid, values, torch.finfo(values.dtype).max).amin(-1).double()
    scale = torch.maximum(high.abs(), low.abs())
    tolerance = SPREAD_ULPS * torch.finfo(values.dtype).eps * scale
    return ~valid.any(-1) | ((high - low) <= tolerance)


def _normalise(values: torch.Tensor, valid: torch.Tensor, scale_by_std: bool, unbiased: bool,
               eps: float, min_std: float = 0.0) -> torch.Tensor:
    """(v - mean) / (std + eps) over the valid entries of each row of `values` [Q, K]; rows
    whose spread is zero (`zero_spread`) or whose std is <= `min_std` get 0. The statistics are
    taken in float64 and the result returned in `values`' dtype."""
    flat = zero_spread(values, valid)
    wide = values.double()
    valid_f = valid.double()
    count = valid_f.sum(-1, keepdim=True).clamp(min=1)
    mean = (wide * valid_f).sum(-1, keepdim=True) / count
    centred = (wide - mean) * valid_f
    dof = (count - 1).clamp(min=1) if unbiased else count
    std = (centred.square().sum(-1, keepdim=True) / dof).sqrt()
    # A group with no spread carries no signal, nor does one whose std is within the floor.
    scaled = centred / (std + eps) if scale_by_std else centred
    signal = (std > min_std) & ~flat[:, None]
    return torch.where(signal, scaled, torch.zeros_like(centred)).to(values.dtype)


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


@dataclass(frozen=True)
class GroupNorm:
    """How a group's rewards are normalised (`grpo.group_size`, `grpo.scale_by_std` and the
    variant's own choice, `grpo.std_unbiased`, `grpo.std_eps`, `grpo.min_reward_std`)."""
    group_size: int
    scale_by_std: bool = True
    unbiased: bool = False
    eps: float = 1e-6
    min_std: float = 0.0


def outcome_estimate(rewards: torch.Tensor, step_rewards, step_mask, step_end_index,
                     num_tokens: int, norm: GroupNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome supervision (§4.1.2): every token of a sample gets its normalised reward.
    rewards: [N]. Returns ([N, T] token advantages, [N, 1] normalised rewards)."""
    normalised = outcome_advantages(rewards, norm.group_size, scale_by_std=norm.scale_by_std,
                                    unbiased=norm.unbiased, eps=norm.eps,
                                    min_std=norm.min_std)[:, None]
    return normalised.expand(-1, num_tokens), normalised


def rft_estimate(rewards: torch.Tensor, step_rewards, step_mask, step_end_index,
                 num_tokens: int, norm: GroupNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """Online RFT (§5.2.1): every token of a right sample gets 1, of a wrong one 0.
    Returns ([N, T], [N, 1])."""
    normalised = rejection_sampling_advantages(rewards)[:, None]
    return normalised.expand(-1, num_tokens), normalised


def process_estimate(rewards: torch.Tensor, step_rewards: torch.Tensor, step_mask: torch.Tensor,
                     step_end_index: torch.Tensor, num_tokens: int, norm: GroupNorm
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Process supervision (§4.1.3): a token gets the sum of the normalised rewards of its step
    and every later one. step_*: [N, S]. Returns ([N, T], [N, S] normalised step rewards)."""
    normalised = normalised_step_rewards(step_rewards.float(), step_mask, norm.group_size,
                                         scale_by_std=norm.scale_by_std, unbiased=norm.unbiased,
                                         eps=norm.eps, min_std=norm.min_std)
    return step_sums_to_tokens(normalised, step_mask, step_end_index, num_tokens), normalised


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "outcome": outcome_estimate,
    "process": process_estimate,
    "rft": rft_estimate,
}
"""`grpo.supervision` -> estimator(rewards [N], step_rewards, step_mask, step_end_index [N, S]
(None for outcome rewards), T, GroupNorm) -> (token advantages [N, T], what was normalised)."""


def informative_groups(rewards: torch.Tensor, group_size: int,
                       step_rewards: torch.Tensor | None = None,
                       step_mask: torch.Tensor | None = None) -> torch.Tensor:
    """DAPO's dynamic-sampling filter (Yu et al. 2025, eq. 11: 0 < |{o_i correct}| < G), on the
    values the advantages are built from: [Q] bool, True where a group's rewards (process
    supervision: all of its step rewards together) are not all equal up to float rounding."""
    if step_rewards is None:
        grouped = rewards.view(-1, group_size)
        return ~zero_spread(grouped, torch.ones_like(grouped, dtype=torch.bool))
    s = step_rewards.shape[1]
    return ~zero_spread(step_rewards.reshape(-1, group_size * s),
                        step_mask.reshape(-1, group_size * s))


def zero_group_correction(num_rows: float, zero_rows: float) -> float:
    """GPG's gradient correction (Chu et al. 2025, eq. 9): alpha = B / (B - M) for a batch of B
    samples of which M have zero advantage (their groups' rewards all equal), so that the
    batch-mean gradient is not shrunk by samples that carry none. 1 when every sample does."""
    if num_rows <= zero_rows:
        return 1.0
    return num_rows / (num_rows - zero_rows)


def token_budget_mask(lengths: torch.Tensor, budget: int, order: torch.Tensor) -> torch.Tensor:
    """C3PO's training-token budget (Ling Team 2025, Ring-lite eq. 4): responses are taken in
    `order` (the sampling strategy's order of row indices) until their lengths reach the budget
    Phi: N responses with sum_{j<N} |y_j| < Phi <= sum_{j<=N} |y_j|, and the last one keeps only
    the tokens that bring the total to exactly Phi (|Psi| = Phi; fewer when the batch holds fewer).

    lengths: [N] tokens per response. Returns [N] the number of tokens kept from each response
    (its first ones)."""
    kept = torch.zeros_like(lengths)
    left = budget
    for row in order.tolist():
        if left <= 0:
            break
        take = min(int(lengths[row]), left)
        kept[row] = take
        left -= take
    return kept
