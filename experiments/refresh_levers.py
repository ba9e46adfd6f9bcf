"""Does a refresh make the reward models better on the policy they must judge next? Levers measured.

    python experiments/refresh_levers.py --run runs/tiny [--levers paper,from-base,...]

Takes a finished `igrpo iterate` run (the demo's: `make demo`, or `run.seed=1 run.name=tiny-seed1`)
and redoes its first refresh (the reward models of iteration 1, trained on the GRPO-1 policy's
labelled samples + 10% replay) once per lever, each in a copy of the run that keeps the units
before it; each refreshed reward model is then compared with the one it replaces on the same
samples of the GRPO-1 policy (`refresh-check/1`: in-group AUROC, best-of-16 pick, step accuracy
against the task's step oracle, 32 held-out questions x 16 samples at GRPO's temperature).

Levers (overrides of the run's config):
  paper         the paper's refresh: continue the previous reward model on the policy's labelled
                samples + 10% replay (every lever starts from it)
  from-base     restart from the first reward models' backbone (`iterate.refresh_from=base`)
  worked        1,000 worked solutions in the replay pool (`iterate.refresh_worked_solutions`,
                the tiny config's setting: they share the 10% replay with earlier samples; the
                figures in docs/reward_models.md predate that and had them join whole)
  questions-x4  label 4x as many questions per refresh (`label.questions=128`; relabels)
  epochs-x4     4x the refresh's epochs (`iterate.refresh_epochs=8`)
  replay-50     half of the refresh set replayed from iteration 0 (`iterate.replay_fraction=0.5`)
  worked-questions-x4   worked and questions-x4 together
  worked-lr-quarter     worked, the refresh at a quarter of the first training's rate
                        (`rm.lr=5e-5`: only the refresh trains in the copy)

Prints a table (each cell previous -> refreshed; the change in in-group AUROC with its paired 95%
interval over the questions) and writes `<out>/levers.json` (default `<run>-levers`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import igrpo  # noqa: E402
from iteration.manifest import fork  # noqa: E402

PAPER = ["iterate.refresh_worked_solutions=0", "iterate.refresh_from=previous",
         "iterate.refresh_epochs=0", "iterate.replay_fraction=0.1"]
LEVERS = {
    "paper": [],
    "from-base": ["iterate.refresh_from=base"],
    "worked": ["iterate.refresh_worked_solutions=1000"],
    "questions-x4": ["label.questions=128"],
    "epochs-x4": ["iterate.refresh_epochs=8"],
    "replay-50": ["iterate.replay_fraction=0.5"],
    "worked-questions-x4": ["iterate.refresh_worked_solutions=1000", "label.questions=128"],
    "worked-lr-quarter": ["iterate.refresh_worked_solutions=1000", "rm.lr=5e-5"],
}
KEEP = ("sft", "label/0", "rm-orm/0", "rm-prm/0", "eval/0", "grpo/1", "eval/1", "label/1")


def copy_run(run: Path, out: Path, relabel: bool) -> None:
    """`out`: `run`'s units up to the refresh (its labels too unless `relabel`)."""
    keep = [u for u in KEEP if not (relabel and u == "label/1")]
    drop = ["grpo/iteration-2", "labels/iteration-2",
            *(f"rm-{kind}/iteration-{i}" for kind in ("orm", "prm") for i in (1, 2))]
    if relabel:
        drop += ["labels/iteration-1", "replay/prm/iteration-1.jsonl",
                 "replay/orm/iteration-1.jsonl"]
    fork(run, out, keep=lambda unit: unit in keep, drop=drop)


def refresh(run: Path, seed: int, overrides: list[str]) -> dict:
    """The refresh units of iteration 1 in `run` under `overrides`; the refresh check."""
    from iteration.loop import IterationRun

    cfg = igrpo.load_config("configs/tiny.yaml", [f"run.root={run.parent}", f"run.name={run.name}",
                                                  f"run.seed={seed}", "run.wandb_mode=disabled",
                                                  *overrides])
    session = igrpo.Session(cfg, "iterate")
    loop = IterationRun(session.wiring, run, Path(cfg.model.policy_path),
                        session.wiring.splits(), session.logger, session.config_yaml)
    policy = loop._abs(loop.manifest.outputs("grpo/1")["policy"])
    plan = loop.plan()
    loop.manifest.run("label/1", lambda: loop.label(1, policy), plan)
    for kind in ("orm", "prm"):
        loop.manifest.run(f"rm-{kind}/1", lambda kind=kind: loop.reward_model(kind, 1), plan)
    return loop.manifest.run("refresh-check/1", lambda: loop.refresh_check(1, policy), plan)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--out", type=Path, help="default: <run>-levers")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every lever")
    a = p.parse_intermixed_args()
    import yaml

    seed = yaml.safe_load((a.run / "config.yaml").read_text())["run"]["seed"]
    out = a.out or a.run.parent / f"{a.run.name}-levers"
    results_path = out / "levers.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for lever in a.levers.split(","):
        if lever in results:
            continue
        started = time.perf_counter()
        copy_run(a.run, out / lever, relabel=any(o.startswith("label.") for o in LEVERS[lever]))
        results[lever] = {**refresh(out / lever, seed, [*a.overrides, *PAPER, *LEVERS[lever]]),
                          "minutes": (time.perf_counter() - started) / 60}
        out.mkdir(exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1))
    print("| lever | PRM in-group AUROC | change [95%] | PRM BoN pick | PRM step acc | "
          "ORM in-group AUROC | change [95%] | ORM BoN pick | ORM acc | minutes |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for lever, r in results.items():
        cells = []
        for kind in ("prm", "orm"):
            c = r[kind]["change"]["group_auroc"]
            cells += [f"{r[kind]['previous'][m]:.3f} -> {r[kind]['refreshed'][m]:.3f}"
                      for m in ("group_auroc", "pick", "step_accuracy")]
            cells.insert(len(cells) - 2, f"{c['diff']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]")
        print(f"| {lever} | " + " | ".join(cells) + f" | {r['minutes']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
