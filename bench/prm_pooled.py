"""A token-classification PRM's scoring through vLLM's pooling runner (`rm.backend=vllm`) beside
the transformers forward (`rm.backend=hf`), on the CPU build. Run it with the vLLM venv's python:

    .venv-vllm/bin/python bench/prm_pooled.py [--model bundled|wide] [--solutions 256]
                                              [--repeats 3]

The PRM: the tiny warm start (or bench/lora_vs_full.py's random 8 x 1024 Llama) under a
2-class token-classification head. The rows: synthetic solutions of 3-5 steps, scored
`rm.score_batch_size` (64) rows a call, in one process (vLLM's engine made and loaded first, then
a warm-up call each side). Per side: the median over `--repeats` of the seconds to score every
row, its rows a second, and the largest difference between the two sides' step scores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lora_vs_full import wide_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("bundled", "wide"), default="bundled")
    parser.add_argument("--solutions", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForTokenClassification

    from configs import load_config
    from configs.loader import BUNDLED
    from reward_model.examples import synthetic_step_examples
    from reward_model.vllm_scorer import load_scorer
    from runtime.data import load_splits
    from runtime.models import load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="prm-pooled-"))
    base = BUNDLED / "tiny_warm_start" if args.model == "bundled" else wide_model(work / "wide")
    torch.manual_seed(0)
    AutoModelForTokenClassification.from_pretrained(base, num_labels=2).save_pretrained(
        work / "prm")
    load_tokenizer(base).save_pretrained(work / "prm")
    cfg = load_config("configs/tiny.yaml", [
        "rm.family=token_classification", "rm.lm_weight=0", "rm.likelihood_feature=false",
        "rm.extra_layers_from=[]", "rm.vllm_kv_cache_gb=1", "rollout.kv_cache_gb=1"])
    examples = synthetic_step_examples(load_splits(cfg.data, 0).eval[:args.solutions], 3)
    torch.set_num_threads(cfg.run.threads)
    sides = {"vllm": load_scorer(work / "prm", cfg.rm, cfg.model, pooled=True),
             "hf": load_scorer(work / "prm", cfg.rm, cfg.model, pooled=False)}
    seconds, scores = {}, {}
    for name, scorer in sides.items():
        scorer.score(examples[:8])  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            scores[name] = scorer.score(examples)
            times.append(time.perf_counter() - started)
        seconds[name] = statistics.median(times)
    gap = max(abs(a - b) for g, w in zip(scores["vllm"], scores["hf"]) for a, b in zip(g, w))
    print(f"model {args.model}, {len(examples)} solutions, median of {args.repeats}:")
    for name in sides:
        print(f"  {name:<5} {seconds[name]:8.3f} s   {len(examples) / seconds[name]:8.1f} rows/s")
    print(f"  vllm / hf rows/s {seconds['hf'] / seconds['vllm']:.2f}x; largest score "
          f"difference {gap:.1e}")


if __name__ == "__main__":
    main()
