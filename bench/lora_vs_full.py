"""A GRPO stage with a LoRA policy beside the same stage with full fine-tuning: update speed,
step time and peak memory, measured side by side.

    python bench/lora_vs_full.py [--steps 6] [--rounds 2] [--rank 16] [--model bundled|wide]
                                 [--group-size 64]

Each run is one GRPO stage from the same starting model at the demo's batch (2 questions x
G = 64, configs/tiny.yaml, the rule reward), in a process of its own (so its peak RSS is its
own), full fine-tuning and LoRA (`model.lora.rank`, all linear layers) alternating for
`--rounds` rounds, so that both see the same machine state. Per run: the medians over the steps
after the first of `train/tokens_per_s` (the update's tokens a second), `time/update` and
`time/step`, and the process's peak RSS. `--model wide`: a random 8-layer 1024-wide Llama over
the character tokenizer (134M parameters) instead of the shipped 2.6M warm start, where the
adapter's share of the work is closer to a real model's.
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
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, resource, statistics, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
from configs import load_config
from iteration.resolve import resolve
from policy.rewards import RuleReward
from runtime.data import load_splits
from runtime.tracking import MetricsLogger, read_metrics

work, start, overrides = Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
cfg = load_config(sys.argv[1] + "/configs/tiny.yaml", [f"run.root={work}", *overrides])
torch.set_num_threads(cfg.run.threads)
splits = load_splits(cfg.data, cfg.run.seed)
logger = MetricsLogger(work / "m.jsonl", config={}, mode="disabled", project="", name="")
resolve(cfg).policy_trainer(0, start)(work, start, RuleReward(), splits.rl, splits.eval[:2],
                                      logger, "", out_name="grpo", evaluate_ends=False)
rows = [r for r in read_metrics(work / "m.jsonl") if "train/loss" in r][1:]
out = {k: statistics.median(r[k] for r in rows) for k in json.loads(sys.argv[5])}
if "rollout/logprob_diff" in rows[0]:
    out["logprob_diff_max"] = max(r["rollout/logprob_diff"] for r in rows)
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT " + json.dumps(out))
"""


def wide_model(folder: Path) -> Path:
    """A random 8-layer, 1024-wide Llama over the character tokenizer (saved once)."""
    from configs.schema import TinyModelConfig
    from runtime.tiny_model import build_tiny

    if not (folder / "config.json").exists():
        build_tiny(folder, TinyModelConfig(hidden_size=1024, num_layers=8, num_heads=16,
                                           intermediate_size=2816, max_positions=256), 0,
                   extra_tokens=("ки",))
    return folder


def alternate(arms: dict[str, list[str]], common: list[str], start: Path, rounds: int,
              work: Path, keys: list[str]) -> dict[str, dict]:
    """Each arm's GRPO stage (`common` + its overrides) in a process of its own, the arms
    alternating for `rounds` rounds; per arm the medians over its runs of each run's medians
    of `keys` over the steps after the first (and its peak RSS)."""
    results: dict[str, list[dict]] = {name: [] for name in arms}
    for round_ in range(rounds):
        for name, extra in arms.items():
            folder = work / f"{name}-{round_}"
            done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(folder),
                                   str(start), json.dumps([*common, *extra]), json.dumps(keys)],
                                  capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            line = [li for li in done.stdout.splitlines() if li.startswith("RESULT ")][-1]
            results[name].append(json.loads(line.removeprefix("RESULT ")))
            print(name, round_, results[name][-1], flush=True)
    return {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            for name, runs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", choices=("bundled", "wide"), default="bundled")
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args()

    from configs.loader import BUNDLED

    work = Path(tempfile.mkdtemp(prefix="lora-vs-full-"))
    start = BUNDLED / "tiny_warm_start" if args.model == "bundled" else wide_model(work / "wide")
    common = [f"policy.steps={args.steps}", "policy.eval_every=0", f"policy.group_size={args.group_size}",
              "policy.questions_per_step=2", "policy.supervision=outcome",
              "run.wandb_mode=disabled", "inspect.every=0", "policy.save_every=1000"]
    arms = {"full": ["policy.lr=5e-5"],
            "lora": [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}",
                     "policy.lr=5e-4"]}
    summary = alternate(arms, common, start, args.rounds, work,
                        ["train/tokens_per_s", "time/update", "time/step"])
    full, lora = summary["full"], summary["lora"]
    print(f"\nmodel {args.model}, rank {args.rank}, {args.rounds} rounds of {args.steps} steps; "
          "medians (LoRA / full):")
    for key in full:
        print(f"  {key:<20} full {full[key]:10.3f}   LoRA {lora[key]:10.3f}   "
              f"ratio {lora[key] / full[key]:.2f}")


if __name__ == "__main__":
    main()
