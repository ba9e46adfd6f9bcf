"""A few GRPO steps of a ~0.4B random-init Qwen2 in bf16 on one GPU: tokens/s, peak memory, MFU.

    bash scripts/gpu_check.sh              # on a GPU machine, within ~8 minutes
    python scripts/gpu_check.py --small    # the same code path in seconds (CPU smoke run)

The model (hidden 1024, 24 layers, 16 heads, FFN 4096, over the shipped GPT-2 tokenizer) is built
with random weights, so nothing is downloaded; the reward is
the rule reward on GSM8K train questions (a random model earns none, which changes nothing about
the speed). Rollout and update throughput come from the GRPO loop's own metrics; MFU counts
6 x params x tokens per update (forward 2, backward 4) against the GPU's dense bf16 peak
(`--peak-tflops`, 989 for H100/H200 SXM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--small", action="store_true", help="tiny sizes: a CPU smoke run")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                        help="rollout.backend: transformers generate or a colocated vLLM engine")
    args = parser.parse_args()
    import torch

    from configs import load_config
    from policy.grpo import train_grpo
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from runtime.models import accelerator
    from runtime.tiny_model import build_model, tiny_tokenizer
    from runtime.tracking import MetricsLogger, read_metrics

    cuda = torch.cuda.is_available()
    dims = (64, 2, 2, 128) if args.small else (1024, 24, 16, 4096)
    if args.small:
        args.steps, args.questions, args.group, args.max_new_tokens, args.micro_batch = \
            2, 2, 4, 16, 8
    work = Path(tempfile.mkdtemp(prefix="igrpo-gpu-check-"))
    tokenizer = tiny_tokenizer("gpt2")
    model = build_model(tokenizer, *dims, max_positions=2048, seed=0, architecture="qwen2")
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    bf16 = cuda and not args.small
    cfg = load_config("configs/tiny.yaml", [
        f"run.root={work}", "run.wandb_mode=disabled", f"model.policy_path={work / 'model'}",
        f"model.dtype={'bfloat16' if bf16 else 'float32'}", f"deepspeed.bf16={str(bf16).lower()}",
        "model.attn_implementation=sdpa", "data.source=gsm8k", "data.prompt_template=boxed",
        "data.max_prompt_tokens=256", "rm.max_length=1024", f"label.max_new_tokens={args.max_new_tokens}",
        f"grpo.steps={args.steps}", f"grpo.questions_per_step={args.questions}",
        f"grpo.group_size={args.group}", f"grpo.max_new_tokens={args.max_new_tokens}",
        f"deepspeed.micro_batch_size={args.micro_batch}", "grpo.supervision=outcome",
        "grpo.eval_every=0", "grpo.inspect_every=0", f"grpo.save_every={args.steps}",
        "grpo.lr=1e-6", "run.threads=0", f"rollout.backend={args.backend}"])
    splits = load_splits(cfg.data, 0)
    logger = MetricsLogger(work / "metrics.jsonl", config={}, mode="disabled", project="", name="")
    started = time.perf_counter()
    train_grpo(cfg, work, work / "model", RuleReward(), splits.rl, splits.eval[:2], logger, "",
               evaluate_ends=False)
    rows = [r for r in read_metrics(work / "metrics.jsonl") if "time/step" in r][1:] or \
        [r for r in read_metrics(work / "metrics.jsonl") if "time/step" in r]
    median = {key: statistics.median(r[key] for r in rows) for key in
              ("rollout/tokens_per_s", "train/tokens_per_s", "time/step", "time/rollout",
               "time/update", "rollout/length_mean")}
    update_flops = 6 * params * median["train/tokens_per_s"]
    report = {
        "device": torch.cuda.get_device_name() if cuda else str(accelerator()),
        "backend": args.backend,
        "params": params, "dtype": cfg.model.dtype,
        "samples_per_step": args.questions * args.group, "max_new_tokens": args.max_new_tokens,
        **median,
        "update_tflops": update_flops / 1e12,
        "mfu_update": update_flops / (args.peak_tflops * 1e12) if cuda else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":  # vLLM's engine may spawn processes: keep the entry guarded
    main()
