"""A GRPO optimizer step, ours vs TRL's `GRPOTrainer`, on the same model, prompts and settings.

    pip install -e ".[bench]"        # TRL is a benchmark-only extra
    python bench/grpo_vs_trl.py [--models tiny,20m] [--steps 5 --repeats 2] [--layouts 1x2,2x1]

Models: the shipped tiny warm start (2.6M) and a ~20M tiny Llama (random weights, so its
samples mostly run to the length limit). Both sides: the same model and character tokenizer, the same synthetic prompts, the same
rule-based reward (final answer vs gold), G = 8 samples x 8 questions a step, the same maximum
completion length, temperature 1.0, learning rate 5e-5, beta 0.04, one update per step (mu = 1),
on CPU in one precision for both (`--precision`): fp32, or bf16 (ours: bf16 weights with
DeepSpeed's fp32 master copy, `model.dtype=bfloat16 deepspeed.bf16=true`; TRL: `bf16=True`,
autocast over fp32 weights), bf16 running on the CPU's AMX/AVX-512 bf16 units where it has them;
and in one layout for both (`--layouts`): P processes x T threads each, several processes
launched by `torchrun` (data parallel: ours over DeepSpeed, TRL's trainer over DDP, gloo both).
TRL is set to its fastest fair CPU setting otherwise: no gradient checkpointing, no vLLM,
`loss_type="grpo"` (its default is "dapo") and `beta=0.04` (its default is 0). Each side runs in its
own child processes (peak RSS is summed over them), the first step is a warm-up, and the step
time is the median of the others. Each repeat runs ours then TRL at each setting in turn, and the
medians over `--repeats` are reported. A speed ratio is the median over the repeats of ours / TRL,
each run of ours paired with the TRL run that follows it (a pair shares the machine's speed of the
moment), with its range; the `fastest` row pairs, repeat by repeat, our fastest setting with
TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
Q, G, LR, BETA = 8, 8, 5e-5, 0.04

CHILD = r"""
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["WANDB_MODE"] = "disabled"
import torch
torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
side, policy, steps, max_tokens, out = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
bf16 = sys.argv[7] == "bf16"
WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
Q, G, LR, BETA = 8, 8, 5e-5, 0.04

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

from runtime.data import synthetic_records
from tasks.grading import grade
from configs import load_config as _load
records = synthetic_records(11, Q * steps, 2, 4)
template = _load("configs/tiny.yaml").data.prompt_template
result = {}
if side == "ours":
    from configs import load_config
    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from runtime.tracking import MetricsLogger, read_metrics
    cfg = load_config("configs/tiny.yaml", [
        f"run.root={out}", f"policy.steps={steps}", f"policy.questions_per_step={Q}",
        f"policy.group_size={G}", f"policy.lr={LR}", f"policy.beta={BETA}", "policy.loss=grpo",
        "policy.supervision=outcome", f"policy.max_new_tokens={max_tokens}", "policy.eval_every=0",
        "inspect.every=0", "policy.save_every=100000",
        f"deepspeed.micro_batch_size={Q * G // WORLD}", "run.wandb_mode=disabled",
        f"run.threads={torch.get_num_threads()}"]
        + (["model.dtype=bfloat16", "deepspeed.bf16=true"] if bf16 else []))
    logger = MetricsLogger(Path(out) / "m.jsonl", config={}, mode="disabled", project="", name="",
                           enabled=RANK == 0)
    resolve(cfg).train_policy(Path(out), policy, RuleReward(), records, records[:1], logger, "")
    if RANK == 0:  # the step's metrics cover every rank's samples
        rows = [r for r in read_metrics(Path(out) / "m.jsonl") if "time/step" in r][1:]
        med = lambda k: statistics.median(r[k] for r in rows)
        result = {"step_s": med("time/step"), "rollout_s": med("time/rollout"),
                  "scoring_s": med("time/scoring"), "update_s": med("time/update"),
                  "completion_tokens": med("rollout/length_mean") * Q * G}
else:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from runtime.models import load_tokenizer
    tokenizer = load_tokenizer(policy)
    data = Dataset.from_list([{"prompt": template.replace("{question}", r.question), "gold": r.answer}
                              for r in records])

    def reward(prompts, completions, gold, **kwargs):
        return [float(grade(c, g)) for c, g in zip(completions, gold)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.lengths = [], []
        def on_step_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()
        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.started)
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    clock = Clock()
    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=Q * G // WORLD, num_generations=G,
        gradient_accumulation_steps=1, max_completion_length=max_tokens, temperature=1.0,
        top_k=0, learning_rate=LR, beta=BETA, loss_type="grpo", num_iterations=1,
        gradient_checkpointing=False, use_vllm=False, bf16=bf16, use_cpu=True,
        max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        lr_scheduler_type="constant", warmup_steps=0, shuffle_dataset=False)
    model = AutoModelForCausalLM.from_pretrained(policy)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    if RANK == 0:  # TRL logs the lengths of every rank's completions
        result = {"step_s": statistics.median(clock.times[1:]),
                  "completion_tokens": statistics.median(clock.lengths[1:]) * Q * G}
result["peak_rss"] = peak_rss()
Path(out, f"result-{RANK}.json").write_text(json.dumps(result))
"""


def cpu_name() -> str:
    """The CPU's model name and whether it has bf16 matrix units (AMX or AVX-512 bf16)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    units = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return f"{name} ({', '.join(units) if units else 'no bf16 units'})"


def run_side(side: str, policy: str, steps: int, max_tokens: int, precision: str,
             layout: str) -> dict:
    """One run of one side: rank 0's step times and completion tokens, peak RSS summed over
    the processes. `layout`: "PxT", P processes of T threads each."""
    from runtime.dist import free_port

    processes, threads = map(int, layout.split("x"))
    out = tempfile.mkdtemp()
    script = Path(out) / "child.py"
    script.write_text(CHILD)
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    env = {**os.environ, "BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([*launch, str(script), str(ROOT), side, policy, str(steps),
                           str(max_tokens), out, precision],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    results = {rank: json.loads((Path(out) / f"result-{rank}.json").read_text())
               for rank in range(processes) if (Path(out) / f"result-{rank}.json").exists()}
    if done.returncode != 0 or len(results) != processes:
        raise SystemExit(f"{side} ({precision}, {layout}) failed:\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-5000:]}")
    return {**results[0], "peak_rss": sum(r["peak_rss"] for r in results.values())}


def measure(label: str, policy: str, steps: int, max_tokens: int, repeats: int,
            precisions: list[str], layouts: list[str]) -> list[str]:
    """Every (precision, layout, side) run `repeats` times, interleaved: each repeat runs ours
    then TRL at each setting in turn. Markdown rows of their medians and ratios."""
    settings = [(p, layout) for p in precisions for layout in layouts]
    runs = {(*setting, side): [] for setting in settings for side in ("ours", "trl")}
    for _ in range(repeats):
        for precision, layout, side in runs:
            runs[precision, layout, side].append(
                run_side(side, policy, steps, max_tokens, precision, layout))
    rows = []
    for precision, layout in settings:
        ours, trl = runs[precision, layout, "ours"], runs[precision, layout, "trl"]
        for side, rs in (("ours", ours), ("TRL", trl)):
            m = {k: median_of(rs, k) for k in rs[0]}
            split = [f"{m[k]:.2f}" if k in m else "-" for k in ("rollout_s", "update_s")]
            rows.append(f"| {label} | {precision} | {layout} | {side} | {m['step_s']:.2f} | "
                        f"{' | '.join(split)} | {m['completion_tokens'] / m['step_s']:,.0f} | "
                        f"{m['peak_rss'] / 2**30:.2f} |")
        # Each run of ours is paired with the TRL run right after it, so a pair shares the
        # machine's speed of the moment (it drifts by up to 2x over minutes here).
        rows.append(ratio_row(label, precision, layout, [throughput(o) / throughput(t)
                                                         for o, t in zip(ours, trl)],
                              median_of(ours, "peak_rss") / median_of(trl, "peak_rss")))
    if len(settings) > 1:
        # Ours at its fastest against TRL at its fastest, repeat by repeat.
        best = [max(throughput(runs[(*s, "ours")][i]) for s in settings)
                / max(throughput(runs[(*s, "trl")][i]) for s in settings) for i in range(repeats)]
        rows.append(ratio_row(label, "fastest", "fastest", best, None))
    return rows


def ratio_row(label: str, precision: str, layout: str, ratios: list[float],
              rss: float | None) -> str:
    """The median of the repeats' ratios of completion tokens a second, and their range."""
    ratios = sorted(ratios)
    memory = "" if rss is None else f"**{rss:.2f}x**"
    return (f"| {label} | {precision} | {layout} | **ours / TRL** | | | | "
            f"**{statistics.median(ratios):.2f}x** ({ratios[0]:.2f}-{ratios[-1]:.2f}x) | "
            f"{memory} |")


def median_of(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def throughput(run: dict) -> float:
    """Completion tokens a second of one run (its median step)."""
    return run["completion_tokens"] / run["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,20m", help="tiny, 20m or both")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=112)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precision", default="fp32,bf16", help="fp32, bf16 or both")
    parser.add_argument("--layouts", default="1x2,2x1",
                        help="processes x threads each, comma-separated")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from configs.schema import TinyModelConfig
    from runtime.tiny_model import build_tiny

    rows = ["| model | precision | processes x threads | side | s/step | rollout s | update s | "
            "completion tok/s | peak RSS GiB |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    models = []
    if "tiny" in args.models:
        models.append(("tiny warm start (2.6M)", str(ROOT / "runtime/bundled/tiny_warm_start")))
    if "20m" in args.models:
        big = build_tiny(Path(tempfile.mkdtemp()) / "tiny20m",
                         TinyModelConfig(hidden_size=512, num_layers=6, num_heads=8,
                                         intermediate_size=1536), seed=0)
        models.append(("tiny Llama (~20M, random)", str(big)))
    for label, policy in models:
        rows += measure(label, policy, args.steps, args.max_tokens, args.repeats,
                        args.precision.split(","), args.layouts.split(","))
    print(f"{cpu_name()}; {Q} questions x G={G}, at most {args.max_tokens} completion tokens, "
          f"{args.steps} steps a run (the first a warm-up), medians of {args.repeats} runs "
          "per side")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
