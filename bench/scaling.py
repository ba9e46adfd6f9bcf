"""Scaling curve: GRPO step time as G goes 8 -> 16 -> 32 -> 64, at two completion lengths.

    python bench/scaling.py [--questions 2 --steps 3 --lengths 56 112]

The tiny default model, fresh (its samples run to the length limit, so every step handles exactly
questions x G x length completion tokens), outcome supervision with the rule reward, one update a
step, micro-batches of 64. For each point: the median of the steps after the first (warm-up),
split into rollout and update, and the seconds per 1,000 completion tokens. A least-squares line
of step time against total tokens gives the slope (seconds per 1k tokens); the ratio of each
point's cost per token to the smallest point's shows any knee.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def point(base: Path, group: int, length: int, questions: int, steps: int) -> dict:
    from configs import load_config
    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from runtime.data import synthetic_records
    from runtime.tracking import MetricsLogger, read_metrics

    out = Path(tempfile.mkdtemp())
    cfg = load_config("configs/tiny.yaml", [
        f"run.root={out}", f"policy.steps={steps}", f"policy.questions_per_step={questions}",
        f"policy.group_size={group}", f"policy.max_new_tokens={length}", "policy.eval_every=0",
        "inspect.every=0", "policy.save_every=100000", "policy.supervision=outcome",
        "deepspeed.micro_batch_size=64", "run.wandb_mode=disabled"])
    records = synthetic_records(5, questions * steps, 2, 4)
    logger = MetricsLogger(out / "m.jsonl", config={}, mode="disabled", project="", name="")
    resolve(cfg).train_policy(out, base, RuleReward(), records, records[:1], logger, "")
    rows = [r for r in read_metrics(out / "m.jsonl") if "time/step" in r][1:]
    tokens = statistics.median(r["rollout/length_mean"] for r in rows) * questions * group
    return {"G": group, "length": length, "tokens": tokens,
            **{k: statistics.median(r[f"time/{k}"] for r in rows)
               for k in ("step", "rollout", "update")}}


def main() -> None:
    import torch

    from configs.schema import TinyModelConfig
    from runtime.tiny_model import build_tiny

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[56, 112])
    args = parser.parse_args()
    torch.set_num_threads(2)
    base = build_tiny(Path(tempfile.mkdtemp()) / "tiny", TinyModelConfig(), 0)
    points = [point(base, g, n, args.questions, args.steps)
              for n in args.lengths for g in args.groups]
    xs = [p["tokens"] / 1000 for p in points]
    ys = [p["step"] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / \
        sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    best = min(p["step"] / p["tokens"] for p in points)
    print(f"{args.questions} questions a step, medians of {args.steps - 1} steps per point")
    print(f"{'G':>4}{'length':>8}{'tokens':>9}{'s/step':>9}{'rollout':>9}{'update':>9}"
          f"{'s/1k tok':>10}{'vs best':>9}")
    for p in points:
        per_k = p["step"] / p["tokens"] * 1000
        print(f"{p['G']:>4}{p['length']:>8}{p['tokens']:>9.0f}{p['step']:>9.2f}"
              f"{p['rollout']:>9.2f}{p['update']:>9.2f}{per_k:>10.3f}"
              f"{p['step'] / p['tokens'] / best:>8.2f}x")
    print(f"least squares: step seconds = {intercept:.2f} + {slope:.3f} x (thousand tokens)")


if __name__ == "__main__":
    main()
