"""The replication study's results: one small JSON file per finished run, kept in the repository
(docs/replication/), and the statistics over seeds that docs/replication.md reports.

A run's file holds what every comparison needs and nothing it does not: per held-out question,
the greedy and majority answers' rightness and each sample's rightness and trace (right answer,
every step right) as 0/1 strings; GRPO's proxy and gold reward per step; the arm's overrides, its
compute minutes and the commit. From those, each metric of a run is recomputed, and two arms of
the same task are compared paired by seed (a seed draws the held-out questions, so both arms of
a seed answer the same ones): the mean over seeds of the per-seed difference with a 95% t
interval over seeds, and beside it a question-level interval (a paired bootstrap over every
seed's questions together), which leaves out the spread between training runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from runtime.stats import (bootstrap_interval, paired_ratio_difference, ratio_interval,
                           t_interval_over_seeds)

METRICS = ("mean_at_k", "greedy_accuracy", "trace_accuracy", "lucky_answer_rate")
LABELS = {"mean_at_k": "mean@4", "greedy_accuracy": "greedy", "trace_accuracy": "trace acc",
          "lucky_answer_rate": "lucky answers", "maj_accuracy": "maj@4", "pass_at_k": "pass@4"}


def _bits(flags) -> str:
    return "".join("1" if f else "0" for f in flags)


def compact_outcomes(outcomes: dict) -> dict:
    """An evaluation's outcomes file (policy/evaluate.py) as 0/1 strings per question."""
    out = {"questions_sha": hashlib.sha256(json.dumps(outcomes["questions"]).encode())
           .hexdigest()[:16],
           "greedy": _bits(g >= 0.5 for g in outcomes["greedy_accuracy"]),
           "majority": _bits(m >= 0.5 for m in outcomes["maj_accuracy"]),
           "right": ",".join(_bits(r) for r in outcomes["sample_right"])}
    if "sample_trace" in outcomes:
        out["trace"] = ",".join(_bits(t) for t in outcomes["sample_trace"])
    return out


def per_question(compact: dict) -> dict[str, np.ndarray]:
    """Each metric's per-question values (policy/evaluate.py's, the lucky-answer rate as its
    numerator `lucky` and denominator `right_samples`, pooled over questions) from a compact
    evaluation."""
    from policy.evaluate import lucky_counts
    from policy.evaluate import per_question as values_of

    def flags(bits: str) -> list[bool]:
        return [c == "1" for c in bits]

    right = [flags(q) for q in compact["right"].split(",")]
    trace = [flags(q) for q in compact["trace"].split(",")] if "trace" in compact else None
    values = values_of(flags(compact["greedy"]), right, flags(compact["majority"]), trace)
    out = {name: np.asarray(v, dtype=float) for name, v in values.items()}
    out["right_samples"] = np.array([sum(r) for r in right], float)
    if trace is not None:
        out["lucky"] = np.asarray(lucky_counts(right, trace)[0], dtype=float)
    return out


def metric(values: dict[str, np.ndarray], name: str) -> float | None:
    """One run's value of `name` (None where its data has no step oracle)."""
    if name == "lucky_answer_rate":
        if "lucky" not in values or values["right_samples"].sum() == 0:
            return None
        return float(values["lucky"].sum() / values["right_samples"].sum())
    return float(values[name].mean()) if name in values else None


def write_run(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def read_runs(folder: Path) -> dict[tuple[str, str, int], dict]:
    """{(task, arm, seed): record} of every result file under `folder` (<task>/seed<S>-<arm>.json)."""
    runs = {}
    for path in sorted(folder.glob("*/seed*-*.json")):
        record = json.loads(path.read_text())
        runs[(record["task"], record["arm"], int(record["seed"]))] = record
    return runs


def arm_summary(runs: dict, task: str, arm: str) -> dict[str, dict]:
    """Per metric, the mean over an arm's seeds with its t interval over seeds."""
    seeds = sorted(s for (t, a, s) in runs if t == task and a == arm)
    out = {}
    for name in (*METRICS, "maj_accuracy", "pass_at_k"):
        values = [metric(per_question(runs[(task, arm, s)]["final"]), name) for s in seeds]
        if seeds and all(v is not None for v in values):
            out[name] = t_interval_over_seeds(values)
    return out


def warm_summary(runs: dict, task: str) -> dict[str, dict]:
    """The warm start's metrics over the seeds that have any run of `task` (one per seed)."""
    by_seed = {}
    for (t, _, s), record in runs.items():
        if t == task:
            by_seed.setdefault(s, record["warm"])
    out = {}
    for name in (*METRICS, "maj_accuracy", "pass_at_k"):
        values = [metric(per_question(by_seed[s]), name) for s in sorted(by_seed)]
        if values and all(v is not None for v in values):
            out[name] = t_interval_over_seeds(values)
    return out


def compare(runs: dict, task: str, arm: str, against: str) -> dict[str, dict]:
    """`arm` minus `against` on `task`, per metric, paired by the seeds both ran: {"seeds",
    "mean", "lo", "hi" (t over seeds), "q_lo", "q_hi" (paired bootstrap over all the seeds'
    questions), "resolved" (the t interval leaves out 0)}. {} with no seed in common."""
    seeds = sorted(s for (t, a, s) in runs if t == task and a == arm
                   and (task, against, s) in runs)
    if not seeds:
        return {}
    pairs = []
    for s in seeds:
        x, y = (runs[(task, name, s)]["final"] for name in (arm, against))
        if x["questions_sha"] != y["questions_sha"]:
            raise ValueError(f"{task} seed {s}: {arm} and {against} were evaluated on different "
                             "questions")
        pairs.append((per_question(x), per_question(y)))
    out = {}
    for name in METRICS:
        diffs = [metric(a, name) - metric(b, name) if None not in (metric(a, name), metric(b, name))
                 else None for a, b in pairs]
        if None in diffs:
            continue
        entry = t_interval_over_seeds(diffs)
        if name == "lucky_answer_rate":
            before = (np.concatenate([b["lucky"] for _, b in pairs]),
                      np.concatenate([b["right_samples"] for _, b in pairs]))
            after = (np.concatenate([a["lucky"] for a, _ in pairs]),
                     np.concatenate([a["right_samples"] for a, _ in pairs]))
            q = paired_ratio_difference(before, after)
            entry["q_lo"], entry["q_hi"] = q["lo"], q["hi"]
        else:
            entry["q_lo"], entry["q_hi"] = bootstrap_interval(
                np.concatenate([a[name] - b[name] for a, b in pairs]))
        entry["resolved"] = bool(entry["seeds"] > 1 and (entry["lo"] > 0 or entry["hi"] < 0))
        out[name] = entry
    return out


def question_interval(values: dict[str, np.ndarray], name: str) -> tuple[float, float] | None:
    """A run's 95% interval over its held-out questions (bootstrap), for one metric."""
    if name == "lucky_answer_rate":
        if "lucky" not in values or values["right_samples"].sum() == 0:
            return None
        return ratio_interval(values["lucky"], values["right_samples"])[1:]
    return bootstrap_interval(values[name]) if name in values else None


def log_invocation(folder: Path, command: str, seconds: float, runs: int) -> None:
    """Append one invocation of the study (its command, wall time, runs finished) to the log."""
    import time

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "invocations.jsonl", "a") as log:
        log.write(json.dumps({"command": command, "ended": time.strftime("%Y-%m-%d %H:%M"),
                              "wall_minutes": round(seconds / 60, 2), "runs": runs}) + "\n")


def read_invocations(folder: Path) -> list[dict]:
    path = folder / "invocations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []
