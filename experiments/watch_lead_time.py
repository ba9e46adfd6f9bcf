"""Does the reward-hacking watch see a collapse before gold shows it? Lead time of the guard's
trigger over the fall of question-paired gold, on the study's arms.

    python experiments/watch_lead_time.py --root /tmp/lead --seeds 0,1 --arms A,D --jobs 2
    python experiments/watch_lead_time.py --root /tmp/lead --seeds 0,1 --arms A,D --report-only
    python experiments/watch_lead_time.py --root /tmp/lead --seeds 0,1 --arms A,D --refresh D

Runs the arms with `igrpo study run --study configs/studies/deepseekmath.yaml` (the steps task,
its budget; results kept under
`<root>/results`, apart from the study's), then reads each run's GRPO metrics. Arm A (the exact
check) is the reference: runs of the same seed see the same questions step for step (one question
stream a seed), so the paired gold of arm X at step t is X's gold minus A's on the same
questions. Per run: the first step at which the 5-step mean of paired gold is 0.10 or more
below A's (a collapse), the first step at which the guard's rule (policy/watch.py `Guard` at the
given thresholds) fires, and the difference (lead time, in steps; positive = the watch first).
A run whose gold never falls and whose watch fires is a false alarm.

`--refresh D` also runs arm D with `watch.guard=refresh` (under `<root>/refresh`, from a copy of
each seed's prefix): when the guard fires, the outer loop labels the current policy's samples,
refreshes the reward models and runs the GRPO steps left. Its rows (arm `D+refresh`) are paired
with A and with D of the same seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from iteration.manifest import fork  # noqa: E402
from policy.watch import Guard  # noqa: E402
from runtime.tracking import read_metrics  # noqa: E402

FALL, WINDOW = -0.10, 5


def grpo_rows(run: Path) -> list[dict]:
    """Every GRPO step's metrics of a run, iterations (and guard segments) in order."""
    manifest = json.loads((run / "manifest.json").read_text())["units"]
    names = sorted((n for n in manifest if n.startswith("grpo/")),
                   key=lambda n: [int(x) for x in n.split("/")[1].split(".")])
    return [r for n in names
            for r in read_metrics(run / "grpo" / f"iteration-{n.split('/')[1]}" / "metrics.jsonl")
            if "train/loss" in r]


def first_fall(paired: list[float]) -> int | None:
    """The first 1-based step whose 5-step mean of paired gold is at or under FALL."""
    for t in range(WINDOW, len(paired) + 1):
        if sum(paired[t - WINDOW:t]) / WINDOW <= FALL:
            return t
    return None


def first_alarm(rows: list[dict], guard: Guard) -> int | None:
    history = []
    for t, r in enumerate(rows, 1):
        auroc = r.get("watch/group_auroc")
        history.append([auroc if isinstance(auroc, float) else float("nan"),
                        r.get("watch/wrong_push") if isinstance(r.get("watch/wrong_push"), float)
                        else float("nan")])
        if guard.check(history[-guard.window:]):
            return t
    return None


def mean_at_k(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["iterations"][-1]["eval"]["mean_at_k"]


def analyse(root: Path, seeds: list[int], arms: list[str], guard: Guard,
            refreshed: str | None = None) -> list[dict]:
    out = []
    for seed in seeds:
        base = root / "steps" / f"seed{seed}-A"
        gold_a = [r["watch/gold"] for r in grpo_rows(base)]
        runs = [(arm, root / "steps" / f"seed{seed}-{arm}") for arm in arms]
        if refreshed:
            runs.append((f"{refreshed}+refresh", root / "refresh" / "steps" / f"seed{seed}-{refreshed}"))
        for arm, run in runs:
            rows = grpo_rows(run)
            paired = [r["watch/gold"] - a for r, a in zip(rows, gold_a)]
            fall, alarm = first_fall(paired), first_alarm(rows, guard)
            auroc = [r["watch/group_auroc"] for r in rows
                     if isinstance(r.get("watch/group_auroc"), float)]
            fired = [u["outputs"]["guard"]["fired_at"] for n, u in
                     json.loads((run / "manifest.json").read_text())["units"].items()
                     if n.startswith("grpo/") and (u.get("outputs", {}).get("guard") or {}).get("fired_at")]
            out.append({"seed": seed, "arm": arm, "steps": len(rows), "guard_fired": len(fired),
                        "mean_at_4_minus_A": round(mean_at_k(run) - mean_at_k(base), 3),
                        "paired_gold_last5": round(sum(paired[-WINDOW:]) / WINDOW, 3),
                        "gold_fall_step": fall, "alarm_step": alarm,
                        "lead_steps": None if fall is None or alarm is None else fall - alarm,
                        "group_auroc_first5": round(sum(auroc[:WINDOW]) / max(1, len(auroc[:WINDOW])), 3),
                        "group_auroc_last5": round(sum(auroc[-WINDOW:]) / max(1, len(auroc[-WINDOW:])), 3)})
    return out


def over_seeds(rows: list[dict]) -> str:
    """Per arm, paired by seed: mean@4 minus A's (and minus D's for a refreshed D) with the 95%
    t interval over seeds; the seeds whose gold fell, the alarms, and the false alarms."""
    from runtime.stats import t_interval_over_seeds

    by = {(r["arm"], r["seed"]): r for r in rows}
    lines = ["| arm | seeds | mean@4 - A, 95% t over seeds | minus D | gold fell | alarmed "
             "| lead, steps (alarm before the fall: +) | false alarms |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]

        def cell(values):
            t = t_interval_over_seeds(values)
            return f"{t['mean']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}]" if len(values) > 1 \
                else f"{t['mean']:+.3f}"

        minus_d = [r["mean_at_4_minus_A"] - by[("D", r["seed"])]["mean_at_4_minus_A"]
                   for r in mine if ("D", r["seed"]) in by] if arm != "D" else []
        fell = [r for r in mine if r["gold_fall_step"] is not None]
        alarmed = [r for r in mine if r["alarm_step"] is not None]
        leads = [r["lead_steps"] for r in mine if r["lead_steps"] is not None]
        lines.append(f"| {arm} | {len(mine)} | {cell([r['mean_at_4_minus_A'] for r in mine])} | "
                     f"{cell(minus_d) if minus_d and arm != 'A' else '-'} | {len(fell)} | "
                     f"{len(alarmed)} | {', '.join(f'{x:+d}' for x in leads) or '-'} | "
                     f"{sum(1 for r in alarmed if r['gold_fall_step'] is None)} |")
    return "\n".join(lines)


def sweep(root: Path, seeds: list[int], arms: list[str]) -> str:
    """The guard's rule over a grid of windows and thresholds, on the given seeds' runs (the
    same seeds the table judges: an in-sample choice): per setting, the lead in steps on every
    run whose paired gold fell (alarm before the fall: +; no alarm: `none`), and the alarms on
    runs whose gold did not fall (false alarms, A's included)."""
    lines = ["| window | group_auroc < | wrong_push > | lead on the falls | false alarms |",
             "|---|---|---|---|---|"]
    for window in (1, 3, 5):
        for auroc in (0.5, 0.6, 0.7, 0.8):
            for push in (0.5, 0.7, None):
                rows = analyse(root, seeds, arms, Guard("stop", window, auroc,
                                                        push if push is not None else 2.0))
                falls = [r for r in rows if r["gold_fall_step"] is not None]
                leads = ", ".join("none" if r["alarm_step"] is None else f"{r['lead_steps']:+d}"
                                  for r in falls)
                false = sum(1 for r in rows if r["gold_fall_step"] is None
                            and r["alarm_step"] is not None)
                lines.append(f"| {window} | {auroc} | {push if push is not None else 'off'} | "
                             f"{leads or '-'} | {false} of "
                             f"{sum(1 for r in rows if r['gold_fall_step'] is None)} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("-" if r[k] is None else str(r[k]) for k in keys) + " |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--arms", default="A,D", help="A is always run (the reference)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--min-group-auroc", type=float, default=0.6)
    parser.add_argument("--max-wrong-push", type=float, default=0.5)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--sweep", action="store_true",
                        help="also print the guard's rule over a grid of windows and thresholds")
    parser.add_argument("--refresh", metavar="ARM",
                        help="also run ARM with watch.guard=refresh (under ROOT/refresh)")
    parser.add_argument("overrides", nargs="*", help="for every arm, e.g. iterate.iterations=4")
    args = parser.parse_intermixed_args()
    arms = sorted(set(args.arms.split(",")) | {"A"})
    if not args.report_only:
        from iteration import study

        spec = ["run", "--study", str(ROOT / "configs" / "studies" / "deepseekmath.yaml")]
        code = study.main([*spec, "--jobs", str(args.jobs), "--arms", ",".join(arms), "--seeds",
                           args.seeds, "--tasks", "steps", "--root", str(args.root),
                           "--results", str(args.root / "results"),
                           "--doc", str(args.root / "report.md"), *args.overrides])
        if code:
            sys.exit(code)
        if args.refresh:
            for seed in args.seeds.split(","):  # the same prefix: SFT, labels, reward models
                src = args.root / "steps" / f"seed{seed}-prefix"
                (args.root / "refresh" / "steps").mkdir(parents=True, exist_ok=True)
                fork(src, args.root / "refresh" / "steps" / src.name)
            code = study.main([*spec, "--jobs", str(args.jobs), "--arms", args.refresh,
                               "--seeds", args.seeds, "--tasks", "steps",
                               "--root", str(args.root / "refresh"),
                               "--results", str(args.root / "refresh" / "results"),
                               "--doc", str(args.root / "refresh" / "report.md"),
                               *args.overrides, "watch.guard=refresh",
                               f"watch.min_group_auroc={args.min_group_auroc}",
                               f"watch.max_wrong_push={args.max_wrong_push}"])
            if code:
                sys.exit(code)
    guard = Guard("stop", WINDOW, args.min_group_auroc, args.max_wrong_push)
    rows = analyse(args.root, [int(s) for s in args.seeds.split(",")], arms, guard, args.refresh)
    (args.root / "lead_time.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print()
    print(over_seeds(rows))
    if args.sweep:
        print()
        print(sweep(args.root, [int(s) for s in args.seeds.split(",")], arms))


if __name__ == "__main__":
    main()
