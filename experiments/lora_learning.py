"""Does GRPO with a LoRA policy learn, over seeds? LoRA GRPO, its shuffled-reward control and full
fine-tuning GRPO, paired by seed.

    python experiments/lora_learning.py --seeds 0 1 2 [--out docs/lora/learning.json]

tests/test_learning.py's setting (the shipped tiny warm start, 15 GRPO steps of 8 questions x
G = 8, the rule reward, outcome supervision, mean@4 at temperature 1 on 200 held-out questions
with the same sampling noise) for each seed (`run.seed`: the questions each step draws and the
sampling): full fine-tuning at lr 5e-5, LoRA rank 16 (alpha 32, all linear layers) at 10x that,
and LoRA with shuffled rewards. Prints per seed the three mean@4 (and the warm start's) and the
paired differences over seeds with their 95% t intervals (each against the warm start, LoRA -
control, LoRA - full). Resumes: a run whose outcomes
file exists is read, not redone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

GRPO = ["policy.steps=15", "policy.questions_per_step=8", "policy.group_size=8",
        "policy.eval_every=0", "policy.save_every=1000", "data.eval_questions=200",
        "run.wandb_mode=disabled", "run.threads=2", "eval.k=4", "policy.supervision=outcome"]
ARMS = {"full": ["policy.lr=5e-5"],
        "lora": ["model.lora.rank=16", "model.lora.alpha=32", "policy.lr=5e-4"],
        "lora_control": ["model.lora.rank=16", "model.lora.alpha=32", "policy.lr=5e-4",
                         "controls.shuffle_rewards=true"]}


def mean_at_4(root: Path, arm: str, seed: int) -> float:
    import torch

    from configs import load_config
    from configs.loader import BUNDLED
    from iteration.resolve import resolve
    from policy.evaluate import evaluate_policy
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from runtime.models import load_causal_lm, load_tokenizer
    from runtime.tracking import MetricsLogger
    from tasks.prompts import prompt_format

    out = root / (f"{arm}-seed{seed}" if arm != "warm_start" else arm)
    outcomes = out / "outcomes.json"
    if not outcomes.exists() and arm == "warm_start":  # (no training: one for every seed)
        out.mkdir(parents=True, exist_ok=True)
        warm = BUNDLED / "tiny_warm_start"
        cfg = load_config(str(ROOT / "configs/tiny.yaml"), GRPO)
        torch.manual_seed(0)
        evaluate_policy(load_causal_lm(warm).eval(), load_tokenizer(warm),
                        load_splits(cfg.data, 0).eval, prompt_format(cfg.data), k=4,
                        temperature=1.0, max_new_tokens=112, batch_size=256,
                        outcomes_path=outcomes)
    if not outcomes.exists():
        cfg = load_config(str(ROOT / "configs/tiny.yaml"),
                          [f"run.root={out}", f"run.seed={seed}", *GRPO, *ARMS[arm]])
        torch.set_num_threads(cfg.run.threads)
        splits = load_splits(cfg.data, 0)  # (the held-out questions of every seed alike)
        logger = MetricsLogger(out / "metrics.jsonl", config={}, mode="disabled", project="",
                               name="")
        warm = BUNDLED / "tiny_warm_start"
        final = resolve(cfg).train_policy(out, warm, RuleReward(), splits.rl, splits.eval,
                                          logger, "", evaluate_ends=False)
        torch.manual_seed(0)  # the same sampling noise for every policy
        evaluate_policy(load_causal_lm(final).eval(), load_tokenizer(final), splits.eval,
                        prompt_format(cfg.data), k=4, temperature=1.0, max_new_tokens=112,
                        batch_size=256, outcomes_path=outcomes)
    values = json.loads(outcomes.read_text())["mean_at_k"]
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--root", default="/tmp/lora-learning")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from runtime.stats import t_interval_over_seeds

    root = Path(args.root)
    table = {seed: {arm: mean_at_4(root, arm, seed) for arm in ["warm_start", *ARMS]}
             for seed in args.seeds}
    for seed, row in table.items():
        print(f"seed {seed}: " + ", ".join(f"{arm} {v:.3f}" for arm, v in row.items()),
              flush=True)
    summary = {
        "lora - warm start": t_interval_over_seeds([r["lora"] - r["warm_start"]
                                                    for r in table.values()]),
        "full - warm start": t_interval_over_seeds([r["full"] - r["warm_start"]
                                                    for r in table.values()]),
        "lora - control": t_interval_over_seeds([r["lora"] - r["lora_control"]
                                                 for r in table.values()]),
        "lora - full": t_interval_over_seeds([r["lora"] - r["full"] for r in table.values()])}
    for name, s in summary.items():
        print(f"{name}: {s['mean']:+.3f} [{s['lo']:+.3f}, {s['hi']:+.3f}] over {s['seeds']} "
              "seeds")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"seeds": table, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
