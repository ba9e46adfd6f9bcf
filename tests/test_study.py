"""The replication study (scripts/replicate.py, scripts/study_results.py): kept results, statistics
over seeds by hand, and the study end to end on the small config."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.stats import bootstrap_interval

ROOT = Path(__file__).resolve().parents[1]
T95_2DF = 4.303  # Student's t, two-sided 95%, 2 degrees of freedom


def _script(name):
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


sr = _script("study_results")


def _eval(right, trace, greedy="110", majority="100", questions=("q0", "q1", "q2")):
    outcomes = {"questions": list(questions),
                "greedy_accuracy": [float(c) for c in greedy],
                "maj_accuracy": [float(c) for c in majority],
                "sample_right": [[c == "1" for c in q] for q in right.split(",")],
                "sample_trace": [[c == "1" for c in q] for q in trace.split(",")]}
    return sr.compact_outcomes(outcomes)


def _record(task, arm, seed, final, warm=None, proxy=(0.5,) * 6, gold=(0.5,) * 6):
    return {"task": task, "arm": arm, "seed": seed, "minutes": 10.0 + seed,
            "final": final, "warm": warm or final,
            "grpo": {"proxy": list(proxy), "gold": list(gold)}}


# Arm X, per seed (3 questions, k = 2); arm Y the same on every seed.
X = {0: ("11,10,00", "11,00,00"), 1: ("11,11,00", "11,00,00"), 2: ("11,10,10", "11,10,00")}
Y = ("10,10,00", "10,10,00")


def _runs():
    runs = {}
    for seed, (right, trace) in X.items():
        runs[("steps", "X", seed)] = _record("steps", "X", seed, _eval(right, trace))
        runs[("steps", "Y", seed)] = _record("steps", "Y", seed, _eval(*Y))
    return runs


def test_a_runs_metrics_by_hand():
    values = sr.per_question(_eval(*X[0]))
    # mean@2: (1 + 0.5 + 0) / 3; trace: (1 + 0 + 0) / 3; greedy 2 of 3; majority 1 of 3;
    # lucky: q1's right sample has a wrong step, of 3 right samples in all.
    assert sr.metric(values, "mean_at_k") == pytest.approx(0.5)
    assert sr.metric(values, "trace_accuracy") == pytest.approx(1 / 3)
    assert sr.metric(values, "greedy_accuracy") == pytest.approx(2 / 3)
    assert sr.metric(values, "maj_accuracy") == pytest.approx(1 / 3)
    assert sr.metric(values, "pass_at_k") == pytest.approx(2 / 3)
    assert sr.metric(values, "lucky_answer_rate") == pytest.approx(1 / 3)
    no_oracle = dict(_eval(*X[0]))
    no_oracle.pop("trace")
    assert sr.metric(sr.per_question(no_oracle), "lucky_answer_rate") is None


def test_comparison_paired_by_seed_with_a_t_interval_over_seeds_by_hand():
    runs = _runs()
    diff = sr.compare(runs, "steps", "X", "Y")
    # mean@2 per seed: X 1/2, 2/3, 2/3 against Y 1/3: differences 1/6, 1/3, 1/3.
    d = np.array([1 / 6, 1 / 3, 1 / 3])
    half = T95_2DF * d.std(ddof=1) / math.sqrt(3)
    m = diff["mean_at_k"]
    assert m["seeds"] == 3 and m["mean"] == pytest.approx(d.mean())
    assert (m["lo"], m["hi"]) == pytest.approx((d.mean() - half, d.mean() + half), abs=1e-3)
    assert m["resolved"] and m["lo"] > 0
    # The question-level interval: a paired bootstrap over all 9 (seed, question) differences.
    per_q = np.concatenate([sr.per_question(runs[("steps", "X", s)]["final"])["mean_at_k"]
                            - sr.per_question(runs[("steps", "Y", s)]["final"])["mean_at_k"]
                            for s in range(3)])
    assert (m["q_lo"], m["q_hi"]) == pytest.approx(bootstrap_interval(per_q))
    # Trace accuracy: X 1/3, 1/3, 1/2 against Y 1/3: differences 0, 0, 1/6 -> not resolved.
    t = diff["trace_accuracy"]
    assert t["mean"] == pytest.approx(1 / 18) and not t["resolved"] and t["lo"] < 0
    # Lucky answers: X 1/3, 2/4, 1/4 against Y's 0 of 2.
    assert diff["lucky_answer_rate"]["mean"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 4) / 3)
    # Only the seeds both arms ran are paired; one seed has no interval and is never resolved.
    del runs[("steps", "Y", 1)], runs[("steps", "Y", 2)]
    one = sr.compare(runs, "steps", "X", "Y")["mean_at_k"]
    assert one["seeds"] == 1 and math.isnan(one["lo"]) and not one["resolved"]
    assert sr.compare(runs, "steps", "X", "nobody") == {}


def test_a_comparison_refuses_runs_evaluated_on_other_questions():
    runs = _runs()
    runs[("steps", "Y", 2)]["final"] = _eval(*Y, questions=("q0", "q1", "other"))
    with pytest.raises(ValueError, match="steps seed 2: X and Y were evaluated on different"):
        sr.compare(runs, "steps", "X", "Y")


def test_report_bolds_what_is_resolved_and_lists_every_arm(monkeypatch):
    replicate = _script("replicate")
    runs = {}
    for seed, (right, trace) in X.items():
        runs[("steps", "B", seed)] = _record("steps", "B", seed, _eval(right, trace),
                                             proxy=(0.2,) * 5 + (0.9,) * 5,
                                             gold=(0.4,) * 5 + (0.3,) * 5)
        runs[("steps", "A", seed)] = _record("steps", "A", seed, _eval(*Y))
    text = replicate.report(runs, "python scripts/replicate.py", ["steps"])
    arms_table = text.split("## Every arm after RL")[1].split("## Every training run")[0]
    rows = {line.split(" | ")[1]: line for line in arms_table.splitlines()
            if line.startswith("| steps | ")}
    assert set(rows) >= {"warm start", "A", "B"}
    # B's mean@2 over seeds: (1/2 + 2/3 + 2/3) / 3 = 0.611; minutes: mean of 10, 11, 12.
    assert rows["B"].split(" | ")[5].startswith("0.611 [") and rows["B"].endswith("| 11.0 |")
    question = next(line for line in text.splitlines() if "| B - A |" in line)
    assert "**+0.278 [" in question and "q [" in question  # resolved: bold
    assert "| steps | B | 3 | 0.200 -> 0.900 | 0.400 -> 0.300 |" in text
    assert "- Command: `python scripts/replicate.py` (the last invocation" in text
    # Each training run, seed by seed: B's mean@2 on seeds 0-2 with its gold's first and last 5.
    assert "| task | arm | seed 0 | seed 1 | seed 2 |" in text
    assert ("| steps | B | 0.500 (0.40 -> 0.30) | 0.667 (0.40 -> 0.30) | 0.667 (0.40 -> 0.30) |"
            in text)


def test_study_plans_each_arm_at_its_seeds_and_skips_kept_results(tmp_path):
    replicate = _script("replicate")
    results = tmp_path / "results"
    work = replicate.study_jobs(tmp_path / "runs", ["steps", "tiny"], ["A", "E", "D+"], None,
                                results)
    planned = sorted((j.root.name, j.arm, j.seed) for j in work)
    # A: 5 seeds on both tasks; E and D+: 3 seeds on the steps task only.
    assert planned.count(("steps", "A", 4)) == 1 and ("tiny", "A", 4) in planned
    assert len(planned) == 5 + 5 + 3 + 3 and not any(t == "tiny" and a != "A"
                                                     for t, a, _ in planned)
    assert all(j.strong == (j.arm == "D+") for j in work)
    sr.write_run(results / "steps" / "seed0-A.json", _record("steps", "A", 0, _eval(*Y)))
    again = replicate.study_jobs(tmp_path / "runs", ["steps"], ["A"], [0, 1], results)
    assert [(j.arm, j.seed) for j in again] == [("A", 1)]
    assert sr.read_runs(results)[("steps", "A", 0)]["arm"] == "A"


def test_study_rejects_a_bad_override_before_any_run(tmp_path, capsys):
    replicate = _script("replicate")
    with pytest.raises(SystemExit):
        replicate.main(["--root", str(tmp_path), "--results", str(tmp_path / "r"),
                        "--doc", str(tmp_path / "d.md"), "policy.stepz=3"])
    assert "policy.stepz" in capsys.readouterr().err and not (tmp_path / "steps").exists()


@pytest.mark.slow
def test_study_end_to_end_shares_the_prefix_keeps_results_and_resumes(tmp_path):
    """Arms A (exact check), B (step labels), D (PRM, frozen), G (refreshed) and D+ (strong
    reward models) of one seed on the steps task, at the tests' small settings, two at a time."""
    from fault_injection import DIST_VARS
    from small_config import ITERATE, SMALL

    root, results, doc = tmp_path / "runs", tmp_path / "results", tmp_path / "replication.md"
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    args = [sys.executable, "scripts/replicate.py", "--root", str(root), "--results", str(results),
            "--doc", str(doc), "--tasks", "steps", "--seeds", "0", "--arms", "A,B,D,G,D+",
            "--jobs", "2", "--strong-questions", "4", "--strong-samples", "2", *SMALL, *ITERATE,
            "rm.likelihood_feature=true"]
    # Stopped (SIGTERM) while its first runs work: every worker ends, the invocation is logged.
    import psutil

    log = open(tmp_path / "stopped.log", "w")
    first = subprocess.Popen(args, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    manifest = root / "steps" / "seed0-prefix" / "manifest.json"
    while not (manifest.exists() and '"label/0"' in manifest.read_text()):
        assert first.poll() is None
        time.sleep(0.2)
    workers = psutil.Process(first.pid).children(recursive=True)
    first.terminate()
    assert first.wait(timeout=60) == 128 + 15, (tmp_path / "stopped.log").read_text()[-3000:]
    _, alive = psutil.wait_procs(workers, timeout=20)  # (the resource tracker ends last)
    assert not alive
    assert sr.read_invocations(results)[0]["runs"] == 0
    (results / "invocations.jsonl").unlink()
    subprocess.run(args, check=True, env=env, cwd=ROOT)  # resumes in the same folders
    runs = root / "steps"
    units = {arm: json.loads((runs / f"seed0-{arm}" / "manifest.json").read_text())["units"]
             for arm in ("A", "B", "D", "G", "D+")}
    prefix = json.loads((runs / "seed0-prefix" / "manifest.json").read_text())["units"]
    # Iteration 0 ran once, in the prefix; D+ reads the strong reward models instead.
    assert units["D"]["rm-prm/0"] == prefix["rm-prm/0"] == units["A"]["rm-prm/0"]
    strong = json.loads((runs / "strong" / "done.json").read_text())
    # (a path relative to the arm's folder: the study's root may move)
    assert (runs / "seed0-D+" / units["D+"]["rm-prm/0"]["outputs"]["path"]).resolve() == \
        Path(strong["prm"])
    assert kept_strong_is_in_the_results(results, strong)
    assert units["D+"]["eval/0"]["started"] > prefix["eval/0"]["finished"]
    strong_cfg = json.loads((Path(strong["prm"]) / "config.json").read_text())
    warm_cfg = json.loads((runs / "seed0-prefix" / prefix["sft"]["outputs"]["policy"]
                           / "config.json").read_text())
    assert strong_cfg["num_hidden_layers"] == 2 * warm_cfg["num_hidden_layers"]  # twice as deep
    # Frozen arms never refresh; Algorithm 1 refreshes before iteration 2.
    assert "rm-prm/1" not in units["D"] and units["G"]["rm-prm/1"]["state"] == "done"
    # Each finished run's results are kept, with the rewards GRPO logged at every step.
    kept = sr.read_runs(results)
    assert sorted(a for _, a, _ in kept) == ["A", "B", "D", "D+", "G"]
    record = kept[("steps", "B", 0)]
    assert len(record["grpo"]["proxy"]) == 4 and record["overrides"][1] == \
        "iterate.reward=step_oracle"
    assert record["final"]["questions_sha"] == kept[("steps", "A", 0)]["final"]["questions_sha"]
    assert "trace" in record["final"]  # the steps task has a step oracle
    # Its minutes are its own units', the shared prefix's counted apart.
    assert 0 < record["minutes"] and 0 < record["prefix_minutes"] == kept[("steps", "A", 0)][
        "prefix_minutes"]
    assert record["common_overrides"][0] == "policy.steps=20" and "run.threads=1" not in \
        record["common_overrides"]
    assert kept[("steps", "D+", 0)]["strong_sha256"] == strong["sha256"]
    text = doc.read_text()
    assert "| steps | B | " in text and "| B - A |" in text and "<!-- reading: kept by" in text
    invocation, = sr.read_invocations(results)
    assert invocation["runs"] == 5 and "--arms A,B,D,G,D+" in invocation["command"]
    assert "The whole study: 5 runs kept" in text
    assert f"PRM `{strong['sha256']['prm']}`; every strong run read them" in text
    # Another budget into the same results stops before any run, naming the kept file.
    other = subprocess.run([*args, "policy.steps=3"], env=env, cwd=ROOT, capture_output=True,
                           text=True)
    assert other.returncode == 2 and "seed0-A.json was made with the overrides" in other.stderr
    # A rerun finds every result kept and runs nothing; --report-only keeps the command line.
    rerun = subprocess.run(args, check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    assert "[study] 0 runs to do" in rerun.stdout
    subprocess.run([sys.executable, "scripts/replicate.py", "--results", str(results), "--doc",
                    str(doc), "--report-only"], check=True, env=env, cwd=ROOT)
    assert "--strong-questions 4" in doc.read_text().splitlines()[4]  # (the last invocation's)


def test_jobs_run_seed_by_seed_each_after_its_prefix_and_the_strong_models(tmp_path, monkeypatch):
    replicate = _script("replicate")
    calls = []
    monkeypatch.setattr(replicate, "prefix", lambda root, seed, o, config: calls.append(
        ("prefix", root.name, seed)))
    monkeypatch.setattr(replicate, "strong_reward_models", lambda config, root, o, q, s: (
        calls.append(("strong", root.name, q, s)) or {"prm": "P", "orm": "O"}))
    monkeypatch.setattr(replicate, "run_job", lambda job, o, rms: calls.append(
        ("run", job.root.name, job.arm, job.seed, rms)))
    work = replicate.study_jobs(tmp_path, ["steps", "tiny"], ["A", "D+"], [1, 0], tmp_path / "r")
    replicate.run_jobs(work, [], 1, (8, 2))
    assert calls == [
        ("prefix", "steps", 0), ("run", "steps", "A", 0, None), ("strong", "steps", 8, 2),
        ("run", "steps", "D+", 0, {"prm": "P", "orm": "O"}), ("prefix", "tiny", 0),
        ("run", "tiny", "A", 0, None),
        ("prefix", "steps", 1), ("run", "steps", "A", 1, None),
        ("run", "steps", "D+", 1, {"prm": "P", "orm": "O"}), ("prefix", "tiny", 1),
        ("run", "tiny", "A", 1, None)]


def kept_strong_is_in_the_results(results, strong):
    kept = json.loads((results / "steps" / "strong.json").read_text())
    return kept["sha256"] == strong["sha256"] and "prm" not in kept and kept["questions"] == 4


def test_a_failed_run_stops_the_study_with_its_error(tmp_path):
    """A run that fails in a worker process ends the study with the run's error (a worker dies
    silently on SystemExit, which would leave the study waiting for it forever)."""
    replicate = _script("replicate")
    work = [replicate.Job("configs/no_such.yaml", tmp_path, 0, "A", [])]
    with pytest.raises(RuntimeError, match="seed0-prefix: igrpo iterate exited"):
        replicate.run_jobs(work, [], 2)
