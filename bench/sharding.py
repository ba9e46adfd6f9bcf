"""Evaluation and labelling spread over ranks: the wall time of `igrpo eval` and `igrpo label` on the
shipped warm start with the same settings, as 1 process (1 and 2 threads) and as 2 processes of 1
thread under `torchrun` (gloo), and whether the 2-process results equal the 1-process ones.

    python bench/sharding.py [--eval-questions 300] [--k 4] [--label-questions 16] [--repeats 2]
        [--commands eval,label]

Each repeat runs every layout of both commands once, interleaved, in a fresh run folder; times
include start-up (about 5 s of imports a process). Ratios are medians over repeats of
time(1 process) / time(2 processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from runtime.dist import free_port  # noqa: E402

LAYOUTS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}


def command(layout: str, args: list[str]) -> list[str]:
    procs, threads = LAYOUTS[layout]
    tail = [*args, f"run.threads={threads}"]
    if procs == 1:
        return [sys.executable, "-m", "igrpo", *tail]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "igrpo", *tail]


def timed(cmd: list[str]) -> float:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return time.perf_counter() - started


def outputs(kind: str, run: Path) -> str:
    """What the command computed: the evaluation's metrics, or the labels."""
    if kind == "eval":
        return "".join(p.read_text() for p in sorted((run / "eval").glob("*.json")))
    return (run / "labels" / "math_shepherd.jsonl").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval-questions", type=int, default=300)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--label-questions", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--commands", default="eval,label", help="which of eval, label to time")
    ns = parser.parse_args()
    base = ["--config", "configs/tiny.yaml"]
    jobs = {
        "eval": ["eval", *base, "eval.checkpoint=runtime/bundled/tiny_warm_start",
                 f"data.eval_questions={ns.eval_questions}", f"eval.k={ns.k}",
                 "eval.batch_size=64"],
        "label": ["label", *base, f"label.questions={ns.label_questions}",
                  "label.shard_size=8"],
    }
    jobs = {kind: jobs[kind] for kind in ns.commands.split(",")}
    seconds: dict[tuple[str, str], list[float]] = {}
    same: dict[str, bool] = {}
    for repeat in range(ns.repeats):
        for kind, args in jobs.items():
            made = {}
            for layout in LAYOUTS:
                folder = Path(tempfile.mkdtemp(prefix=f"shard-{kind}-{layout}-"))
                took = timed(command(layout, [*args, f"run.root={folder}"]))
                seconds.setdefault((kind, layout), []).append(took)
                made[layout] = outputs(kind, folder / "tiny")
                shutil.rmtree(folder)
                print(f"repeat {repeat + 1}: {kind} {layout}: {took:.1f} s", flush=True)
            same[kind] = same.get(kind, True) and len(set(made.values())) == 1
    print("\n| command | 1 process, 1 thread | 1 process, 2 threads | 2 processes x 1 thread "
          "| 1x1 / 2x1 | 1x2 / 2x1 | same result |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in jobs:
        t = {layout: seconds[(kind, layout)] for layout in LAYOUTS}
        ratio = {layout: statistics.median(a / b for a, b in zip(t[layout], t["2x1"]))
                 for layout in ("1x1", "1x2")}
        print(f"| igrpo {kind} | " + " | ".join(f"{statistics.median(t[x]):.1f} s"
                                                  for x in LAYOUTS)
              + f" | {ratio['1x1']:.2f}x | {ratio['1x2']:.2f}x | {same[kind]} |")
    print(json.dumps({f"{k}/{layout}": v for (k, layout), v in seconds.items()}))


if __name__ == "__main__":
    main()
