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


# The clipped-surrogate objectives differ only in how the per-token terms of the step are
# summed and normalised: [N, T] terms, [N, T] mask and the step's global counts -> a scalar.

def sequence_mean(per_token, mask, num_sequences, num_tokens, max_tokens):
    """GRPO (DeepSeekMath eq. 3): 1/G sum_i 1/|o_i| sum_t."""
    return _seq_mean(per_token, mask).sum() / num_sequences


def sequence_sum(per_token, mask, num_sequences, num_tokens, max_tokens):
    """DeepSeek-R1 as the seed writes it: 1/G sum_i sum_t (no 1/|o_i|)."""
    return (per_token * mask).sum() / num_sequences


def constant_length(per_token, mask, num_sequences, num_tokens, max_tokens):
    """Dr. GRPO (Liu et al. 2025, §3.2): a constant normaliser, G * max_tokens."""
    return (per_token * mask).sum() / (num_sequences * max_tokens)


def token_mean(per_token, mask, num_sequences, num_tokens, max_tokens):
    """DAPO (Yu et al. 2025, eq. 8): token level, 1/sum_i |o_i| sum_i sum_t. C3PO (Ring-lite,
    eq. 4) is the same sum over its token budget, `num_tokens` being the budget Phi and `mask`
    the budget's tokens (policy.math.advantages.token_budget_mask)."""
    return (per_token * mask).sum() / num_tokens


def clipped_loss(normalise: Callable[..., torch.Tensor]) -> Callable[..., LossOutput]:
    """The loss -normalise(min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) - beta KL)."""

    @_masked_inputs
    def loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, clip_eps_low,
             clip_eps_high, beta, num_sequences, num_tokens, max_tokens) -> LossOutput:
        per_token, active, kl = _ppo_terms(logprobs, old_logprobs, ref_logprobs, advantages,
                                           clip_eps_low, clip_eps_high, beta)
        return _output(normalise(per_token, mask, num_sequences, num_tokens, max_tokens),
                       active, kl, mask)

    loss.__doc__ = f"The clipped surrogate, normalised as: {normalise.__doc__}"
    return loss


grpo_loss = clipped_loss(sequence_mean)
r1_loss = clipped_loss(sequence_sum)
dr_grpo_loss = clipped_loss(constant_length)  # with advantages not divided by the std
dapo_loss = clipped_loss(token_mean)  # with clip-higher: grpo.clip_eps_high > grpo.clip_eps
c3po_loss = dapo_loss  # over the token budget (grpo.token_budget_share)


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
    "c3po": PolicyLoss(c3po_loss),
}


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
