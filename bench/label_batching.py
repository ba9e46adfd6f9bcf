"""Math-Shepherd labelling: batched vs one prefix per generate call, same solutions, same labels.

    python bench/label_batching.py [--policy runs/tiny/sft/best] [--solutions 32] [--repeats 3]

Greedy completion makes both paths deterministic, so their labels must be identical; the script
checks that and prints the median time of each path and the speed ratio (goal: >= 5x).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from configs.schema import ModelConfig, TinyModelConfig
from process_supervision.label import Labeller, Solution
from runtime.data import synthetic_records
from runtime.tiny_model import build_tiny
from runtime.models import load_causal_lm, load_tokenizer
from tasks.prompts import PromptFormat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="", help="completer checkpoint (default: random tiny)")
    parser.add_argument("--solutions", type=int, default=32)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 16, 64],
                        help="prefixes per generate call for the batched path (a sweep)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the completer's weights, on both paths")
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = args.policy or build_tiny(tempfile.mkdtemp() + "/tiny", TinyModelConfig(), seed=0)
    model, tok = load_causal_lm(path, ModelConfig(dtype=args.dtype)).eval(), load_tokenizer(path)
    solutions = [Solution(r, r.solution_steps)
                 for r in synthetic_records(7, args.solutions, 2, 4)]
    prefixes = sum(len(s.steps) - 1 for s in solutions)
    paths = {f"batched x{b}": b for b in args.batch} | {"per-prefix": 0}
    times: dict[str, list[float]] = {name: [] for name in paths}
    labels = {}
    for _ in range(args.repeats):
        for name, per_call in paths.items():
            labeller = Labeller(model, tok, PromptFormat(), args.completions, 48, 1.0,
                                prefixes_per_batch=max(per_call, 1))
            started = time.perf_counter()
            labels[name] = labeller.label(solutions, greedy=True, batched=per_call > 0)
            times[name].append(time.perf_counter() - started)
    reference = labels["per-prefix"]
    same = all([x.hard for x in labels[n]] == [x.hard for x in reference] and
               [x.soft for x in labels[n]] == [x.soft for x in reference] for n in labels)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"solutions {len(solutions)}, step prefixes {prefixes}, N = {args.completions}, "
          f"{args.dtype}, repeats {args.repeats}")
    print(f"{'path':<14}{'median s':>10}{'prefixes/s':>12}{'vs per-prefix':>15}")
    for name, t in med.items():
        print(f"{name:<14}{t:>10.2f}{prefixes / t:>12.1f}{med['per-prefix'] / t:>14.1f}x")
    print(f"labels identical on every path: {same}")


if __name__ == "__main__":
    main()
