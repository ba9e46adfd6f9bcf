"""CPU smoke runs of the stages through the CLI on a tiny random model: sft then grpo, label,
train-rm and eval-rm, a changed config, a bad override."""

import json

import pytest
import torch

import igrpo
from runtime.models import load_causal_lm
from runtime.tracking import read_metrics
from wandb_offline import read_offline_run
from small_config import SMALL as BASE

SMALL = [*BASE, "policy.eval_every=1"]
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
    assert not (run / "sft" / "final").exists()  # only with sft.export_final
    assert igrpo.main(["grpo", *_args(tmp_path, "policy.supervision=process",
                                      "policy.reward=step_oracle")]) == 0
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
    assert offline["config"]["policy"]["reward"] == "step_oracle"  # the resolved config, verbatim
    # The watch (policy/watch.py) on every step, in both; the question ids in metrics.jsonl only.
    for key in ("watch/gold", "watch/proxy", "watch/group_auroc", "watch/adv_auroc",
                "watch/trace_auroc",
                "watch/wrong_push", "watch/steps_per_solution", "watch/tokens_per_step"):
        assert all(key in r for r in rows[1:]) and key in offline["history"][-1], key
    assert offline["history"][1]["watch/kl_init"] == rows[1]["watch/kl_init"]
    assert rows[1]["watch/kl_init"] == pytest.approx(0.0, abs=1e-7)  # step 1: the start itself
    assert offline["history"][-1]["watch/gold"] == pytest.approx(rows[-1]["reward/accuracy"])
    assert len(rows[-1]["watch/question_ids"]) == 2
    assert "watch/question_ids" not in offline["history"][-1]
    # The synthetic task has a step oracle: trace accuracy joins the final evaluation, in wandb.
    assert offline["history"][-1]["eval/trace_accuracy"] == rows[-1]["eval/trace_accuracy"]
    assert (run / "config.yaml").exists() and (run / "grpo" / "config.yaml").exists()
    assert igrpo.main(["eval", *_args(tmp_path)]) == 0
    report = json.loads((run / "eval" / "grpo.json").read_text())
    assert set(report) >= {"eval/greedy_accuracy", "eval/maj_accuracy", "eval/pass_at_k",
                           "eval/trace_accuracy"}


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


