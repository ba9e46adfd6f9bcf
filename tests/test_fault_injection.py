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
