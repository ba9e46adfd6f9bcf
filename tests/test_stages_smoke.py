"""CPU smoke runs of the SFT and GRPO stages on a tiny random model, through the CLI and DeepSpeed."""

import json

import pytest
import torch

import igrpo
from configs import load_config
from policy.algorithms import train_policy
from policy.rewards import RuleReward
from runtime.data import load_splits
from runtime.tiny_model import build_tiny
from runtime.models import load_causal_lm
from runtime.tracking import MetricsLogger, read_metrics
from wandb_offline import read_offline_run
from small_config import SMALL as BASE

SMALL = [*BASE, "grpo.eval_every=1"]
STEP_METRICS = [
    "reward/mean", "reward/std", "reward/zero_std_groups", "reward/accuracy", "rollout/length_mean",
    "rollout/truncation_rate", "train/kl", "train/clip_fraction", "train/entropy",
    "train/grad_norm", "train/lr", "time/rollout", "time/scoring", "time/update",
]


def _weights_differ(a, b) -> bool:
    """Both folders load; some tensor of b differs from a's."""
    wa, wb = load_causal_lm(a).state_dict(), load_causal_lm(b).state_dict()
    assert wa.keys() == wb.keys()
    return any(not torch.equal(wa[k], wb[k]) for k in wa)


def _args(tmp_path, *extra):
    return ["--config", "configs/tiny.yaml", f"run.root={tmp_path}", *SMALL, *extra]


def test_cli_sft_then_grpo_process(tmp_path):
    assert igrpo.main(["sft", *_args(tmp_path)]) == 0
    run = tmp_path / "tiny"
    best = run / "sft" / "best"
    assert (best / "model.safetensors").exists()
    sft_rows = read_metrics(run / "sft" / "metrics.jsonl")
    assert sft_rows[-1]["train/loss"] > 0 and "val/greedy_accuracy" in sft_rows[-1]
    # The export is the best validation checkpoint: the base model itself unless a later
    # validation beat step 0's.
    vals = [r["val/greedy_accuracy"] for r in sft_rows if "val/greedy_accuracy" in r]
    assert _weights_differ(run / "base", best) == (max(vals[1:]) > vals[0])
    assert igrpo.main(["grpo", *_args(tmp_path, "grpo.supervision=process",
                                      "grpo.reward=step_oracle")]) == 0
    rows = read_metrics(run / "grpo" / "metrics.jsonl")
    # GRPO moved the warm start exactly when some step had a gradient (a random model's
    # samples may all be wrong: equal rewards, zero advantages, and a zero KL gradient).
    moved = any(r["train/grad_norm"] > 0 for r in rows[1:])
    assert _weights_differ(best, run / "grpo" / "final") == moved
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in STEP_METRICS:
        assert all(key in r for r in rows[1:]), key
    assert "eval/maj_accuracy" in rows[-1] and "eval/pass_at_k" in rows[-1]
    # The offline wandb run holds the same metrics.
    runs = list((run / "grpo" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    offline = read_offline_run(runs[0])
    assert [r["_step"] for r in offline["history"]] == [0, 1, 2]
    for key in STEP_METRICS:
        assert offline["history"][-1][key] == pytest.approx(rows[-1][key]), key
    assert offline["config"]["grpo"]["reward"] == "step_oracle"  # the resolved config, verbatim
    assert (run / "config.yaml").exists() and (run / "grpo" / "config.yaml").exists()
    assert igrpo.main(["eval", *_args(tmp_path)]) == 0
    report = json.loads((run / "eval" / "grpo.json").read_text())
    assert set(report) >= {"eval/greedy_accuracy", "eval/maj_accuracy", "eval/pass_at_k"}


def test_sft_lr_decays_linearly_to_zero(tmp_path):
    assert igrpo.main(["sft", *_args(tmp_path, "sft.lr_decay=true", "sft.lr=1e-3",
                                     "sft.epochs=2", "sft.eval_every=0")]) == 0
    lrs = [r["train/lr"] for r in read_metrics(tmp_path / "tiny" / "sft" / "metrics.jsonl")
           if "train/lr" in r]
    total = len(lrs)
    assert total == 8  # 64 questions / 16 a step, 2 epochs
    # The rate each step ran at: DeepSpeed's 2-step warm-up (0, half), then 1e-3 falling
    # linearly to 0 at the last step.
    expected = [1e-3 * (k / 2 if k < 2 else (total - k) / (total - 2)) for k in range(total)]
    assert lrs == pytest.approx(expected)


def test_changed_config_refuses_to_resume(tmp_path, capsys):
    assert igrpo.main(["sft", *_args(tmp_path)]) == 0
    capsys.readouterr()
    assert igrpo.main(["sft", *_args(tmp_path, "sft.lr=0.5")]) == 2
    assert "differing keys: sft.lr" in capsys.readouterr().err
    # How it runs may change: the finished stage resumes (nothing to do) with other threads.
    assert igrpo.main(["sft", *_args(tmp_path, "run.threads=1")]) == 0


def test_bad_override_fails_before_work(tmp_path, capsys):
    assert igrpo.main(["sft", *_args(tmp_path, "sft.lrr=1")]) == 2
    assert "sft.lrr" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


class _RandomReward:
    """Seeded random rewards: every group has signal, so every loss must move the weights."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, records, rollout):
        from policy.rewards import Scores

        return Scores(rewards=torch.rand(len(records), generator=self.gen))


class _CrashAt:
    """The rule reward, but raising on its `n`-th call (a crash in the middle of a run)."""

    def __init__(self, n):
        self.n, self.calls, self.inner = n, 0, RuleReward()

    def __call__(self, records, rollout):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("simulated crash")
        return self.inner(records, rollout)


def test_grpo_resumes_after_crash(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.steps=3",
                                            "grpo.save_every=1", "grpo.eval_every=0",
                                            "run.wandb_mode=disabled", "grpo.supervision=outcome"])
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_policy(cfg, tmp_path, base, _CrashAt(3), splits.rl, splits.eval, logger, "")
    reward = _CrashAt(0)
    train_policy(cfg, tmp_path, base, reward, splits.rl, splits.eval, logger, "")
    assert reward.calls == 1  # only step 3 was left to do
    steps = [r["step"] for r in read_metrics(tmp_path / "m.jsonl")]
    assert steps == [0, 1, 2, 3]
    assert (tmp_path / "grpo" / "final" / "config.json").exists()


@pytest.mark.parametrize("loss", ["r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po"])
def test_every_loss_variant_runs_a_step(tmp_path, loss):
    extra = {"dapo": ["grpo.dynamic_sampling=true", "grpo.overlong_buffer_share=0.2"],
             "c3po": ["grpo.token_budget_share=0.5"]}.get(loss, [])
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.steps=1",
                                            "grpo.eval_every=0", f"grpo.loss={loss}",
                                            "grpo.mu=2", "run.wandb_mode=disabled",
                                            "grpo.supervision=outcome", *extra])
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    final = train_policy(cfg, tmp_path, base, _RandomReward(), splits.rl, splits.eval[:2], logger, "")
    row = read_metrics(tmp_path / "m.jsonl")[-1]
    assert torch.isfinite(torch.tensor(row["train/loss"])) and row["train/grad_norm"] > 0
    before, after = load_causal_lm(base), load_causal_lm(final)
    assert not torch.equal(before.lm_head.weight, after.lm_head.weight)


def test_cli_label_train_rm_eval_rm(tmp_path):
    extra = ["label.questions=4", "label.samples_per_question=2", "label.num_completions=2",
             "label.max_new_tokens=12", "label.shard_size=3", "rm.epochs=1", "rm.batch_size=4",
             "rm.eval_solutions=4", "rm.bon_questions=2", "rm.bon_samples=2",
             "run.wandb_mode=disabled"]
    assert igrpo.main(["sft", *_args(tmp_path, *extra)]) == 0
    assert igrpo.main(["label", *_args(tmp_path, *extra)]) == 0
    labels = tmp_path / "tiny" / "labels"
    rows = [json.loads(line) for line in open(labels / "math_shepherd.jsonl")]
    assert rows and all(r["input"].count("ки") == len(r["soft_labels"]) for r in rows)
    stats = json.loads((labels / "stats.json").read_text())
    assert stats["label/solutions"] == len(rows)
    assert len(list((labels / "shards").glob("shard-*.jsonl"))) == -(-len(rows) // 3)
    for kind in ("prm", "orm"):
        assert igrpo.main(["train-rm", *_args(tmp_path, *extra, f"rm.kind={kind}",
                                              f"rm.data_path={labels / 'math_shepherd.jsonl'}")]) == 0
    assert igrpo.main(["eval-rm", *_args(tmp_path, *extra)]) == 0
    report = json.loads((tmp_path / "tiny" / "eval" / "reward_models.json").read_text())
    assert {"prm/step_accuracy", "orm/step_accuracy", "bon/prm_pick", "bon/orm_pick",
            "bon/majority", "bon/random"} <= set(report)


@pytest.mark.parametrize("extra", [["grpo.mu=1"], ["grpo.mu=2"], ["grpo.algorithm=ppo"]],
                         ids=["grpo", "grpo-mu2", "ppo"])
def test_first_step_uses_the_policy_as_its_reference(tmp_path, monkeypatch, extra):
    """A stage's first step, from its reference, runs no reference forward (the policy's own
    log-probs are the reference's) and ends where the run with the reference forward ends: the
    same losses and KL, weights within 1e-6. Later steps do run it."""
    import shutil

    import policy.algorithms.grpo
    import policy.critic
    import policy.kit

    calls = {"reference": 0}
    forward = policy.kit.forward_logprobs

    def counting(model, rollout, micro):  # the reference's forwards (and pi_old's: mu = 2)
        calls["reference"] += 1
        return forward(model, rollout, micro)

    for module in (policy.kit, policy.algorithms.grpo, policy.critic):  # where it is called
        monkeypatch.setattr(module, "forward_logprobs", counting)
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.steps=2",
                                            "grpo.eval_every=0", "run.wandb_mode=disabled",
                                            "grpo.supervision=outcome", *extra])
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    copy = shutil.copytree(base, tmp_path / "copy")
    rows, finals, counts = [], [], []
    for name, reference in (("same", base), ("copy", copy)):
        calls["reference"] = 0
        logger = MetricsLogger(tmp_path / f"{name}.jsonl", config={}, mode="disabled",
                               project="", name="")
        torch.manual_seed(0)
        finals.append(train_policy(cfg, tmp_path, base, _RandomReward(), splits.rl, splits.eval[:2],
                                 logger, "", out_name=name, reference_path=reference,
                                 evaluate_ends=False))
        rows.append([r for r in read_metrics(tmp_path / f"{name}.jsonl") if "train/loss" in r])
        counts.append(calls["reference"])
    assert counts[1] - counts[0] == 1  # the first step's reference forward, skipped
    assert len(rows[0]) == len(rows[1]) == 2
    for a, b in zip(*rows):
        for key in ("train/loss", "train/kl"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    wa, wb = load_causal_lm(finals[0]).state_dict(), load_causal_lm(finals[1]).state_dict()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    assert _weights_differ(base, finals[0])
