"""The policy losses (policy/math/losses.py) against hand-computed numbers, the seed's worked
example and the paper's gradient coefficients: the k3 KL, the clipped objective and its variants,
clip fractions, micro-batch sums."""

import math

import pytest
import torch

from policy.math.advantages import (informative_groups, rejection_sampling_advantages)
from policy.math.losses import POLICY_LOSSES, k3_kl
from policy.math.shaping import overlong_penalty

from seed_example import seed_inputs


def test_seed_example_clipped_ratios_and_objective():
    logp, old_logp, adv, mask, _ = seed_inputs()
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


def test_k3_zero_when_equal_positive_otherwise():
    logp = torch.log(torch.tensor([0.2, 0.5, 0.9]))
    assert k3_kl(logp, logp).abs().max().item() == 0.0
    ref = torch.log(torch.tensor([0.3, 0.4, 0.8]))
    kl = k3_kl(logp, ref)
    assert (kl > 0).all()
    # x = 0.3 / 0.2 = 1.5: 1.5 - ln 1.5 - 1
    assert kl[0].item() == pytest.approx(1.5 - math.log(1.5) - 1, rel=1e-5)


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


def test_clip_higher_and_cispo_clip_on_the_upper_side_only():
    """Ratios 1.25 and 1.3 on A > 0, 0.75 on A < 0. GRPO's symmetric 0.2 clips all three;
    DAPO's eps_high 0.28 lets 1.25 through (1 upper, 1 lower); CISPO bounds the weight above
    only: 1 upper clip, never a lower one."""
    new = torch.tensor([[1.25, 1.3, 0.75]]).log()
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    kw = dict(beta=0.0, num_sequences=1, num_tokens=3, max_tokens=3)
    grpo = POLICY_LOSSES["grpo"].fn(new, old, None, adv, mask, clip_eps_low=0.2,
                                    clip_eps_high=0.2, **kw)
    dapo = POLICY_LOSSES["dapo"].fn(new, old, None, adv, mask, clip_eps_low=0.2,
                                    clip_eps_high=0.28, **kw)
    cispo = POLICY_LOSSES["cispo"].fn(new, old, None, adv, mask, clip_eps_low=0.2,
                                      clip_eps_high=0.28, **kw)
    assert (grpo.clip_fraction.item(), grpo.clip_high.item()) == pytest.approx((1.0, 2 / 3))
    assert (dapo.clip_fraction.item(), dapo.clip_high.item()) == pytest.approx((2 / 3, 1 / 3))
    assert (cispo.clip_fraction.item(), cispo.clip_high.item()) == pytest.approx((1 / 3, 1 / 3))


def _gspo_group():
    """Three sequences of lengths 3, 2 and 1: per-token log(pi / pi_old) with means 0.1, 0.4
    and -0.5, advantages +1, +0.5 and -2 on every token."""
    mask = torch.tensor([[1., 1., 1.], [1., 1., 0.], [1., 0., 0.]])
    log_ratio = torch.tensor([[0.3, 0.0, 0.0], [0.5, 0.3, 0.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.1, -9.0], [-2.0, -9.0, -9.0]])
    adv = torch.tensor([[1.0] * 3, [0.5] * 3, [-2.0] * 3]) * mask
    return (old + log_ratio).requires_grad_(), old, adv, mask


def test_gspo_sequence_ratio_clip_and_loss_by_hand():
    """s = e^0.1 = 1.10517 (inside [0.8, 1.2]), e^0.4 = 1.49182 (clipped above: 1.2 x 0.5 =
    0.6), e^-0.5 = 0.60653 (clipped below: 0.8 x -2 = -1.6). Objective (1.10517 + 0.6 - 1.6) / 3
    = 0.035057; only the unclipped sequence has a gradient: -s A / |o| / G = -1.10517 / 3 / 3 on
    each of its tokens. Clipped: 3 of 6 tokens, 2 of them above."""
    logp, old, adv, mask = _gspo_group()
    out = POLICY_LOSSES["gspo"].fn(logp, old, None, adv, mask, clip_eps_low=0.2,
                                   clip_eps_high=0.2, beta=0.0, num_sequences=3, num_tokens=6,
                                   max_tokens=3)
    assert out.loss.item() == pytest.approx(-(math.exp(0.1) + 0.6 - 1.6) / 3, abs=1e-6)
    assert out.loss.item() == pytest.approx(-0.035057, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    assert out.clip_high.item() == pytest.approx(2 / 6)
    out.loss.backward()
    expected = torch.tensor([[-math.exp(0.1) / 9] * 3, [0.0] * 3, [0.0] * 3])
    assert torch.allclose(logp.grad, expected, atol=1e-7)


def test_gspo_paper_ranges_clip_every_sequence_that_moved():
    """With the paper's ranges (3e-4 below, 4e-4 above) the three moved sequences are all
    clipped and carry no gradient; an unmoved one (ratio 1) is not clipped."""
    logp, old, adv, mask = _gspo_group()
    out = POLICY_LOSSES["gspo"].fn(logp, old, None, adv, mask, clip_eps_low=3e-4,
                                   clip_eps_high=4e-4, beta=0.0, num_sequences=3, num_tokens=6,
                                   max_tokens=3)
    assert out.clip_fraction.item() == pytest.approx(1.0)
    out.loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    same = old.clone().requires_grad_()
    out = POLICY_LOSSES["gspo"].fn(same, old, None, adv, mask, clip_eps_low=3e-4,
                                   clip_eps_high=4e-4, beta=0.0, num_sequences=3, num_tokens=6,
                                   max_tokens=3)
    assert out.clip_fraction.item() == 0.0
    assert out.loss.item() == pytest.approx(-(1 + 0.5 - 2) / 3)


def test_gspo_token_equals_gspo_when_a_sequence_shares_its_advantage():
    """GSPO-token's ratio has GSPO's value and token t's gradient: with one advantage per
    sequence its loss and every token's gradient equal GSPO's; with per-token advantages token
    t of an unclipped sequence gets -s_i A_{i,t} / |o_i| / G."""
    grads, losses = [], []
    for name in ("gspo", "gspo_token"):
        logp, old, adv, mask = _gspo_group()
        out = POLICY_LOSSES[name].fn(logp, old, None, adv, mask, clip_eps_low=0.2,
                                     clip_eps_high=0.2, beta=0.0, num_sequences=3, num_tokens=6,
                                     max_tokens=3)
        out.loss.backward()
        grads.append(logp.grad)
        losses.append(out.loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-7)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
    logp, old, _, mask = _gspo_group()
    step_adv = torch.tensor([[1.0, -0.5, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = POLICY_LOSSES["gspo_token"].fn(logp, old, None, step_adv, mask, clip_eps_low=0.2,
                                         clip_eps_high=0.2, beta=0.0, num_sequences=3,
                                         num_tokens=6, max_tokens=3)
    out.loss.backward()
    s = math.exp(0.1)
    assert logp.grad[0].tolist() == pytest.approx([-s * a / 3 / 3 for a in (1.0, -0.5, 2.0)],
                                                  abs=1e-7)


def test_gspo_under_process_supervision_is_gspo_token():
    from iteration.resolve import policy_loss

    assert policy_loss("gspo", "process") is POLICY_LOSSES["gspo_token"]
    assert policy_loss("gspo", "outcome") is POLICY_LOSSES["gspo"]
    assert policy_loss("grpo", "process") is POLICY_LOSSES["grpo"]


def test_dpo_loss_and_gradient_of_a_pair_by_hand():
    """One pair, DeepSeekMath's form (eq. 14: each side's log-ratio averaged over its tokens):
    chosen (0.3 - 0.1) / 2 = 0.1, rejected 0.4 / 1; beta 0.5: margin 0.5 x (0.1 - 0.4) = -0.15,
    loss -log sigmoid(-0.15) = 0.770957. Gradient: -beta sigmoid(0.15) / |o+| = -0.134357 on
    each chosen token, +beta sigmoid(0.15) / |o-| = +0.268715 on the rejected one, 0 on padding
    and on the unpaired rows."""
    from policy.math.losses import dpo_loss

    ref = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0], [-1.0, -1.0, -1.0],
                        [-2.0, -2.0, -2.0]])
    logp = (ref + torch.tensor([[0.3, -0.1, 0.0], [0.4, 0.0, 0.0], [0.7, 0.2, 0.1],
                                [-0.3, 0.0, 0.0]])).requires_grad_()
    mask = torch.tensor([[1., 1., 0.], [1., 0., 0.], [1., 1., 1.], [1., 0., 0.]])
    role = torch.tensor([1.0, -1.0, 0.0, 0.0])
    out = dpo_loss(logp, ref, mask, role, beta=0.5, num_pairs=1.0)
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(0.15)), abs=1e-6)
    assert out.loss.item() == pytest.approx(0.770957, abs=1e-6)
    assert out.margin_sum.item() == pytest.approx(-0.15, abs=1e-6)
    assert out.right_sum.item() == 0.0
    out.loss.backward()
    c = 0.5 / (1 + math.exp(-0.15))
    expected = torch.tensor([[-c / 2, -c / 2, 0.0], [c, 0.0, 0.0], [0.0] * 3, [0.0] * 3])
    assert c / 2 == pytest.approx(0.134357, abs=1e-6)
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_preference_pairs_match_best_with_worst_within_a_group():
    """Group 0 (rewards 1, 0, 1, 0; ranked 0, 2, 1, 3, ties in rollout order): the best with
    the worst (rows 0 and 3), then the second best with the second worst (2 and 1);
    group 1 all right: none; group 2 (0.9, 0.2, 0.5, 0.5): 0.9 with 0.2, then 0.5 = 0.5 stops;
    group 3 holds a NaN: none."""
    from policy.algorithms.dpo import preference_pairs

    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.2, 0.5, 0.5,
                            1.0, 0.0, 0.0, 0.0])
    broken = torch.tensor([False, False, False, True])
    order, role = preference_pairs(rewards, 4, broken)
    assert order.tolist()[:6] == [0, 3, 2, 1, 8, 9]
    assert role.tolist()[:6] == [1, -1, 1, -1, 1, -1] and not role[6:].any()
    assert sorted(order.tolist()) == list(range(16))


def test_a_grpo_step_by_hand_its_loss_and_gradient_whatever_the_ranks_and_micro_batches():
    """One GRPO step from the one place (`GRPOSpec`'s loss and scalars, `rank_loss`): two
    samples of one question, lengths 2 and 1, advantages +-0.7071 (rewards 1 and 0 normalised
    by the group's unbiased std), one pass (ratio 1), beta 0.04 against a reference.

    Loss = -1/G sum_i 1/|o_i| sum_t (A_i - beta k3_{i,t}), k3 = e^(ref - lp) - (ref - lp) - 1;
    d loss / d lp_{i,t} = -1/G 1/|o_i| (A_i - beta (1 - e^(ref - lp))). With lp = log 0.5 and
    ref = log 0.25 on every token: k3 = 0.5 + log 2 - 1 = 0.19315, 1 - e^(ref - lp) = 0.5:
      loss = -1/2 [(0.7071 - 0.04 * 0.19315) + (-0.7071 - 0.04 * 0.19315)] = 0.0077259
      grads: sample 0 (|o| = 2): -1/2 * 1/2 * (0.7071 - 0.02) = -0.171777 per token,
             sample 1 (|o| = 1): -1/2 * (-0.7071 - 0.02) = +0.363553.
    The same gradient comes out when the rows are split over 2 ranks (each backpropagating
    `rank_loss` of its share, DeepSpeed averaging over ranks) or over 2 micro-batches of one
    rank (their shares added: `scale_wrt_gas=False`)."""
    from configs import load_config
    from iteration.resolve import resolve
    from runtime.engine import rank_loss

    spec = resolve(load_config("configs/tiny.yaml", ["policy.loss=grpo",
                                                     "policy.supervision=outcome"])).method
    assert (spec.beta, spec.clip_low, spec.clip_high) == (0.04, 0.2, 0.2)
    a = 1 / math.sqrt(2)
    lp0 = torch.full((2, 2), math.log(0.5))
    ref = torch.full((2, 2), math.log(0.25))
    adv = torch.tensor([[a, a], [-a, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])

    def grads(parts, world_size):
        """Each part (rows) a rank's micro-batch: the summed gradient of every part's
        `rank_loss`, averaged over the ranks as DeepSpeed does."""
        lp = lp0.clone().requires_grad_(True)
        total = 0.0
        for rows in parts:
            out = spec.loss(lp[rows], lp[rows].detach(), ref[rows], adv[rows], mask[rows],
                            clip_eps_low=spec.clip_low, clip_eps_high=spec.clip_high,
                            beta=spec.beta, num_sequences=2.0, num_tokens=3.0,
                            max_tokens=spec.max_tokens)
            rank_loss(out.loss, world_size).backward()
            total += out.loss.item()
        return total, lp.grad / world_size

    k3 = 0.5 + math.log(2) - 1
    expected = torch.tensor([[-0.5 * 0.5 * (a - 0.02)] * 2, [-0.5 * (-a - 0.02), 0.0]])
    for parts, world_size in (([slice(0, 2)], 1), ([slice(0, 1), slice(1, 2)], 2),
                              ([slice(0, 1), slice(1, 2)], 1)):
        loss, grad = grads(parts, world_size)
        assert loss == pytest.approx(-0.5 * (a - 0.04 * k3 - a - 0.04 * k3), abs=1e-6)
        assert loss == pytest.approx(0.0077259, abs=1e-6)
        assert torch.allclose(grad, expected, atol=1e-6), (parts, world_size, grad)
    assert expected[0, 0].item() == pytest.approx(-0.171777, abs=1e-6)
    assert expected[1, 0].item() == pytest.approx(0.363553, abs=1e-6)


def test_truncated_importance_weights_by_hand():
    """`policy.tis_cap`: pi_old / pi_sampler per token, capped, 0 off the mask. The sampler gave
    p = 0.25, 0.4, 0.1, 0.3 to tokens the trainer gives 0.5, 0.2, 0.9, 0.6 (the last one
    masked): ratios 2, 0.5, 9, 2; with cap 3 the weights are 2, 0.5, 3, 0 and only the third
    is capped."""
    from policy.math.losses import truncated_importance_weights

    old = torch.tensor([[0.5, 0.2, 0.9, 0.6]]).log()
    sampler = torch.tensor([[0.25, 0.4, 0.1, 0.3]]).log()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, capped = truncated_importance_weights(old, sampler, mask, 3.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 3.0, 0.0]]))
    assert capped.tolist() == [[False, False, True, False]]
    assert not weights.requires_grad


def test_importance_weighted_advantages_weight_each_tokens_policy_gradient_term():
    """The GRPO loss of advantages times the TIS weights is the per-token weighted objective
    TRL computes (w_t min(r A, clip(r) A), then the KL term unweighted), by hand at a ratio
    inside and one outside the clip range; its gradient is the weighted one too."""
    loss_fn = POLICY_LOSSES["grpo"].fn
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logprobs = torch.tensor([[-0.9, -2.5, -0.5]], requires_grad=True)  # r = e^0.1, e^-0.5, 1
    ref = torch.tensor([[-1.0, -2.0, -0.7]])
    advantages, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    weights = torch.tensor([[2.0, 0.5, 1.5]])
    out = loss_fn(logprobs, old, ref, advantages * weights, mask, clip_eps_low=0.2,
                  clip_eps_high=0.2, beta=0.04, num_sequences=1.0, num_tokens=3.0,
                  max_tokens=3)
    r = torch.exp(logprobs - old)
    surrogate = torch.minimum(r * advantages, r.clamp(0.8, 1.2) * advantages)
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    by_hand = -(weights * surrogate - 0.04 * kl).sum(-1).mean() / 3  # GRPO: per-sequence mean
    torch.testing.assert_close(out.loss, by_hand)
    (grad,) = torch.autograd.grad(out.loss, logprobs, retain_graph=True)
    (hand,) = torch.autograd.grad(by_hand, logprobs)
    torch.testing.assert_close(grad, hand)
