"""Group-relative advantages (DeepSeekMath §4.1.2 outcome, §4.1.3 process) as pure functions,
and the credit forms for process rewards (`PROCESS_CREDIT`: §4.1.3's sum, PURE's min, anchored).

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


def step_sums_to_tokens(normalised: torch.Tensor, step_mask: torch.Tensor,
                        step_end_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N, S] normalised step rewards -> [N, T]: token t gets the sum over steps ending at or
    after t (0 after the last step)."""
    token = torch.arange(num_tokens, device=normalised.device)
    covers = (step_end_index[:, None, :] >= token[None, :, None]) & step_mask[:, None, :]
    return (covers.to(normalised.dtype) * normalised[:, None, :]).sum(-1)


@dataclass(frozen=True)
class GroupNorm:
    """How a group's rewards are normalised: groups of `group_size` rows, divided by their std
    or not, the std's convention, the epsilon added to it, and the spread at or below which a
    group gets 0."""
    group_size: int
    scale_by_std: bool = True
    unbiased: bool = False
    eps: float = 1e-6
    min_std: float = 0.0


def outcome_estimate(rewards: torch.Tensor, num_tokens: int, norm: GroupNorm
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome supervision (§4.1.2): every token of a sample gets its normalised reward.
    rewards: [N]. Returns ([N, T] token advantages, [N, 1] normalised rewards)."""
    normalised = outcome_advantages(rewards, norm.group_size, scale_by_std=norm.scale_by_std,
                                    unbiased=norm.unbiased, eps=norm.eps,
                                    min_std=norm.min_std)[:, None]
    return normalised.expand(-1, num_tokens), normalised


def rft_estimate(rewards: torch.Tensor, num_tokens: int, norm: GroupNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online RFT (§5.2.1): every token of a right sample gets 1, of a wrong one 0 (no group
    baseline: `norm` is not read). Returns ([N, T], [N, 1])."""
    normalised = rejection_sampling_advantages(rewards)[:, None]
    return normalised.expand(-1, num_tokens), normalised


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "outcome": outcome_estimate,
    "rft": rft_estimate,
}
"""`policy.supervision` (outcome, rft) -> estimator(rewards [N], T, GroupNorm) -> (token
advantages [N, T], what was normalised [N, 1]). Process supervision takes its credit form from
`PROCESS_CREDIT` instead."""


# Credit assignment for process rewards (`grpo.process_credit`, docs/grpo.md): how step rewards
# become token advantages. Each form: (step_rewards, step_mask, step_end_index [N, S], correct
# [N] bool or None, T, GroupNorm, weight) -> ([N, T] token advantages, what was normalised).

NO_CHECK = ("grpo.process_credit=anchored and prime need the reward's final-answer check "
            "(Scores.correct), but this reward did not return it")


def sum_credit(step_rewards: torch.Tensor, step_mask: torch.Tensor,
               step_end_index: torch.Tensor, correct: torch.Tensor | None, num_tokens: int,
               norm: GroupNorm, weight: float = 0.0, revealed: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeekMath §4.1.3: all step rewards of a group normalised together, r~ = (r - mean) /
    std; token t gets sum_{j: end_j >= t} r~_j, its step's and every later step's (0 after the
    last step, and on every token of a sample without a step).
    Returns ([N, T], [N, S] normalised step rewards)."""
    normalised = normalised_step_rewards(step_rewards.float(), step_mask, norm.group_size,
                                         scale_by_std=norm.scale_by_std, unbiased=norm.unbiased,
                                         eps=norm.eps, min_std=norm.min_std)
    return step_sums_to_tokens(normalised, step_mask, step_end_index, num_tokens), normalised


def min_form_values(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PURE's min-form value of each step (Cheng et al. 2025, V(s_t) = min_{t' >= t} r_t'):
    v_k = min_{j >= k} r_j over the sample's real steps j. A sample without a step (an empty
    completion) has no value of its own and must not sit at the group's average: it gets one
    entry, in column 0, at the group's floor min(0, lowest step reward of the group) (0 is the
    bottom of a P(+) read-out and the step oracle's "wrong"; every reward here scores a sample
    without a step 0), so it is never above any real step of its group.

    step_rewards, step_mask: [Q*G, S]. Returns ([Q*G, S] float32 values (0 on padding),
    [Q*G, S] bool: the entries that count: real steps, and column 0 of a sample without one).
    """
    rewards = step_rewards.float()
    s = rewards.shape[1]
    masked = torch.where(step_mask, rewards, torch.full_like(rewards, float("inf")))
    later_min = masked.flip(-1).cummin(-1).values.flip(-1)
    values = torch.where(step_mask, later_min, torch.zeros_like(rewards))
    floor = masked.reshape(-1, group_size * s).amin(-1).clamp(max=0.0)
    empty = ~step_mask.any(-1)
    first = torch.zeros_like(step_mask)
    first[:, 0] = True
    stand_in = first & empty[:, None]
    values = torch.where(stand_in, floor.repeat_interleave(group_size)[:, None], values)
    return values, step_mask | stand_in


def own_step_to_tokens(values: torch.Tensor, step_mask: torch.Tensor,
                       step_end_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N, S] per-step values -> [N, T]: token t gets the value of its own step, the first real
    step ending at or after t (step ends increase along a sample); 0 after the last step; a
    sample without a step gets its column-0 entry (`min_form_values`' floor) on every token."""
    token = torch.arange(num_tokens, device=values.device)
    covers = (step_end_index[:, None, :] >= token[None, :, None]) & step_mask[:, None, :]
    own = covers & (covers.cumsum(-1) == 1)
    tokens = (own.to(values.dtype) * values[:, None, :]).sum(-1)
    empty = ~step_mask.any(-1)
    return torch.where(empty[:, None], values[:, :1].expand(-1, num_tokens), tokens)


def min_credit(step_rewards: torch.Tensor, step_mask: torch.Tensor,
               step_end_index: torch.Tensor, correct: torch.Tensor | None, num_tokens: int,
               norm: GroupNorm, weight: float = 0.0, revealed: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """PURE's min-form credit (Cheng et al. 2025, "Stop Summation: Min-Form Credit Assignment Is
    All Process Reward Model Needs for Reasoning"), in GRPO's group normalisation: the values
    v_k = min_{j >= k} r_j of a group's steps (`min_form_values`, a sample without a step at the
    group's floor) are normalised together, v~ = (v - mean) / std over all of them, each step
    once, as §4.1.3 normalises rewards; token t gets v~ of its own step (0 after the last step).
    Where a sample's rewards never rise again (the step oracle: 1 up to the first slip, then 0),
    every step's value is the last step's reward.

    The value is the paper's definition and the strict form of PURE's code (CJReinforce/PURE,
    branch verl: `reward_model.credit_assignment: 'strict min-form'`, a reverse running minimum
    of the token-level rewards in `compute_rloo_outcome_advantage`,
    verl/trainer/ppo/core_algos.py). Where this departs from that code: its default (temperature
    0.1) turns each sample's step rewards r into softmax(-r / 0.1) * r and sums them from the
    token on (verl/workers/fsdp_workers.py `_forward_micro_batch`; main branch:
    openrlhf/utils/utils.py `turn_process_reward_logits_to_reward`), which is ~min_j r_j up to
    the worst step and ~0 after it, not the minimum of the later steps; its strict form also
    takes the minimum over the 0 of every token that ends no step; and its baseline is RLOO's
    (the other samples' mean return per token) and the advantages are whitened over the batch,
    where here the group's mean and std over steps are used. Its verifiable reward is added to
    the last token's reward (coefficient 1.0); here that is `anchored_credit`.
    Returns ([N, T], [N, S] normalised values, the floor of a stepless sample in column 0)."""
    values, valid = min_form_values(step_rewards, step_mask, norm.group_size)
    normalised = normalised_step_rewards(values, valid, norm.group_size,
                                         scale_by_std=norm.scale_by_std, unbiased=norm.unbiased,
                                         eps=norm.eps, min_std=norm.min_std)
    return own_step_to_tokens(normalised, step_mask, step_end_index, num_tokens), normalised


def anchored_credit(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                    step_end_index: torch.Tensor, correct: torch.Tensor | None,
                    num_tokens: int, norm: GroupNorm, weight: float = 0.5,
                    revealed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact final-answer check's outcome advantage plus a bounded process term:
    A_t = o + weight * clamp(v~_t, -1, 1), where o = (c - mean) / std is `correct` [N] (1 right,
    0 wrong) normalised within each group of G samples (as outcome supervision normalises its
    rewards), and v~_t is `min_credit`'s token value, normalised within the group separately
    (over the steps' min-form values). The process term cannot grow with the number of steps
    (Gao et al. 2024, "On Designing Effective RL Reward at Training Time for LLM Reasoning",
    bound process rewards against such hacking with Clip and Delta), and with weight <= 0.5 it
    never lifts a wrong answer's token above a right answer's in its group: their outcome
    advantages differ by 1 / sqrt(q (1 - q)) >= 2 (q the group's share right; >= 1.41 with the
    sample std, exactly 1 without the std), while the process term spans at most 2 * weight
    (unless `min_std` zeroes the outcome part). Where the outcome does not spread (all right or
    all wrong) only the process term speaks. PURE's best model added verifiable rewards, on the
    ~10% of its prompts that had a gold answer, to its PRM's (coefficient 1.0, on the last
    token); here every sample has its verdict and the PRM refines it.
    Under a gold budget (`revealed` [N] bool, whole groups: the questions whose check may be
    read) a group outside it has no outcome term, and its tokens get the min-form value v~_t
    alone, unclamped and unweighted (`min_credit`: the PRM is all it has).
    Returns ([N, T], [N, S + 1]: the normalised min-form values, then o in the last column,
    0 outside the budget)."""
    process, normalised = min_credit(step_rewards, step_mask, step_end_index, None, num_tokens,
                                     norm)
    return outcome_beside(process, weight * process.clamp(-1.0, 1.0), normalised, correct, norm,
                          revealed)


def outcome_beside(process: torch.Tensor, term: torch.Tensor, normalised: torch.Tensor,
                   correct: torch.Tensor | None, norm: GroupNorm,
                   revealed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The check's forms (`anchored`, `prime`): A_t = o + `term` ([N, T], the weighted process
    part), o = `correct` normalised within each group; under a gold budget (`revealed` [N]) a
    group outside it gets the unweighted `process` alone and o = 0. Returns (A, `normalised`
    [N, S] with o appended as the last column)."""
    if correct is None:
        raise ValueError(NO_CHECK)
    outcome = outcome_advantages(correct.float(), norm.group_size, scale_by_std=norm.scale_by_std,
                                 unbiased=norm.unbiased, eps=norm.eps, min_std=norm.min_std)
    advantages = outcome[:, None] + term
    if revealed is not None:
        advantages = torch.where(revealed[:, None], advantages, process)
        outcome = torch.where(revealed, outcome, torch.zeros_like(outcome))
    return advantages, torch.cat([normalised, outcome[:, None]], -1)


def prime_credit(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                 step_end_index: torch.Tensor, correct: torch.Tensor | None, num_tokens: int,
                 norm: GroupNorm, weight: float = 1.0, revealed: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """PRIME's advantage (Cui et al. 2025; verl's recipe/prime `compute_rloo_advantage_return`)
    in GRPO's group normalisation: the exact check's outcome advantage plus `weight` times the
    sum form's, A_t = o + weight * sum_{j: end_j >= t} r~_j, where o = (c - mean) / std is
    `correct` normalised within each group and r~ the group-normalised step rewards
    (`sum_credit`). PRIME baselines each reward source separately (its "gt" and its implicit
    rewards, leave-one-out within the group), sums them at equal coefficients (5 and 5: weight
    1.0), takes each token's return over the later tokens and whitens the batch; here the group
    normalises each source and the step's return is the sum form's. Unlike `anchored_credit` the
    process term is neither bounded nor min-form: PRIME's own. Under a gold budget (`revealed`)
    a group outside it gets the sum form alone.
    Returns ([N, T], [N, S + 1]: the normalised step rewards, then o in the last column, 0
    outside the budget)."""
    process, normalised = sum_credit(step_rewards, step_mask, step_end_index, None, num_tokens,
                                     norm)
    return outcome_beside(process, weight * process, normalised, correct, norm, revealed)


def sum_informative(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                    correct: torch.Tensor | None, group_size: int,
                    revealed: torch.Tensor | None = None) -> torch.Tensor:
    """[Q] bool: the group's step rewards spread (what `sum_credit` normalises)."""
    return informative_groups(step_rewards, group_size, step_rewards, step_mask)


def min_informative(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                    correct: torch.Tensor | None, group_size: int,
                    revealed: torch.Tensor | None = None) -> torch.Tensor:
    """[Q] bool: the group's min-form values spread (what `min_credit` normalises)."""
    values, valid = min_form_values(step_rewards, step_mask, group_size)
    width = group_size * values.shape[1]
    return ~zero_spread(values.reshape(-1, width), valid.reshape(-1, width))


def anchored_informative(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                         correct: torch.Tensor | None, group_size: int,
                         revealed: torch.Tensor | None = None) -> torch.Tensor:
    """[Q] bool: the group's final-answer checks (inside the gold budget) or its min-form
    values spread (either part of `anchored_credit` can carry signal)."""
    return (checks_spread(correct, group_size, revealed)
            | min_informative(step_rewards, step_mask, correct, group_size))


def checks_spread(correct: torch.Tensor | None, group_size: int,
                  revealed: torch.Tensor | None = None) -> torch.Tensor:
    """[Q] bool: the group's final-answer checks are not all equal, and (under a gold budget)
    may be read."""
    if correct is None:
        raise ValueError(NO_CHECK)
    verdicts = correct.float().view(-1, group_size)
    spread = ~zero_spread(verdicts, torch.ones_like(verdicts, dtype=torch.bool))
    if revealed is not None:
        spread &= revealed.view(-1, group_size)[:, 0]
    return spread


def prime_informative(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                      correct: torch.Tensor | None, group_size: int,
                      revealed: torch.Tensor | None = None) -> torch.Tensor:
    """[Q] bool: the group's checks (inside the gold budget) or its step rewards spread."""
    return (checks_spread(correct, group_size, revealed)
            | sum_informative(step_rewards, step_mask, correct, group_size))


@dataclass(frozen=True)
class ProcessCredit:
    """One `grpo.process_credit` form: its estimator and DAPO's filter on what it normalises."""
    estimate: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """(step_rewards, step_mask, step_end_index [N, S], correct [N] | None, T, GroupNorm,
    weight, revealed=[N] bool | None) -> ([N, T] token advantages, what was normalised);
    `revealed`: the gold budget (only the anchored form reads the check)."""
    informative: Callable[..., torch.Tensor]
    """(step_rewards, step_mask [N, S], correct [N] | None, G, revealed=...) -> [Q] bool:
    groups whose advantages can be non-zero."""
    reads_check: bool = False
    """The advantages read the exact final-answer check (`Scores.correct`)."""


PROCESS_CREDIT: dict[str, ProcessCredit] = {
    "sum": ProcessCredit(sum_credit, sum_informative),
    "min": ProcessCredit(min_credit, min_informative),
    "anchored": ProcessCredit(anchored_credit, anchored_informative, reads_check=True),
    "prime": ProcessCredit(prime_credit, prime_informative, reads_check=True),
}
"""`grpo.process_credit` -> how process rewards become token advantages (docs/grpo.md)."""


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
