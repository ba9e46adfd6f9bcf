"""How much room a task leaves process supervision: GRPO rewarded by the task's true step labels
(`policy.reward=step_oracle`, process advantages) against GRPO rewarded by the exact final-answer
check (`policy.reward=rule`, outcome advantages), from the same warm start at the same budget, over
seeds, on each task given; with the warm start's own held-out numbers (seed by seed: a seed draws
its own held-out questions).

    python scripts/ceiling.py --jobs 2                      # both tiny tasks, seeds 0-2, 40 steps
    python scripts/ceiling.py --tasks configs/tiny_steps.yaml --seeds 0 1 2 3 4 policy.steps=20

Every run is an `igrpo grpo` then an `igrpo eval` into `--root`; a finished one is reused, so an
interrupted study continues. The table (also `--root`/ceiling.json) gives each arm's mean over
seeds and the step-label arm minus the exact-check arm, paired by seed, with a t interval over
seeds: the spread between training runs, which intervals over held-out questions leave out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.stats import t_interval_over_seeds as t_interval  # noqa: E402

ARMS = {
    "exact": ["policy.reward=rule", "policy.supervision=outcome"],
    "steps": ["policy.reward=step_oracle", "policy.supervision=process"],
}
"""arm -> overrides: the exact final-answer check with outcome advantages; the true step labels
with process advantages (DeepSeekMath's sum form)."""
METRICS = ("mean_at_k", "greedy_accuracy", "trace_accuracy", "lucky_answer_rate")


def igrpo(args: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        done = subprocess.run([sys.executable, "-m", "igrpo", *args], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, "WANDB_MODE": "disabled"})
    if done.returncode:
        raise RuntimeError(f"igrpo {' '.join(args)} failed (exit {done.returncode}); see {log}")


def run_one(task: str, seed: int, arm: str | None, root: Path, overrides: list[str]) -> dict:
    """The held-out metrics of one seed's warm start (`arm` None) or of its GRPO arm."""
    name = f"{Path(task).stem}-seed{seed}-{arm or 'warm'}"
    common = ["--config", task, f"run.root={root}", f"run.name={name}", f"run.seed={seed}",
              "run.wandb_mode=disabled", *overrides]
    result = root / name / "eval" / "result.json"
    if result.exists():
        return json.loads(result.read_text())
    log = root / name / "log.txt"
    if arm is not None:
        igrpo(["grpo", *common, *ARMS[arm]], log)
        checkpoint = root / name / "grpo" / "final"
    else:
        from configs import load_config

        checkpoint = load_config(task, overrides).model.policy_path
    igrpo(["eval", *common, f"eval.checkpoint={checkpoint}"], log)
    reports = [json.loads(p.read_text()) for p in (root / name / "eval").glob("*.json")
               if p.name != "result.json"]
    found = next(m for m in reports if m["checkpoint"] == str(checkpoint))
    result.write_text(json.dumps(found, indent=2))
    return found


def summarise(runs: dict) -> dict:
    """{task: {"warm"|arm: {metric: {seed: value}}, "steps - exact": {metric: t interval over
    the seeds that have the metric in both arms}}}."""
    out: dict = {}
    for (task, seed, arm), metrics in runs.items():
        per = out.setdefault(task, {}).setdefault(arm or "warm", {})
        for m in METRICS:
            if f"eval/{m}" in metrics:
                per.setdefault(m, {})[seed] = metrics[f"eval/{m}"]
    for task, arms in out.items():
        steps, exact = arms.get("steps", {}), arms.get("exact", {})
        arms["steps - exact"] = {
            m: t_interval([steps[m][s] - exact[m][s] for s in steps[m] if s in exact[m]])
            for m in METRICS if m in steps and m in exact}
    return out


def table(summary: dict) -> str:
    lines = []
    for task, arms in summary.items():
        lines.append(f"{task}  (mean over seeds; difference paired by seed, 95% t interval)")
        lines.append(f"{'':>14}" + "".join(f"{m:>26}" for m in METRICS))
        for arm in ("warm", *ARMS):
            if arm in arms:
                lines.append(f"{arm:>14}" + "".join(
                    f"{sum(v.values()) / len(v):>26.3f}" if (v := arms[arm].get(m))
                    else f"{'-':>26}" for m in METRICS))
        diff = arms.get("steps - exact", {})
        lines.append(f"{'steps - exact':>14}" + "".join(
            f"{d['mean']:+9.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if (d := diff.get(m))
            else f"{'-':>26}" for m in METRICS))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["configs/tiny.yaml",
                                                       "configs/tiny_steps.yaml"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "ceiling")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (e.g. policy.steps=20)")
    args = parser.parse_args()
    overrides = ["policy.steps=40", *args.overrides]
    if args.jobs > 1 and not any(o.startswith("run.threads=") for o in overrides):
        overrides.append("run.threads=1")
    keys = [(t, s, a) for t in args.tasks for s in args.seeds for a in (None, *ARMS)]
    with ThreadPoolExecutor(args.jobs) as pool:
        found = dict(zip(keys, pool.map(lambda key: run_one(*key, args.root, overrides), keys)))
    summary = summarise(found)
    args.root.mkdir(parents=True, exist_ok=True)
    (args.root / "ceiling.json").write_text(json.dumps(
        {"command": " ".join(sys.argv), "overrides": overrides, "seeds": args.seeds,
         "summary": summary}, indent=2, default=str))
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
