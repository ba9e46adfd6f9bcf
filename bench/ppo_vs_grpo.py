"""PPO with a critic against GRPO on the same model and batch: peak RSS and seconds per step,
measured side by side in one run, plus `igrpo plan`'s 7B figures with and without the critic.

    python bench/ppo_vs_grpo.py [--models tiny,20m] [--steps 4] [--repeats 2]
    python bench/ppo_vs_grpo.py --models none        # the plan's figures only

Both sides: `configs/tiny.yaml` with the rule reward, outcome supervision, 8 questions x G = 8
a step, the same completion limit, one update per step (mu = 1), beta 0.04 (the `grpo` and `ppo`
recipes: PPO adds the critic's engine, its forward over the rollout, its update, and the
policy's rollout log-probs the KL penalty in the reward needs). Each side runs in its own child
process (peak RSS is per process: VmHWM); the first step is a warm-up and the step time is the
median of the others; each side runs `--repeats` times, alternating, and the medians are
reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, sys
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch
torch.set_num_threads(2)
recipe, policy, steps, out = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
from pathlib import Path
from configs import load_config
from iteration.resolve import resolve
from policy.rewards import RuleReward
from runtime.data import load_splits
from runtime.tracking import MetricsLogger, read_metrics
cfg = load_config("configs/tiny.yaml", [
    f"run.root={out}", f"policy.steps={steps}", "policy.questions_per_step=8", "policy.group_size=8",
    "policy.supervision=outcome", "policy.eval_every=0", "inspect.every=0",
    "policy.save_every=100000", "deepspeed.micro_batch_size=64", "run.wandb_mode=disabled",
    "run.threads=2", "policy.beta=0.04"], recipe=recipe)
splits = load_splits(cfg.data, 0)
logger = MetricsLogger(Path(out) / "m.jsonl", config={}, mode="disabled", project="", name="")
resolve(cfg).train_policy(Path(out), policy, RuleReward(), splits.rl, splits.eval, logger, "",
           evaluate_ends=False)
rows = read_metrics(Path(out) / "m.jsonl")[1:]
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
            if line.startswith("VmHWM:"))
print(json.dumps({"step_s": statistics.median(r["time/rollout"] + r["time/scoring"]
                                              + r["time/update"] for r in rows),
                  "update_s": statistics.median(r["time/update"] for r in rows),
                  "peak_rss": peak}))
"""


def run_side(recipe: str, policy: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), recipe, policy, str(steps),
                               out], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(name: str, policy: str, steps: int, repeats: int) -> list[str]:
    runs: dict[str, list[dict]] = {"grpo": [], "ppo": []}
    for _ in range(repeats):
        for recipe in runs:
            runs[recipe].append(run_side(recipe, policy, steps))
    med = {recipe: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
           for recipe, rs in runs.items()}
    rows = [f"| {name} | {recipe} | {m['step_s']:.2f} | {m['update_s']:.2f} | "
            f"{m['peak_rss'] / 2**20:,.0f} |" for recipe, m in med.items()]
    rows.append(f"| {name} | ppo / grpo | {med['ppo']['step_s'] / med['grpo']['step_s']:.2f}x | "
                f"{med['ppo']['update_s'] / med['grpo']['update_s']:.2f}x | "
                f"{med['ppo']['peak_rss'] / med['grpo']['peak_rss']:.2f}x |")
    print(rows[-1], flush=True)
    return rows


def plan_rows() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from configs import load_config
    from configs.memory import GB, peak, plan

    rows = ["| 7B config, 8 GPUs | peak GiB/GPU | critic model states GiB/GPU |", "| --- | --- | --- |"]
    for recipe in ("grpo", "ppo"):
        cfg = load_config("configs/deepseekmath_7b.yaml", recipe=recipe)
        items, numbers = plan(cfg, 8, 1, cfg.data.max_prompt_tokens)  # as `igrpo plan` does
        critic = sum(r.gpu_bytes for r in items if r.item == "critic model states")
        rows.append(f"| {recipe} | {peak(numbers, 80) / GB:.1f} | {critic / GB:.1f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,20m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = ["| model | side | s/step | update s/step | peak RSS MiB |", "| --- | --- | --- | --- | --- |"]
    if "tiny" in args.models:
        rows += measure("tiny warm start (2.6M)", str(ROOT / "runtime/bundled/tiny_warm_start"),
                        args.steps, args.repeats)
    if "20m" in args.models:
        sys.path.insert(0, str(ROOT))
        from configs.schema import TinyModelConfig
        from runtime.tiny_model import build_tiny

        big = build_tiny(Path(tempfile.mkdtemp()) / "tiny20m",
                         TinyModelConfig(hidden_size=512, num_layers=6, num_heads=8,
                                         intermediate_size=1536), seed=0)
        rows += measure("tiny Llama (~20M, random)", str(big), args.steps, args.repeats)
    print("\n".join(rows))
    print()
    print("\n".join(plan_rows()))


if __name__ == "__main__":
    main()
