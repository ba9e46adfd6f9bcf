"""The value-based family's formulas (policy/math/value.py) against hand computations and plain loops."""

import math

import pytest
import torch

from policy.math.value import (clipped_value_loss, gae, kl_penalty_rewards, last_token_rewards,
                               length_adaptive_lambda, positive_nll, step_end_rewards)


def _loop_gae(rewards, values, length, gamma, lam, last_value):
    """GAE the textbook way, over one sequence's `length` real tokens."""
    advantages = [0.0] * length
    running = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else last_value
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_matches_a_plain_loop_with_padding(gamma, lam):
    torch.manual_seed(0)
    lengths = [7, 3, 0, 5]
    rewards, values = torch.randn(4, 7), torch.randn(4, 7)
    mask = (torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards_padded = torch.where(mask > 0, rewards, torch.tensor(123.0))  # padding is ignored
    last = torch.tensor([0.0, 0.4, 0.0, -0.7])
    advantages, returns = gae(rewards_padded, torch.where(mask > 0, values, 9.0), mask, gamma,
                              lam, last)
    for i, n in enumerate(lengths):
        expected = _loop_gae(rewards[i].tolist(), values[i].tolist(), n, gamma, lam,
                             last[i].item())
        assert advantages[i, :n].tolist() == pytest.approx(expected, abs=1e-5)
        assert returns[i, :n].tolist() == pytest.approx(
            [a + v for a, v in zip(expected, values[i, :n].tolist())], abs=1e-5)
        assert advantages[i, n:].abs().sum() == 0 and returns[i, n:].abs().sum() == 0


def test_gae_by_hand_and_per_sequence_lambda():
    """Two tokens, gamma 1, V = (0.5, 0.25), reward 1 at the end. lam 1: both advantages are the
    Monte Carlo return minus V: 0.5 and 0.75. lam 0: TD errors 0.25 - 0.5 = -0.25 and 0.75."""
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25], [0.5, 0.25]])
    advantages, returns = gae(rewards, values, torch.ones(2, 2), 1.0, torch.tensor([1.0, 0.0]))
    assert advantages.tolist() == [[0.5, 0.75], [-0.25, 0.75]]
    assert returns.tolist() == [[1.0, 1.0], [0.25, 1.0]]


def test_extended_gae_bootstraps_a_truncated_sequence():
    """T-PPO's extended GAE: a sequence cut after two tokens (no reward yet) whose next state the
    critic values at 0.8. gamma 1, lam 0.5, V = (0.2, 0.6): delta = (0.4, 0.2), A_1 = 0.2,
    A_0 = 0.4 + 0.5 * 0.2 = 0.5. Without the bootstrap the cut reads as a wrong ending."""
    rewards, values = torch.zeros(1, 2), torch.tensor([[0.2, 0.6]])
    advantages, returns = gae(rewards, values, torch.ones(1, 2), 1.0, 0.5, torch.tensor([0.8]))
    assert advantages[0].tolist() == pytest.approx([0.5, 0.2])
    assert returns[0].tolist() == pytest.approx([0.7, 0.8])
    ended, _ = gae(rewards, values, torch.ones(1, 2), 1.0, 0.5)
    assert ended[0].tolist() == pytest.approx([0.4 + 0.5 * -0.6, -0.6])


def test_length_adaptive_lambda():
    """VAPO eq. 8 with alpha 0.05: l = 100 -> 1 - 1/5 = 0.8; l = 1000 -> 0.98; l = 10 -> clamped
    to 0 (1 - 1/0.5 = -1)."""
    lam = length_adaptive_lambda(torch.tensor([100, 1000, 10]), 0.05)
    assert lam.tolist() == pytest.approx([0.8, 0.98, 0.0])


def test_decoupled_lambdas_give_monte_carlo_critic_targets():
    """VC-PPO's decoupled GAE: the critic's targets with lambda 1 are the Monte Carlo returns
    (gamma 1: the reward to come, here the final reward 1 at every token), whatever the values;
    the actor's lambda 0.95 gives different advantages from the same values."""
    torch.manual_seed(1)
    values = torch.rand(1, 6)
    rewards = last_token_rewards(torch.tensor([1.0]), torch.ones(1, 6))
    _, critic_targets = gae(rewards, values, torch.ones(1, 6), 1.0, 1.0)
    assert critic_targets[0].tolist() == pytest.approx([1.0] * 6)
    actor, _ = gae(rewards, values, torch.ones(1, 6), 1.0, 0.95)
    assert actor[0, -1] == pytest.approx(1.0 - values[0, -1].item())
    assert actor[0, 0] != pytest.approx(1.0 - values[0, 0].item())


def test_clipped_value_loss_by_hand():
    """V_old 0, R 1, clip 0.2. V = 0.5: unclipped (0.5)^2 = 0.25, clipped V 0.2 -> 0.64: the
    max, 0.64. V = 1.5: 0.25 vs 0.64 -> 0.64. V = 0.1 (inside the clip): 0.81 both. Loss =
    1/2 (0.64 + 0.64 + 0.81) / 3 tokens."""
    values = torch.tensor([[0.5, 1.5, 0.1, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss = clipped_value_loss(values, torch.zeros(1, 4), torch.ones(1, 4), mask, 0.2, 3.0)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.64 + 0.81) / 3)
    plain = clipped_value_loss(values, torch.zeros(1, 4), torch.ones(1, 4), mask, 0.0, 3.0)
    assert plain.item() == pytest.approx(0.5 * (0.25 + 0.25 + 0.81) / 3)


def test_vapo_nll_only_on_right_samples():
    """Two samples of two tokens: the right one's log-probs (-1, -3) count, the wrong one's do
    not: loss = (1 + 3) / 2 tokens = 2; its gradient reaches only the right sample's tokens."""
    logprobs = torch.tensor([[-1.0, -3.0], [-0.5, -0.5]], requires_grad=True)
    loss = positive_nll(logprobs, torch.ones(2, 2), torch.tensor([True, False]), 2.0)
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert logprobs.grad.tolist() == [[-0.5, -0.5], [0.0, 0.0]]


def test_token_rewards():
    """The reward sits at the last real token; step rewards at their steps' end tokens; the KL
    penalty is -beta * (log pi - log pi_ref) on real tokens."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    placed = last_token_rewards(torch.tensor([2.0, -1.0]), mask)
    assert placed.tolist() == [[0.0, 0.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    steps = step_end_rewards(torch.tensor([[0.3, 0.9]]), torch.tensor([[True, True]]),
                             torch.tensor([[1, 3]]), 4)
    assert steps[0].tolist() == pytest.approx([0.0, 0.3, 0.0, 0.9])
    kl = kl_penalty_rewards(torch.tensor([[-1.0, -2.0, -3.0, 0.0]] * 2),
                            torch.tensor([[-1.5, -2.0, -2.0, 0.0]] * 2), mask, 0.1)
    assert kl[0].tolist() == pytest.approx([-0.05, 0.0, 0.1, 0.0])
    assert math.isclose(kl[1].sum().item(), -0.05, abs_tol=1e-7)
