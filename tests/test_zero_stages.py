"""Every ZeRO stage, every process count, on 2 gloo processes: each stage's training state saves
and loads back under ZeRO-0/1/2/3 in fp32 and bf16; Algorithm 1 (`iterate`, process supervision,
both reward models with their validation split and likelihood calibration, 2 iterations) on 2
processes under ZeRO-2 and ZeRO-3 equals the 1-process run, and killed at random moments it
resumes to its own uninterrupted result; the phases that only generate or score are spread over
the ranks; an error found on one rank stops them all."""

import json
import math
import os
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from configs import load_config
from runtime.tiny_model import build_tiny

from fault_injection import Zygote, kill_and_resume, kill_targets, unit_timeline
from launch import bare_ranks
from small_config import ITERATE, SMALL

ITERATE_ARGS = [*SMALL, *ITERATE, "run.threads=1", "policy.save_every=1", "rm.save_every=1",
                # each question's G samples seeded alone: the rollout is the same on 1 or 2 ranks
                "policy.rollout_questions=1"]
"""`iterate` at the tests' small settings; `rm.val_fraction` and `rm.calibration_examples` stay at
their defaults and configs/tiny.yaml turns the likelihood feature on, so both reward models
validate and calibrate, the phases that stopped ZeRO-3 runs."""
ITERATE_TOL = dict(rtol=1e-4, atol=1e-5)
"""1 process against 2, after 2 iterations: the 1-step equivalence tests' rtol, with atol raised
from 1e-6 to 1e-5 because 2 iterations compound the rounding (measured: the reward models within
4e-8, the mean loss of the last iteration within 4e-6)."""
ADAM_FLIPS = 0.001
"""Share of a GRPO policy's weights allowed past ITERATE_TOL, each by at most 2 lr a step: Adam
moves a weight by about lr whatever its gradient's size, so a gradient that is 0 up to rounding
and rounds to the other sign on 2 processes moves it the other way (measured: 2 of 13,536
weights, by 1.7e-5 and 4.0e-5, after 4 steps at lr 2e-5)."""


def _iterate(root: Path) -> list[str]:
    return ["iterate", "--config", "configs/tiny.yaml", f"run.root={root}", *ITERATE_ARGS]


@pytest.fixture(scope="module")
def ranks():
    """This file's runs, their ranks forked from one process that imported the project once,
    with the variables torchrun gives its workers (a cold launch costs every rank's imports);
    torchrun itself is tested in tests/test_distributed.py."""
    zygote = Zygote(env=ZYGOTE_ENV)
    yield zygote
    zygote.close()


ZYGOTE_ENV = {"DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = load_config("configs/tiny.yaml", SMALL)
    return build_tiny(tmp_path_factory.mktemp("base") / "tiny", cfg.model.tiny, 0,
                      extra_tokens=(cfg.rm.step_tag,))


def _same_logs(folder: Path, name: str) -> dict:
    """zero_resume.py's record of `name`: the second call loaded step 1's state, and both runs
    logged the same rows to step 2 (wall-clock numbers aside)."""
    rows = json.loads((folder / f"{name}.json").read_text())
    assert rows["resumed_from"] == 1, name

    def timeless(run):
        return [{k: v for k, v in row.items()
                 if not k.startswith("time/") and "per_s" not in k} for row in run]

    assert timeless(rows["resumed"]) == timeless(rows["straight"]), name
    assert rows["straight"][-1]["step"] == 2, name
    return rows


@pytest.mark.slow
def test_every_stage_resumes_under_every_zero_stage(tmp_path_factory, base, ranks):
    """SFT, reward-model, GRPO and PPO (with its critic) states saved after step 1 under ZeRO-0,
    1, 2 and 3, in fp32 and in bf16, load into fresh engines on 2 processes, and step 2 then
    equals the uninterrupted run's bit for bit: weights (the critic's too) and every logged
    number but wall-clock ones."""
    root = tmp_path_factory.mktemp("resume")
    ranks.launch(2, "zero_resume", root, base, "sft,rm,grpo,ppo", "fp32,bf16",
                 log=root / "zero_resume.log", timeout=600)
    for precision, kind in ((p, k) for p in ("fp32", "bf16")
                            for k in ("sft", "rm", "grpo", "ppo")):
        tmp_path = root / precision
        for stage in (0, 1, 2, 3):
            name = f"{kind}-z{stage}"
            _same_logs(tmp_path, name)
            exports = sorted(p.relative_to(tmp_path / f"{name}-straight") for p in
                             (tmp_path / f"{name}-straight").rglob("model.safetensors"))
            assert len(exports) == (2 if kind == "ppo" else 1), name
            for rel in exports:
                a = load_file(tmp_path / f"{name}-straight" / rel)
                b = load_file(tmp_path / f"{name}-resumed" / rel)
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) for k in a), f"{name}: {rel}"


@pytest.mark.slow
def test_grpo_with_an_online_reward_model_resumes_under_every_zero_stage(tmp_path, base, ranks):
    """GRPO rewarded by a reward model that learns at every step (`rm.online`: the ORM, and
    PRIME's implicit PRM, stepping after the policy's update or, in PRIME's order, inside the
    scoring): killed after step 1's state is saved under ZeRO-0, 1, 2 and 3 on 2
    processes, step 2 then equals the uninterrupted run's bit for bit: the policy's and the
    reward model's weights, every logged number (its loss among them) but wall-clock ones.
    Its state is the stage's companion (step 2's rewards read what step 1 taught it)."""
    kinds = ("grpo_online", "grpo_implicit", "grpo_prime")
    ranks.launch(2, "zero_resume", tmp_path, base, ",".join(kinds), "fp32",
                 log=tmp_path / "zero_resume.log", timeout=600)
    for name in (f"{kind}-z{stage}" for kind in kinds for stage in (0, 1, 2, 3)):
        rows = _same_logs(tmp_path / "fp32", name)
        assert sum("online_rm/loss" in row for row in rows["straight"]) == 2  # one a step
        for folder in ("final", "online-rm"):
            a = load_file(tmp_path / "fp32" / f"{name}-straight" / "grpo" / folder /
                          "model.safetensors")
            b = load_file(tmp_path / "fp32" / f"{name}-resumed" / "grpo" / folder /
                          "model.safetensors")
            assert all(torch.equal(a[k], b[k]) for k in a), f"{name}: {folder}"


@pytest.mark.slow
def test_lora_stages_resume_under_every_zero_stage(tmp_path, base, ranks):
    """GRPO, SFT and PPO of a LoRA policy (`model.lora`: the adapter trains, the base is frozen,
    the reference is the base; PPO's critic trains whole) and a LoRA token-classification PRM
    (`rm.lora`, its head trained whole), and GRPO rewarded by a LoRA online ORM (`rm.online`,
    `rm.lora`), killed after step 1's state is saved under ZeRO-0, 1, 2 and 3 on 2 processes: step 2 then equals the uninterrupted run's bit for bit, every
    logged number but wall-clock ones and the merged export."""
    kinds = ("grpo_lora", "sft_lora", "ppo_lora", "rm_lora", "grpo_online_lora")
    ranks.launch(2, "zero_resume", tmp_path, base, ",".join(kinds), "fp32",
                 log=tmp_path / "zero_resume.log", timeout=600)
    for name in (f"{kind}-z{stage}" for kind in kinds for stage in (0, 1, 2, 3)):
        _same_logs(tmp_path / "fp32", name)
        straight, resumed = (tmp_path / "fp32" / f"{name}-{mode}" for mode in ("straight",
                                                                                 "resumed"))
        exports = sorted(p.relative_to(straight) for p in straight.rglob("model.safetensors"))
        # (SFT: best and final; PPO: the policy and its critic, trained whole; GRPO with a LoRA
        # online ORM: the policy and the ORM's merged export)
        assert len(exports) == (2 if name.startswith(("sft", "ppo", "grpo_online")) else 1), name
        start = load_file(Path(base) / "model.safetensors")
        for rel in exports:
            a, b = load_file(straight / rel), load_file(resumed / rel)
            if "critic" not in str(rel):  # merged: a plain checkpoint (a classifier: its head)
                assert a.keys() - {"score.weight", "score.bias"} == \
                    start.keys() - {"lm_head.weight"}, name
            assert all(torch.equal(a[k], b[k]) for k in a), f"{name}: {rel}"
        final = load_file(straight / next(r for r in exports if r.parent.name == "final"))
        if name.startswith("rm"):  # the head: the classifier's own, absent from the base
            start = {k: v for k, v in start.items() if k in final}
            assert "score.weight" in final, name
        assert any(not torch.equal(final[k], start[k]) for k in final), name  # it learnt
        if name.startswith("grpo_online"):  # and so did the ORM, its adapter alone
            orm = load_file(straight / "grpo" / "online-rm" / "model.safetensors")
            moved = {k for k in orm if not torch.equal(orm[k], start[k])}
            assert moved and all(k.endswith("proj.weight") for k in moved), name


@pytest.fixture(scope="module")
def iterate_runs(tmp_path_factory, ranks):
    """The small Algorithm 1 run on 1 process (ZeRO-0), and on 2 under ZeRO-2 and ZeRO-3."""
    root = tmp_path_factory.mktemp("iterate")
    for name, nproc, extra in (("p1", 1, []), ("z2", 2, ["deepspeed.zero_stage=2"]),
                               ("z3", 2, ["deepspeed.zero_stage=3"])):
        log = root / f"{name}.log"
        ranks.start([*_iterate(root / name), *extra], log, ranks=nproc)
        codes = [os.waitstatus_to_exitcode(s) for s in ranks.wait(600)]
        assert codes == [0] * nproc, log.read_text()[-3000:]
    return {name: root / name / "tiny" for name in ("p1", "z2", "z3")}


def _flat(value, key=""):
    if isinstance(value, dict):
        return {k: v for name, item in value.items()
                for k, v in _flat(item, f"{key}/{name}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{key}[{i}]").items()}
    return {key: value}


def _close(a, b, rtol: float, atol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= atol + rtol * abs(b)
    return a == b


def _weights(run: Path) -> list[Path]:
    return sorted(p.relative_to(run) for p in run.rglob("model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_iterate_on_two_processes_equals_one(iterate_runs, stage):
    """Every summary number (held-out accuracy, the reward models' step metrics and best-of-N,
    GRPO's means) and every exported model (SFT, both reward models of both iterations, GRPO's
    policies) of the 2-process run equal the 1-process run's."""
    one, two = iterate_runs["p1"], iterate_runs[f"z{stage}"]
    a = _flat(json.loads((one / "summary.json").read_text()))
    b = _flat(json.loads((two / "summary.json").read_text()))
    assert a.keys() == b.keys()
    assert any("rm/prm/step_accuracy" in k for k in a) and any("grpo/reward/mean" in k for k in a)
    differ = {k: (a[k], b[k]) for k in a if not _close(a[k], b[k], **ITERATE_TOL)}
    assert not differ
    models = _weights(one)
    assert models == _weights(two)
    assert {str(p.parent.parent) for p in models} >= {
        "rm-orm/iteration-0", "rm-orm/iteration-1", "rm-prm/iteration-1", "grpo/iteration-2"}
    cfg = load_config("configs/tiny.yaml", ITERATE_ARGS)
    adam_bound = 2 * cfg.policy.lr * cfg.policy.steps * cfg.iterate.iterations
    for rel in models:
        wa, wb = load_file(one / rel), load_file(two / rel)
        if not str(rel).startswith("grpo/"):
            for key in wa:
                torch.testing.assert_close(wb[key], wa[key], **ITERATE_TOL, msg=f"{rel}: {key}")
            continue
        gap = torch.cat([(wb[k] - wa[k]).abs().flatten() for k in wa])
        allowed = torch.cat([(ITERATE_TOL["atol"] + ITERATE_TOL["rtol"] * wa[k].abs()).flatten()
                             for k in wa])
        assert float((gap > allowed).float().mean()) <= ADAM_FLIPS, rel
        assert float(gap.max()) <= adam_bound, rel
    changed = load_file(one / "grpo/iteration-2/final/model.safetensors")
    started = load_file(one / "sft/best/model.safetensors")
    assert any(not torch.equal(changed[k], started[k]) for k in changed)  # GRPO moved the policy


def _same_run(killed: Path, straight: Path) -> None:
    """A killed and resumed run's summary and every export equal the uninterrupted run's bit
    for bit."""
    assert json.loads((killed / "summary.json").read_text()) == \
        json.loads((straight / "summary.json").read_text())
    assert _weights(killed) == _weights(straight)
    for rel in _weights(straight):
        a, b = load_file(straight / rel), load_file(killed / rel)
        assert all(torch.equal(a[k], b[k]) for k in a), rel


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_iterate_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path, iterate_runs,
                                                                     stage):
    """Both ranks SIGKILLed together 5 times (the labelling and both reward-model refreshes of
    iteration 1 among the units hit), each time resumed with the same command: the summary and
    every exported model equal the uninterrupted 2-process run's bit for bit."""
    straight = iterate_runs[f"z{stage}"]
    targets = kill_targets(unit_timeline(straight / "manifest.json"), 5, random.Random(stage),
                           required=("label/1", "rm-orm/1", "rm-prm/1"))
    zygote = Zygote(env=ZYGOTE_ENV, ranks=2)
    try:
        report = kill_and_resume(zygote, [*_iterate(tmp_path), f"deepspeed.zero_stage={stage}"],
                                 tmp_path / "tiny", tmp_path / "killed.log", targets)
    finally:
        zygote.close()
    print(f"\n{len(report.kills)} kills: {dict(Counter(k['unit'] for k in report.kills))}")
    assert report.exit_code == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert len(report.kills) >= 5
    hit = {k["unit"] for k in report.kills}
    assert hit & {"label/1"} and hit & {"rm-orm/1", "rm-prm/1"}, hit
    _same_run(tmp_path / "tiny", straight)


@pytest.mark.slow
def test_a_lora_iterate_killed_in_its_grpo_stages_resumes_to_the_uninterrupted_result(
        tmp_path, ranks):
    """Algorithm 1 with a LoRA policy (`model.lora`) on 2 processes under ZeRO-3: SIGKILLed
    inside the GRPO stage of each iteration and resumed with the same command, the summary and
    every export equal the uninterrupted run's bit for bit. Each iteration's GRPO starts from
    the merged policy of the one before with a fresh adapter, its reference that merged policy:
    iteration 2's export differs from iteration 1's only in the adapted layers."""
    lora = ["model.lora.rank=4", "model.lora.alpha=8", "policy.lr=1e-3",
            "deepspeed.zero_stage=3"]
    straight_root, killed_root = tmp_path / "straight", tmp_path / "killed"
    ranks.start([*_iterate(straight_root), *lora], tmp_path / "straight.log", ranks=2)
    codes = [os.waitstatus_to_exitcode(s) for s in ranks.wait(600)]
    assert codes == [0, 0], (tmp_path / "straight.log").read_text()[-3000:]
    straight = straight_root / "tiny"
    targets = kill_targets(unit_timeline(straight / "manifest.json"), 2, random.Random(0),
                           required=("grpo/1", "grpo/2"))
    zygote = Zygote(env=ZYGOTE_ENV, ranks=2)
    try:
        report = kill_and_resume(zygote, [*_iterate(killed_root), *lora], killed_root / "tiny",
                                 tmp_path / "killed.log", targets)
    finally:
        zygote.close()
    assert report.exit_code == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert {k["unit"] for k in report.kills} == {"grpo/1", "grpo/2"}
    _same_run(killed_root / "tiny", straight)
    first, second = (load_file(straight / f"grpo/iteration-{i}/final/model.safetensors")
                     for i in (1, 2))
    assert first.keys() == second.keys()  # plain checkpoints, merged
    for key in first:
        assert torch.equal(first[key], second[key]) != key.endswith("proj.weight"), key


@pytest.mark.slow
def test_generation_and_scoring_phases_are_spread_over_the_ranks(tmp_path, ranks):
    """Evaluation (greedy, k samples, the outcomes file), sampling for labels, Math-Shepherd
    labelling, a reward model's step metrics, best-of-N and the check of a stepwise file compute
    on 2 processes exactly what they compute on 1, with the shipped warm start, while each rank generates for only part of
    the prompts. A non-finite loss on one rank stops both, each naming where."""
    for nproc in (1, 2):
        ranks.launch(nproc, "dist_check", "shards", tmp_path / f"p{nproc}",
                     log=tmp_path / f"p{nproc}.log")
    one, two = (json.loads((tmp_path / f"p{n}" / "shards.json").read_text()) for n in (1, 2))
    assert one["eval"]["eval/greedy_accuracy"] > 0.5 and one["eval"]["eval/mean_at_k"] > 0.3
    for key in ("eval", "solutions", "labels", "rm", "bon", "rows", "row_questions"):
        assert two[key] == one[key], key
    # a stepwise file's bad row, in one rank's chunks, stops both with the row named
    assert two["bad_row"] == ["OUT/bad.jsonl: row 8: field 'input': no step tag 'ки'"] * 2
    outcomes = [(tmp_path / f"p{n}" / "eval.json").read_text() for n in (1, 2)]
    assert outcomes[0] == outcomes[1]
    (alone,), (first, second) = one["prompts_by_rank"], two["prompts_by_rank"]
    assert sorted(first + second) == sorted(alone)
    assert 0.3 < len(first) / len(alone) < 0.7
    assert two["nonfinite"] == ["rank 0: another rank's loss is not finite",
                                "rank 1: the loss is nan"]


def test_a_config_mismatch_stops_every_rank(tmp_path):
    """A run folder made with another config refuses to resume on every rank, each exiting 2
    with the keys named, also where no launcher stops the others (srun, mpirun)."""
    args = ["-m", "igrpo", "sft", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
            "model.policy_path=", "sft.enabled=true"]
    folder = tmp_path / "tiny" / "sft"
    folder.mkdir(parents=True)
    cfg = load_config("configs/tiny.yaml", ["model.policy_path=", "sft.enabled=true",
                                            "sft.lr=0.5"])
    from configs import to_yaml

    (folder / "config.yaml").write_text(to_yaml(cfg))
    ranks = bare_ranks(2, *args)
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], outputs
    for out in outputs:
        assert "was made with a different config; differing keys: sft.lr" in out, out[-2000:]
