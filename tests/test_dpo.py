"""DPO and online DPO (policy/algorithms/dpo.py) and GSPO under the outer loop: where the pairs
come from, resume after a crash, and `igrpo iterate --recipe online_dpo|gspo` killed and resumed
to the uninterrupted result (the loss and pairing math: tests/test_losses.py; the gradient
coefficient: tests/test_unified_paradigm.py)."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import Zygote, kill_and_resume, kill_targets, unit_timeline
from runtime.tracking import read_metrics
from small_config import ITERATE, SMALL
from small_runs import RandomReward, run_recipe


class _Recording(RandomReward):
    """RandomReward that keeps the texts it judged, call by call."""

    def __init__(self, crash_at: int = 0):
        super().__init__(crash_at)
        self.texts = []

    def __call__(self, records, rollout):
        self.texts.append(list(rollout.texts))
        return super().__call__(records, rollout)


@pytest.mark.parametrize("recipe", ["dpo", "online_dpo"])
def test_pairs_come_from_the_starting_policy_or_the_current_one(tmp_path, recipe):
    """Three steps at lr 0 and at lr 0.05 from the same seeds: DPO's samples are the starting
    policy's whatever the policy learns (the same texts every step); online DPO's follow the
    policy (the same first step, different later ones), and both take optimizer steps on
    pairs."""
    texts = {}
    for lr in ("0.0", "0.05"):
        torch.manual_seed(0)
        reward = _Recording()
        run_recipe(tmp_path / lr, recipe, "policy.steps=3", f"policy.lr={lr}", reward=reward)
        texts[lr] = reward.texts
        rows = [r for r in read_metrics(tmp_path / lr / "m.jsonl") if "dpo/pairs" in r]
        assert len(rows) == 3 and all(r["dpo/pairs"] > 0 and r["train/skipped_step"] == 0
                                      for r in rows)
    assert texts["0.0"][0] == texts["0.05"][0]
    if recipe == "dpo":
        assert texts["0.0"] == texts["0.05"]
    else:
        assert texts["0.0"][1:] != texts["0.05"][1:]


@pytest.mark.parametrize("recipe", ["dpo", "online_dpo"])
def test_dpo_resumes_bitwise_after_a_crash(tmp_path, recipe):
    """Three steps straight, against the same run crashing at its third reward call and re-run
    with the rewards it had not drawn: the policies end bitwise equal."""
    torch.manual_seed(0)
    _, final_a = run_recipe(tmp_path / "straight", recipe, "policy.steps=3", "policy.lr=0.05")
    with pytest.raises(RuntimeError, match="simulated crash"):
        torch.manual_seed(0)
        run_recipe(tmp_path / "crashed", recipe, "policy.steps=3", "policy.lr=0.05",
                   reward=RandomReward(crash_at=3))
    replay = RandomReward()
    for _ in range(2):
        replay(["q"] * 8, None)
    _, final_b = run_recipe(tmp_path / "crashed", recipe, "policy.steps=3", "policy.lr=0.05",
                            reward=replay)
    assert replay.calls == 3  # step 3 only
    a, b = load_file(str(final_a / "model.safetensors")), load_file(str(final_b /
                                                                        "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _args(root, recipe, *extra):
    return ["iterate", "--config", "configs/tiny.yaml", f"run.root={root}", "--recipe", recipe,
            *SMALL, *ITERATE, "iterate.iterations=1", "policy.steps=3", "policy.save_every=1",
            "rm.save_every=1", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, extra", [("online_dpo", ()),
                                           ("gspo", ("grpo.process_credit=anchored",))],
                         ids=["online_dpo", "gspo"])
def test_iterate_recipe_killed_in_its_policy_stage_resumes_to_the_same_result(tmp_path, recipe,
                                                                               extra):
    """`igrpo iterate --recipe online_dpo|gspo` (PRM-judged, the reference reset to the current
    policy; gspo's process advantages in the anchored credit form, so that a credit form is
    resumed too): SIGKILLed three times, once inside its policy stage, and resumed with the same
    command, it ends with the uninterrupted run's summary and weights, bit for bit."""
    zygote = Zygote()
    try:
        assert zygote.run(_args(tmp_path / "straight", recipe, *extra),
                          tmp_path / "straight.log") == 0
        straight = tmp_path / "straight" / "tiny"
        targets = kill_targets(unit_timeline(straight / "manifest.json"), 3, random.Random(0),
                               required=("grpo/1",))
        report = kill_and_resume(zygote, _args(tmp_path / "killed", recipe, *extra),
                                 tmp_path / "killed" / "tiny", tmp_path / "killed.log", targets)
    finally:
        zygote.close()
    assert report.exit_code == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert "grpo/1" in {k["unit"] for k in report.kills}, report.kills
    killed = tmp_path / "killed" / "tiny"
    summary = json.loads((straight / "summary.json").read_text())
    assert json.loads((killed / "summary.json").read_text()) == summary
    assert [it["iteration"] for it in summary["iterations"]] == [0, 1]
    folder = "online_dpo" if recipe == "online_dpo" else "grpo"  # policy.algorithm's folder
    rows = read_metrics(straight / folder / "iteration-1" / "metrics.jsonl")
    assert rows and all(("dpo/pairs" in r) == (recipe == "online_dpo") for r in rows)
    finals = sorted(p.relative_to(straight) for p in straight.rglob("model.safetensors"))
    assert any(f"{folder}/iteration-1" in str(p) for p in finals)
    for rel in finals:
        a, b = load_file(straight / rel), load_file(killed / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel
