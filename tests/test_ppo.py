"""PPO, VC-PPO and VAPO (policy/algorithms/ppo.py) end to end on a small model: both engines
learn and are exported, value pretraining runs first, a crash resumes bitwise, and a NaN
reward is dropped."""

import json

import pytest
import torch
from safetensors.torch import load_file

from configs import load_config
from runtime.models import load_causal_lm
from runtime.tiny_model import build_tiny
from runtime.tracking import read_metrics
from small_config import SMALL
from small_runs import RandomReward, run_recipe


@pytest.mark.parametrize("recipe", ["ppo", "vc_ppo", "vapo", "t_ppo"])
def test_every_value_recipe_trains_the_policy_and_the_critic(tmp_path, recipe):
    base, final = run_recipe(tmp_path, recipe, "policy.steps=2", "ppo.value_pretrain_steps=2"
                       if recipe in ("vc_ppo", "vapo") else "ppo.value_pretrain_steps=0",
                       "ppo.window_share=0.5" if recipe == "t_ppo" else "run.threads=2")
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # T-PPO's first window (6 of 12 tokens) may end no sequence: no reward, a zero critic,
        # nothing to learn yet; by the second every sequence has ended
        if recipe != "t_ppo" or row["step"] == 2:
            assert row["train/grad_norm"] > 0 and row["critic/grad_norm"] > 0
        assert torch.isfinite(torch.tensor([row["train/loss"], row["critic/value_loss"]])).all()
        # VAPO's LM loss on right samples acts; the others have none
        assert (row["train/positive_nll"] > 0) == (recipe == "vapo")
        assert ("train/kl" in row) == (recipe == "ppo")  # beta 0.04 only in plain PPO
        assert ("tppo/ended" in row) == (recipe == "t_ppo")
    assert not torch.equal(load_causal_lm(base).lm_head.weight,
                           load_causal_lm(final).lm_head.weight)
    critic = load_file(str(final.parent / "critic" / "model.safetensors"))
    assert critic["score.weight"].abs().sum() > 0  # the zero-initialised head learned
    assert final.parent == tmp_path / ("t_ppo" if recipe == "t_ppo" else "ppo")
    pretrain = final.parent / "value-pretrain"
    assert (pretrain / "done.json").exists() == (recipe in ("vc_ppo", "vapo"))
    if recipe in ("vc_ppo", "vapo"):
        losses = [r["critic/pretrain_value_loss"] for r in read_metrics(pretrain / "metrics.jsonl")]
        assert len(losses) == 2 and all(v > 0 for v in losses)


def test_ppo_resumes_bitwise_after_a_crash(tmp_path):
    """VAPO for 3 steps after 2 of value pretraining, straight through, against the same run
    crashing at its fourth reward call (PPO step 2) and re-run: the policy and the critic end
    bitwise equal, and the resumed run draws only the samples it had not finished."""
    straight = tmp_path / "straight"
    _, final_a = run_recipe(straight, "vapo", "policy.steps=3", "ppo.value_pretrain_steps=2")
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(crashed, "vapo", "policy.steps=3", "ppo.value_pretrain_steps=2",
             reward=RandomReward(crash_at=4))
    # the same stream of rewards, past the 3 draws of the finished steps (2 pretraining, 1 PPO)
    replay = RandomReward()
    for _ in range(3):
        replay(["q"] * 8, None)
    _, final_b = run_recipe(crashed, "vapo", "policy.steps=3", "ppo.value_pretrain_steps=2",
                      reward=replay)
    assert replay.calls == 5  # PPO steps 2 and 3 only
    for name in ("final", "critic"):
        a = load_file(str(final_a.parent / name / "model.safetensors"))
        b = load_file(str(final_b.parent / name / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    steps = [r["step"] for r in read_metrics(crashed / "m.jsonl")]
    assert steps == [1, 2, 3]
    assert json.loads((crashed / "ppo" / "done.json").read_text())["steps"] == 3


def test_critic_from_the_reward_model_starts_at_its_logit_margin(tmp_path):
    """A critic initialised from a reward model with the head lm_head['+'] - lm_head['-'] values
    every state at the reward model's logit margin there."""
    from policy.actor_critic import critic_from
    from runtime.tiny_model import build_tokenizer

    cfg = load_config("configs/tiny.yaml", [*SMALL])
    lm = load_causal_lm(build_tiny(tmp_path / "rm", cfg.model.tiny, 0))
    tokenizer = build_tokenizer()
    plus, minus = tokenizer.convert_tokens_to_ids("+"), tokenizer.convert_tokens_to_ids("-")
    head = lm.get_output_embeddings().weight
    critic = critic_from(lm, head[plus] - head[minus]).eval()
    ids = torch.tensor([tokenizer.encode("1+2=3\n3*4=12")])
    with torch.no_grad():
        logits = lm(input_ids=ids).logits
        values = critic(input_ids=ids).logits[..., 0]
    assert torch.allclose(values, logits[..., plus] - logits[..., minus], atol=1e-5)


class _NaNFirst(RandomReward):
    """RandomReward's stream with the first row of every call not a number (a reward model's NaN)."""

    def __call__(self, records, rollout):
        scores = super().__call__(records, rollout)
        scores.rewards[0] = float("nan")
        return scores


@pytest.mark.parametrize("recipe", ["ppo", "t_ppo"])
def test_a_non_finite_reward_is_dropped_not_trained_on(tmp_path, recipe):
    """PPO and T-PPO score through GRPO's scoring step: a NaN reward's group (T-PPO: its row)
    leaves the loss and is counted, and the step trains on the rest."""
    run_recipe(tmp_path, recipe, "policy.steps=2", "ppo.value_pretrain_steps=0",
         *(["ppo.window_share=1.0"] if recipe == "t_ppo" else []), reward=_NaNFirst())
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["reward/nonfinite_groups"] for r in rows] == [1.0, 1.0]
    for row in rows:
        assert torch.isfinite(torch.tensor([row["train/loss"], row["critic/value_loss"],
                                            row["reward/mean"]])).all()
        assert row["train/grad_norm"] > 0


def test_what_the_value_family_cannot_combine_with_fails_at_load():
    from configs import ConfigError

    assert load_config("configs/tiny.yaml", recipe="t_ppo").policy.supervision == "outcome"
    with pytest.raises(ConfigError, match="window_share=0.125 .T-PPO. runs with policy.supervision"
                                          "=outcome and rollout.backend=hf; got process"):
        load_config("configs/tiny.yaml", ["policy.supervision=process"], recipe="t_ppo")
    with pytest.raises(ConfigError, match="online RFT has no critic"):
        load_config("configs/tiny.yaml", ["policy.supervision=rft"], recipe="ppo")
    with pytest.raises(ConfigError, match="ppo.lam_actor / lam_critic = 1.5 / 0.95"):
        load_config("configs/tiny.yaml", ["ppo.lam_actor=1.5"], recipe="ppo")
    with pytest.raises(ConfigError, match="policy.algorithm=ppo with ppo.window_share=0.5: T-PPO"):
        load_config("configs/tiny.yaml", ["ppo.window_share=0.5"], recipe="ppo")
    with pytest.raises(ConfigError, match="policy.algorithm=t_ppo with ppo.window_share=0.0"):
        load_config("configs/tiny.yaml", ["ppo.window_share=0"], recipe="t_ppo")
