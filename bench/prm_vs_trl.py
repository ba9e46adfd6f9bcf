"""PRM training, ours (`igrpo train-rm rm.family=token_classification`) vs TRL's `PRMTrainer`
(TRL 1.13, the last release that has it), side by side in one run.

    pip install --no-deps --target .bench/trl113 "trl==1.13.0" accelerate   # TRL's other needs are ours
    python bench/prm_vs_trl.py [--steps 30 --repeats 3 --precisions fp32,bf16]
                               [--arms ours-plain,ours-padded,ours-packed,ours-shared,trl-grouped,trl]

Both sides: the same random Qwen2 over the shipped GPT-2 BPE (`--hidden`, 2 layers) under a
fresh 2-label token-classification head, the same TRL stepwise rows laid out as TRL lays them
(BOS, prompt, each step and the separator "\\n", the label at the separator): `--questions`
word problems, each with `--solutions` solutions of 3-10 steps (Math-Shepherd's rows repeat each
question over many solutions), `--batch` rows an optimizer step, learning rate 2e-5, AdamW, one
process of `--threads` threads on the CPU, no evaluation during training, in one precision
(fp32, or bf16: ours bf16 weights with DeepSpeed's fp32 master copy; TRL `bf16=True`, autocast
over fp32 weights). The arms, each a setting of one side:

- `ours-plain`: the padded forward (`rm.pack=false`), rows in random order (`rm.pack`'s
  default before it);
- `ours-padded`: the padded forward, batches grouped by length (`rm.group_by_length`): the two
  trainers' common design;
- `ours-packed`: no padding (`rm.pack=true`, the default), rows in random order;
- `ours-shared`: no padding, and a question's solutions side by side (`rm.group_by_question`),
  so each question's tokens run once for its solutions in the batch;
- `trl-grouped`: TRL grouping by length (`train_sampling_strategy="group_by_length"`), its
  fastest setting; `trl`: TRL's default random order.

Each arm runs in a child process of its own (peak RSS is the child's); the first 3 steps are a
warm-up and the step time is the median of the others. Tokens/s = the rows' mean token count x
rows a step / step time (every arm draws its batches from the same rows). Each repeat runs every
arm in turn at each precision; a ratio is the median over repeats of an arm's tokens/s over
`trl-grouped`'s in the same repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_PATH = ROOT / ".bench" / "trl113"
LR = 2e-5

CHILD = r"""
import json, os, statistics, sys, time
from pathlib import Path
root, arm, base, data, steps, batch, precision, out = sys.argv[1:9]
side, _, setting = arm.partition("-")
sys.path.insert(0, root)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["WANDB_MODE"] = "disabled"
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
import torch
threads = int(os.environ["BENCH_THREADS"])
torch.set_num_threads(threads)
steps, batch, bf16 = int(steps), int(batch), precision == "bf16"

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

result = {}
if side == "ours":
    import igrpo
    from runtime.tracking import read_metrics
    assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={out}",
                       "run.name=ours", f"rm.init_path={base}", "rm.family=token_classification",
                       "rm.lm_weight=0", "rm.likelihood_feature=false", f"rm.data_path={data}",
                       f"rm.batch_size={batch}", f"deepspeed.micro_batch_size={batch}",
                       f"rm.lr={%(lr)r}", "rm.eval_every=0", "rm.save_every=100000",
                       "rm.val_fraction=0.002", "rm.max_length=1024", "run.wandb_mode=disabled",
                       f"run.threads={threads}", f"rm.epochs={steps * batch / 1990:.6f}"]
                      + ["deepspeed.fused_adam=true",
                         f"rm.group_by_length={setting == 'padded'}",
                         f"rm.pack={setting not in ('padded', 'plain')}",
                         f"rm.group_by_question={setting == 'shared'}"]
                      + (["model.dtype=bfloat16", "deepspeed.bf16=true"] if bf16 else [])) == 0
    rows = [r for r in read_metrics(Path(out) / "ours" / "rm-prm" / "metrics.jsonl")
            if "time/step" in r]
    result = {"step_s": statistics.median(r["time/step"] for r in rows[3:]), "steps": len(rows)}
else:
    from datasets import load_dataset
    from transformers import AutoModelForTokenClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.prm import PRMConfig, PRMTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []
        def on_step_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()
        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.started)

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForTokenClassification.from_pretrained(base, num_labels=2)
    model.config.pad_token_id = tokenizer.pad_token_id
    clock = Clock()
    config = PRMConfig(output_dir=out, per_device_train_batch_size=batch,
                       gradient_accumulation_steps=1, learning_rate=%(lr)r, max_steps=steps,
                       bf16=bf16, use_cpu=True, logging_steps=1000, report_to=[],
                       save_strategy="no", seed=0, lr_scheduler_type="constant",
                       warmup_steps=0, max_length=1024, step_separator="\n",
                       gradient_checkpointing=False, dataloader_num_workers=0,
                       train_sampling_strategy="group_by_length" if setting == "grouped"
                       else "random")
    trainer = PRMTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=load_dataset("json", data_files=data, split="train"),
                         callbacks=[clock])
    trainer.train()
    result = {"step_s": statistics.median(clock.times[3:]), "steps": len(clock.times)}
result["peak_rss"] = peak_rss()
Path(out, "result.json").write_text(json.dumps(result))
""" % {"lr": LR}


def stepwise_rows(questions: int, solutions: int, seed: int = 0) -> list[dict]:
    """TRL stepwise rows: `questions` word problems of 3-10 amounts, each with `solutions`
    solutions of running sums, a step wrong ~25% of the time (its sum off by one, and every
    later step labelled wrong); a question's solutions side by side, as Math-Shepherd's file
    holds them."""
    rng = random.Random(seed)
    rows = []
    for i in range(questions):
        terms = [rng.randrange(10, 999) for _ in range(rng.randrange(3, 11))]
        prompt = (f"Problem {i}: a shop sells {len(terms)} lots of apples, of "
                  f"{', '.join(map(str, terms))} apples. How many in all?")
        for _ in range(solutions):
            total, wrong, steps, labels = 0, False, [], []
            for k, t in enumerate(terms):
                slip = not wrong and rng.random() < 0.25 / len(terms) * 3
                total += t + (1 if slip else 0)
                wrong = wrong or slip
                steps.append(f"Step {k + 1}: add the {k + 1}th amount, {t}, to what we have so "
                             f"far, which gives {total} in all.")
                labels.append(not wrong)
            rows.append({"prompt": prompt, "completions": steps, "labels": labels})
    return rows


def mean_tokens(rows: list[dict], base: Path) -> float:
    """Mean tokens a row in TRL's layout (what both sides train on)."""
    sys.path.insert(0, str(ROOT))
    from process_supervision.formats import StepExample
    from reward_model.families import Reading, encode_separated
    from runtime.models import load_tokenizer

    tokenizer = load_tokenizer(base)
    examples = [StepExample(r["prompt"], tuple(r["completions"]),
                            tuple(map(float, r["labels"]))) for r in rows]
    lengths = [int(m.sum()) for m in encode_separated(tokenizer, examples, Reading(),
                                                      1024).attention_mask]
    return sum(lengths) / len(lengths)


def run_arm(arm, base, data, steps, batch, precision, threads) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        if arm.startswith("trl"):
            env["PYTHONPATH"] = f"{TRL_PATH}:{env.get('PYTHONPATH', '')}"
        subprocess.run([sys.executable, "-c", CHILD, str(ROOT), arm, str(base), str(data),
                        str(steps), str(batch), precision, out], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(Path(out, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--questions", type=int, default=250)
    parser.add_argument("--solutions", type=int, default=8)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--arms", default="ours-padded,ours-packed,ours-shared,trl-grouped")
    args = parser.parse_args()
    arms = args.arms.split(",")
    if not (TRL_PATH / "trl").exists():
        raise SystemExit(f"no TRL 1.13 in {TRL_PATH}: pip install --no-deps --target {TRL_PATH} "
                         "'trl==1.13.0' accelerate")
    sys.path.insert(0, str(ROOT))
    from runtime.tiny_model import build_stand_in

    work = Path(tempfile.mkdtemp(prefix="prm-vs-trl-"))
    base = build_stand_in(work / "base", "qwen2", hidden=args.hidden, heads=4)
    rows = stepwise_rows(args.questions, args.solutions)
    data = work / "stepwise.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = mean_tokens(rows, base)
    runs: dict = {}
    for repeat in range(args.repeats):
        for precision in args.precisions.split(","):
            for arm in arms:
                result = run_arm(arm, base, data, args.steps, args.batch, precision, args.threads)
                result["tokens_per_s"] = tokens * args.batch / result["step_s"]
                runs.setdefault((precision, arm), []).append(result)
                print(json.dumps({"repeat": repeat, "precision": precision, "arm": arm,
                                  **result}), flush=True)
    print(f"\n{args.hidden}-wide 2-layer Qwen2, {args.questions} questions x {args.solutions} "
          f"solutions, {tokens:.0f} tokens a row, {args.batch} rows a step, {args.threads} "
          "threads; ratios against trl-grouped in the same repeat, [range]")
    print("| precision | arm | tokens/s | / trl-grouped | peak RSS | RSS / trl-grouped |")
    print("| --- | --- | --- | --- | --- | --- |")
    for precision in args.precisions.split(","):
        reference = runs.get((precision, "trl-grouped"))
        for arm in arms:
            mine = runs[(precision, arm)]
            line = (f"| {precision} | {arm} | "
                    f"{statistics.median(r['tokens_per_s'] for r in mine):,.0f} | ")
            if reference:
                speed = [m["tokens_per_s"] / t["tokens_per_s"] for m, t in zip(mine, reference)]
                rss = [m["peak_rss"] / t["peak_rss"] for m, t in zip(mine, reference)]
                line += (f"{statistics.median(speed):.2f}x [{min(speed):.2f}-{max(speed):.2f}] | "
                         f"{statistics.median(m['peak_rss'] for m in mine) / 2**20:,.0f} MB | "
                         f"{statistics.median(rss):.2f}x |")
            else:
                line += f"- | {statistics.median(m['peak_rss'] for m in mine) / 2**20:,.0f} MB | - |"
            print(line)


if __name__ == "__main__":
    main()
