"""The value-based family's formulas (PPO, VC-PPO, VAPO, T-PPO), one function each.

Tensors are per completion token, [N, T] (N sequences, T completion tokens, `mask` 1 on real
tokens, right padding), as in policy/math/losses.py. A value `values[:, t]` is the critic's estimate
for the state before token t (the question and tokens < t), read at the position whose logits
predict token t, so values line up with log-probs. `last_values` [N] is the state after a
sequence's last real token: 0 for a finished sequence, the critic's estimate for one cut short
(T-PPO's extended GAE).
"""

from __future__ import annotations

import torch


def kl_penalty_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                       mask: torch.Tensor, beta: float) -> torch.Tensor:
    """PPO's per-token KL penalty (DeepSeekMath §4.1, eq. 2: r_t = r_phi(q, o_<=t) - beta *
    log(pi(o_t)/pi_ref(o_t))): the -beta * log-ratio part, [N, T], 0 on padding."""
    if ref_logprobs is None or beta == 0:
        return torch.zeros_like(mask, dtype=torch.float32)
    return -beta * (logprobs.float() - ref_logprobs.float()) * mask


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome rewards [N] placed at each sequence's last real token (DeepSeekMath eq. 2: the
    reward model scores the whole output there): [N, T]. Sequences without tokens get none."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask.bool(), positions, -1).amax(-1)
    return (positions[None, :] == last[:, None]).float() * rewards.float()[:, None]


def step_end_rewards(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                     step_end_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Process rewards [N, S] placed at the token where each step ends (a PRM's score of step k
    is a reward at its last token): [N, T]."""
    out = torch.zeros(step_rewards.shape[0], num_tokens, device=step_rewards.device)
    index = step_end_index.long().clamp(0, num_tokens - 1)
    return out.scatter_add(1, index, step_rewards.float() * step_mask)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float | torch.Tensor, last_values: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16; DeepSeekMath §4.1):
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_l (gamma lam)^l delta_{t+l}, over each
    sequence's real tokens only (padding is skipped, not treated as a state). `lam` is one value
    or one per sequence [N] (VAPO's length-adaptive lambda). The value after the last real token
    is `last_values` (default 0: the sequence ended). Returns (advantages, returns = A + V),
    [N, T] each, 0 on padding."""
    mask = mask.float()
    rewards, values = rewards.float() * mask, values.float() * mask
    lam = torch.as_tensor(lam, dtype=torch.float32, device=values.device).expand(values.shape[0])
    next_value = torch.zeros(values.shape[0], device=values.device) if last_values is None \
        else last_values.float()
    running = torch.zeros_like(next_value)
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        real = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        advantages[:, t] = torch.where(real, step, 0.0)
        running = torch.where(real, step, running)
        next_value = torch.where(real, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE for the policy (Yue et al. 2025, eq. 8): lambda = 1 - 1 /
    (alpha * l) for a sequence of l tokens (alpha = 0.05), so that the bias of the TD errors is
    spread evenly whatever the length. Clamped to [0, 1]: sequences under 1/alpha tokens get 0."""
    return (1.0 - 1.0 / (alpha * lengths.float().clamp(min=1))).clamp(0.0, 1.0)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip: float, num_tokens: float) -> torch.Tensor:
    """PPO's clipped value loss (as in OpenAI's baselines and DeepSeekMath's PPO): 1/2 max((V -
    R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2), summed over real tokens and divided by the
    step's global token count `num_tokens` (micro-batch losses add up to the batch's). clip <= 0:
    the plain squared error."""
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    loss = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * (loss * mask).sum() / num_tokens


def whiten(advantages: torch.Tensor, mask: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """(A - mean) / std on real tokens, with the batch's (global) statistics; 0 on padding."""
    return (advantages - mean) / (std + 1e-8) * mask


def positive_nll(logprobs: torch.Tensor, mask: torch.Tensor, right: torch.Tensor,
                 num_tokens: float) -> torch.Tensor:
    """VAPO's positive-example LM loss (Yue et al. 2025, eq. 9): the negative log-likelihood of
    the tokens of right samples only, divided by the global count of those tokens."""
    keep = mask.float() * right.float()[:, None]
    return -(logprobs * keep).sum() / max(num_tokens, 1.0)

