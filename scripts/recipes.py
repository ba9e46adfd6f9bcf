"""Every recipe of configs/recipes/ on the synthetic task, from the shipped warm start, at the same
wall-clock budget, for several seeds, beside the shuffled-reward control; writes docs/recipes.md.

    python scripts/recipes.py --jobs 2                      # every recipe, seeds 0 and 1
    python scripts/recipes.py --recipes dapo,gpg --seeds 0 --minutes 2
    python scripts/recipes.py --report-only                 # rebuild the document

Each arm trains `configs/tiny.yaml` under its recipe with the rule reward (final answer against
the gold one; outcome supervision, online RFT's own coefficient for online_rft) for
`policy.max_minutes` of wall clock, then the held-out questions are evaluated (mean@k, greedy,
maj@k, pass@k with 95% intervals, and the paired change from the warm start). With `--jobs N`,
N arms run at a time and share the cores, so each arm's minutes are the same kind of minutes.
Runs resume: re-running the command continues where it stopped.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from configs import load_config, to_yaml  # noqa: E402
from configs.loader import recipes  # noqa: E402
from iteration.summary import change_from  # noqa: E402
from iteration.study import study_parser  # noqa: E402
from iteration.study_report import write_doc  # noqa: E402

CONFIG = "configs/tiny.yaml"
# arm -> (recipe, overrides of its own)
ARMS = {name: (name, [] if name == "online_rft" else ["policy.supervision=outcome"])
        for name in ("grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po", "online_rft",
                     "offline_rft", "ppo", "vc_ppo", "vapo", "t_ppo", "gspo", "dpo",
                     "online_dpo")}
ARMS["shuffled-control"] = ("grpo", ["policy.supervision=outcome", "controls.shuffle_rewards=true"])
COMMON = ["policy.reward=rule", "policy.steps=100000", "policy.eval_every=0", "inspect.every=0",
          "policy.save_every=5", "run.wandb_mode=disabled"]
METRICS = (("mean_at_k", "mean@k"), ("greedy_accuracy", "greedy"), ("maj_accuracy", "maj@k"),
           ("pass_at_k", "pass@k"))


def arm_config(root: Path, arm: str, seed: int, minutes: float, extra: list[str]):
    recipe, own = ARMS[arm] if arm != "warm-start" else ("grpo", [])
    return load_config(CONFIG, [*COMMON, f"policy.max_minutes={minutes}", f"run.seed={seed}",
                                f"run.root={root}", f"run.name=seed{seed}-{arm}", *extra, *own],
                       recipe=recipe)


def _evaluate(cfg, policy, out: Path) -> dict:
    """Held-out metrics of `policy` into `out`/metrics.json (outcomes beside it), once."""
    from iteration import stages
    from iteration.resolve import resolve
    from runtime.data import load_splits
    from runtime.rundir import atomic_write_json

    done = out / "metrics.json"
    if done.exists():
        return json.loads(done.read_text())
    w = resolve(cfg)
    model, tokenizer = stages.load_policy(w, policy)
    metrics = stages.evaluate(w, model, tokenizer, load_splits(cfg.data, cfg.run.seed).eval,
                              outcomes_path=out / "outcomes.json", progress=False)
    atomic_write_json(done, metrics)
    return metrics


def run_arm(root: Path, arm: str, seed: int, minutes: float, extra: list[str]) -> str:
    """Train one arm within its budget (or evaluate the warm start: arm `warm-start`)."""
    import torch

    from iteration.resolve import make_reward, resolve
    from runtime.data import load_splits
    from runtime.models import load_tokenizer
    from runtime.tracking import MetricsLogger

    cfg = arm_config(root, arm, seed, minutes, extra)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(seed)
    run = root / cfg.run.name
    start = cfg.model.policy_path
    if arm == "warm-start":
        _evaluate(cfg, start, run / "eval")
        return f"seed {seed}: warm start evaluated"
    splits = load_splits(cfg.data, seed)
    logger = MetricsLogger(run / "grpo" / "metrics.jsonl", config={}, mode="disabled",
                           project="", name=cfg.run.name)
    try:
        w = resolve(cfg)
        reward = make_reward(w, load_tokenizer(start, cfg.model), "rule")
        final = w.train_policy(run, start, reward, splits.rl, splits.eval, logger, to_yaml(cfg),
                               evaluate_ends=False)
    finally:
        logger.close()
    _evaluate(cfg, final, run / "eval")
    return f"seed {seed}: {arm} done"


def run_all(root: Path, arms: list[str], seeds: list[int], minutes: float, extra: list[str],
            jobs: int) -> None:
    work = [("warm-start", s) for s in seeds] + [(a, s) for s in seeds for a in arms]
    extra = [*extra, f"run.threads={max(1, (os.cpu_count() or 1) // max(1, jobs))}"]
    with ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_arm, root, arm, seed, minutes, extra) for arm, seed in work]
        for done in as_completed(futures):
            print(f"[recipes] {done.result()}", flush=True)


def arm_row(root: Path, arm: str, seed: int) -> dict | None:
    run = root / f"seed{seed}-{arm}"
    if not (run / "eval" / "metrics.json").exists():
        return None
    done = json.loads((run / "grpo" / "done.json").read_text())
    rows = [json.loads(line) for line in open(run / "grpo" / "metrics.jsonl")]
    extra = sum(r.get("rollout/extra_samples", 0.0) for r in rows)
    skipped = sum(r.get("train/skipped_step", 0.0) for r in rows)
    return {"metrics": json.loads((run / "eval" / "metrics.json").read_text()),
            "change": change_from(root / f"seed{seed}-warm-start" / "eval" / "outcomes.json",
                                  run / "eval" / "outcomes.json"),
            "steps": done.get("steps", 0), "samples": done.get("samples"),
            "kept": done.get("kept"), "extra": extra, "skipped": skipped,
            "split": (done["sampling_seconds"], done["fine_tune_seconds"])
            if "sampling_seconds" in done else None,
            "pretrain": json.loads((run / "grpo" / "value-pretrain" / "done.json").read_text())
            if (run / "grpo" / "value-pretrain" / "done.json").exists() else None}


def _cell(metrics: dict, key: str) -> str:
    value = metrics[f"eval/{key}"]
    return f"{value:.3f} [{metrics[f'eval/{key}_lo']:.3f}, {metrics[f'eval/{key}_hi']:.3f}]"


def _change(d: dict) -> str:
    return f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"


def record_invocation(root: Path, command: str, seconds: float) -> None:
    """Append a finished invocation to `<root>/invocations.jsonl` (the document lists them all:
    arms of one table may come from several invocations, each resuming the others' runs)."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "invocations.jsonl").open("a") as f:
        f.write(json.dumps({"command": command, "minutes": round(seconds / 60, 1)}) + "\n")


def invocations(root: Path) -> list[str]:
    path = root / "invocations.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [f"`{r['command']}` ({r['minutes']} min)" for r in rows]


def report(root: Path, arms: list[str], seeds: list[int], minutes: float, extra: list[str],
           jobs: int) -> str:
    lines = ["# The recipes side by side on the tiny task", "",
             "Generated by `scripts/recipes.py`; do not edit above the reading section.", "",
             "- Commands, in order, with their wall time on this machine (2 CPU cores): "
             + "; ".join(invocations(root) or ["(none recorded)"]) + ".",
             f"- Budget: {minutes:g} min of training wall clock per arm (`policy.max_minutes`), "
             f"{jobs} arm(s) at a time sharing the cores; config "
             f"`{CONFIG}` with the rule reward and {' '.join(f'`{e}`' for e in extra) or 'no other overrides'}.",
             "- Each arm: `--recipe NAME` (configs/recipes/), outcome supervision (online RFT: "
             "its own coefficient); `shuffled-control` is the grpo recipe with each step's "
             "rewards shuffled across the batch.", ""]
    warm = {s: root / f"seed{s}-warm-start" / "eval" / "metrics.json" for s in seeds}
    lines += ["## Held-out accuracy", "",
              "Mean and 95% bootstrap interval over the held-out questions; `change` is paired "
              "over the same questions against the warm start; `steps` the optimizer steps the "
              "budget allowed (offline RFT: fine-tuning steps in what its sampling left of the "
              "budget; VC-PPO and VAPO: PPO steps after value pretraining, which spends part of "
              "the budget).", "",
              "| arm | seed | steps | mean@k | change | greedy | change | maj@k | pass@k |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in seeds:
        if warm[s].exists():
            m = json.loads(warm[s].read_text())
            lines.append(f"| warm start | {s} | 0 | {_cell(m, 'mean_at_k')} | | "
                         f"{_cell(m, 'greedy_accuracy')} | | {_cell(m, 'maj_accuracy')} | "
                         f"{_cell(m, 'pass_at_k')} |")
    notes = []
    for arm in arms:
        for s in seeds:
            row = arm_row(root, arm, s)
            if row is None:
                continue
            m, ch = row["metrics"], row["change"]
            lines.append(f"| {arm} | {s} | {row['steps']} | {_cell(m, 'mean_at_k')} | "
                         f"{_change(ch['mean_at_k'])} | {_cell(m, 'greedy_accuracy')} | "
                         f"{_change(ch['greedy_accuracy'])} | {_cell(m, 'maj_accuracy')} | "
                         f"{_cell(m, 'pass_at_k')} |")
            if row["extra"]:
                notes.append(f"{arm} seed {s}: {row['extra']:.0f} extra samples drawn by "
                             "dynamic sampling")
            if row["skipped"]:
                notes.append(f"{arm} seed {s}: {row['skipped']:.0f} steps without signal skipped")
            if row["kept"] is not None:
                notes.append(f"{arm} seed {s}: {row['kept']} right samples kept of "
                             f"{row['samples']}")
            if row["pretrain"]:
                notes.append(f"{arm} seed {s}: {row['pretrain']['steps']} value-pretraining "
                             f"steps ({row['pretrain']['seconds']:.0f} s of the budget)")
            if row["split"]:
                notes.append(f"{arm} seed {s}: {row['split'][0]:.0f} s sampling, "
                             f"{row['split'][1]:.0f} s fine-tuning")
    if notes:
        lines += ["", "Notes from the runs: " + "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = study_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "recipes", "--recipes", ARMS,
                          2)
    parser.add_argument("--minutes", type=float, default=3.0,
                        help="training wall clock per arm (policy.max_minutes)")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "recipes.md")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every arm")
    args = parser.parse_intermixed_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.recipes.split(",")
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; known: {', '.join(ARMS)}")
    assert set(recipes()) <= set(ARMS), "a recipe of configs/recipes/ has no arm here"
    for arm in arms:  # a bad override fails here, before any run starts
        arm_config(args.root, arm, seeds[0], args.minutes, args.overrides)
    start = time.perf_counter()
    if not args.report_only:
        run_all(args.root, arms, seeds, args.minutes, args.overrides, args.jobs)
    if not args.report_only:
        record_invocation(args.root, " ".join(["python scripts/recipes.py", *sys.argv[1:]]),
                          time.perf_counter() - start)
    text = report(args.root, list(ARMS) if args.report_only else arms, seeds, args.minutes,
                  args.overrides, args.jobs)
    marker = "<!-- reading: kept by scripts/recipes.py -->"
    print(f"wrote {write_doc(args.doc, text, marker=marker)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
