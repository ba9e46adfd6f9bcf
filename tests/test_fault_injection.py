"""Crash-anywhere resume: SIGKILL the default job 20 times at random moments, resume it each time
with the same command, and get the same summary and weights as an uninterrupted run."""

import json
import random
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import Zygote, kill_and_resume, kill_targets, unit_timeline
from small_config import ITERATE, SMALL

KILLS = 20


def _args(root):
    return ["iterate", "--config", "configs/tiny.yaml", f"run.root={root}", *SMALL, *ITERATE,
            "policy.save_every=1", "rm.save_every=1"]


@pytest.mark.slow
def test_twenty_kills_resume_to_the_same_result(tmp_path):
    zygote = Zygote()
    try:
        assert zygote.run(_args(tmp_path / "straight"), tmp_path / "straight.log") == 0
        timeline = unit_timeline(tmp_path / "straight" / "tiny" / "manifest.json")
        targets = kill_targets(timeline, KILLS, random.Random(0))
        report = kill_and_resume(zygote, _args(tmp_path / "killed"), tmp_path / "killed" / "tiny",
                                 tmp_path / "killed.log", targets)
    finally:
        zygote.close()
    units = Counter(k["unit"] for k in report.kills)
    mid_write = [k for k in report.kills if k["partial_writes"]]
    print(f"\n{len(report.kills)} kills over {report.attempts} attempts; units hit: "
          f"{dict(units)}; kills that left a half-written file: {len(mid_write)} "
          f"{[k['partial_writes'][:2] for k in mid_write]}")
    assert report.exit_code == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert len(report.kills) >= KILLS
    straight, killed = tmp_path / "straight" / "tiny", tmp_path / "killed" / "tiny"
    assert json.loads((killed / "summary.json").read_text()) == \
        json.loads((straight / "summary.json").read_text())
    finals = sorted(p.relative_to(straight) for p in straight.rglob("model.safetensors"))
    assert any("grpo/iteration-2" in str(p) for p in finals)
    for rel in finals:
        a, b = load_file(straight / rel), load_file(killed / rel)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), rel


@pytest.mark.slow
def test_a_run_killed_around_a_fired_guard_resumes_to_the_same_result(tmp_path):
    """`watch.guard=refresh`: the small random model answers wrong, so every positive advantage
    goes to a wrong answer (`watch/wrong_push` 1 > 0.5) and the guard fires at grpo/1's second
    step of three; the manifest plans a labelling round on that policy (label/1, rm-*/1,
    refresh-check/1) and grpo/1.1 for the step left. SIGKILLed in each of those units and once
    more anywhere, the run resumes to the uninterrupted summary and weights."""
    args = lambda root: [*_args(root), "iterate.iterations=1", "policy.steps=3",  # noqa: E731
                         "watch.guard=refresh", "watch.window=2"]
    zygote = Zygote()
    try:
        assert zygote.run(args(tmp_path / "straight"), tmp_path / "straight.log") == 0
        straight = tmp_path / "straight" / "tiny"
        manifest = json.loads((straight / "manifest.json").read_text())["units"]
        assert manifest["grpo/1"]["outputs"]["guard"]["fired_at"] == 2
        assert manifest["grpo/1.1"]["outputs"]["question_steps"] == [2, 3]
        targets = kill_targets(unit_timeline(straight / "manifest.json"), 5, random.Random(0),
                               required=("grpo/1", "label/1", "rm-prm/1", "grpo/1.1"))
        report = kill_and_resume(zygote, args(tmp_path / "killed"), tmp_path / "killed" / "tiny",
                                 tmp_path / "killed.log", targets)
    finally:
        zygote.close()
    assert report.exit_code == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert len(report.kills) >= 4
    killed = tmp_path / "killed" / "tiny"
    assert json.loads((killed / "summary.json").read_text()) == \
        json.loads((straight / "summary.json").read_text())
    assert json.loads((killed / "manifest.json").read_text())["units"].keys() == manifest.keys()
    for rel in ("grpo/iteration-1/final", "grpo/iteration-1.1/final", "rm-prm/iteration-1/final"):
        a, b = (load_file(run / rel / "model.safetensors") for run in (straight, killed))
        assert all(torch.equal(a[k], b[k]) for k in a), rel
