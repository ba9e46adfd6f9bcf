"""Group-relative advantages (policy/math/advantages.py) against hand-computed numbers and the
seed's worked example: outcome, process, RFT, the estimator table, GPG's alpha, C3PO's budget."""

import math

import pytest
import torch

from policy.algorithms.grpo import advantage_step
from policy.math.advantages import (outcome_advantages, process_advantages, token_budget_mask,
                                    zero_group_correction)
from policy.rewards import Scores

from recipe_batch import LENGTHS, REWARDS, batch_rollout, recipe_config
from seed_example import seed_inputs


def test_seed_example_advantages():
    *_, adv = seed_inputs()
    assert adv.tolist() == pytest.approx([0.577, 0.577, 0.577, -1.732], abs=1e-3)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_equal_group_has_exactly_zero_advantage(dtype):
    rewards = torch.full((64,), 0.7, dtype=dtype)
    assert (outcome_advantages(rewards, 64) == 0).all()
    steps = torch.full((64, 3), 0.7, dtype=dtype)
    adv = process_advantages(steps, torch.ones(64, 3, dtype=torch.bool),
                             torch.tensor([[1, 3, 5]] * 64), 6, 64)
    assert (adv == 0).all()
    # 0.1 + 0.6 is 0.7 up to rounding: one reward, no spread
    near = torch.tensor([0.1 + 0.6, 0.7, 0.7, 0.7], dtype=torch.float64)
    assert (outcome_advantages(near, 4) == 0).all()
    # a real spread of one part in a thousand keeps its signal
    assert (outcome_advantages(torch.tensor([0.7, 0.7007]), 2) != 0).all()


def test_gpg_alpha_by_hand():
    assert zero_group_correction(8, 4) == 2.0   # B = 8 samples, M = 4 without signal
    assert zero_group_correction(64, 16) == pytest.approx(64 / 48)
    assert zero_group_correction(8, 0) == 1.0
    assert zero_group_correction(8, 8) == 1.0   # nothing to correct: the step is skipped


def test_c3po_selection_and_normaliser_by_hand():
    lengths = torch.tensor([5, 3, 4, 2])
    order = torch.tensor([2, 0, 1, 3])
    # budget 9: row 2 (4 tokens, 5 left), row 0 (5 tokens, 0 left): sum_{j<N} 4 < 9 <= 9
    assert token_budget_mask(lengths, 9, order).tolist() == [5, 0, 4, 0]
    # budget 7: row 2 (4), then row 0 cut to 3 tokens so that |Psi| = Phi
    assert token_budget_mask(lengths, 7, order).tolist() == [3, 0, 4, 0]
    # budget above the batch: everything, and the normaliser stays Phi
    assert token_budget_mask(lengths, 100, order).tolist() == [5, 3, 4, 2]
    # Through the step: Phi = 0.25 * 2 * 3 * 4 = 6 tokens of the 11; the loss divides by 6.
    cfg = recipe_config("c3po", "grpo.token_budget_share=0.25")
    rewards = torch.tensor(REWARDS)
    batch = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                           batch_rollout(), cfg.grpo, seed=3)
    assert batch.loss_mask.sum() == 6 and batch.num_tokens == 6
    order = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    expected = token_budget_mask(torch.tensor(LENGTHS), 6, order)
    assert batch.loss_mask.sum(-1).long().tolist() == expected.tolist()
    assert batch.stats["train/budget_tokens"] == 6
