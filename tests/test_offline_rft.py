"""Offline RFT (policy/algorithms/offline_rft.py): the right samples are kept and a killed run
resumes; a wall-clock budget is shared between sampling and fine-tuning."""

import torch

from configs import load_config



def test_offline_rft_keeps_the_right_samples_and_resumes(tmp_path):
    """The starting policy is sampled once (policy.steps x questions x G samples, graded by the
    rule), only the right ones are fine-tuned on, and a rerun samples nothing again."""
    import json

    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from runtime.models import load_causal_lm
    from runtime.tracking import MetricsLogger, read_metrics
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=2",
                                            "model.policy_path=bundled:tiny_warm_start",
                                            "policy.max_new_tokens=112",
                                            "run.wandb_mode=disabled"], recipe="offline_rft")
    splits = load_splits(cfg.data, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    calls = []

    def reward(records, rollout):
        calls.append(len(records))
        return RuleReward()(records, rollout)

    start = cfg.model.policy_path
    final = resolve(cfg).train_policy(tmp_path, start, reward, splits.rl, splits.eval, logger, "")
    rows = [json.loads(line) for line in open(tmp_path / "offline_rft" / "samples.jsonl")]
    assert len(rows) == 2 * 2 * 4 and calls == [8, 8]
    right = [r for r in rows if r["right"]]
    assert 0 < len(right) < len(rows)  # the warm start is right on some samples, not all
    from tasks.grading import grade
    assert all(grade(r["text"], r["answer"]) == r["right"] for r in rows)
    done = json.loads((tmp_path / "offline_rft" / "done.json").read_text())
    assert (done["samples"], done["kept"]) == (16, len(right))
    metrics = read_metrics(tmp_path / "m.jsonl")
    assert metrics[-1]["rft/kept"] == len(right)
    assert not torch.equal(load_causal_lm(start).lm_head.weight,
                           load_causal_lm(final).lm_head.weight)
    # a crash after sampling: the samples are reused, nothing is drawn again
    (tmp_path / "offline_rft" / "done.json").unlink()
    resolve(cfg).train_policy(tmp_path, start, reward, splits.rl, splits.eval, logger, "")
    assert calls == [8, 8]


def test_offline_rft_shares_its_budget_between_sampling_and_fine_tuning(tmp_path, monkeypatch):
    """A 4-minute budget, half of it for sampling: at 50 s a sampled step, sampling stops after
    the step that reaches 120 s (3 steps, 150 s) and the fine-tuning gets the 90 s left."""
    import json

    import policy.algorithms.offline_rft as offline_rft
    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from small_config import SMALL

    assert offline_rft.budget_split(4, 0.5, 150.0) == (120.0, 90.0)
    assert offline_rft.budget_split(4, 0.5, 300.0)[1] == 1e-3  # overspent: one step still runs
    assert offline_rft.budget_split(0, 0.5, 999.0) == (float("inf"), 0.0)  # no budget
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=6",
                                            "model.policy_path=bundled:tiny_warm_start",
                                            "policy.max_minutes=4", "run.wandb_mode=disabled"],
                      recipe="offline_rft")
    clock = iter(range(0, 100_000, 50))  # a step reads the clock twice: 50 s each
    monkeypatch.setattr(offline_rft, "perf_counter", lambda: float(next(clock)))
    w = resolve(cfg)
    rows = offline_rft.sample_once(w.stage, w.method, tmp_path, cfg.model.policy_path,
                                   RuleReward(), load_splits(cfg.data, 0).rl)
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    assert offline_rft.sampled_seconds(rows) == 150.0
    # resumed: the seconds already spent count, so nothing more is drawn
    again = offline_rft.sample_once(w.stage, w.method, tmp_path, cfg.model.policy_path,
                                    RuleReward(), load_splits(cfg.data, 0).rl)
    assert again == rows
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(rows)
    assert json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])["seconds"] == 50.0
