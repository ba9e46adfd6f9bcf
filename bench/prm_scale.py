"""PRM training on a Math-Shepherd-sized file: time to the first optimizer step, peak memory and
steps/s, this checkout against another revision side by side.

    python bench/prm_scale.py [--rows 445000] [--steps 20] [--before REV]

Writes (once, then reused) a Math-Shepherd-layout JSONL of `--rows` rows (a question and 4-12
steps of arithmetic, a `ки` tag after each, about 290 GPT-2 tokens a row; 445K rows is the size
of Math-Shepherd) and trains a PRM on it with `igrpo train-rm` from a random 2-layer, 64-wide
Llama over the shipped GPT-2 BPE (the tag added as a token), 32 rows a step, one process of 2
threads, stopping after `--steps` optimizer steps. Reported per side: seconds from the start of
the command to the end of its first optimizer step (reading, checking and splitting the file
included), peak RSS (VmHWM) and, at the first step, its anonymous and file-backed parts (the
file's memory-mapped table is file-backed: the ranks of a run share those pages), and the
median step time. `--before REV` runs the same in a git worktree of REV.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, sys, time
started = time.perf_counter()
repo, base, data, steps, out = sys.argv[1:6]
sys.path.insert(0, repo)
os.chdir(repo)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["WANDB_MODE"] = "disabled"
import igrpo
from runtime import training

class Enough(BaseException):
    pass

def memory():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

marks = []
advance = training.StageLoop.advance
def timed(self):
    advance(self)
    marks.append(time.perf_counter())
    if len(marks) == 1:
        marks_memory.update(memory())
    if len(marks) >= int(steps):
        raise Enough
training.StageLoop.advance = timed
marks_memory = {}
try:
    igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={out}", "run.name=s",
                f"rm.init_path={base}", f"rm.data_path={data}", "rm.add_tag_token=true",
                "rm.lm_weight=0", "rm.likelihood_feature=false", "rm.batch_size=32",
                "deepspeed.micro_batch_size=32", "rm.eval_every=0", "rm.save_every=100000",
                "rm.max_length=512", "rm.epochs=1", "run.threads=2", "run.wandb_mode=disabled"])
except Enough:
    pass
gaps = [b - a for a, b in zip(marks, marks[1:])]
Path = __import__("pathlib").Path
Path(out, "result.json").write_text(json.dumps({
    "first_step_s": marks[0] - started, "step_s": statistics.median(gaps),
    "peak_rss": memory()["VmHWM"], "anon_at_first_step": marks_memory["RssAnon"],
    "file_at_first_step": marks_memory["RssFile"]}))
"""


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    """Math-Shepherd rows: `input` with a tag after each step, `label` with + or - there."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            terms = [rng.randrange(10, 9999) for _ in range(rng.randrange(4, 13))]
            question = (f"Problem {i}: a warehouse receives {len(terms)} deliveries of boxes in "
                        f"one week, of {', '.join(map(str, terms))} boxes each. The manager wants "
                        "to know how many boxes arrived in all. How many boxes arrived?")
            total, wrong, steps, marks = 0, False, [], []
            for k, t in enumerate(terms):
                slip = not wrong and rng.random() < 0.05
                total += t + (1 if slip else 0)
                wrong = wrong or slip
                steps.append(f"Step {k + 1}: The delivery number {k + 1} brought {t} boxes, so "
                             f"after it the warehouse holds {total} boxes in all.")
                marks.append("-" if wrong else "+")
            body = "\n".join(f"{s} ки" for s in steps)
            label = "\n".join(f"{s} {m}" for s, m in zip(steps, marks))
            f.write(json.dumps({"input": f"{question} {body}",
                                "label": f"{question} {label}"}) + "\n")


def run_side(repo: Path, base: Path, data: Path, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_DATASETS_OFFLINE": "1"}
        subprocess.run([sys.executable, "-c", CHILD, str(repo), str(base), str(data),
                        str(steps), out], cwd=repo, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(out, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=445_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--before", default="")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "prm-scale"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from runtime.tiny_model import build_stand_in

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"math_shepherd_{args.rows}.jsonl"
    if not data.exists():
        write_rows(data.with_suffix(".part"), args.rows)
        data.with_suffix(".part").rename(data)
    base = work / "base"
    if not (base / "config.json").exists():
        build_stand_in(base, "llama", hidden=64)
    sides = {"this checkout": ROOT}
    if args.before:
        tree = work / f"tree-{args.before}"
        if not tree.exists():
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.before],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        sides = {args.before: tree, **sides}
    from datasets import load_dataset

    load_dataset("json", data_files=str(data), split="train")  # both sides read a warm cache
    print(f"{args.rows:,} rows ({data.stat().st_size / 2**20:,.0f} MB), {args.steps} steps of 32")
    print("side             first step (s)  step (s)  peak RSS (MB)  anon / file at step 1 (MB)")
    for name, repo in sides.items():
        r = run_side(repo, base, data, args.steps)
        print(f"{name:<16} {r['first_step_s']:14.1f}  {r['step_s']:8.3f}  "
              f"{r['peak_rss'] / 2**20:13,.0f}  {r['anon_at_first_step'] / 2**20:,.0f} / "
              f"{r['file_at_first_step'] / 2**20:,.0f}", flush=True)


if __name__ == "__main__":
    main()
