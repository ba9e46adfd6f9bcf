"""The GRPO math against hand-computed numbers and the seed's worked example."""

import math

import pytest
import torch

from policy.math.advantages import (outcome_advantages, process_advantages,
                                    rejection_sampling_advantages)
from policy.generation.logprobs import selective_log_softmax
from policy.math.advantages import informative_groups
from policy.math.losses import POLICY_LOSSES, k3_kl, overlong_penalty

# The seed's worked example (003_69686f70371876c1.txt): G = 4, eps = 0.2, per-token old/new probs.
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


def _padded(rows, fill=1.0):
    width = max(len(r) for r in rows)
    values = torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=torch.float64)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows],
                        dtype=torch.float64)
    return values, mask


def _seed_inputs():
    old, mask = _padded(OLD)
    new, _ = _padded(NEW)
    adv = outcome_advantages(torch.tensor(REWARDS, dtype=torch.float64), 4)
    return new.log(), old.log(), adv[:, None] * mask, mask, adv


def test_seed_example_advantages():
    *_, adv = _seed_inputs()
    assert adv.tolist() == pytest.approx([0.577, 0.577, 0.577, -1.732], abs=1e-3)


def test_seed_example_clipped_ratios_and_objective():
    logp, old_logp, adv, mask, _ = _seed_inputs()
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(0.8, 1.2)
    # Spot checks from the seed's tables: r_{3,1} = 1.25 -> 1.2, r_{2,9} = 0.75 -> 0.8.
    assert ratio[2, 0].item() == pytest.approx(1.250, abs=1e-3)
    assert clipped[2, 0].item() == pytest.approx(1.200, abs=1e-3)
    assert ratio[1, 8].item() == pytest.approx(0.750, abs=1e-3)
    assert clipped[1, 8].item() == pytest.approx(0.800, abs=1e-3)
    expected_clipped = [
        [1.167, 1.120, 1.125, 0.914, 1.111, 1.083, 1.063],
        [0.800, 0.875, 1.100, 1.067, 0.833, 1.125, 1.143, 0.800, 0.800, 1.083, 1.071, 1.063],
        [1.200, 1.167, 1.200, 1.071],
        [0.800, 1.200, 1.200, 1.125, 1.143, 0.800, 1.083, 0.900, 0.800, 1.111, 0.800, 1.067],
    ]
    for i, row in enumerate(expected_clipped):
        assert clipped[i, :len(row)].tolist() == pytest.approx(row, abs=1e-3)
    terms = torch.minimum(ratio * adv, clipped * adv) * mask
    per_response = terms.sum(-1) / mask.sum(-1)
    assert per_response.tolist() == pytest.approx([0.625, 0.563, 0.669, -1.736], abs=1e-3)
    out = POLICY_LOSSES["grpo"].fn(logp, old_logp, None, adv, mask, clip_eps_low=0.2,
                                   clip_eps_high=0.2, beta=0.04, num_sequences=4,
                                   num_tokens=35, max_tokens=12)
    assert -out.loss.item() == pytest.approx(0.0305, abs=1e-3)


def test_all_equal_group_gives_zero_advantage_not_nan():
    adv = outcome_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3)
    assert adv.tolist() == [0.0] * 6
    adv = outcome_advantages(torch.tensor([0.5, 0.5]), 1)  # G = 1: no group to compare against
    assert adv.tolist() == [0.0, 0.0]


def test_unbiased_std_and_no_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25; sample std = sqrt(0.75 / 3) = 0.5 -> (1 - 0.25) / 0.5 = 1.5
    assert outcome_advantages(r, 4, unbiased=True, eps=0)[0].item() == pytest.approx(1.5)
    assert outcome_advantages(r, 4, scale_by_std=False).tolist() == [0.75, -0.25, -0.25, -0.25]


def test_process_advantages_by_hand():
    # One group, G = 2. Sample 0: 3 steps ending at tokens 1, 3, 5 with rewards 1, 0, 1.
    # Sample 1: 2 steps ending at tokens 2, 4 with rewards 0, 0; token 5 lies after its last step.
    step_rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    step_mask = torch.tensor([[True, True, True], [True, True, False]])
    step_end = torch.tensor([[1, 3, 5], [2, 4, 0]])
    # All 5 step rewards together: mean 0.4, population std sqrt((2*0.36 + 3*0.16)/5) = sqrt(0.24).
    sd = math.sqrt(0.24)
    hi, lo = 0.6 / sd, -0.4 / sd
    adv = process_advantages(step_rewards, step_mask, step_end, num_tokens=7, group_size=2, eps=0)
    expected0 = [hi + lo + hi] * 2 + [lo + hi] * 2 + [hi] * 2 + [0.0]
    expected1 = [lo + lo] * 3 + [lo] * 2 + [0.0] * 2
    assert adv[0].tolist() == pytest.approx(expected0, abs=1e-6)
    assert adv[1].tolist() == pytest.approx(expected1, abs=1e-6)


def test_process_advantages_equal_plain_loop():
    torch.manual_seed(0)
    n, s, t, g = 8, 4, 20, 4
    rewards = torch.rand(n, s)
    mask = torch.rand(n, s) > 0.3
    ends = torch.sort(torch.randint(0, t, (n, s)), dim=-1).values
    fast = process_advantages(rewards, mask, ends, t, g, eps=0)
    for q in range(n // g):
        vals = torch.cat([rewards[i][mask[i]] for i in range(q * g, (q + 1) * g)])
        mean, std = vals.mean(), vals.std(unbiased=False)
        for i in range(q * g, (q + 1) * g):
            for tok in range(t):
                want = sum(((rewards[i, j] - mean) / std).item()
                           for j in range(s) if mask[i, j] and ends[i, j] >= tok)
                assert fast[i, tok].item() == pytest.approx(want, abs=1e-5)


def test_k3_zero_when_equal_positive_otherwise():
    logp = torch.log(torch.tensor([0.2, 0.5, 0.9]))
    assert k3_kl(logp, logp).abs().max().item() == 0.0
    ref = torch.log(torch.tensor([0.3, 0.4, 0.8]))
    kl = k3_kl(logp, ref)
    assert (kl > 0).all()
    # x = 0.3 / 0.2 = 1.5: 1.5 - ln 1.5 - 1
    assert kl[0].item() == pytest.approx(1.5 - math.log(1.5) - 1, rel=1e-5)


def test_chunked_logprobs_equal_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50)
    labels = torch.randint(0, 50, (3, 7))
    full = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    chunked = selective_log_softmax(logits, labels, chunk_tokens=4)
    assert torch.allclose(chunked, full, atol=1e-5)
    bf16 = selective_log_softmax(logits.bfloat16(), labels, chunk_tokens=5)
    assert bf16.dtype == torch.float32


def test_grpo_gradient_matches_paper_coefficient():
    # mu = 1: pi = pi_old, so d J / d log pi_t = (1/G)(1/|o_i|)(A + beta (pi_ref/pi - 1)).
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.4], [0.3, 0.6, 0.1]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.4, 0.4], [0.2, 0.7, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[0.7] * 3, [-0.7] * 3], dtype=torch.float64)
    beta = 0.04
    x = logp.clone().requires_grad_(True)
    out = POLICY_LOSSES["grpo"].fn(x, logp, ref, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                   beta=beta, num_sequences=2, num_tokens=5, max_tokens=3)
    (-out.loss).backward()
    coeff = adv + beta * (torch.exp(ref - logp) - 1)
    expected = coeff * mask / mask.sum(-1, keepdim=True) / 2
    assert torch.allclose(x.grad, expected, atol=1e-12)


def test_online_rft_gradient_is_the_paper_rft_objective():
    # DeepSeekMath 5.2.1 / A.1.2: online RFT's gradient coefficient is I(o), with no baseline and
    # no KL: d J / d log pi_t = (1/G)(1/|o_i|) I(o_i). The rule's 1/0 and an ORM's 0.7/0.2 alike.
    rewards = torch.tensor([1.0, 0.0, 0.7, 0.2], dtype=torch.float64)
    assert rejection_sampling_advantages(rewards).tolist() == [1.0, 0.0, 1.0, 0.0]
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.4], [0.3, 0.6, 0.1], [0.5, 0.5, 0.5],
                                   [0.9, 0.9, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]],
                        dtype=torch.float64)
    adv = rejection_sampling_advantages(rewards)[:, None] * mask
    x = logp.clone().requires_grad_(True)
    out = POLICY_LOSSES["grpo"].fn(x, logp, logp, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                   beta=0.0, num_sequences=4, num_tokens=9, max_tokens=3)
    (-out.loss).backward()
    rft = x.clone().detach().requires_grad_(True)  # the RFT objective itself, differentiated
    objective = sum((rft[i] * mask[i]).sum() / mask[i].sum() for i in (0, 2)) / 4
    objective.backward()
    assert torch.allclose(x.grad, rft.grad, atol=1e-12)
    assert x.grad[1].abs().sum() == 0 and x.grad[3].abs().sum() == 0  # wrong samples: no push


# Hand-derived example shared by the variants: two sequences, one question.
# seq 0: tokens with ratios 1.5, 1.0 (A = +1); seq 1: one token, ratio 0.5 (A = -1), one pad.
# log pi (new) = log of [0.6, 0.4] and [0.2]; old = [0.4, 0.4] and [0.4]; no KL (beta = 0).
def _variant_inputs():
    new = torch.tensor([[0.6, 0.4], [0.2, 1.0]], dtype=torch.float64)
    old = torch.tensor([[0.4, 0.4], [0.4, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    return new.log(), old.log(), adv, mask


@pytest.mark.parametrize("name, expected_objective", [
    # clipped terms: seq 0 -> min(1.5, 1.2) = 1.2 and 1.0; seq 1 -> max(0.5, 0.8) * -1 = -0.8
    ("grpo", ((1.2 + 1.0) / 2 + (-0.8) / 1) / 2),     # per-sequence means, then 1/G
    ("r1", ((1.2 + 1.0) + (-0.8)) / 2),               # no 1/|o_i|
    ("dr_grpo", ((1.2 + 1.0) + (-0.8)) / (2 * 4)),    # constant normaliser G * max_tokens (4)
    ("dapo", (1.2 + 1.0 - 0.8) / 3),                  # 1 / sum |o_i|
    # gpg: (log .6 + log .4) * 1 + log .2 * -1, over 3 tokens
    ("gpg", (math.log(0.6) + math.log(0.4) - math.log(0.2)) / 3),
    # cispo: sg(min(r, 1 + eps_high)) A log pi, no lower bound: r = 1.5 -> 1.2, r = 0.5 stays
    ("cispo", (1.2 * math.log(0.6) + math.log(0.4) - 0.5 * math.log(0.2)) / 3),
    # c3po: the clipped objective over the budget's tokens, divided by Phi (num_tokens = 3 here)
    ("c3po", (1.2 + 1.0 - 0.8) / 3),
])
def test_variants_by_hand(name, expected_objective):
    logp, old, adv, mask = _variant_inputs()
    out = POLICY_LOSSES[name].fn(logp, old, None, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                 beta=0.0, num_sequences=2, num_tokens=3, max_tokens=4)
    assert -out.loss.item() == pytest.approx(expected_objective, abs=1e-9)


def test_cispo_gradient_stops_through_weight():
    logp, old, adv, mask = _variant_inputs()
    x = logp.clone().requires_grad_(True)
    out = POLICY_LOSSES["cispo"].fn(x, old, None, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                    beta=0.0, num_sequences=2, num_tokens=3, max_tokens=4)
    (-out.loss).backward()
    assert x.grad.flatten().tolist() == pytest.approx([1.2 / 3, 1 / 3, -0.5 / 3, 0.0])


def test_clip_fraction_counts_active_clips():
    # seq 0 token 0: A > 0, r = 1.5 > 1.2 (clipped); seq 1 token 0: A < 0, r = 0.5 < 0.8 (clipped);
    # seq 0 token 1: r = 1 (not clipped). 2 of 3 real tokens.
    logp, old, adv, mask = _variant_inputs()
    out = POLICY_LOSSES["grpo"].fn(logp, old, None, adv, mask, clip_eps_low=0.2,
                                   clip_eps_high=0.2, beta=0.0, num_sequences=2, num_tokens=3,
                                   max_tokens=4)
    assert out.clip_fraction.item() == pytest.approx(2 / 3)


def test_microbatch_sum_equals_full_batch():
    torch.manual_seed(1)
    logp, old = torch.randn(6, 5) * 0.1 - 1, torch.randn(6, 5) * 0.1 - 1
    ref = torch.randn(6, 5) * 0.1 - 1
    adv, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    kwargs = dict(clip_eps_low=0.2, clip_eps_high=0.28, beta=0.04, num_sequences=6,
                  num_tokens=mask.sum().item(), max_tokens=5)
    for spec in POLICY_LOSSES.values():
        full = spec.fn(logp, old, ref, adv, mask, **kwargs).loss
        parts = sum(spec.fn(logp[i:i + 2], old[i:i + 2], ref[i:i + 2], adv[i:i + 2],
                            mask[i:i + 2], **kwargs).loss for i in range(0, 6, 2))
        assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_dapo_options():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2).tolist() == [False, True]
    pen = overlong_penalty(torch.tensor([10, 16, 18, 20]), max_tokens=20, buffer=4, penalty=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])


def test_majority_vote():
    from policy.evaluate import majority_answer

    texts = ["The answer is 4", "The answer is 4.0", "The answer is 5", "no answer", "#### 5",
             "The answer is 4"]
    assert majority_answer(texts) == "4"
    assert majority_answer(["nothing here"]) is None


def test_shuffled_reward_control_moves_step_rewards_off_their_steps():
    from policy.kit import shuffled_rewards
    from policy.rewards import Scores

    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False],
                         [True, True, True, True]])
    steps = torch.arange(12, dtype=torch.float32).reshape(3, 4) * mask
    scores = Scores(rewards=torch.tensor([0.1, 0.2, 0.3]), step_rewards=steps, step_mask=mask,
                    step_end_index=torch.zeros(3, 4, dtype=torch.long))
    moved, rewards = shuffled_rewards(scores, scores.rewards)
    # The same values on the same layout (padding untouched) ...
    assert sorted(moved.step_rewards[mask].tolist()) == sorted(steps[mask].tolist())
    assert (moved.step_rewards[~mask] == 0).all()
    assert sorted(rewards.tolist()) == pytest.approx([0.1, 0.2, 0.3])
    # ... but not on their own steps (a no-op for process supervision before this control
    # permuted the step rewards too).
    assert not torch.equal(moved.step_rewards, steps)
    assert torch.equal(scores.step_rewards, steps)  # the input is left as it was
