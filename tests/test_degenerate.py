"""Degenerate numbers: each case is handled (documented, counted) or stops with the step named;
no NaN reaches `optimizer.step()`."""

import dataclasses

import pytest
import torch

from configs import load_config
from configs.schema import DeepSpeedConfig
from policy.math.advantages import outcome_advantages
from policy.scoring import drop_nonfinite
from iteration.resolve import resolve
from policy.math.losses import POLICY_LOSSES, k3_kl
from policy.rewards import Scores
from runtime.data import load_splits
from runtime.engine import build_engine, checked_backward, engine_step
from runtime.tiny_model import build_model, build_tiny, build_tokenizer
from runtime.models import load_causal_lm
from runtime.tracking import MetricsLogger, read_metrics
from by_hand import process_advantages
from small_config import SMALL

LOSS_KW = dict(clip_eps_low=0.2, clip_eps_high=0.2, beta=0.04, num_sequences=2.0,
               num_tokens=3.0, max_tokens=4)


def test_single_sample_groups_and_all_equal_groups_give_zero():
    assert outcome_advantages(torch.tensor([1.0, 0.0, 5.0]), 1).tolist() == [0.0, 0.0, 0.0]
    assert outcome_advantages(torch.tensor([2.0, 2.0, 2.0, 2.0]), 4).tolist() == [0.0] * 4
    one_step = process_advantages(torch.tensor([[1.0]]), torch.tensor([[True]]),
                                  torch.tensor([[2]]), 4, 1)
    assert one_step.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_reward_spread_under_the_floor_gives_zero():
    # A reward model that barely separates a group (0.50, 0.51, 0.49, 0.50: population std
    # 0.00707) would get advantages of +-1.414 from its noise; a floor of 0.01 zeroes that group
    # and leaves a real spread (0, 1, 0, 1: std 0.5 -> +-1) alone.
    rewards = torch.tensor([0.50, 0.51, 0.49, 0.50, 0.0, 1.0, 0.0, 1.0])
    plain = outcome_advantages(rewards, 4)
    assert plain[:4].tolist() == pytest.approx([0.0, 1.4142, -1.4142, 0.0], abs=1e-3)
    floored = outcome_advantages(rewards, 4, min_std=0.01)
    assert floored.tolist() == pytest.approx([0, 0, 0, 0, -1, 1, -1, 1], abs=1e-5)
    assert outcome_advantages(rewards, 4, min_std=0.01, scale_by_std=False).tolist() == \
        pytest.approx([0, 0, 0, 0, -0.5, 0.5, -0.5, 0.5], abs=1e-6)
    # Process supervision: the floor applies to the std over all step rewards of the group.
    steps = torch.tensor([[0.50, 0.52], [0.48, 0.50], [0.0, 1.0], [1.0, 1.0]])
    mask = torch.ones_like(steps, dtype=torch.bool)
    ends = torch.tensor([[1, 3], [1, 3], [1, 3], [1, 3]])
    adv = process_advantages(steps, mask, ends, 4, 2, min_std=0.05)
    assert adv[:2].abs().sum() == 0 and adv[2:].abs().sum() > 0
    assert process_advantages(steps, mask, ends, 4, 2)[:2].abs().sum() > 1


def test_empty_and_all_padding_completions():
    """A sample with no step gets advantage 0; an all-padding row adds nothing to the loss."""
    adv = process_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
                             torch.tensor([[True, True], [False, False]]),
                             torch.tensor([[0, 2], [0, 0]]), 3, 2)
    assert torch.isfinite(adv).all() and adv[1].tolist() == [0.0, 0.0, 0.0]
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [float("-inf")] * 3], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    for name, spec in POLICY_LOSSES.items():
        out = spec.fn(logprobs, logprobs.detach(), logprobs.detach(), torch.ones(2, 3), mask,
                      **LOSS_KW)
        assert torch.isfinite(out.loss), name
        (grad,) = torch.autograd.grad(out.loss, logprobs)
        assert torch.isfinite(grad).all() and grad[1].abs().sum() == 0, name
    empty = POLICY_LOSSES["grpo"].fn(torch.zeros(2, 3), torch.zeros(2, 3), None,
                                     torch.zeros(2, 3), torch.zeros(2, 3), **LOSS_KW)
    assert empty.loss.item() == 0.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_overflowing_log_ratios_stay_finite(name):
    """logp - old = +-1000 would overflow exp(); the clamped ratio keeps loss and grads finite,
    also on masked-out tokens."""
    logprobs = torch.tensor([[-0.1, -0.2, -0.3], [-0.1, -0.2, -0.3]], requires_grad=True)
    old = torch.tensor([[-1000.0, -0.2, -0.3], [-0.1, 900.0, -0.3]])
    ref = torch.tensor([[-0.1, -999.0, -0.3], [800.0, -0.2, -0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([[1.0] * 3, [-1.0] * 3])
    out = POLICY_LOSSES[name].fn(logprobs, old, ref, advantages, mask, **LOSS_KW)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    assert torch.isfinite(k3_kl(logprobs.detach(), ref)).all()


def test_nonfinite_rewards_drop_their_groups():
    scores = Scores(rewards=torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.5, 0.5]),
                    step_rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0],
                                               [1.0, float("inf")], [0.5, float("nan")]]),
                    step_mask=torch.tensor([[True, True], [True, True], [True, True],
                                            [True, True], [True, True], [True, False]]),
                    step_end_index=torch.zeros(6, 2, dtype=torch.long))
    cleaned, broken = drop_nonfinite(scores, 2)
    # Group 0 has a NaN reward, group 2 an inf step reward; group 1 is clean (sample 5's NaN sits
    # on a padding step, which no advantage reads).
    assert broken.tolist() == [True, False, True]
    assert torch.isfinite(cleaned.rewards).all() and torch.isfinite(cleaned.step_rewards).all()
    assert cleaned.rewards.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert cleaned.step_rewards[2:4].tolist() == [[0.0, 0.0], [1.0, 1.0]]


class _NaNForFirstGroup:
    """A 'PRM' that returns NaN for every sample of the first question of each step."""

    def __init__(self, group_size):
        self.group_size = group_size

    def __call__(self, records, rollout):
        rewards = torch.rand(len(records))
        rewards[:self.group_size] = float("nan")
        return Scores(rewards=rewards)


def _small_run(tmp_path, *extra):
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=2",
                                            "policy.eval_every=0", "run.wandb_mode=disabled",
                                            "policy.supervision=outcome", "inspect.every=0",
                                            *extra])
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    return cfg, load_splits(cfg.data, 0), base, logger


def test_grpo_survives_a_nan_reward_model(tmp_path):
    cfg, splits, base, logger = _small_run(tmp_path)
    final = resolve(cfg).train_policy(tmp_path, base, _NaNForFirstGroup(cfg.policy.group_size), splits.rl,
                       splits.eval[:2], logger, "")
    rows = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/loss" in r]
    assert [r["reward/nonfinite_groups"] for r in rows] == [1.0, 1.0]
    assert all(r["train/kept_groups"] == 0.5 for r in rows)
    model = load_causal_lm(final)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(model.lm_head.weight, load_causal_lm(base).lm_head.weight)


def test_nan_loss_stops_the_run_naming_the_step(tmp_path, monkeypatch):
    cfg, splits, base, logger = _small_run(tmp_path, "policy.save_every=1")
    spec = POLICY_LOSSES["grpo"]
    calls = []

    def nan_at_second_step(*args, **kw):
        out = spec.fn(*args, **kw)
        calls.append(1)
        return dataclasses.replace(out, loss=out.loss * float("nan")) if len(calls) == 2 else out

    monkeypatch.setitem(POLICY_LOSSES, "grpo",
                        dataclasses.replace(spec, fn=nan_at_second_step))
    with pytest.raises(FloatingPointError, match="grpo step 2, update 1, micro-batch 1"):
        resolve(cfg).train_policy(tmp_path, base, _NaNForFirstGroup(cfg.policy.group_size), splits.rl,
                   splits.eval[:2], logger, "")
    # Step 1's checkpoint is intact and the run resumes from it (step 2 only is redone).
    monkeypatch.setitem(POLICY_LOSSES, "grpo", spec)
    resolve(cfg).train_policy(tmp_path, base, _NaNForFirstGroup(cfg.policy.group_size), splits.rl,
               splits.eval[:2], logger, "")
    steps = [r["step"] for r in read_metrics(tmp_path / "m.jsonl") if "train/loss" in r]
    assert steps == [1, 2]


def test_nonfinite_gradient_never_reaches_the_optimizer():
    """A NaN loss is refused before backward; a NaN gradient (stage 0 measures the norm) is
    refused before the optimizer step; the weights stay as they were."""
    tokenizer = build_tokenizer(())
    model = build_model(tokenizer, 16, 1, 2, 32, 64, seed=0)
    engine = build_engine(model, DeepSpeedConfig(), lr=1e-2, micro_batch_size=1, grad_accum=1)
    before = [p.detach().clone() for p in engine.module.parameters()]
    logits = engine(input_ids=torch.tensor([[5, 6, 7]])).logits
    with pytest.raises(FloatingPointError, match="sft step 1: the loss is nan"):
        checked_backward(engine, logits.mean() * float("nan"), "sft step 1")
    checked_backward(engine, logits.mean(), "sft step 1")
    next(engine.module.parameters()).grad.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="sft step 1: the gradient norm is nan"):
        engine_step(engine, "sft step 1")
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
