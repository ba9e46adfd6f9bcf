"""PPO, VC-PPO and VAPO (policy/algorithms/ppo.py) end to end on a small model: every recipe runs, both
engines learn and are exported, value pretraining runs first, and a crash resumes bitwise."""

import json

import pytest
import torch
from safetensors.torch import load_file

from configs import load_config
from policy.algorithms import train_policy
from policy.rewards import Scores
from runtime.data import load_splits
from runtime.models import load_causal_lm
from runtime.tiny_model import build_tiny
from runtime.tracking import MetricsLogger, read_metrics
from small_config import SMALL


class _Reward:
    """Seeded random rewards, right = reward >= 0.5; raises on call `crash_at` (a crash)."""

    def __init__(self, crash_at: int = 0):
        self.gen, self.calls, self.crash_at = torch.Generator().manual_seed(0), 0, crash_at

    def __call__(self, records, rollout):
        self.calls += 1
        if self.calls == self.crash_at:
            raise RuntimeError("simulated crash")
        rewards = torch.rand(len(records), generator=self.gen)
        return Scores(rewards=rewards, correct=rewards >= 0.5)


def _run(tmp_path, recipe: str, *extra: str, reward=None):
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.eval_every=0",
                                            "run.wandb_mode=disabled", "grpo.supervision=outcome",
                                            "grpo.save_every=1", *extra], recipe=recipe)
    splits = load_splits(cfg.data, 0)
    base = tmp_path / "base"
    if not (base / "config.json").exists():
        build_tiny(base, cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    final = train_policy(cfg, tmp_path, base, reward or _Reward(), splits.rl, splits.eval[:2],
                       logger, "", evaluate_ends=False)
    return base, final


@pytest.mark.parametrize("recipe", ["ppo", "vc_ppo", "vapo", "t_ppo"])
def test_every_value_recipe_trains_the_policy_and_the_critic(tmp_path, recipe):
    base, final = _run(tmp_path, recipe, "grpo.steps=2", "ppo.value_pretrain_steps=2"
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
    pretrain = tmp_path / "grpo" / "value-pretrain"
    assert (pretrain / "done.json").exists() == (recipe in ("vc_ppo", "vapo"))
    if recipe in ("vc_ppo", "vapo"):
        losses = [r["critic/pretrain_value_loss"] for r in read_metrics(pretrain / "metrics.jsonl")]
        assert len(losses) == 2 and all(v > 0 for v in losses)


def test_ppo_resumes_bitwise_after_a_crash(tmp_path):
    """VAPO for 3 steps after 2 of value pretraining, straight through, against the same run
    crashing at its fourth reward call (PPO step 2) and re-run: the policy and the critic end
    bitwise equal, and the resumed run draws only the samples it had not finished."""
    straight = tmp_path / "straight"
    _, final_a = _run(straight, "vapo", "grpo.steps=3", "ppo.value_pretrain_steps=2")
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(crashed, "vapo", "grpo.steps=3", "ppo.value_pretrain_steps=2",
             reward=_Reward(crash_at=4))
    # the same stream of rewards, past the 3 draws of the finished steps (2 pretraining, 1 PPO)
    replay = _Reward()
    for _ in range(3):
        replay(["q"] * 8, None)
    _, final_b = _run(crashed, "vapo", "grpo.steps=3", "ppo.value_pretrain_steps=2",
                      reward=replay)
    assert replay.calls == 5  # PPO steps 2 and 3 only
    for name in ("final", "critic"):
        a = load_file(str(final_a.parent / name / "model.safetensors"))
        b = load_file(str(final_b.parent / name / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    steps = [r["step"] for r in read_metrics(crashed / "m.jsonl")]
    assert steps == [1, 2, 3]
    assert json.loads((crashed / "grpo" / "done.json").read_text())["steps"] == 3


def test_critic_from_the_reward_model_starts_at_its_logit_margin(tmp_path):
    """A critic initialised from a reward model with the head lm_head['+'] - lm_head['-'] values
    every state at the reward model's logit margin there."""
    from policy.critic import critic_from
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


def test_tppo_windows_carry_unfinished_sequences_and_filter_ended_ones(tmp_path):
    """T-PPO with a 4-token window of a 12-token budget: each step trains only its window's
    tokens, sequences still running carry over (with their tokens) and ended ones leave; the
    pool is saved with the state, so a crash resumes the same sequences bitwise."""
    from policy.algorithms.tppo import fill_pool, window_rollout

    pool, nxt = fill_pool([{"k": 0, "tokens": [5, 6]}], 3, 7)
    assert pool == [{"k": 0, "tokens": [5, 6]}, {"k": 7, "tokens": []}, {"k": 8, "tokens": []}]
    assert nxt == 9
    # a row that ended with EOS (id 1), one that ran out of tokens (budget 4), one running on
    rollout, window, ended = window_rollout(0, 1, [[9, 9], [9], [9, 9]], [[5, 6], [], [7]],
                                            [[8, 1], [4, 4, 4, 4], [3]], ["a", "b", "c"], 4, 1)
    assert ended.tolist() == [True, True, False]
    assert rollout.truncated.tolist() == [False, True, False]
    assert window.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert rollout.prompt_ids.tolist() == [[9, 9], [0, 9], [9, 9]]

    window_args = ("grpo.steps=3", "ppo.window_share=0.34")  # 4 tokens of 12
    _, final_a = _run(tmp_path / "straight", "t_ppo", *window_args)
    rows = read_metrics(tmp_path / "straight" / "m.jsonl")
    assert all(0 < r["tppo/window_tokens"] <= 8 * 4 for r in rows)
    assert sum(r["tppo/ended"] for r in rows) > 0 and rows[0]["tppo/carried"] > 0
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(crashed, "t_ppo", *window_args, reward=_CountingCrash(rows, crash_step=3))
    _, final_b = _run(crashed, "t_ppo", *window_args, reward=_CountingCrash(rows, skip=2))
    for name in ("final", "critic"):
        a = load_file(str(final_a.parent / name / "model.safetensors"))
        b = load_file(str(final_b.parent / name / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), name


class _CountingCrash(_Reward):
    """_Reward's stream, called only for steps where some sequence ended: crashes at the call
    of step `crash_step`, or starts `skip` steps into the stream (the calls those steps made,
    found from the straight run's metrics)."""

    def __init__(self, rows, crash_step: int = 0, skip: int = 0):
        super().__init__()
        calls = [(r["step"], int(r["tppo/ended"])) for r in rows if r["tppo/ended"] > 0]
        steps = [step for step, _ in calls]
        self.crash_at = steps.index(crash_step) + 1 if crash_step in steps else 0
        for step, ended in calls:
            if step <= skip:  # the draws those steps made: one per ended sequence
                self(["q"] * ended, None)
        self.calls = 0


class _NaNFirst(_Reward):
    """_Reward's stream with the first row of every call not a number (a reward model's NaN)."""

    def __call__(self, records, rollout):
        scores = super().__call__(records, rollout)
        scores.rewards[0] = float("nan")
        return scores


@pytest.mark.parametrize("recipe", ["ppo", "t_ppo"])
def test_a_non_finite_reward_is_dropped_not_trained_on(tmp_path, recipe):
    """PPO and T-PPO score through GRPO's scoring step: a NaN reward's group (T-PPO: its row)
    leaves the loss and is counted, and the step trains on the rest."""
    _run(tmp_path, recipe, "grpo.steps=2", "ppo.value_pretrain_steps=0",
         *(["ppo.window_share=1.0"] if recipe == "t_ppo" else []), reward=_NaNFirst())
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["reward/nonfinite_groups"] for r in rows] == [1.0, 1.0]
    for row in rows:
        assert torch.isfinite(torch.tensor([row["train/loss"], row["critic/value_loss"],
                                            row["reward/mean"]])).all()
        assert row["train/grad_norm"] > 0


def test_what_the_value_family_cannot_combine_with_fails_at_load():
    from configs import ConfigError

    assert load_config("configs/tiny.yaml", recipe="t_ppo").grpo.supervision == "outcome"
    with pytest.raises(ConfigError, match="window_share=0.125 .T-PPO. runs with grpo.supervision"
                                          "=outcome and rollout.backend=hf; got process"):
        load_config("configs/tiny.yaml", ["grpo.supervision=process"], recipe="t_ppo")
    with pytest.raises(ConfigError, match="online RFT has no critic"):
        load_config("configs/tiny.yaml", ["grpo.supervision=rft"], recipe="ppo")
    with pytest.raises(ConfigError, match="ppo.lam_actor / lam_critic = 1.5 / 0.95"):
        load_config("configs/tiny.yaml", ["ppo.lam_actor=1.5"], recipe="ppo")
