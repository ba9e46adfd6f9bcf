"""GPU checks. Three of them:

    python scripts/gpu_check.py real                          # --cpu: at a small size, on CPU
    python scripts/gpu_check.py iterate --config deepseekmath_7b.yaml --backend vllm --nproc 8
    python scripts/gpu_check.py speed --backend hf            # --small: a CPU smoke run

`real`: one GRPO iteration of configs/qwen25_math_1p5b.yaml (Algorithm 1: labelling, both reward
models, evaluation, GRPO, evaluation) on one GPU, its policy a randomly initialised model of the
real Qwen2.5-Math-1.5B architecture (configs/models/qwen25_math_1p5b/config.json, 1.54B
parameters; nothing is downloaded) over the shipped GPT-2 tokenizer, with the `hf` backend (so it
runs where only PyTorch is installed). The recipe's GRPO shapes are kept (4 questions x G = 64,
1,024 new tokens, micro-batch 8, ZeRO-2, bf16, gradient checkpointing); its counts are cut (2 GRPO
steps, a few labelled and evaluated questions, shorter labelling and evaluation samples). It prints
each memory phase's measured peak (`runtime.memory.memory_phase`) beside `igrpo plan`'s prediction
for this GPU, the rollout's and the update's tokens/s and the update's MFU. `--cpu`: the same
architecture shrunk to 2 layers of 64, the counts tiny, on the CPU (the check of the check).

`iterate`: the config's GPU path on `--nproc` processes (one per GPU, under torchrun), its model
swapped for a tiny random stand-in of the same family (runtime.tiny_model.build_stand_in) and its
counts made small: Algorithm 1 with one GRPO iteration of 4 steps, SIGKILLed (every rank) in the
middle of GRPO and resumed with the same command. It prints whether it finished, and per GPU the
rollout's tokens/s, the seconds spent pushing weights into vLLM and the peak memory (PyTorch's,
and the device's as a whole, vLLM's pool included). `--cpu` runs the same on gloo processes.

`speed`: a few GRPO steps of a ~0.4B random-init Qwen2 in bf16 on one GPU: tokens/s, peak memory,
MFU. The model (hidden 1024, 24 layers, 16 heads, FFN 4096, over the shipped GPT-2 tokenizer) is
built with random weights, so nothing is downloaded; the reward is the rule reward on GSM8K
train questions (a random model earns none, which changes nothing about the speed). MFU counts
6 x params x tokens per update (forward 2, backward 4) against the GPU's dense bf16 peak
(`--peak-tflops`, 989 for H100/H200 SXM).

`bash scripts/gpu_check.sh` runs both on every GPU it finds.
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


ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = ["policy.steps=4", "policy.save_every=1", "policy.questions_per_step={n}",
             "policy.group_size=4", "policy.max_new_tokens=16", "deepspeed.micro_batch_size=4",
             "eval.max_new_tokens=16", "eval.k=2", "eval.batch_size=8", "data.eval_questions=4",
             "label.questions=3", "label.samples_per_question=2", "label.num_completions=2",
             "label.max_new_tokens=16", "rm.batch_size={n}", "rm.bon_questions=2",
             "rm.bon_samples=2", "iterate.iterations=1", "run.wandb_mode=disabled"]


REAL_RUN = ["policy.steps=2", "policy.save_every=2", "data.eval_questions=8", "eval.k=4",
            "eval.max_new_tokens=256", "label.questions=2", "label.samples_per_question=2",
            "label.num_completions=2", "label.max_new_tokens=256", "rm.batch_size=4",
            "rm.bon_questions=2", "rm.bon_samples=8", "iterate.iterations=1",
            "run.wandb_mode=disabled", "rollout.backend=hf", "inspect.every=0",
            "eval.batch_size=64", "label.prefixes_per_batch=8"]  # the hf backend's sizes
REAL_CPU = ["model.dtype=float32", "deepspeed.bf16=false", "deepspeed.fused_adam=false",
            "policy.group_size=4", "policy.max_new_tokens=16", "deepspeed.micro_batch_size=4",
            "eval.max_new_tokens=16", "label.max_new_tokens=16", "data.eval_questions=2",
            "eval.k=2", "data.max_prompt_tokens=176", "rm.max_length=192", "rm.bon_samples=2",
            "run.threads=1"]


def real_model(out: Path, small: bool) -> Path:
    """A randomly initialised model of the shipped Qwen2.5-Math-1.5B configuration (bf16 on a
    GPU; `small`: 2 layers of 64, float32) and the shipped GPT-2 tokenizer with a chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from runtime.tiny_model import STAND_IN_CHAT, tiny_tokenizer

    shrink = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_window_layers=2) if small else {}
    shipped = json.loads((ROOT / "configs/models/qwen25_math_1p5b/config.json").read_text())
    config = AutoConfig.for_model(**{**shipped, **shrink})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32 if small else torch.bfloat16)
    tokenizer = tiny_tokenizer("gpt2")
    tokenizer.chat_template = STAND_IN_CHAT
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def real_check(args) -> dict:
    """One GRPO iteration of the 1.5B recipe on a random model of its real architecture: each
    phase's measured peak beside the plan's, tokens/s, MFU."""
    import torch

    import igrpo
    from configs import load_config
    from configs.memory import GB, phases, plan
    from runtime.memory import PHASE_PEAKS
    from runtime.tracking import read_metrics

    work = Path(tempfile.mkdtemp(prefix="igrpo-gpu-real-"))
    cuda = torch.cuda.is_available() and not args.cpu
    model = real_model(work / "model", small=not cuda)
    overrides = [*REAL_RUN, *([] if cuda else REAL_CPU), f"run.root={work}",
                 f"model.policy_path={model}"]
    started = time.perf_counter()
    code = igrpo.main(["iterate", "--config", "configs/qwen25_math_1p5b.yaml", *overrides])
    wall = time.perf_counter() - started
    cfg = load_config("configs/qwen25_math_1p5b.yaml", overrides)
    rows, numbers = plan(cfg, 1, 1, cfg.data.max_prompt_tokens)
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GB if cuda else 80.0
    predicted = {p.name: round(p.peak / GB, 2) for p in phases(numbers, gpu_gib)}
    steps = [r for r in read_metrics(work / cfg.run.name / "grpo" / "iteration-1" /
                                      "metrics.jsonl") if "train/loss" in r]
    update = statistics.median(r["train/tokens_per_s"] for r in steps) if steps else 0.0
    flops = 6 * numbers["params"] * update
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "exit_code": code,
            "params": numbers["params"], "wall_s": round(wall, 1),
            "phases_gib": {name: {"plan": gib, "measured": round(PHASE_PEAKS[name], 2)
                                  if name in PHASE_PEAKS else None}
                           for name, gib in predicted.items()},
            "rollout_tokens_per_s": [round(r["rollout/tokens_per_s"], 1) for r in steps],
            "update_tokens_per_s": [round(r["train/tokens_per_s"], 1) for r in steps],
            "mfu_update": flops / (args.peak_tflops * 1e12) if cuda else None,
            "grpo_steps": len(steps)}


def iterate_check(args) -> dict:
    """The config's GPU path on a stand-in: run, SIGKILL in GRPO, resume; what it measured."""
    import os
    import signal

    from configs import load_config
    from runtime.tiny_model import STAND_INS, build_stand_in
    from runtime.tracking import read_metrics

    work = Path(tempfile.mkdtemp(prefix="igrpo-gpu-iterate-"))
    stand_in = build_stand_in(work / "model", STAND_INS[args.config], chat=True, hidden=128)
    overrides = [o.format(n=2 * args.nproc) for o in SMALL_RUN] + [
        f"run.root={work}", f"model.policy_path={stand_in}", f"rollout.backend={args.backend}"]
    env = dict(os.environ)
    if args.lora:  # a LoRA policy: the adapter trains, vLLM gets the merged weights
        overrides += [f"model.lora.rank={args.lora}", f"model.lora.alpha={2 * args.lora}"]
    if args.cpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        overrides += ["model.dtype=float32", "deepspeed.bf16=false", "rollout.kv_cache_gb=1",
                      "run.threads=1"]
    run = work / load_config(f"configs/{args.config}").run.name
    started = time.perf_counter()
    proc, killed = _launch(args, overrides, env, work), None
    deadline = time.monotonic() + args.timeout
    metrics = run / "grpo" / "iteration-1" / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and any("train/loss" in r for r in read_metrics(metrics)):
            os.killpg(proc.pid, signal.SIGKILL)  # every rank and the launcher, mid-GRPO
            proc.wait()
            killed = max(r["step"] for r in read_metrics(metrics))
            break
        time.sleep(0.2)
    if killed is not None:
        proc = _launch(args, overrides, env, work)
    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return {"config": args.config, "backend": args.backend, "processes": args.nproc,
            "lora_rank": args.lora,
            "exit_code": code, "killed_after_step": killed, **_measured(run, metrics),
            "wall_s": round(time.perf_counter() - started, 1), "log": str(work / "log.txt")}


def _launch(args, overrides: list[str], env: dict, work: Path):
    """`igrpo iterate` of the config on `args.nproc` processes under torchrun, in a process
    group of its own (so one SIGKILL stops every rank)."""
    import subprocess

    from runtime.dist import free_port

    log = open(work / "log.txt", "a")
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "igrpo", "iterate",
         "--config", f"configs/{args.config}", *overrides], cwd=ROOT, env=env, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)


def _measured(run: Path, metrics: Path) -> dict:
    """Whether every unit finished, and GRPO's steps: tokens/s, weight-push seconds and the
    peak memory per GPU."""
    from runtime.tracking import read_metrics

    rows = [r for r in read_metrics(metrics) if "train/loss" in r] if metrics.exists() else []
    memory = {key: round(max(r[key] for r in rows if key in r), 2)
              for key in sorted({k for r in rows for k in r if k.startswith("memory/")})}
    units = json.loads((run / "manifest.json").read_text())["units"] \
        if (run / "manifest.json").exists() else {}
    return {"finished": bool(units) and all(u["state"] == "done" for u in units.values()),
            "grpo_steps_logged": [r["step"] for r in rows],
            "rollout_tokens_per_s": [round(r["rollout/tokens_per_s"], 1) for r in rows],
            "weight_push_s": [round(r["time/weight_push"], 3) for r in rows
                              if "time/weight_push" in r], **memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("real", "iterate", "speed"), nargs="?",
                        default="speed")
    parser.add_argument("--config", default="qwen25_math_1p5b.yaml",
                        help="iterate: a GPU config of configs/")
    parser.add_argument("--nproc", type=int, default=1, help="iterate: processes (GPUs)")
    parser.add_argument("--cpu", action="store_true",
                        help="real: a small size on the CPU; iterate: gloo processes on the CPU")
    parser.add_argument("--timeout", type=float, default=600.0, help="iterate: seconds")
    parser.add_argument("--lora", type=int, default=0,
                        help="iterate: a LoRA policy of this rank (model.lora.rank; 0 = off)")
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
    check = {"real": real_check, "iterate": iterate_check, "speed": speed_check}[args.check]
    found = check(args)
    if args.check == "real":
        print(f"{'phase':<22}{'plan GiB':>9}{'measured':>10}")
        for name, gib in found["phases_gib"].items():
            measured = "n/a" if gib["measured"] is None else f"{gib['measured']:.2f}"
            print(f"{name:<22}{gib['plan']:>9.2f}{measured:>10}")
    print(json.dumps(found, indent=2))


def speed_check(args) -> dict:
    """A few GRPO steps of the ~0.4B model: throughput, MFU and peak memory."""
    import torch

    from configs import load_config
    from iteration.resolve import resolve
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
        f"policy.steps={args.steps}", f"policy.questions_per_step={args.questions}",
        f"policy.group_size={args.group}", f"policy.max_new_tokens={args.max_new_tokens}",
        f"deepspeed.micro_batch_size={args.micro_batch}", "policy.supervision=outcome",
        "policy.eval_every=0", "inspect.every=0", f"policy.save_every={args.steps}",
        "policy.lr=1e-6", "run.threads=0", f"rollout.backend={args.backend}"])
    splits = load_splits(cfg.data, 0)
    logger = MetricsLogger(work / "metrics.jsonl", config={}, mode="disabled", project="", name="")
    started = time.perf_counter()
    resolve(cfg).train_policy(work, work / "model", RuleReward(), splits.rl, splits.eval[:2], logger, "",
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
    return report


if __name__ == "__main__":  # vLLM's engine may spawn processes: keep the entry guarded
    main()
