"""Do an ensemble's members err apart where GRPO hacks the first one? Shared error on hacked steps.

    python experiments/ensemble_shared_error.py --root /tmp/lead --seeds 0,3,2 --members 3

Reads a replication study's root (`igrpo study run ... --root ROOT`, the steps task, arms A and
D). For each seed, the prefix (`ROOT/steps/seed<S>-prefix`, whose PRM is arm D's frozen reward)
is forked to `ROOT/ensemble/seed<S>` and its PRM unit redone with `rm.ensemble=K`: the first
member is the prefix's (already trained), members 2..K are trained as `igrpo iterate` trains
them. Then every rollout of arm D's GRPO stages (its traces, both iterations) is scored by each
member, and per GRPO step: each member's in-group AUROC against the exact check, the worst-case
and mean aggregates', the first member's own error (the share of wrong samples it scores above
its median right sample of the group) and the shared error (the share every member does:
`policy.watch.shared_error`, what no aggregate removes). A step is *hacked* where D's gold (the
share of its samples right) is at least `--gap` below A's at the same step (the same questions:
both walk the same stream), *held* otherwise.

The issue's rule: run the ensemble's study arm only if the shared error on hacked steps is low.
Writes `--out` (JSON: every step's numbers and the summary per seed) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import igrpo  # noqa: E402
from iteration.manifest import fork  # noqa: E402


def member_run(root: Path, seed: int, members: int) -> Path:
    """`ROOT/ensemble/seed<S>`: the prefix with its PRM unit redone as an ensemble's (members
    2..K trained; the first is the prefix's). Resumes."""
    from iteration.loop import IterationRun

    prefix, run = root / "steps" / f"seed{seed}-prefix", root / "ensemble" / f"seed{seed}"
    if not run.exists():
        fork(prefix, run, keep=lambda unit: unit not in ("rm-prm/0", "eval/0"))
    cfg = igrpo.load_config(str(prefix / "config.yaml"), [
        f"run.root={run.parent}", f"run.name={run.name}", "run.wandb_mode=disabled",
        "policy.supervision=process", f"rm.ensemble={members}"])
    session = igrpo.Session(cfg, "iterate")
    loop = IterationRun(session.wiring, run, Path(cfg.model.policy_path),
                        session.wiring.splits(), session.logger, session.config_yaml)
    loop.manifest.run("rm-prm/0", lambda: loop.reward_model("prm", 0), loop.plan())
    return run


def step_golds(run: Path) -> list[float]:
    """`watch/gold` of every GRPO step of `run`'s two iterations, in order."""
    from runtime.tracking import read_metrics

    return [r["watch/gold"] for k in (1, 2)
            for r in read_metrics(run / "grpo" / f"iteration-{k}" / "metrics.jsonl")
            if "watch/gold" in r]


def score_steps(run: Path, members_run: Path, seed: int, group_size: int) -> list[dict]:
    """Every GRPO step of arm D's `run`, its samples scored by each member of the ensemble."""
    import torch

    from iteration.loop import IterationRun
    from policy.trace import read_trace
    from policy.watch import group_auroc, shared_error
    from reward_model.ensemble import aggregate_members
    from process_supervision.formats import StepExample
    from runtime.steps import split_steps

    cfg = igrpo.load_config(str(members_run / "config.yaml"), [
        f"run.root={members_run.parent}", f"run.name={members_run.name}",
        "run.wandb_mode=disabled"])
    session = igrpo.Session(cfg, "iterate")
    loop = IterationRun(session.wiring, members_run, Path(cfg.model.policy_path),
                        session.wiring.splits(), session.logger, session.config_yaml)
    scorers = loop._scorers(0, ["prm"], members=True)["prm"]
    separator = cfg.data.step_separator
    out = []
    for k in (1, 2):
        rows = read_trace(run / "grpo" / f"iteration-{k}" / "trace")
        for step in sorted({r["step"] for r in rows}):
            batch = sorted((r for r in rows if r["step"] == step),
                           key=lambda r: (r["group"], r["sample"]))
            steps = [split_steps(r["completion"], separator) for r in batch]
            examples = [StepExample(r["question"], tuple(s), (0.0,) * len(s))
                        for r, s in zip(batch, steps) if s]
            each = []
            for scorer in scorers:
                scored = iter(scorer.score(examples))
                # a solution's score: its lowest step's (rm.aggregate=min), 0 without a step
                each.append([min(next(scored) or [0.0]) if s else 0.0 for s in steps])
            members = torch.tensor(each).T  # [N, K]
            correct = torch.tensor([r["correct"] for r in batch])
            first = members[:, :1]
            out.append({
                "iteration": k, "step": step,
                "member_auroc": [group_auroc(members[:, m], correct, group_size)[0]
                                 for m in range(members.shape[1])],
                "worst_auroc": group_auroc(aggregate_members(members.T, "worst"), correct,
                                           group_size)[0],
                "mean_auroc": group_auroc(aggregate_members(members.T, "mean"), correct,
                                          group_size)[0],
                "first_error": shared_error(first, correct, group_size)[0],
                "shared_error": shared_error(members, correct, group_size)[0],
                "wrong_counted": shared_error(members, correct, group_size)[1],
                "first_vs_trace": max(abs(a - r["reward"]) for a, r in
                                      zip(members[:, 0].tolist(), batch)),
            })
    return out


def mean(values) -> float:
    values = [v for v in values if isinstance(v, float) and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--seeds", default="0,3,2")
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--gap", type=float, default=0.2)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("docs/reward_holding/shared_error.json"))
    a = p.parse_args()
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    for seed in [int(s) for s in a.seeds.split(",")]:
        if str(seed) in results:
            continue
        started = time.perf_counter()
        members_run = member_run(a.root, seed, a.members)
        steps = score_steps(a.root / "steps" / f"seed{seed}-D", members_run, seed, a.group_size)
        gold_d = step_golds(a.root / "steps" / f"seed{seed}-D")
        gold_a = step_golds(a.root / "steps" / f"seed{seed}-A")
        for row, d, g in zip(steps, gold_d, gold_a):
            row.update(gold_d=d, gold_a=g, hacked=d <= g - a.gap)
        results[str(seed)] = {"steps": steps, "minutes": (time.perf_counter() - started) / 60}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1))
    print(f"| seed | steps hacked | first member's error, hacked / held | shared error, hacked / "
          f"held | member AUROCs on hacked steps | worst-case AUROC, hacked | "
          f"first member vs trace |")
    print("|---|---|---|---|---|---|---|")
    for seed, r in results.items():
        hacked = [s for s in r["steps"] if s["hacked"]]
        held = [s for s in r["steps"] if not s["hacked"]]
        aurocs = ", ".join(f"{mean(s['member_auroc'][m] for s in hacked):.2f}"
                           for m in range(len(r["steps"][0]["member_auroc"])))
        print(f"| {seed} | {len(hacked)} of {len(r['steps'])} | "
              f"{mean(s['first_error'] for s in hacked):.3f} / "
              f"{mean(s['first_error'] for s in held):.3f} | "
              f"{mean(s['shared_error'] for s in hacked):.3f} / "
              f"{mean(s['shared_error'] for s in held):.3f} | {aurocs} | "
              f"{mean(s['worst_auroc'] for s in hacked):.2f} | "
              f"{max(s['first_vs_trace'] for s in r['steps']):.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
