"""How right are Math-Shepherd labels? Agreement with the true step correctness on the synthetic task.

    python experiments/label_accuracy.py --completer runs/tiny/sft/best [--solutions 200] [--n 8]

Labels solutions whose first wrong step is known by construction (half correct, half with one
slip) with the completer, then prints: the agreement of the hard estimate with the truth over all
steps (and over the steps before the last, which the completer decides), and the calibration of
the soft estimate (per bin of soft value: how many steps, and the share truly correct).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs import load_config  # noqa: E402
from process_supervision.label import Labeller, Solution  # noqa: E402
from reward_model.examples import synthetic_step_examples  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completer", required=True)
    parser.add_argument("--solutions", type=int, default=200)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    cfg = load_config("configs/tiny.yaml")
    records = load_splits(cfg.data, args.seed).eval[:args.solutions]
    examples = synthetic_step_examples(records, seed=args.seed + 5)
    model, tok = load_causal_lm(args.completer).eval(), load_tokenizer(args.completer)
    labeller = Labeller(model, tok, prompt_format(cfg.data), args.n, cfg.label.max_new_tokens,
                        cfg.label.temperature, prefixes_per_batch=64)
    started = time.perf_counter()
    labelled = labeller.label([Solution(r, ex.steps) for r, ex in zip(records, examples)])
    minutes = (time.perf_counter() - started) / 60
    pairs = [(h, s, t) for x, ex in zip(labelled, examples)
             for h, s, t in zip(x.hard, x.soft, ex.labels)]
    inner = [(h, s, t) for x, ex in zip(labelled, examples)
             for h, s, t in list(zip(x.hard, x.soft, ex.labels))[:-1]]
    agree = sum(h == t for h, _, t in pairs) / len(pairs)
    agree_inner = sum(h == t for h, _, t in inner) / len(inner)
    print(f"{len(labelled)} solutions, {len(pairs)} steps ({len(inner)} decided by the completer),"
          f" N = {args.n}, {labeller.prefixes_done} prefixes in {minutes:.1f} min "
          f"({labeller.prefixes_done / (minutes * 60):.1f} prefixes/s)")
    print(f"hard-estimate agreement with truth: all steps {agree:.3f}; "
          f"completer-decided steps {agree_inner:.3f}")
    positives = [t for _, _, t in inner]
    print(f"share of truly correct steps among completer-decided: {sum(positives) / len(positives):.3f}")
    print("soft-estimate calibration (completer-decided steps):")
    print(f"{'soft bin':>12}{'steps':>8}{'truly correct':>15}")
    edges = [0.0, 1e-9, 0.25, 0.5, 0.75, 1.0 - 1e-9, 1.0 + 1e-9]
    for lo, hi in zip(edges, edges[1:]):
        rows = [t for _, s, t in inner if lo <= s < hi]
        if rows:
            label = "0" if hi < 1e-6 else "1" if lo > 1 - 1e-6 else f"({lo:.2f},{hi:.2f})"
            print(f"{label:>12}{len(rows):>8}{sum(rows) / len(rows):>15.3f}")


if __name__ == "__main__":
    main()
