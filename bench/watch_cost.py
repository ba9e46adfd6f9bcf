"""What the reward-hacking watch and the rollout traces cost a GRPO step, measured in the steps
themselves.

    python bench/watch_cost.py [--steps 8] [--group-size 64] [--questions 2]

One GRPO stage from the shipped tiny warm start at the demo's batch (2 questions x G = 64,
configs/tiny.yaml; the rule reward), with `watch/kl_init` measured every step (two extra
forwards over the step's samples, the worst case: the default is every 5th step) and every
rollout traced. Each step logs its own `time/watch` (the KL forwards), `time/trace` (gathering,
decoding and writing the step's parquet file) and `time/step` (rollout + scoring + update), so
each ratio is of the same step on the same machine state; the medians over the steps after the
first are printed, with the trace's bytes per sample. The watch's AUROCs and shares are
reductions over the step's [N] rows: their cost is not measurable beside these.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--questions", type=int, default=2)
    args = parser.parse_args()

    import torch

    from configs import load_config
    from configs.loader import BUNDLED
    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from runtime.tracking import MetricsLogger, read_metrics

    work = Path(tempfile.mkdtemp(prefix="watch-cost-"))
    try:
        cfg = load_config(str(ROOT / "configs/tiny.yaml"), [
            f"run.root={work}", f"policy.steps={args.steps}", "policy.eval_every=0",
            f"policy.group_size={args.group_size}", f"policy.questions_per_step={args.questions}",
            "policy.supervision=outcome", "run.wandb_mode=disabled", "watch.kl_init_every=1",
            "inspect.trace=true", "inspect.every=0"])
        torch.set_num_threads(cfg.run.threads)
        splits = load_splits(cfg.data, cfg.run.seed)
        logger = MetricsLogger(work / "m.jsonl", config={}, mode="disabled", project="", name="")
        warm = BUNDLED / "tiny_warm_start"
        resolve(cfg).policy_trainer(0, str(warm))(work, warm, RuleReward(), splits.rl,
                                                  splits.eval[:2], logger, "", out_name="grpo",
                                                  evaluate_ends=False)
        rows = [r for r in read_metrics(work / "m.jsonl") if "train/loss" in r][1:]
        files = sorted((work / "grpo" / "trace").glob("*.parquet"))
        samples = args.questions * args.group_size * len(files)
        report = {
            "steps_measured": len(rows),
            "step_seconds": statistics.median(r["time/step"] for r in rows),
            "kl_init_over_step": statistics.median(r["time/watch"] / r["time/step"] for r in rows),
            "trace_over_step": statistics.median(r["time/trace"] / r["time/step"] for r in rows),
            "trace_bytes_per_sample": sum(f.stat().st_size for f in files) / samples,
            "completion_tokens_per_sample": statistics.mean(r["rollout/length_mean"]
                                                            for r in rows)}
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
