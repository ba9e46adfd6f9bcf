"""Build (or rebuild and check) a shipped tiny warm start: runtime/bundled/tiny_warm_start, or with
`--task steps` runtime/bundled/tiny_steps_warm_start (configs/tiny_steps.yaml's task).

The tiny analogue of DeepSeekMath-Instruct: the tiny Llama trained by `igrpo sft` on the synthetic
task's worked solutions, 40% of which forget to carry and borrow, in two stages: the `sft` section
of configs/tiny.yaml from a model built in the run folder (800 steps, rate 1e-3 decaying to 0),
then 400 more steps from that stage's best checkpoint at 5e-4 decaying to 0 (validation greedy
accuracy: 0.745 after stage 1, best 0.805 in stage 2, 0.76 at its end: more SFT stopped helping).
`make demo` and the tests start from it, as the paper's Algorithm 1 starts from an instruct model.
The steps task's warm start continues that one for 400 steps (rate 5e-4 decaying to 0) on its own
task's worked solutions (5-7 additions and subtractions, 40% by the same slipping student).

    python scripts/build_warm_start.py                 # train, evaluate, write the bundle (~35 min)
    python scripts/build_warm_start.py --check         # train again into runs/, compare, keep the bundle
    python scripts/build_warm_start.py --from-run      # package the SFT runs already in --run
    python scripts/build_warm_start.py --task steps    # the steps task's (~30 min on 2 cores)

The bundle holds the model, its tokenizer, `recipe.json` (the command, the SFT run's record, the
held-out accuracies with 95% intervals, the weights' sha256) and `heldout.json` (per-question
outcomes, for paired comparisons). `--check` reports the rebuilt policy's held-out accuracies
next to the shipped ones and the paired difference, and exits 1 when a difference's 95% interval
leaves out 0: float kernels differ between machines, so a rebuild matches within noise, not
bitwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import igrpo  # noqa: E402
from configs import load_config  # noqa: E402
from iteration.summary import change_from  # noqa: E402
from policy.evaluate import evaluate_policy  # noqa: E402
from runtime.data import load_splits, step_oracle  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402
from runtime.rundir import atomic_write_json  # noqa: E402

TASKS = {
    "tiny": ("configs/tiny.yaml", ROOT / "runtime" / "bundled" / "tiny_warm_start", [
        # Stage 1, configs/tiny.yaml's `sft` section: build the tiny model in the run folder.
        ["model.policy_path=", "sft.enabled=true", "run.wandb_mode=disabled"],
        # Stage 2: from stage 1's best checkpoint ({previous}), 400 steps more at a lower rate.
        ["model.policy_path={previous}", "sft.enabled=true", "run.wandb_mode=disabled",
         "sft.lr=5e-4", "sft.epochs=1"]]),
    "steps": ("configs/tiny_steps.yaml", ROOT / "runtime" / "bundled" / "tiny_steps_warm_start", [
        # One stage: the tiny warm start, 400 steps on this task's worked solutions.
        ["model.policy_path=bundled:tiny_warm_start", "sft.enabled=true",
         "run.wandb_mode=disabled", "sft.lr=5e-4", "sft.epochs=1"]]),
}
"""task -> (config, bundle, the overrides of each `igrpo sft` stage, in order)."""
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_bundle(model: Path, bundle: Path, recipe: dict) -> None:
    """Copy the model folder's FILES into `bundle` and write `recipe.json` (`recipe` and the
    weights' sha256). Each file is written beside its target and renamed over it: a run that
    has the old weights mapped keeps reading them (a copy in place would pull them from under
    it)."""
    bundle.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (model / name).exists():
            partial = bundle / f".{name}.partial"
            shutil.copy2(model / name, partial)
            partial.chmod(0o644)
            os.replace(partial, bundle / name)
    atomic_write_json(bundle / "recipe.json", {
        **recipe, "sha256": {"model.safetensors": sha256(bundle / "model.safetensors")}})


def evaluate(task: str, policy: Path, outcomes: Path) -> dict:
    """Held-out metrics of `policy` exactly as `make demo` measures its iteration 0 (with the
    trace metrics: the synthetic task has a step oracle)."""
    config, _, stages = TASKS[task]
    cfg = load_config(config, ["model.policy_path=", *(o for o in stages[0]
                                                        if not o.startswith("model.policy_path"))])
    splits = load_splits(cfg.data, cfg.run.seed)
    model = load_causal_lm(policy, cfg.model).eval()
    return evaluate_policy(model, load_tokenizer(policy, cfg.model), splits.eval,
                           prompt_format(cfg.data), k=cfg.eval.k,
                           temperature=cfg.eval.temperature,
                           max_new_tokens=cfg.eval.max_new_tokens,
                           batch_size=cfg.eval.batch_size, timeout_s=cfg.eval.grade_timeout_s,
                           progress=True, outcomes_path=outcomes,
                           step_oracle=step_oracle(cfg.data),
                           step_separator=cfg.data.step_separator)


def commands(task: str, root: Path) -> list[list[str]]:
    """The `igrpo sft` commands, into `root/stage1`, `root/stage2`, ..., each from the
    previous stage's best checkpoint."""
    config, _, stages = TASKS[task]
    return [["sft", "--config", config, f"run.root={root}", f"run.name=stage{i + 1}",
             *(o.format(previous=root / f"stage{i}" / "sft" / "best") for o in overrides)]
            for i, overrides in enumerate(stages)]


def check_failures(change: dict) -> int:
    """`--check`'s exit code: 1 when a paired 95% interval of the rebuilt-minus-shipped change
    leaves out 0 (the rebuild differs by more than the evaluation's noise), else 0."""
    off = [name for name, d in change.items()
           if isinstance(d, dict) and (d["lo"] > 0 or d["hi"] < 0)]
    for name in off:
        print(f"rebuild differs from the shipped warm start beyond noise: {name}")
    return 1 if off else 0


def train(task: str, root: Path) -> float:
    start = time.perf_counter()
    for argv in commands(task, root):
        if igrpo.main(argv) != 0:
            raise SystemExit(f"igrpo {' '.join(argv)} failed")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny",
                        help="which warm start: configs/tiny.yaml's or configs/tiny_steps.yaml's")
    parser.add_argument("--run", type=Path, default=None,
                        help="folder of the SFT runs, stage1, stage2, ... (trained unless "
                             "--from-run; default runs/warm-start, runs/warm-start-steps)")
    parser.add_argument("--from-run", action="store_true",
                        help="package the SFT run already in --run instead of training")
    parser.add_argument("--check", action="store_true",
                        help="compare with the shipped bundle instead of replacing it")
    args = parser.parse_args()
    default_run = "warm-start" if args.task == "tiny" else f"warm-start-{args.task}"
    args.run = args.run or ROOT / "runs" / default_run
    _, bundle, overrides = TASKS[args.task]
    seconds = None if args.from_run else train(args.task, args.run)
    stages = [args.run / f"stage{i + 1}" / "sft" for i in range(len(overrides))]
    best = stages[-1] / "best"
    outcomes = args.run / "heldout.json"
    metrics = evaluate(args.task, best, outcomes)
    if args.check:
        shipped = json.loads((bundle / "recipe.json").read_text())["heldout"]
        change = change_from(bundle / "heldout.json", outcomes)
        for name, d in change.items():
            if isinstance(d, dict):
                print(f"{name:>16}: shipped {shipped['eval/' + name]:.3f}  rebuilt "
                      f"{metrics['eval/' + name]:.3f}  difference {d['diff']:+.3f} "
                      f"[{d['lo']:+.3f}, {d['hi']:+.3f}]")
        return check_failures(change)
    write_bundle(best, bundle, {
        "commands": [" ".join(["igrpo", *argv])
                     for argv in commands(args.task, Path("runs") / default_run)],
        "configs": [(stage / "config.yaml").read_text() for stage in stages],
        "sft": [json.loads((stage / "done.json").read_text()) for stage in stages],
        "validation": [[r for r in (json.loads(line) for line in open(stage / "metrics.jsonl"))
                        if "val/greedy_accuracy" in r] for stage in stages],
        "sft_seconds": seconds, "heldout": metrics})
    shutil.copy2(outcomes, bundle / "heldout.json")
    print(json.dumps(metrics, indent=2))
    print(f"wrote {bundle}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
