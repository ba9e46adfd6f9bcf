"""DeepSeekMath §5.2.1 writes SFT, RFT, online RFT, DPO, PPO and GRPO as one gradient,

    grad J = E[(q, o) ~ D] [ 1/|o| sum_t GC(q, o, t, pi_rf) grad log pi_theta(o_t | q, o_<t) ],

the methods differing in their data source D, their reward function and the gradient
coefficient GC. For each method, on a tiny model and one batch of four sampled completions:
the gradient of the loss the project trains with (its own code path) equals, parameter by
parameter, the gradient of sum_t w_t GC_t log pi(o_t) with GC computed here from the paper's
formulas and w_t the method's normalisation (docs/grpo.md, "One gradient")."""

import dataclasses
import math

import pytest
import torch

from configs import load_config
from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import generate_groups
from policy.math.advantages import ADVANTAGE_ESTIMATORS, GroupNorm
from policy.math.losses import POLICY_LOSSES, dpo_loss
from policy.math.value import gae, kl_penalty_rewards, last_token_rewards
from policy.supervised import token_nll_sum
from runtime.models import load_causal_lm, load_tokenizer
from runtime.tiny_model import build_tiny
from small_config import SMALL

REWARDS = [1.0, 0.0, 1.0, 0.0]  # the rule's grades of the four samples (one question, G = 4)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """A tiny random policy, one question, G = 4 sampled completions of different lengths."""
    cfg = load_config("configs/tiny.yaml", SMALL)
    path = build_tiny(tmp_path_factory.mktemp("paradigm") / "base", cfg.model.tiny, 0)
    model, tokenizer = load_causal_lm(path, cfg.model, train=True), load_tokenizer(path)
    torch.manual_seed(0)
    rollout = generate_groups(model, tokenizer, ["What is 2 + 3?"], 4, max_new_tokens=8,
                              temperature=1.0)
    # completions of 4, 2, 6 and 3 tokens (cut where the sampler had not ended them)
    keep = torch.arange(8)[None, :] < torch.tensor([[4], [2], [6], [3]])
    completion_mask = rollout.completion_mask * keep
    rollout = dataclasses.replace(
        rollout, completion_mask=completion_mask,
        completion_ids=torch.where(completion_mask.bool(), rollout.completion_ids,
                                   tokenizer.pad_token_id))
    mask = rollout.completion_mask.float()
    assert len(set(mask.sum(-1).tolist())) == 4
    return model, rollout, mask


def _logprobs(model, rollout):
    return completion_logprobs(model, rollout.input_ids, rollout.attention_mask,
                               rollout.prompt_ids.shape[1], share_prompts=False, pack=False)


def _assert_same_gradient(model, loss, logprobs, coefficient, weight, mask):
    """grad(loss) == -grad(sum_t weight * GC * log pi), parameter by parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    paper = torch.autograd.grad(-(weight * coefficient.detach() * logprobs * mask).sum(), params,
                                allow_unused=True)
    compared = 0
    for a, b in zip(ours, paper):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()
        compared += 1
    assert compared and any(g is not None and g.abs().sum() > 0 for g in paper)


def _per_sequence(mask):
    """The paper's 1/G sum_i 1/|o_i|: each token of sequence i weighs 1 / (G |o_i|)."""
    return 1.0 / (mask.shape[0] * mask.sum(-1, keepdim=True).clamp(min=1))


def _sft_labels(rollout):
    ids = rollout.input_ids
    labels = ids.clone()
    labels[:, :rollout.prompt_ids.shape[1]] = -100
    labels[rollout.attention_mask == 0] = -100
    return labels


def test_sft_coefficient_is_one(batch):
    """SFT (and the warm start's SFT stage): GC = 1 on every token, the loss the mean NLL over
    the batch's tokens."""
    model, rollout, mask = batch
    logprobs = _logprobs(model, rollout)
    nll, tokens = token_nll_sum(model, rollout.input_ids, rollout.attention_mask,
                                _sft_labels(rollout))
    _assert_same_gradient(model, nll / tokens, logprobs, torch.ones_like(mask),
                          1.0 / mask.sum(), mask)


def test_offline_rft_coefficient_is_the_indicator_of_a_right_sample(batch):
    """RFT (offline_rft): the SFT loss on the right samples only, i.e. GC = I(o) over every
    sample (1 right, 0 wrong), normalised by the right samples' tokens."""
    model, rollout, mask = batch
    logprobs = _logprobs(model, rollout)
    right = torch.tensor(REWARDS) >= 0.5
    kept = right.nonzero().squeeze(-1)
    nll, tokens = token_nll_sum(model, rollout.input_ids[kept], rollout.attention_mask[kept],
                                _sft_labels(rollout)[kept])
    coefficient = right.float()[:, None].expand_as(mask)
    _assert_same_gradient(model, nll / tokens, logprobs, coefficient,
                          1.0 / (mask * coefficient).sum(), mask)


def test_online_rft_coefficient_is_the_indicator_per_sequence(batch):
    """Online RFT (policy.supervision=rft, beta 0): GC = I(o), under the paper's 1/G 1/|o|."""
    model, rollout, mask = batch
    logprobs = _logprobs(model, rollout)
    rewards = torch.tensor(REWARDS)
    norm = GroupNorm(4, True, False, 1e-6, 0.0)
    advantages, _ = ADVANTAGE_ESTIMATORS["rft"](rewards, mask.shape[1], norm)
    out = POLICY_LOSSES["grpo"].fn(logprobs, logprobs.detach(), None, advantages * mask, mask,
                                   clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0,
                                   num_sequences=4, num_tokens=float(mask.sum()),
                                   max_tokens=mask.shape[1])
    coefficient = torch.tensor([[1.0 if r >= 0.5 else 0.0] for r in REWARDS]).expand_as(mask)
    _assert_same_gradient(model, out.loss, logprobs, coefficient, _per_sequence(mask), mask)


def test_dpo_coefficient_is_the_sigmoid_of_the_reversed_margin(batch):
    """DPO as DeepSeekMath writes it (Appendix A.1.4; pairs (0, 1) and (2, 3), right over
    wrong, against a perturbed reference): GC = beta sigmoid(beta lr(o-) - beta lr(o+)) on
    o+'s tokens, its negative on o-'s, lr the token mean of log pi/pi_ref, under 1/P over the
    pairs and the paper's 1/|o|."""
    model, rollout, mask = batch
    logprobs = _logprobs(model, rollout)
    ref = logprobs.detach() + 0.3 * torch.randn(logprobs.shape, generator=torch.Generator()
                                                .manual_seed(1))
    beta = 0.1
    out = dpo_loss(logprobs, ref, mask, torch.tensor([1.0, -1.0, 1.0, -1.0]), beta=beta,
                   num_pairs=2.0)
    log_ratio = (((logprobs.detach() - ref) * mask).sum(-1) / mask.sum(-1)).tolist()
    coefficient = torch.zeros_like(mask)
    for chosen, rejected in ((0, 1), (2, 3)):
        gc = beta / (1 + math.exp(-(beta * log_ratio[rejected] - beta * log_ratio[chosen])))
        coefficient[chosen], coefficient[rejected] = gc, -gc
    _assert_same_gradient(model, out.loss, logprobs, coefficient,
                          0.5 / mask.sum(-1, keepdim=True), mask)


def test_ppo_coefficient_is_the_gae_advantage_through_the_clipped_ratio(batch):
    """PPO (the ppo recipe's policy loss): GC_t = A_t r_t where the clip is not active, 0 where
    it is; A_t GAE (gamma 1, lambda 0.95) over r_t = the outcome at the last token - beta
    log(pi/pi_ref), computed here by the recursion A_t = delta_t + gamma lambda A_{t+1}."""
    model, rollout, mask = batch
    logprobs = _logprobs(model, rollout)
    gen = torch.Generator().manual_seed(2)
    old = logprobs.detach() + 0.3 * torch.randn(logprobs.shape, generator=gen)
    ref = logprobs.detach() + 0.2 * torch.randn(logprobs.shape, generator=gen)
    values = torch.randn(logprobs.shape, generator=gen) * mask
    beta, gamma, lam = 0.04, 1.0, 0.95
    rewards = last_token_rewards(torch.tensor(REWARDS), mask) + \
        kl_penalty_rewards(old, ref, mask, beta)
    advantages, _ = gae(rewards, values, mask, gamma, lam)
    out = POLICY_LOSSES["grpo"].fn(logprobs, old, None, advantages, mask, clip_eps_low=0.2,
                                   clip_eps_high=0.2, beta=0.0, num_sequences=4,
                                   num_tokens=float(mask.sum()), max_tokens=mask.shape[1])
    by_hand = torch.zeros_like(mask)
    for i in range(4):
        n = int(mask[i].sum())
        later = 0.0
        for t in reversed(range(n)):
            r_t = (REWARDS[i] if t == n - 1 else 0.0) - beta * float(old[i, t] - ref[i, t])
            v_next = float(values[i, t + 1]) if t + 1 < n else 0.0
            later = r_t + gamma * v_next - float(values[i, t]) + gamma * lam * later
            by_hand[i, t] = later
    assert torch.allclose(advantages, by_hand, atol=1e-5)
    ratio = torch.exp(logprobs.detach() - old)
    clipped = ((by_hand > 0) & (ratio > 1.2)) | ((by_hand < 0) & (ratio < 0.8))
    assert clipped[mask.bool()].any() and not clipped[mask.bool()].all()
    coefficient = torch.where(clipped, 0.0, by_hand * ratio)
    _assert_same_gradient(model, out.loss, logprobs, coefficient, _per_sequence(mask), mask)


def test_grpo_coefficient_is_the_group_advantage_plus_the_k3_gradient(batch):
    """GRPO (the paper's objective, mu = 1 so pi_old = pi): GC = A_i + beta (pi_ref/pi - 1),
    A_i = (r_i - mean(r)) / std(r) of the group (here (1, -1, 1, -1))."""
    model, rollout, mask = batch
    logprobs = _logprobs(model, rollout)
    ref = logprobs.detach() + 0.3 * torch.randn(logprobs.shape, generator=torch.Generator()
                                                .manual_seed(3))
    beta = 0.04
    norm = GroupNorm(4, True, False, 1e-6, 0.0)
    advantages, _ = ADVANTAGE_ESTIMATORS["outcome"](torch.tensor(REWARDS), mask.shape[1],
                                                    norm)
    out = POLICY_LOSSES["grpo"].fn(logprobs, logprobs.detach(), ref, advantages * mask, mask,
                                   clip_eps_low=0.2, clip_eps_high=0.2, beta=beta,
                                   num_sequences=4, num_tokens=float(mask.sum()),
                                   max_tokens=mask.shape[1])
    mean = sum(REWARDS) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / 4)
    a = torch.tensor([[(r - mean) / (std + 1e-6)] for r in REWARDS])
    coefficient = a + beta * (torch.exp(ref - logprobs.detach()) - 1)
    _assert_same_gradient(model, out.loss, logprobs, coefficient, _per_sequence(mask), mask)
