"""The replication study: DeepSeekMath's RL comparisons on the tiny task, every arm from the shipped
warm start at the same compute per arm, for several seeds; writes docs/replication.md.

    python scripts/replicate.py                         # every arm, seeds 0 and 1
    python scripts/replicate.py --seeds 0 --arms grpo-process,grpo-process-iterative
    python scripts/replicate.py --report-only           # rebuild the document from finished runs

Arms (overrides of configs/tiny.yaml; all run `igrpo iterate` for `iterate.iterations` iterations):
  online-rft               online rejection-sampling fine-tuning: advantage 1 on right samples
  grpo-outcome             GRPO, outcome supervision (the ORM's score), reward models frozen
  grpo-process             GRPO, process supervision (the PRM's P(+) at each tag), frozen
  grpo-process-no-lik      the same without the likelihood feature (rm.likelihood_feature=false)
  grpo-process-iterative   the same as grpo-process with the reward models refreshed each
                           iteration (Algorithm 1; 10% replay)
  shuffled-control         grpo-process with each step's rewards shuffled across the batch
  offline-rft              offline rejection-sampling fine-tuning (the offline_rft recipe): the
                           warm start sampled once, as many samples as the GRPO arms draw over
                           all their iterations, fine-tuned on its right ones (one iteration)
  dpo                      DPO (the dpo recipe) on right/wrong pairs of the warm start's samples,
                           rule-judged, as many steps as the GRPO arms over all their iterations
                           (one iteration)
  online-dpo               online DPO (the online_dpo recipe): pairs of the current policy's
                           samples, rule-judged, the reference reset every iteration

Per seed, the units every arm shares (labels and reward models of iteration 0, the warm start's
evaluation) run once in a prefix run and are copied into each arm's folder, whose manifest then
resumes at GRPO. Runs resume: re-running the command continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import igrpo  # noqa: E402
from iteration.summary import change_from  # noqa: E402
from policy.evaluate import at_k_curves  # noqa: E402

CONFIG = "configs/tiny.yaml"
ARMS = {
    "online-rft": ["policy.supervision=rft", "iterate.reward=rule", "iterate.refresh=false"],
    "grpo-outcome": ["policy.supervision=outcome", "iterate.refresh=false"],
    "grpo-process": ["policy.supervision=process", "iterate.refresh=false"],
    "grpo-process-no-lik": ["policy.supervision=process", "iterate.refresh=false",
                            "rm.likelihood_feature=false"],
    "grpo-process-iterative": ["policy.supervision=process", "iterate.refresh=true"],
    "shuffled-control": ["policy.supervision=process", "iterate.refresh=false",
                         "controls.shuffle_rewards=true"],
    "offline-rft": ["run.recipe=offline_rft", "iterate.refresh=false"],
    "dpo": ["run.recipe=dpo", "iterate.refresh=false"],
    "online-dpo": ["run.recipe=online_dpo", "iterate.reward=rule", "iterate.refresh=false"],
}
# Arms whose data is the warm start's samples: one iteration of all the arms' steps at once.
FROM_THE_WARM_START = ("offline-rft", "dpo")
# Units that differ with an arm's reward-model settings: rerun in its copy of the prefix.
RM_UNITS = ("rm-orm/0", "rm-prm/0", "eval/0")
METRICS = (("mean_at_k", "mean@k"), ("greedy_accuracy", "greedy"), ("maj_accuracy", "maj@k"),
           ("pass_at_k", "pass@k"), ("trace_accuracy", "trace acc"),
           ("lucky_answer_rate", "lucky answers"))
KS = [1, 2, 4, 8]
TRACE_KEYS = ("trace_accuracy", "lucky_answer_rate")


def iterate(root: Path, name: str, seed: int, *overrides: str) -> None:
    code = igrpo.main(["iterate", "--config", CONFIG, f"run.root={root}", f"run.name={name}",
                       f"run.seed={seed}", "run.wandb_mode=disabled", *overrides])
    if code != 0:
        raise SystemExit(f"{name}: igrpo iterate exited {code}")


def prefix(root: Path, seed: int, extra: list[str]) -> Path:
    """The shared iteration-0 units of one seed."""
    iterate(root, f"seed{seed}-prefix", seed, *extra, "iterate.iterations=0")
    return root / f"seed{seed}-prefix"


def start_arm(prefix_run: Path, arm_run: Path, arm_args: list[str]) -> None:
    """A new arm folder (overrides `arm_args`) holds the prefix's finished units (its manifest
    resumes at GRPO)."""
    if arm_run.exists():
        return
    tmp = arm_run.with_name(arm_run.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(prefix_run, tmp, ignore=shutil.ignore_patterns("config.yaml", "wandb"))
    if "rm.likelihood_feature=false" in arm_args:
        manifest = json.loads((tmp / "manifest.json").read_text())
        for unit in RM_UNITS:
            manifest["units"].pop(unit, None)
        for kind in ("orm", "prm"):
            shutil.rmtree(tmp / f"rm-{kind}" / "iteration-0")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    for stale in ("summary.json", "accuracy.png"):
        (tmp / stale).unlink(missing_ok=True)
    tmp.rename(arm_run)


def arm_overrides(arm: str, overrides: list[str], arm_args: list[str] | None = None) -> list[str]:
    """The arm's overrides (`arm_args`, else ARMS[arm]); offline RFT and DPO draw all their
    samples from the warm start: one iteration of as many steps' samples as the other arms'
    iterations together."""
    arm_args = ARMS[arm] if arm_args is None else arm_args
    if arm not in FROM_THE_WARM_START:
        return arm_args
    cfg = igrpo.load_config(CONFIG, [*overrides, *arm_args])
    return [*arm_args, f"policy.steps={cfg.policy.steps * cfg.iterate.iterations}",
            "iterate.iterations=1"]


def run_arm(root: Path, seed: int, arm: str, arm_args: list[str], overrides: list[str]) -> None:
    """One arm's run (a worker process gets the arm's overrides, not this module's table)."""
    run = root / f"seed{seed}-{arm}"
    start_arm(root / f"seed{seed}-prefix", run, arm_args)
    print(f"[study] seed {seed}: {arm}", flush=True)
    iterate(root, run.name, seed, *overrides, *arm_overrides(arm, overrides, arm_args))


def run_study(root: Path, seeds: list[int], arms: list[str], overrides: list[str],
              jobs: int, table: dict[str, list[str]] | None = None) -> None:
    """Every seed's prefix, then its arms (their overrides from `table`, default ARMS); with
    `jobs` > 1, that many runs at a time, the cores shared out (run.threads), an arm starting
    as soon as its seed's prefix is done."""
    table = ARMS if table is None else table
    if jobs <= 1:
        for seed in seeds:
            prefix(root, seed, overrides)
            for arm in arms:
                run_arm(root, seed, arm, table[arm], overrides)
        return
    overrides = [*overrides, f"run.threads={max(1, (os.cpu_count() or 1) // jobs)}"]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        prefixes = {pool.submit(prefix, root, seed, overrides): seed for seed in seeds}
        runs = []
        for done in as_completed(prefixes):
            done.result()
            runs += [pool.submit(run_arm, root, prefixes[done], arm, table[arm], overrides)
                     for arm in arms]
        for done in as_completed(runs):
            done.result()


def compute_minutes(run: Path) -> float:
    """Minutes the units of one run folder took (a copied prefix's units included)."""
    units = json.loads((run / "manifest.json").read_text())["units"].values()
    return sum(u["finished"] - u["started"] for u in units if u.get("state") == "done") / 60


def finished(run: Path) -> bool:
    """Every iteration of the arm's run is in its summary (a running arm is left out)."""
    import yaml

    if not (run / "summary.json").exists() or not (run / "config.yaml").exists():
        return False
    planned = yaml.safe_load((run / "config.yaml").read_text())["iterate"]["iterations"]
    return len(json.loads((run / "summary.json").read_text())["iterations"]) == planned + 1


def previous_run(doc: Path) -> tuple[str, str] | None:
    """The command and wall-time lines of the run that last wrote `doc` (kept by --report-only)."""
    if not doc.exists():
        return None
    lines = doc.read_text().splitlines()
    found = [next((x for x in lines if x.startswith(p)), None) for p in ("- Command:",
                                                                          "- Wall time:")]
    return tuple(found) if all(found) else None  # type: ignore[return-value]


def arm_result(run: Path) -> dict:
    """Final metrics, change from the warm start, and the reward models of one finished arm."""
    iterations = json.loads((run / "summary.json").read_text())["iterations"]
    first, last = iterations[0], iterations[-1]
    evals = sorted((run / "eval").glob("iteration-*.json"))
    final_eval = run / "eval" / f"iteration-{last['iteration']}.json"
    return {"first": first, "last": last, "minutes": compute_minutes(run),
            "change": change_from(run / "eval" / "iteration-0.json", final_eval),
            "curves": {"before": at_k_curves(json.loads(evals[0].read_text()), KS),
                       "after": at_k_curves(json.loads(final_eval.read_text()), KS)}}


def _cell(entry: dict, key: str) -> str:
    """`0.634 [0.611, 0.657]`; a metric the run lacks: "no step oracle" where its data has
    none (the trace metrics), else "-" (a run from before the metric)."""
    ev = entry["eval"]
    if key not in ev:
        return ev.get("trace_metrics", "-") if key in TRACE_KEYS else "-"
    return f"{ev[key]:.3f} [{ev[key + '_lo']:.3f}, {ev[key + '_hi']:.3f}]"


def _change(d: dict | None) -> str:
    return "-" if d is None else f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def report(root: Path, seeds: list[int], arms: list[str], seconds: float | None,
           command: str, extra: list[str]) -> str:
    results = {(arm, s): arm_result(root / f"seed{s}-{arm}") for arm in arms for s in seeds
               if finished(root / f"seed{s}-{arm}")}
    runs = [(arm, s) for arm in arms for s in seeds if (arm, s) in results]
    lines = ["# Replication study: DeepSeekMath's RL comparisons on the tiny task", "",
             "Generated by `scripts/replicate.py`; do not edit above the reading section.", "",
             f"- Command: `{command}`",
             f"- Wall time: {seconds / 60:.1f} min on 2 CPU cores for this invocation (arms "
             "finished before are reused; each arm's compute is its `minutes`)" if seconds
             else "- Wall time: see the previous full run",
             f"- Config: `{CONFIG}` with {' '.join(f'`{e}`' for e in extra) or 'no overrides'}; "
             "every arm starts from the shipped warm start and runs the same GRPO steps, group "
             "size and held-out evaluation.",
             "- Arms: " + "; ".join(f"{a} (`{' '.join(arm_overrides(a, extra))}`)"
                                    for a in arms), ""]
    lines += _accuracy_section(results, runs, seeds, arms) + _change_section(results, runs)
    lines += _reward_model_section(results, runs)
    lines += _curves_section(results, seeds, arms, root / "figure7.png")
    return "\n".join(lines) + "\n"


def _accuracy_section(results: dict, runs: list, seeds: list[int], arms: list[str]) -> list:
    lines = ["## Held-out accuracy after RL", "",
             "Each cell: mean and 95% bootstrap interval over the held-out questions. The warm "
             "start row is iteration 0 (the same for every arm of a seed). `trace acc`: samples "
             "whose answer and every step are right (the task's step oracle); `lucky answers`: "
             "of the right samples, the share reached through a wrong step (docs/metrics.md).",
             "",
             "| arm | seed | " + " | ".join(t for _, t in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for s in seeds:
        any_arm = next((results[(a, s)] for a in arms if (a, s) in results), None)
        if any_arm:
            lines.append(f"| warm start | {s} | " + " | ".join(
                _cell(any_arm["first"], k) for k, _ in METRICS) + " |")
    for arm, s in runs:
        lines.append(f"| {arm} | {s} | " + " | ".join(
            _cell(results[(arm, s)]["last"], k) for k, _ in METRICS) + " |")
    return lines


def _change_section(results: dict, runs: list) -> list:
    lines = ["", "## Change from the warm start", "",
             "Paired over the same questions: the mean change and its 95% bootstrap interval; "
             "`gap closed` is the share of the warm start's gap between mean@k and pass@k that "
             "RL closed; `minutes` is the compute of the arm's run, its share of the seed's "
             "iteration 0 included.", "",
             "| arm | seed | " + " | ".join(t for _, t in METRICS) + " | gap closed | minutes |",
             "|---|---|" + "---|" * (len(METRICS) + 2)]
    for arm, s in runs:
        ch = results[(arm, s)]["change"]
        closed = ch.get("gap_closed")
        closed = "-" if closed is None else f"{closed:.0%}"
        lines.append(f"| {arm} | {s} | " + " | ".join(_change(ch.get(k)) for k, _ in METRICS)
                     + f" | {closed} | {results[(arm, s)]['minutes']:.1f} |")
    return lines


def _reward_model_section(results: dict, runs: list) -> list:
    lines = ["", "## Reward models and best-of-N after RL", "",
             "Step accuracy and AUROC of the reward models on held-out solutions with known "
             "first wrong steps; best-of-16 picks among the final policy's samples.", "",
             "| arm | seed | PRM step acc | ORM step acc | BoN PRM | BoN ORM | BoN majority "
             "| BoN random | reward | KL |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in runs:
        last = results[(arm, s)]["last"]
        rm, bon, g = last.get("rm", {}), last.get("bon", {}), last.get("grpo", {})
        cells = [rm.get("prm/step_accuracy"), rm.get("orm/step_accuracy"),
                 bon.get("prm_pick"), bon.get("orm_pick"), bon.get("majority"),
                 bon.get("random"), g.get("reward/mean"), g.get("train/kl")]
        lines.append(f"| {arm} | {s} | " + " | ".join(
            "-" if c is None else f"{c:.1e}" if 0 < abs(c) < 1e-3 else f"{c:.3f}"
            for c in cells) + " |")
    return lines


def _curves_section(results: dict, seeds: list[int], arms: list[str], figure: Path) -> list:
    ks = next(iter(results.values()))["curves"]["before"]["k"] if results else KS
    lines = ["", "## Maj@K and Pass@K against K (the paper's Figure 7)", "",
             "From the k samples per held-out question: pass@K by the unbiased estimator, "
             "maj@K as the majority of the first K samples. Mean over seeds.", "",
             "| policy | " + " | ".join(f"pass@{k}" for k in ks) + " | "
             + " | ".join(f"maj@{k}" for k in ks) + " |",
             "|---|" + "---|" * (2 * len(ks))]
    rows = {"warm start": [r["curves"]["before"] for (a, _), r in results.items()
                           if a == arms[0]]}
    for arm in arms:
        rows[arm] = [results[(arm, s)]["curves"]["after"] for s in seeds if (arm, s) in results]
    for name, curves in rows.items():
        if curves:
            mean = {key: [sum(c[key][i] for c in curves) / len(curves) for i in range(len(ks))]
                    for key in ("pass", "maj")}
            lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in mean["pass"]) + " | "
                         + " | ".join(f"{v:.3f}" for v in mean["maj"]) + " |")
    _plot(rows, ks, figure)
    return lines


def _plot(rows: dict, ks: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for name, curves in rows.items():
        if not curves:
            continue
        for ax, key in zip(axes, ("maj", "pass")):
            ys = [sum(c[key][i] for c in curves) / len(curves) for i in range(len(ks))]
            ax.plot(ks, ys, marker="o", label=name)
    for ax, title in zip(axes, ("Maj@K", "Pass@K")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("K")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    finish_figure(fig, axes, "held-out accuracy", path, legend_on=1)


def finish_figure(fig, axes, ylabel: str, path: Path, legend_on: int = 0) -> None:
    """Label the first panel, put the legend on one, save `path` and close the figure (the
    study scripts' plots end alike)."""
    import matplotlib.pyplot as plt

    axes[0].set_ylabel(ylabel)
    axes[legend_on].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_doc(doc: Path, text: str, figure: Path | None = None,
              script: str = "scripts/replicate.py") -> Path:
    """`doc`: the generated part, then the hand-written reading below the marker kept."""
    marker = f"<!-- reading: kept by {script} -->"
    reading = doc.read_text().split(marker, 1)[1] if doc.exists() and marker in doc.read_text() \
        else "\n## Reading\n\n(what the numbers say)\n"
    doc.parent.mkdir(exist_ok=True)
    if figure is not None and figure.exists():
        shutil.copy2(figure, doc.parent / "replication_figure7.png")
        text += "\n![Maj@K and Pass@K against K](replication_figure7.png)\n"
    doc.write_text(text + "\n" + marker + reading)
    return doc


def study_parser(description: str, root: Path, flag: str, arms, jobs: int):
    """The options a study script shares: --root, --seeds, the arms, --jobs, --report-only."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", type=Path, default=root)
    parser.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    parser.add_argument(flag, default=",".join(arms),
                        help=f"comma-separated arms of {', '.join(arms)}")
    parser.add_argument("--jobs", type=int, default=jobs,
                        help="runs at a time, the CPU cores shared among them")
    parser.add_argument("--report-only", action="store_true")
    return parser


def main() -> int:
    parser = study_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "study", "--arms", ARMS, 1)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "replication.md")
    parser.add_argument("overrides", nargs="*",
                        help="key=value overrides for every arm (the compute budget)")
    args = parser.parse_intermixed_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.arms = args.arms.split(",")
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    command = " ".join(["python scripts/replicate.py", *sys.argv[1:]])
    start = time.perf_counter()
    if not args.report_only:
        run_study(args.root, args.seeds, args.arms, args.overrides, args.jobs)
    seconds = None if args.report_only else time.perf_counter() - start
    text = report(args.root, args.seeds, args.arms, seconds, command, args.overrides)
    kept = previous_run(args.doc) if args.report_only else None
    if kept:  # a rebuilt report still names the run that made the numbers
        lines = text.splitlines()
        lines[4:6] = kept
        text = "\n".join(lines) + "\n"
    doc = write_doc(args.doc, text, args.root / "figure7.png")
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
