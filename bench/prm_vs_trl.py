"""PRM training, ours (`igrpo train-rm rm.family=token_classification`) vs TRL's `PRMTrainer`
(TRL 1.13, the last release that has it), side by side in one run.

    pip install --no-deps --target .bench/trl113 "trl==1.13.0" accelerate   # TRL's other needs are ours
    python bench/prm_vs_trl.py [--steps 30 --repeats 3 --precisions fp32,bf16]
                               [--arms ours-plain,ours-padded,ours-packed,ours-shared,trl-grouped,trl]
    # a GPT-2-small shape on rows of Math-Shepherd's lengths (about 20 minutes on 2 cores):
    python bench/prm_vs_trl.py --hidden 768 --layers 12 --heads 12 --intermediate 2048 \
        --rows shepherd --batch 8 --steps 6 --warmup 2 --repeats 2 \
        --arms ours-packed,ours-shared,trl-grouped [--profile]

Both sides: the same random Qwen2 over the shipped GPT-2 BPE (`--hidden`, `--layers`, `--heads`,
`--intermediate`; its pad row drawn like the others, `drawn_pad_row`) under a fresh 2-label
token-classification head, the same TRL stepwise rows laid out as TRL lays them (BOS, prompt,
each step and the separator "\\n", the label at the separator): `--questions` word problems,
each with `--solutions` solutions (`--rows short`: 3-10 short steps; `shepherd`: Math-Shepherd's
lengths), as Math-Shepherd's rows repeat each question over many solutions, `--batch` rows an
optimizer step, learning rate 2e-5, AdamW, one process of `--threads` threads on the CPU, no
evaluation during training, in one precision (fp32, or bf16: ours bf16 weights with DeepSpeed's
fp32 master copy; TRL `bf16=True`, autocast over fp32 weights). The arms, each a setting of one
side:

- `ours-plain`: the padded forward (`rm.pack=false`), rows in random order (`rm.pack`'s
  default before it);
- `ours-padded`: the padded forward, batches grouped by length (`rm.group_by_length`): the two
  trainers' common design;
- `ours-packed`: no padding (`rm.pack=true`, the default), rows in random order;
- `ours-shared`: no padding, and a question's solutions side by side (`rm.group_by_question`),
  so each question's tokens run once for its solutions in the batch;
- `trl-grouped`: TRL grouping by length (`train_sampling_strategy="group_by_length"`), its
  fastest setting; `trl`: TRL's default random order.

Each arm runs in a child process of its own (peak RSS is the child's); the first `--warmup`
steps are left out. Tokens/s = the real tokens (no padding) of the rows the other steps train
over those steps' summed time, so an arm whose steps drew longer rows is not favoured (every
arm draws its batches from the same rows, each in its own order); "computed" is the tokens a step actually runs through the layers (padding and a shared question
counted as run). Each repeat runs every arm in turn at each precision; a ratio is the median
over repeats of an arm's tokens/s over `trl-grouped`'s in the same repeat. Also printed: the
live tensors just before the last optimizer step by dtype (the weights, gradients and optimizer
state) beside the peak RSS, and with `--profile` the last step's self CPU time by kind of op.
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
KINDS = (("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
         ("attention", ("attention", "softmax", "flash")),
         ("optimizer and clipping", ("adam", "_foreach", "vector_norm", "clamp")),
         ("embedding", ("embedding",)),
         ("copies and masks", ("copy", "fill", "index", "cat", "where", "clone", "zero",
                               "masked", "scatter", "gather", "contiguous")))
"""Kinds of ops (words in the op's name) the profile sums self CPU time over."""
LR = 2e-5

CHILD = r"""
import json, os, statistics, sys, time
from pathlib import Path
root, arm, base, data, steps, batch, precision, out, warmup, rows = sys.argv[1:11]
side, _, setting = arm.partition("-")
sys.path.insert(0, root)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["WANDB_MODE"] = "disabled"
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
import torch
threads = int(os.environ["BENCH_THREADS"])
torch.set_num_threads(threads)
steps, batch, bf16, warmup = int(steps), int(batch), precision == "bf16", int(warmup)
computed, norms, real = [0], set(), []

def count_tokens(module, args):
    # the tokens a training forward runs through the layers: what each RMSNorm takes (the
    # model's 2 a layer and its last), averaged over them
    if torch.is_grad_enabled() and type(module).__name__.endswith("RMSNorm"):
        norms.add(id(module))
        computed[0] += args[0].numel() // args[0].shape[-1]

torch.nn.modules.module.register_module_forward_pre_hook(count_tokens)

def live_bytes(module):
    # every live tensor's storage (each once) by dtype, just before an optimizer step: the
    # weights, gradients and optimizer state a step holds beside its activations
    import gc
    seen, by = set(), {}
    grads = [p.grad for p in module.parameters() if p.grad is not None]  # (held by C++ alone)
    for o in gc.get_objects() + grads:
        try:
            if not isinstance(o, torch.Tensor) or o.device.type != "cpu":
                continue
            storage = o.untyped_storage()
        except Exception:
            continue
        if storage.data_ptr() in seen or not storage.nbytes():
            continue
        seen.add(storage.data_ptr())
        key = str(o.dtype).replace("torch.", "")
        by[key] = by.get(key, 0) + storage.nbytes()
    return by

snapshot = {}
profile = {}
PROFILING = os.environ.get("BENCH_PROFILE") == "1"
KINDS = %(kinds)r

class Profiled:
    # torch's profiler over one whole optimizer step: self CPU time in ms by kind of op
    def start(self):
        if PROFILING:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
    def stop(self):
        if PROFILING:
            self.prof.__exit__(None, None, None)
            for event in self.prof.key_averages():
                name = event.key.lower().removeprefix("aten::")
                kind = next((k for k, words in KINDS if any(w in name for w in words)), "other")
                profile[kind] = profile.get(kind, 0.0) + event.self_cpu_time_total / 1e3

profiled = Profiled()

def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

result = {}
if side == "ours":
    import igrpo
    import runtime.training
    stepped = [0]
    plain_step = runtime.training.engine_step

    def engine_step(engine, where=""):
        stepped[0] += 1
        if stepped[0] == steps:  # the last step, gradients in hand
            snapshot.update(live_bytes(engine.module), hwm_before_step=peak_rss())
        norm = plain_step(engine, where)
        if stepped[0] == steps - 1:
            profiled.start()
        elif stepped[0] == steps:
            profiled.stop()
        return norm
    runtime.training.engine_step = engine_step
    import reward_model.train
    plain_loss = reward_model.train.batch_loss

    def batch_loss(engine, batch, *args, **kwargs):
        snapshot.setdefault("hwm_start", peak_rss())  # (loaded, nothing run yet)
        real.append(int(batch.attention_mask.sum()))  # (one call a step: the rank's rows)
        return plain_loss(engine, batch, *args, **kwargs)
    reward_model.train.batch_loss = batch_loss
    from runtime.tracking import read_metrics
    assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={out}",
                       "run.name=ours", f"rm.init_path={base}", "rm.family=token_classification",
                       "rm.lm_weight=0", "rm.likelihood_feature=false", f"rm.data_path={data}",
                       f"rm.batch_size={batch}", f"deepspeed.micro_batch_size={batch}",
                       f"rm.lr={%(lr)r}", "rm.eval_every=0", "rm.save_every=100000",
                       "rm.val_fraction=0", "rm.max_length=1024", "run.wandb_mode=disabled",
                       f"run.threads={threads}", f"rm.epochs={steps * batch / int(rows):.6f}"]
                      + ["deepspeed.fused_adam=true",
                         f"rm.group_by_length={setting == 'padded'}",
                         f"rm.pack={setting not in ('padded', 'plain')}",
                         f"rm.group_by_question={setting == 'shared'}"]
                      + (["model.dtype=bfloat16", "deepspeed.bf16=true"] if bf16 else [])) == 0
    rows = [r for r in read_metrics(Path(out) / "ours" / "rm-prm" / "metrics.jsonl")
            if "time/step" in r]
    times = [r["time/step"] for r in rows]
else:
    from datasets import load_dataset
    from transformers import AutoModelForTokenClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.prm import PRMConfig, PRMTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == steps:
                profiled.start()
            self.started = time.perf_counter()
        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.started)
            if state.global_step == steps:
                profiled.stop()
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if state.global_step + 1 == steps:
                snapshot.update(live_bytes(kw["model"]), hwm_before_step=peak_rss())

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
    def count_real(module, args, kwargs):
        if module.training:
            snapshot.setdefault("hwm_start", peak_rss())  # (loaded, nothing run yet)
            real.append(int(kwargs["attention_mask"].sum()))
    model.register_forward_pre_hook(count_real, with_kwargs=True)
    trainer.train()
    times = clock.times
assert len(real) == len(times), (len(real), len(times))
result = {"step_s": statistics.median(times[warmup:]), "steps": len(times),
          "real_tokens_per_s": sum(real[warmup:]) / sum(times[warmup:])}
result["peak_rss"] = peak_rss()
result["computed_per_step"] = computed[0] / len(norms) / result["steps"]
result["live"] = snapshot
result["profile"] = profile
Path(out, "result.json").write_text(json.dumps(result))
""" % {"lr": LR, "kinds": KINDS}


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
            steps, labels, _ = _solution(rng, terms, lambda k, t, total: (
                f"Step {k + 1}: add the {k + 1}th amount, {t}, to what we have so far, which "
                f"gives {total} in all."))
            rows.append({"prompt": prompt, "completions": steps, "labels": labels})
    return rows


def _solution(rng: random.Random, terms: list[int], step) -> tuple[list[str], list[bool], int]:
    """(steps, labels, total) of one solution summing `terms`: a step slips by one ~25% of the
    time over the solution, and it and every later step are labelled wrong; `step(k, term,
    running total)` writes step k."""
    total, wrong, steps, labels = 0, False, [], []
    for k, t in enumerate(terms):
        slip = not wrong and rng.random() < 0.25 / len(terms) * 3
        total += t + (1 if slip else 0)
        wrong = wrong or slip
        steps.append(step(k, t, total))
        labels.append(not wrong)
    return steps, labels, total


def shepherd_rows(questions: int, solutions: int, seed: int = 0) -> list[dict]:
    """TRL stepwise rows of Math-Shepherd's lengths: a GSM8K-long question (about 70 GPT-2
    tokens) and 4-12 steps of about 25 tokens, about 290 tokens a row as `bench/prm_scale.py`'s
    generated Math-Shepherd file; labels as `stepwise_rows`."""
    rng = random.Random(seed)
    rows = []
    for i in range(questions):
        terms = [rng.randrange(10, 999) for _ in range(rng.randrange(4, 13))]
        prompt = (f"Problem {i}: a warehouse receives {len(terms)} deliveries this week. The "
                  f"deliveries bring {', '.join(map(str, terms))} boxes, and every box holds the "
                  "same number of items. The manager counts the boxes as they arrive and writes "
                  "the running total down. How many boxes did the warehouse receive in all?")
        for _ in range(solutions):
            steps, labels, total = _solution(rng, terms, lambda k, t, total: (
                f"Step {k + 1}: The delivery number {k + 1} brought {t} boxes, so the running "
                f"total is now {total} boxes."))
            steps[-1] += f" The answer is: {total}"
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


def drawn_pad_row(base: Path) -> None:
    """Draw the stand-in's pad row like its other embedding rows. GPT-2's `<|endoftext|>` is its
    pad and the BOS both sides put first; transformers starts a pad row at zero, and a zero
    hidden state through a layer's RMSNorm (eps 1e-6) scales its gradient by 1e3: at 12 layers
    the gradient norm overflows float32 (2 layers pass). A trained model has no zero row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    rows = model.get_input_embeddings().weight
    with torch.no_grad():
        rows[model.config.pad_token_id] = torch.randn(
            rows.shape[1], generator=torch.Generator().manual_seed(0)) * rows.std()
    model.save_pretrained(base)


def run_arm(arm, base, data, steps, batch, precision, threads, warmup, rows,
            profile=False) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "BENCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
               "BENCH_PROFILE": str(int(profile))}
        if arm.startswith("trl"):
            env["PYTHONPATH"] = f"{TRL_PATH}:{env.get('PYTHONPATH', '')}"
        subprocess.run([sys.executable, "-c", CHILD, str(ROOT), arm, str(base), str(data),
                        str(steps), str(batch), precision, out, str(warmup), str(rows)], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(Path(out, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=0,
                        help="the MLP's width (default twice --hidden)")
    parser.add_argument("--rows", choices=("short", "shepherd"), default="short",
                        help="short: 3-10 short steps, ~265 tokens; shepherd: Math-Shepherd's "
                             "lengths, a longer question and 4-12 steps, ~290 tokens")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    parser.add_argument("--profile", action="store_true",
                        help="profile each arm's last step (torch's profiler): ms by kind of op")
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
    base = build_stand_in(work / "base", "qwen2", hidden=args.hidden, heads=args.heads,
                          layers=args.layers, intermediate=args.intermediate or None)
    drawn_pad_row(base)
    rows = (shepherd_rows if args.rows == "shepherd" else stepwise_rows)(args.questions,
                                                                          args.solutions)
    data = work / "stepwise.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = mean_tokens(rows, base)
    runs: dict = {}
    for repeat in range(args.repeats):
        for precision in args.precisions.split(","):
            for arm in arms:
                result = run_arm(arm, base, data, args.steps, args.batch, precision, args.threads,
                                 args.warmup, len(rows), args.profile)
                result["tokens_per_s"] = result["real_tokens_per_s"]
                runs.setdefault((precision, arm), []).append(result)
                print(json.dumps({"repeat": repeat, "precision": precision, "arm": arm,
                                  **result}), flush=True)
    speed_table(runs, arms, args, tokens)
    memory_table(runs, arms, args.precisions.split(","))
    if args.profile:
        profile_table(runs, arms, args.precisions.split(","))

def speed_table(runs: dict, arms: list[str], args, tokens: float) -> None:
    print(f"\n{args.hidden}-wide {args.layers}-layer Qwen2, {args.questions} questions x "
          f"{args.solutions} solutions, {tokens:.0f} tokens a row ({tokens * args.batch:,.0f} a "
          f"step), {args.batch} rows a step, {args.threads} threads; ratios against trl-grouped "
          "in the same repeat, [range]; computed: the tokens a step runs through the layers")
    print("| precision | arm | tokens/s | / trl-grouped | computed a step | peak RSS "
          "| RSS / trl-grouped |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for precision in args.precisions.split(","):
        reference = runs.get((precision, "trl-grouped"))
        for arm in arms:
            mine = runs[(precision, arm)]
            line = (f"| {precision} | {arm} | "
                    f"{statistics.median(r['tokens_per_s'] for r in mine):,.0f} | ")
            computed = statistics.median(m["computed_per_step"] for m in mine)
            memory = statistics.median(m["peak_rss"] for m in mine) / 2**20
            if reference:
                speed = [m["tokens_per_s"] / t["tokens_per_s"] for m, t in zip(mine, reference)]
                rss = [m["peak_rss"] / t["peak_rss"] for m, t in zip(mine, reference)]
                line += (f"{statistics.median(speed):.2f}x [{min(speed):.2f}-{max(speed):.2f}] | "
                         f"{computed:,.0f} | {memory:,.0f} MB | {statistics.median(rss):.2f}x |")
            else:
                line += f"- | {computed:,.0f} | {memory:,.0f} MB | - |"
            print(line)


def memory_table(runs: dict, arms: list[str], precisions: list[str]) -> None:
    print("\nLive tensors just before the last optimizer step (weights, gradients, optimizer "
          "state; the activations are freed by then), MB by dtype; the peak RSS then and at "
          "the end:")
    print("| precision | arm | float32 | bfloat16 | other | in all | peak RSS at the first "
          "forward | before the last step | at the end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for precision in precisions:
        for arm in arms:
            last = runs[(precision, arm)][-1]
            before = last["live"].get("hwm_before_step", 0) / 2**20
            start = last["live"].get("hwm_start", 0) / 2**20
            live = {k: v / 2**20 for k, v in last["live"].items() if not k.startswith("hwm")}
            other = sum(v for k, v in live.items() if k not in ("float32", "bfloat16"))
            print(f"| {precision} | {arm} | {live.get('float32', 0):,.0f} | "
                  f"{live.get('bfloat16', 0):,.0f} | {other:,.0f} | {sum(live.values()):,.0f} | "
                  f"{start:,.0f} | {before:,.0f} | {last['peak_rss'] / 2**20:,.0f} |")


def profile_table(runs: dict, arms: list[str], precisions: list[str]) -> None:
    print("\nThe last step under torch's profiler, self CPU ms by kind of op (the profiler "
          "slows the step):")
    kinds = [k for k, _ in KINDS] + ["other"]
    print(f"| precision | arm | {' | '.join(kinds)} | in all |")
    print("| --- | --- |" + " --- |" * (len(kinds) + 1))
    for precision in precisions:
        for arm in arms:
            spent = runs[(precision, arm)][-1]["profile"]
            print(f"| {precision} | {arm} | "
                  + " | ".join(f"{spent.get(k, 0):,.0f}" for k in kinds)
                  + f" | {sum(spent.values()):,.0f} |")


if __name__ == "__main__":
    main()
