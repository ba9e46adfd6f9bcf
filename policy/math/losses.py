"""Policy losses: the paper's GRPO objective and its seed variants, as a plain table of functions.

Every loss takes per-token tensors of shape [N, T] (N sequences of one micro-batch, T completion
tokens, `mask` 1 on real completion tokens) and the *global* normalisers of the optimizer step
(`num_sequences`, `num_tokens` over all micro-batches and ranks), so that summing the micro-batch
losses gives exactly the loss of the whole batch. Each returns the loss to minimise (minus the
objective). The KL term `beta * k3` against the reference is part of every objective when
`beta > 0` and reference log-probs are given (the variants that drop it are run with beta = 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch


MAX_LOG_RATIO = 20.0
"""Log-probability ratios are clamped to +-20 before `exp` (e^20 ~ 5e8): an overflowing ratio
would turn the loss to inf/NaN, also on masked tokens (inf * 0 = NaN). Far outside any clip
range, so the clamp changes no clipped objective."""


def ratio(logprobs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """exp(logprobs - other), with the log-ratio clamped to +-MAX_LOG_RATIO. [N, T]."""
    return torch.exp((logprobs - other).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Unbiased, non-negative per-token KL estimator: pi_ref/pi - log(pi_ref/pi) - 1. [N, T]."""
    log_ratio = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1


def truncated_importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                                 mask: torch.Tensor, cap: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling for the sampler-trainer gap (TRL's and verl's TIS): the
    weights min(pi_old(y_t) / pi_sampler(y_t), cap) ([N, T], no gradient, 0 off `mask`) and
    where the cap bit ([N, T] bool). pi_old is the trainer's own log-prob of the rollout,
    pi_sampler the one the rollout engine (vLLM) sampled with: the samples came from
    pi_sampler, the objective is pi_old's, and the cap keeps the weights' variance bounded.
    The weight multiplies a token's advantage: for every per-token loss (its term r A, its clip
    decided by r and the sign of A, which a positive weight keeps) that is the token's
    policy-gradient term weighted, the KL term not; GSPO's sequence advantage (a mean of the
    token advantages) is then weighted by its tokens' mean weight."""
    raw = ratio(old_logprobs.detach(), sampler_logprobs.to(old_logprobs))
    live = mask.bool()
    return raw.clamp(max=cap) * live, (raw > cap) & live


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    """Scalar to minimise (this micro-batch's share of the step's loss)."""
    clip_fraction: torch.Tensor
    """Share of this micro-batch's tokens whose clipped term was active."""
    kl: torch.Tensor
    """Mean k3 KL per token of this micro-batch (0 without a reference)."""
    clip_high: torch.Tensor = torch.tensor(0.0)
    """Share of tokens clipped at the upper bound 1 + eps_high (part of `clip_fraction`)."""


def _clipped_surrogate(ratio, advantages, clip_eps_low, clip_eps_high):
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and where the clip is active: [N, T] with
    1 on lower-bound clips and 2 on upper-bound ones (0 elsewhere)."""
    clipped = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    high = (advantages > 0) & (ratio > 1 + clip_eps_high)
    low = (advantages < 0) & (ratio < 1 - clip_eps_low)
    return surrogate, low.long() + 2 * high.long()


def _with_kl(per_token, logprobs, ref_logprobs, beta):
    if ref_logprobs is None or beta == 0:
        return per_token, torch.zeros_like(per_token)
    kl = k3_kl(logprobs, ref_logprobs)
    return per_token - beta * kl, kl


def _ppo_terms(logprobs, old_logprobs, ref_logprobs, advantages, clip_eps_low, clip_eps_high,
               beta):
    """Per-token clipped surrogate minus beta * KL, the clip-active mask, and the KL. [N, T] each."""
    surrogate, active = _clipped_surrogate(ratio(logprobs, old_logprobs), advantages,
                                           clip_eps_low, clip_eps_high)
    per_token, kl = _with_kl(surrogate, logprobs, ref_logprobs, beta)
    return per_token, active, kl


def _masked_inputs(loss_fn):
    """Zero the inputs on masked-out positions before the loss sees them: padding may hold
    -inf/NaN log-probs, and `x * 0` (or `where`'s backward) would carry NaN into the loss or its
    gradient."""

    @functools.wraps(loss_fn)
    def wrapped(logprobs, old_logprobs, ref_logprobs, advantages, mask, **kwargs):
        keep = mask.bool()

        def clean(t):
            return None if t is None else torch.where(keep, t, t.new_zeros(()))

        return loss_fn(clean(logprobs), clean(old_logprobs), clean(ref_logprobs),
                       clean(advantages), mask, **kwargs)

    return wrapped


def _output(objective, active, kl, mask):
    """`active`: [N, T] 0 = not clipped, 1 = clipped below, 2 = clipped above."""
    tokens = mask.sum().clamp(min=1)
    return LossOutput(-objective, ((active > 0).float() * mask).sum().detach() / tokens,
                      (kl * mask).sum().detach() / tokens,
                      ((active == 2).float() * mask).sum().detach() / tokens)


def _seq_mean(per_token, mask):
    return (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)


# The clipped-surrogate objectives: each the per-token min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
# - beta KL of `_ppo_terms`, summed and normalised its own way over the step's global counts.

@_masked_inputs
def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
              clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """GRPO (DeepSeekMath eq. 3): -1/G sum_i 1/|o_i| sum_t (the clipped surrogate - beta KL)."""
    per_token, active, kl = _ppo_terms(logprobs, old_logprobs, ref_logprobs, advantages,
                                       clip_eps_low, clip_eps_high, beta)
    return _output(_seq_mean(per_token, mask).sum() / num_sequences, active, kl, mask)


@_masked_inputs
def r1_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
            clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """DeepSeek-R1 as the seed writes it: -1/G sum_i sum_t (no 1/|o_i|)."""
    per_token, active, kl = _ppo_terms(logprobs, old_logprobs, ref_logprobs, advantages,
                                       clip_eps_low, clip_eps_high, beta)
    return _output((per_token * mask).sum() / num_sequences, active, kl, mask)


@_masked_inputs
def dr_grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
                 clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """Dr. GRPO (Liu et al. 2025, §3.2): a constant normaliser, G * max_tokens (and advantages
    not divided by the std: POLICY_LOSSES)."""
    per_token, active, kl = _ppo_terms(logprobs, old_logprobs, ref_logprobs, advantages,
                                       clip_eps_low, clip_eps_high, beta)
    return _output((per_token * mask).sum() / (num_sequences * max_tokens), active, kl, mask)


@_masked_inputs
def dapo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
              clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """DAPO (Yu et al. 2025, eq. 8): token level, -1/sum_i |o_i| sum_i sum_t, with clip-higher
    (`policy.clip_eps_high` > `policy.clip_eps`). C3PO (Ring-lite, eq. 4) is the same sum over its
    token budget: `num_tokens` is the budget Phi and `mask` the budget's tokens
    (policy.math.advantages.token_budget_mask, `grpo.token_budget_share`)."""
    per_token, active, kl = _ppo_terms(logprobs, old_logprobs, ref_logprobs, advantages,
                                       clip_eps_low, clip_eps_high, beta)
    return _output((per_token * mask).sum() / num_tokens, active, kl, mask)


@_masked_inputs
def gpg_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
             clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """GPG (Chu et al. 2025, eq. 6): 1/sum_i |o_i| sum_i sum_t A log pi: no ratio, no clipping,
    advantages r - mean(r) (F_norm = 1, see POLICY_LOSSES) and GPG's alpha correction
    (policy.math.advantages.zero_group_correction)."""
    per_token, kl = _with_kl(logprobs * advantages, logprobs, ref_logprobs, beta)
    return _output((per_token * mask).sum() / num_tokens, torch.zeros_like(mask), kl, mask)


@_masked_inputs
def cispo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
               clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """CISPO (MiniMax-M1, eq. 4-5): 1/sum_i |o_i| sum sg(min(r, 1 + eps_high)) * A * log pi.
    The importance weight is bounded above only (the paper sets no lower bound), so no token
    loses its gradient to clipping; `clip_eps_low` is not used."""
    is_weight = ratio(logprobs, old_logprobs).detach()
    weight = is_weight.clamp(max=1 + clip_eps_high)
    active = 2 * (is_weight > 1 + clip_eps_high).long()
    per_token, kl = _with_kl(weight * advantages * logprobs, logprobs, ref_logprobs, beta)
    return _output((per_token * mask).sum() / num_tokens, active, kl, mask)


def _sequence_ratio(logprobs, old_logprobs, mask):
    """GSPO's s_i = (pi(o_i|q) / pi_old(o_i|q))^(1/|o_i|) = exp(mean_t log(pi/pi_old)). [N]."""
    return torch.exp(_seq_mean(logprobs - old_logprobs, mask)
                     .clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _sequence_output(per_sequence, active, kl, mask, num_sequences):
    """A loss of [N] sequence objectives over the step's sequences (1/G sum_i), and its stats,
    `active` [N] counted on every token of its sequence."""
    tokens = mask.sum().clamp(min=1)
    per_token_active = active[:, None] * mask
    return LossOutput(-per_sequence.sum() / num_sequences,
                      ((per_token_active > 0).float()).sum().detach() / tokens,
                      (kl * mask).sum().detach() / tokens,
                      ((per_token_active == 2).float()).sum().detach() / tokens)


@_masked_inputs
def gspo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
              clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """GSPO (Zheng et al. 2025, eq. 5-7): 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low,
    1 + eps_high) A_i) with the sequence-level ratio s_i (`_sequence_ratio`) and the sequence's
    advantage A_i (the mean of its token advantages: the group-normalised reward under outcome
    supervision); minus beta times the sequence-mean k3 KL where a reference is given (the
    paper runs without: the gspo recipe sets beta 0)."""
    seq_advantage = _seq_mean(advantages, mask)
    surrogate, active = _clipped_surrogate(_sequence_ratio(logprobs, old_logprobs, mask),
                                           seq_advantage, clip_eps_low, clip_eps_high)
    _, kl = _with_kl(torch.zeros_like(logprobs), logprobs, ref_logprobs, beta)
    return _sequence_output(surrogate - beta * _seq_mean(kl, mask), active, kl, mask,
                            num_sequences)


@_masked_inputs
def gspo_token_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
                    clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): per-token advantages A_{i,t} (process
    supervision) under the ratio s_{i,t} = sg[s_i] * pi(o_t) / sg[pi(o_t)], whose value is the
    sequence's s_i (so the clip acts on whole sequences) and whose gradient is token t's;
    1/G sum_i 1/|o_i| sum_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t}). With every A_{i,t}
    equal to A_i its gradient is GSPO's."""
    token_ratio = _sequence_ratio(logprobs, old_logprobs, mask).detach()[:, None] \
        * torch.exp(logprobs - logprobs.detach())
    surrogate, active = _clipped_surrogate(token_ratio, advantages, clip_eps_low, clip_eps_high)
    per_token, kl = _with_kl(surrogate, logprobs, ref_logprobs, beta)
    return _output(_seq_mean(per_token, mask).sum() / num_sequences, active, kl, mask)


@dataclass(frozen=True)
class PolicyLoss:
    fn: Callable[..., LossOutput]
    std_normalised_advantages: bool = True
    """Whether group advantages are divided by the group std (Dr. GRPO: no)."""


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": PolicyLoss(grpo_loss),
    "r1": PolicyLoss(r1_loss),
    "dr_grpo": PolicyLoss(dr_grpo_loss, std_normalised_advantages=False),
    "dapo": PolicyLoss(dapo_loss),
    "gpg": PolicyLoss(gpg_loss, std_normalised_advantages=False),
    "cispo": PolicyLoss(cispo_loss),
    "c3po": PolicyLoss(dapo_loss),  # over the token budget (grpo.token_budget_share)
    "gspo": PolicyLoss(gspo_loss),
    "gspo_token": PolicyLoss(gspo_token_loss),
}


@dataclass(frozen=True)
class PairLossOutput:
    loss: torch.Tensor
    """Scalar to minimise (this micro-batch's share of the step's loss)."""
    margin_sum: torch.Tensor
    """Sum over this micro-batch's pairs of beta times the difference of the two sides'
    token-mean log(pi/pi_ref)."""
    right_sum: torch.Tensor
    """Pairs whose margin is above 0."""


def dpo_loss(logprobs, ref_logprobs, mask, role, *, beta: float,
             num_pairs: float) -> PairLossOutput:
    """DPO as DeepSeekMath writes it (Appendix A.1.4, eq. 14): -1/P sum_pairs log sigmoid(beta
    (1/|o+| sum_t log pi/pi_ref (o+_t) - 1/|o-| sum_t log pi/pi_ref (o-_t))), each side's
    log-ratio averaged over its tokens (Rafailov et al. 2023, eq. 7, sums them), over pairs
    laid out as rows (chosen, rejected) at (2k, 2k + 1); `role` [N] +1 on a chosen row, -1 on
    its rejected one, 0 on rows outside any pair; `num_pairs` the step's pairs over every
    micro-batch and rank."""
    keep = mask.bool()
    log_ratio = torch.where(keep, logprobs - ref_logprobs, logprobs.new_zeros(())).sum(-1) \
        / mask.sum(-1).clamp(min=1)
    chosen, rejected = log_ratio[0::2], log_ratio[1::2]
    paired = (role[0::2] > 0).to(log_ratio.dtype)
    margin = beta * (chosen - rejected)
    loss = -(torch.nn.functional.logsigmoid(margin) * paired).sum() / num_pairs
    return PairLossOutput(loss, (margin * paired).sum().detach(),
                          ((margin > 0).to(paired.dtype) * paired).sum().detach())
