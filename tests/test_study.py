"""Studies (`igrpo study`, iteration/study.py, iteration/study_results.py): kept results,
statistics over seeds by hand, specs refused before any run, the SLURM job as rendered, and a
study end to end on submitit's local executor."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from iteration import study, study_report
from iteration import study_results as sr
from runtime.stats import bootstrap_interval

ROOT = Path(__file__).resolve().parents[1]
T95_2DF = 4.303  # Student's t, two-sided 95%, 2 degrees of freedom


SHIPPED = ROOT / "configs" / "studies" / "deepseekmath.yaml"


def _spec(tmp_path, name="study.yaml", shipped=SHIPPED, **changes):
    """The shipped spec (`shipped`) with `changes` (dotted keys) made, written to
    tmp_path/name."""
    spec = OmegaConf.load(shipped)
    for key, value in changes.items():
        OmegaConf.update(spec, key, value, merge=False)
    path = tmp_path / name
    OmegaConf.save(spec, path)
    return path


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



def test_report_bolds_what_is_resolved_and_lists_every_arm():
    runs = {}
    for seed, (right, trace) in X.items():
        runs[("steps", "B", seed)] = _record("steps", "B", seed, _eval(right, trace),
                                             proxy=(0.2,) * 5 + (0.9,) * 5,
                                             gold=(0.4,) * 5 + (0.3,) * 5)
        runs[("steps", "A", seed)] = _record("steps", "A", seed, _eval(*Y))
    for record in runs.values():
        record["question_stream"] = study.QUESTION_STREAM
    text = study_report.report(study.load_study(SHIPPED), runs, "igrpo study run", [])
    arms_table = text.split("## Every arm after RL")[1].split("## Every training run")[0]
    rows = {line.split(" | ")[1]: line for line in arms_table.splitlines()
            if line.startswith("| steps | ")}
    assert set(rows) >= {"warm start", "A", "B"}
    # B's mean@2 over seeds: (1/2 + 2/3 + 2/3) / 3 = 0.611; minutes: mean of 10, 11, 12.
    assert rows["B"].split(" | ")[5].startswith("0.611 [") and rows["B"].endswith("| 11.0 |")
    question = next(line for line in text.splitlines() if "| B - A |" in line)
    assert "**+0.278 [" in question and "q [" in question  # resolved: bold
    assert "| steps | B | 3 | 0.200 -> 0.900 | 0.400 -> 0.300 |" in text
    assert "- Command: `igrpo study run` (the last invocation" in text
    # Each training run, seed by seed: B's mean@2 on seeds 0-2 with its gold's first and last 5.
    assert "| task | arm | seed 0 | seed 1 | seed 2 |" in text
    assert ("| steps | B | 0.500 (0.40 -> 0.30) | 0.667 (0.40 -> 0.30) | 0.667 (0.40 -> 0.30) |"
            in text)
    assert "redrew their questions" not in text


def test_runs_of_the_older_question_stream_are_kept_apart(tmp_path):
    """Results kept without `question_stream` redrew their questions each iteration: the report
    gives them tables of their own, marked, and never pairs them with current runs; a study
    asked to add current runs beside them stops before any run."""
    runs = {("steps", "A", 0): _record("steps", "A", 0, _eval(*Y)),
            ("steps", "B", 0): {**_record("steps", "B", 0, _eval(*X[0])),
                                "question_stream": study.QUESTION_STREAM}}
    text = study_report.report(study.load_study(SHIPPED), runs, "igrpo study run", [])
    current, older = text.split("**These runs redrew their questions**")
    assert "| steps | B | " in current and "| steps | A | " not in current
    assert "| steps | A | " in older and "| steps | B | " not in older
    assert "| B - A |" not in text  # no seed has both arms on one stream
    results = tmp_path / "results"
    sr.write_run(results / "steps" / "seed0-A.json",
                 {**runs[("steps", "A", 0)], "common_overrides": ["policy.steps=20"]})
    with pytest.raises(study.StudyError, match="seed0-A.json was made on the older question"):
        study.study_jobs(study.load_study(SHIPPED), tmp_path, ["steps"], ["A"], [0], results,
                         ["policy.steps=20"])


@pytest.mark.parametrize("name, results", [("replication", None),
                                           ("reward_holding", "docs/reward_holding")])
def test_the_shipped_study_regenerates_its_document_from_the_kept_results(tmp_path, name,
                                                                          results):
    """docs/replication.md is the report of docs/replication/ and the hand-written reading;
    docs/reward_holding.md that of the runs on the current question stream kept in
    docs/reward_holding/."""
    doc = tmp_path / f"{name}.md"
    doc.write_text((ROOT / "docs" / f"{name}.md").read_text())
    assert study.main(["report", "--study", str(SHIPPED), "--doc", str(doc),
                       *(["--results", str(ROOT / results)] if results else [])]) == 0
    assert doc.read_text() == (ROOT / "docs" / f"{name}.md").read_text()


def test_study_plans_each_arm_at_its_seeds_and_skips_kept_results(tmp_path):
    results = tmp_path / "results"
    shipped = study.load_study(SHIPPED)
    work = study.study_jobs(shipped, tmp_path / "runs", ["steps", "tiny"], ["A", "E", "D+"],
                            None, results)
    planned = sorted((j.root.name, j.arm, j.seed) for j in work)
    # A: 5 seeds on both tasks; E and D+: 3 seeds on the steps task only.
    assert planned.count(("steps", "A", 4)) == 1 and ("tiny", "A", 4) in planned
    assert len(planned) == 5 + 5 + 3 + 3 and not any(t == "tiny" and a != "A"
                                                     for t, a, _ in planned)
    assert all(j.strong == (j.arm == "D+") for j in work)
    sr.write_run(results / "steps" / "seed0-A.json", _record("steps", "A", 0, _eval(*Y)))
    again = study.study_jobs(shipped, tmp_path / "runs", ["steps"], ["A"], [0, 1], results)
    assert [(j.arm, j.seed) for j in again] == [("A", 1)]
    assert sr.read_runs(results)[("steps", "A", 0)]["arm"] == "A"


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "studies").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_study_loads(path):
    """Every shipped spec's keys, comparisons and every arm's overrides on each of its tasks."""
    loaded = study.load_study(path)
    assert loaded.arms and all(loaded.arm_tasks(a) for a in loaded.arms)


@pytest.mark.parametrize("change, message", [
    ({"arms.A.rewrd": "x"}, r"Key 'rewrd' not in 'ArmSpec'.*key arms\.A\.rewrd"),
    ({"arms.A.seeds": "five"}, r"arms\.A\.seeds"),
    ({"comparisons.Controls": ["steps H - Z"]},
     r"comparisons\.'Controls': 'steps H - Z' names arm 'Z'"),
    ({"comparisons.Controls": ["steps H minus A"]}, r"is not 'TASK ARM - AGAINST'"),
    ({"arms.A.overrides": ["policy.stepz=3"]}, r"arms\.A\.overrides on task steps .*policy\.stepz"),
    ({"arms.A.tasks": ["steps", "gsm8k"]}, r"arms\.A\.tasks: unknown task 'gsm8k'"),
    ({"arms.A.overrides": ["label.questions=3"]}, r"arms\.A\.overrides: label\.questions would "
                                                  r"change the prefix"),
    ({"command": "train"}, r"command: 'train' is not one of iterate, grpo"),
    ({"arms.A.recipe": "dapoo"}, r"arms\.A\.recipe: no recipe 'dapoo'; the recipes are c3po"),
    ({"command": "grpo"}, r"arms\.C\+\.strong: strong reward models are read by `iterate`"),
])
def test_a_bad_spec_is_refused_naming_the_file_and_the_key(tmp_path, change, message):
    path = _spec(tmp_path, **change)
    with pytest.raises(study.StudyError, match=message) as err:
        study.load_study(path)
    assert str(path) in str(err.value)


def test_the_command_refuses_a_bad_spec_or_override_before_any_run(tmp_path, capsys):
    import igrpo

    bad = _spec(tmp_path, **{"comparisons.Controls": ["steps H - Z"]})
    for argv in (["study", "run", "--study", str(bad), "--root", str(tmp_path / "runs")],
                 ["study", "run", "--study", str(SHIPPED), "--root", str(tmp_path / "runs"),
                  "--results", str(tmp_path / "r"), "policy.stepz=3"]):
        with pytest.raises(SystemExit) as exit_:
            igrpo.main(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{bad}: comparisons" in err and "policy.stepz" in err
    assert not (tmp_path / "runs").exists()


FAKE_SLURM = {
    # sbatch keeps the script it was given and answers as SLURM does
    "sbatch": 'cp "$1" "$FAKE_SLURM/job.sh"; echo "$@" > "$FAKE_SLURM/sbatch.args"\n'
              'echo "Submitted batch job 4242"\n',
    # the job failed: the study must stop with its error rather than wait
    "sacct": 'echo "JobID|State|NodeList"; echo "4242|FAILED|node7"\n',
    "scancel": 'echo "$@" >> "$FAKE_SLURM/scancel.args"\n',
    "squeue": 'echo "JOBID"\n',
    "srun": 'exit 1\n',  # (submitit looks for it; the fake cluster never runs the job)
}


def test_the_slurm_executor_renders_each_run_as_a_torchrun_job(tmp_path, monkeypatch):
    """`--executor slurm` on a fake SLURM: the first run (seed 0's prefix) is submitted through
    submitit as a job of the spec's resources whose function is `torchrun --nproc_per_node 2 -m
    igrpo iterate ...` from the project's folder; the job's failure stops the study with its
    message."""
    import submitit

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_ / name).write_text("#!/bin/sh\n" + body)
        (bin_ / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM", str(bin_))
    spec = _spec(tmp_path, **{"resources.processes": 2, "resources.partition": "gpu",
                              "resources.cpus_per_task": 16, "resources.mem_gb": 200,
                              "resources.timeout_min": 90,
                              "resources.setup": ["export HF_HUB_OFFLINE=1"]})
    root = tmp_path / "runs"
    # a job an earlier study left running when it was killed: cancelled before anything else
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "running.json").write_text('[{"job_id": "777", "slurm": true}]')
    with pytest.raises(RuntimeError, match="tiny seed 0: the prefix .*failed") as err:
        study.main(["run", "--study", str(spec), "--executor", "slurm", "--tasks", "tiny",
                    "--arms", "A", "--seeds", "0", "--root", str(root), "--results",
                    str(tmp_path / "results"), "--doc", str(tmp_path / "d.md")])
    assert "4242" in str(err.value)
    assert (bin_ / "scancel.args").read_text().split()[-1] == "777"
    assert json.loads((root / "jobs" / "running.json").read_text()) == []
    script = (bin_ / "job.sh").read_text()
    for line in ("#SBATCH --gpus-per-node=2", "#SBATCH --cpus-per-task=16",
                 "#SBATCH --mem=200GB", "#SBATCH --partition=gpu", "#SBATCH --time=90",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --job-name=tiny-seed0-prefix",
                 "export HF_HUB_OFFLINE=1"):
        assert line in script, line
    job = submitit.SlurmJob(folder=root / "jobs", job_id="4242")
    function = job.submission().function
    assert function.cwd == str(ROOT)
    assert function.command[1:7] == ["-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", "-m", "igrpo"]
    assert function.command[7:] == [
        "iterate", "--config", "configs/tiny.yaml", f"run.root={(root / 'tiny').resolve()}",
        "run.name=seed0-prefix", "run.seed=0", "run.wandb_mode=disabled", "policy.steps=20",
        "iterate.iterations=0"]
    assert not (tmp_path / "results" / "tiny").exists()


def test_jobs_a_killed_study_left_running_are_cancelled_first(tmp_path):
    """A local job's controller left running by a study killed without cleaning up (its pid in
    running.json) is killed with the processes under it (its run), even with SIGINT ignored, as
    a process started in the background has it; a pid that is not a submitit controller (reused
    since) is left alone."""
    import psutil

    child = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"
    leftover = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                 f"subprocess.Popen([sys.executable, '-c', {child!r}]).wait()",
                                 "submitit-controller"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        deadline = time.time() + 30
        while not psutil.Process(leftover.pid).children() and time.time() < deadline:
            time.sleep(0.1)
        run, = psutil.Process(leftover.pid).children()
        (tmp_path / "running.json").write_text(json.dumps(
            [{"job_id": str(leftover.pid), "slurm": False},
             {"job_id": str(other.pid), "slurm": False}]))
        cancelled = study.Ledger(tmp_path).cancel_leftovers()
        assert cancelled == [str(leftover.pid), str(other.pid)]
        leftover.wait(timeout=10)  # (killed, and reaped already by the kill's wait)
        assert other.poll() is None
        assert not run.is_running() or run.status() == psutil.STATUS_ZOMBIE
        assert not (tmp_path / "running.json").exists()
    finally:
        leftover.kill()
        other.kill()


def test_a_second_study_run_on_a_root_in_use_is_refused_before_it_cancels_anything(tmp_path):
    """Two `igrpo study run` invocations on one root: the second would take the first's
    running jobs for a stopped study's leftovers and cancel them. It is refused, naming the live
    invocation's pid, while that one runs; once it is gone the root is claimed afresh."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                              "igrpo", "study", "run"])
    try:
        (tmp_path / "owner.pid").write_text(str(owner.pid))
        with pytest.raises(study.StudyError, match=f"another `igrpo study run` \\(pid {owner.pid}"):
            study.Ledger(tmp_path).claim()
    finally:
        owner.kill()
        owner.wait()
    study.Ledger(tmp_path).claim()
    assert (tmp_path / "owner.pid").read_text() == str(os.getpid())


def test_a_stopped_study_ends_its_local_jobs_even_with_sigint_ignored(tmp_path):
    """A study started in the background (SIGINT ignored, and so in every job it starts) that
    stops ends its local jobs: each job's controller, its task and the command's process, killed
    as a preemption (submitit's LocalJob.cancel sends only SIGINT)."""
    import signal

    import psutil

    executor = study.make_executor("local", tmp_path / "jobs", study.Resources(timeout_min=5))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        job = executor.submit(study.command_function(
            [sys.executable, "-c", "import time; time.sleep(120)"]))
    finally:
        signal.signal(signal.SIGINT, previous)
    controller = psutil.Process(int(job.job_id))
    deadline = time.time() + 60
    while len(controller.children(recursive=True)) < 2 and time.time() < deadline:
        time.sleep(0.2)  # the task, then the command it runs
    tree = [controller, *controller.children(recursive=True)]
    assert len(tree) >= 3
    job.cancel(check=False)  # what submitit offers: SIGINT, ignored here
    time.sleep(2)
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree)
    study.cancel_job(job)
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_jobs_run_seed_by_seed_each_after_its_prefix_and_the_strong_models(tmp_path, monkeypatch):
    """The scheduler's order with one slot: what it submits, in order, to an executor that runs
    nothing (each job done at once)."""
    calls = []

    class Done:
        def __init__(self, value):
            self.value = value

        def done(self):
            return True

        def result(self):
            return self.value

    class Recorder:
        name = None

        def submit(self, fn, *args):
            calls.append(self.name)
            return Done({"prm": "P", "orm": "O"} if fn is study.strong_reward_models else None)

    monkeypatch.setattr(study, "start_arm", lambda prefix, run, args, rms: calls.append(
        f"fork {run.name} {rms}"))
    monkeypatch.setattr(study, "keep_result", lambda job, seconds, overrides, rms: None)
    shipped = study.load_study(_spec(tmp_path, **{"strong.questions": 8, "strong.samples": 2}))
    work = study.study_jobs(shipped, tmp_path, ["steps", "tiny"], ["A", "D+"], [1, 0],
                            tmp_path / "r")
    study.run_jobs(shipped, work, [], 1, Recorder())
    strong = "{'orm': 'O', 'prm': 'P'}"
    assert calls == [
        "steps-seed0-prefix", "fork seed0-A None", "steps-seed0-A", "steps-strong",
        f"fork seed0-D+ {strong}", "steps-seed0-D+", "tiny-seed0-prefix", "fork seed0-A None",
        "tiny-seed0-A", "steps-seed1-prefix", "fork seed1-A None", "steps-seed1-A",
        f"fork seed1-D+ {strong}", "steps-seed1-D+", "tiny-seed1-prefix", "fork seed1-A None",
        "tiny-seed1-A"]


def kept_strong_is_in_the_results(results, strong):
    kept = json.loads((results / "steps" / "strong.json").read_text())
    return kept["sha256"] == strong["sha256"] and "prm" not in kept and kept["questions"] == 4


@pytest.mark.slow
def test_study_end_to_end_shares_the_prefix_keeps_results_and_resumes(tmp_path):
    """Arms A (exact check, frozen reward models), G (refreshed) and D+ (strong reward
    models) of one seed on the steps task, at the tests' small settings, two at a time on
    submitit's local executor. (B and D, also run here before, showed nothing A does not: the
    shared prefix, a frozen arm, the trace.)"""
    import psutil

    from fault_injection import DIST_VARS
    from small_config import ITERATE, SMALL

    root, results, doc = tmp_path / "runs", tmp_path / "results", tmp_path / "replication.md"
    spec = _spec(tmp_path, **{"strong.questions": 4, "strong.samples": 2})
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    args = [sys.executable, "-m", "igrpo", "study", "run", "--study", str(spec), "--root",
            str(root), "--results", str(results), "--doc", str(doc), "--tasks", "steps",
            "--seeds", "0", "--arms", "A,G,D+", "--jobs", "2", *SMALL, *ITERATE,
            "rm.likelihood_feature=true"]
    # Stopped (SIGTERM) while its first runs work: every job ends, the invocation is logged.
    # Started as in the background (SIGINT ignored, which its jobs inherit).
    import signal

    log = open(tmp_path / "stopped.log", "w")
    first = subprocess.Popen(args, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    manifest = root / "steps" / "seed0-prefix" / "manifest.json"
    while not (manifest.exists() and '"label/0"' in manifest.read_text()):
        assert first.poll() is None, (tmp_path / "stopped.log").read_text()[-3000:]
        time.sleep(0.2)
    workers = psutil.Process(first.pid).children(recursive=True)
    first.terminate()
    assert first.wait(timeout=60) == 128 + 15, (tmp_path / "stopped.log").read_text()[-3000:]
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
    assert sr.read_invocations(results)[0]["runs"] == 0
    (results / "invocations.jsonl").unlink()
    subprocess.run(args, check=True, env=env, cwd=ROOT)  # resumes in the same folders
    runs = root / "steps"
    units = {arm: json.loads((runs / f"seed0-{arm}" / "manifest.json").read_text())["units"]
             for arm in ("A", "G", "D+")}
    prefix = json.loads((runs / "seed0-prefix" / "manifest.json").read_text())["units"]
    # Iteration 0 ran once, in the prefix; D+ reads the strong reward models instead.
    assert units["G"]["rm-prm/0"] == prefix["rm-prm/0"] == units["A"]["rm-prm/0"]
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
    assert "rm-prm/1" not in units["A"] and units["G"]["rm-prm/1"]["state"] == "done"
    # Each finished run's results are kept, with the rewards GRPO logged at every step.
    kept = sr.read_runs(results)
    assert sorted(a for _, a, _ in kept) == ["A", "D+", "G"]
    record = kept[("steps", "A", 0)]
    assert len(record["grpo"]["proxy"]) == 4 and record["overrides"][1] == "iterate.reward=rule"
    assert record["final"]["questions_sha"] == kept[("steps", "G", 0)]["final"]["questions_sha"]
    assert "trace" in record["final"] and record["question_stream"] == "walk"
    # Its minutes are its own units', the shared prefix's counted apart.
    assert 0 < record["minutes"] and 0 < record["prefix_minutes"] == kept[("steps", "G", 0)][
        "prefix_minutes"]
    assert record["common_overrides"][0] == "policy.steps=20" and "run.threads=1" not in \
        record["common_overrides"]
    assert kept[("steps", "D+", 0)]["strong_sha256"] == strong["sha256"]
    text = doc.read_text()
    assert "| steps | G | " in text and "| A - G |" in text and "<!-- reading: kept by" in text
    invocation, = sr.read_invocations(results)
    assert invocation["runs"] == 3 and "--arms A,G,D+" in invocation["command"]
    assert "The whole study: 3 runs kept" in text
    assert f"PRM `{strong['sha256']['prm']}`; every strong run read them" in text
    # Another budget into the same results stops before any run, naming the kept file.
    other = subprocess.run([*args, "policy.steps=3"], env=env, cwd=ROOT, capture_output=True,
                           text=True)
    assert other.returncode == 2 and "seed0-A.json was made with the overrides" in other.stderr
    # A rerun finds every result kept and runs nothing; `report` keeps the command line.
    rerun = subprocess.run(args, check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    assert "[study] 0 runs to do" in rerun.stdout
    subprocess.run([sys.executable, "-m", "igrpo", "study", "report", "--study", str(spec),
                    "--results", str(results), "--doc", str(doc)], check=True, env=env, cwd=ROOT)
    assert "--arms A,G,D+" in doc.read_text().splitlines()[4]  # (the last invocation's)


@pytest.mark.slow
def test_a_failed_run_stops_the_study_with_its_error(tmp_path, monkeypatch):
    """A run that fails in its job ends the study with the run's own error; started from a
    process holding a torch.distributed group's launcher variables (its port taken), the
    1-process run does not inherit them."""
    import socket

    from small_config import ITERATE, SMALL

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(taken.getsockname()[1]))):
        monkeypatch.setenv(key, value)
    spec = _spec(tmp_path, **{"tasks.tiny": "configs/tiny.yaml"})
    with pytest.raises(RuntimeError, match=r"tiny seed 0: the prefix \(seed0-prefix\) failed"
                                           r"(.|\n)*/no/such/model"):
        study.main(["run", "--study", str(spec), "--tasks", "tiny", "--arms", "A", "--seeds",
                    "0", "--root", str(tmp_path / "runs"), "--results", str(tmp_path / "r"),
                    "--doc", str(tmp_path / "d.md"), *SMALL, *ITERATE,
                    "model.policy_path=/no/such/model"])
    taken.close()


@pytest.mark.slow
def test_a_grpo_study_evaluates_each_seeds_warm_start_once_and_each_run_after_its_stage(
        tmp_path):
    """configs/studies/ceiling.yaml (`command: grpo`) with an arm under a recipe of another
    algorithm (PPO), one seed of the tiny task at a small budget, on submitit's local executor:
    each run is `igrpo grpo` then `igrpo eval` of the policy in its algorithm's folder, the
    seed's warm start evaluated once in its prefix; the kept results are what `igrpo eval`
    measured, with the steps each stage took, the report pairs the arms, and a rerun runs
    nothing."""
    from fault_injection import DIST_VARS

    small = ["policy.steps=2", "policy.questions_per_step=2", "policy.group_size=4",
             "policy.max_new_tokens=12", "policy.eval_every=0", "data.eval_questions=16",
             "eval.k=2", "deepspeed.micro_batch_size=8"]
    spec = _spec(tmp_path, shipped=ROOT / "configs" / "studies" / "ceiling.yaml", **{
        "arms.ppo": {"reward": "exact check", "advantages": "GAE",
                     "overrides": ["policy.reward=rule", "policy.supervision=outcome"],
                     "recipe": "ppo", "seeds": 1, "tasks": ["tiny"]}})
    root, results, doc = tmp_path / "runs", tmp_path / "results", tmp_path / "ceiling.md"
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    args = [sys.executable, "-m", "igrpo", "study", "run", "--study", str(spec), "--root",
            str(root), "--results", str(results), "--doc", str(doc), "--tasks", "tiny",
            "--seeds", "0", "--jobs", "2", *small]
    subprocess.run(args, check=True, env=env, cwd=ROOT)
    runs = root / "tiny"
    kept = sr.read_runs(results)
    assert sorted(a for _, a, _ in kept) == ["exact", "ppo", "steps"]
    warm = json.loads((runs / "seed0-prefix" / "eval" / "bundled.json").read_text())
    for arm in ("exact", "steps", "ppo"):
        record = kept[("tiny", arm, 0)]
        folder = "ppo" if arm == "ppo" else "grpo"  # the stage's folder: policy.algorithm
        measured = json.loads((runs / f"seed0-{arm}" / "eval" / f"{folder}.json").read_text())
        assert measured["checkpoint"] == str(runs / f"seed0-{arm}" / folder / "final")
        values = sr.per_question(record["final"])
        for metric in ("mean_at_k", "greedy_accuracy", "trace_accuracy"):
            assert sr.metric(values, metric) == pytest.approx(measured[f"eval/{metric}"])
        assert sr.metric(sr.per_question(record["warm"]), "mean_at_k") == pytest.approx(
            warm["eval/mean_at_k"])
        assert len(record["grpo"]["gold"]) == 2 and record["minutes"] > 0
        assert record["steps"] == 2
    assert kept[("tiny", "ppo", 0)]["recipe"] == "ppo"
    config = (runs / "seed0-ppo" / "ppo" / "config.yaml").read_text()
    assert "algorithm: ppo" in config
    assert not (runs / "seed0-ppo" / "grpo").exists()
    text = doc.read_text()
    assert "| tiny | steps - exact | 1 |" in text and "then `igrpo eval`" in text
    assert "[2 steps]" in text  # what the budget allowed each stage
    rerun = subprocess.run(args, check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    assert "[study] 0 runs to do" in rerun.stdout



def test_an_arm_setting_only_grpo_time_rm_keys_keeps_its_prefixs_reward_models(tmp_path):
    """`start_arm`: an arm whose `rm.` overrides change how the first reward models are trained
    or read (`rm.likelihood_feature=false`) redoes them; one that sets only keys GRPO reads
    (`rm.online`, `rm.online_lr`, `rm.family=implicit`: the reward model then learns during
    GRPO) keeps the prefix's; another family does not; an ensemble's redoes them over the
    prefix's trained models, adding its members."""
    import json

    from iteration.study import start_arm

    prefix = tmp_path / "prefix"
    prefix.mkdir()
    units = {name: {"state": "done", "started": 0.0, "finished": 1.0, "outputs": {}}
             for name in ("sft", "label/0", "rm-orm/0", "rm-prm/0", "eval/0")}
    (prefix / "manifest.json").write_text(json.dumps({"seed": 0, "units": units}))
    (prefix / "rm-prm" / "iteration-0").mkdir(parents=True)
    start_arm(prefix, tmp_path / "online", ["policy.supervision=outcome", "rm.online=true",
                                           "rm.online_lr=1e-4", "rm.family=implicit",
                                           "rm.online_update=before"])
    start_arm(prefix, tmp_path / "other", ["rm.family=token_classification"])
    start_arm(prefix, tmp_path / "reread", ["rm.likelihood_feature=false"])
    start_arm(prefix, tmp_path / "members", ["rm.ensemble=3", "rm.ensemble_aggregate=worst"])
    kept = {name: set(json.loads((tmp_path / name / "manifest.json").read_text())["units"])
            for name in ("online", "reread", "other", "members")}
    assert kept["online"] == set(units)
    assert kept["reread"] == kept["other"] == kept["members"] == {"sft", "label/0"}
    # the ensemble's arm redoes the reward-model units over the prefix's models (trained: only
    # the members are new); the others start them afresh
    assert (tmp_path / "members" / "rm-prm" / "iteration-0").is_dir()
    assert not (tmp_path / "reread" / "rm-prm" / "iteration-0").exists()


def test_whether_a_reward_holds_is_judged_seed_by_seed_against_the_exact_check():
    """`study_report.holding` by hand: arm O ends level with A on every seed with A's late gold
    and a watch that never fails: it holds, having read every check. Arm D ends 1/3 below A on
    seed 1 (mean@2 0.5 against 5/6) with its gold 0.3 below over the last 10 steps, its seeds
    spread by a standard deviation of 0.192, and on seed 0 its in-group AUROC sat at 0.5: it
    fails on each count, named. The watch fails only after 5 steps of 5-step means under 0.6."""
    from iteration.study_report import holding, report, watch_fails
    from iteration.study_spec import load_study

    good, bad = _eval("11,11,10", "11,11,10"), _eval("11,10,00", "11,10,00")
    runs = {}
    for seed in (0, 1, 2):
        runs[("steps", "A", seed)] = _record("steps", "A", seed, good, gold=(0.5,) * 12)
        runs[("steps", "O", seed)] = _record("steps", "O", seed, good, gold=(0.5,) * 12)
        runs[("steps", "O", seed)]["grpo"].update(auroc=[0.9] * 12, gold_read=[1.0] * 12)
        runs[("steps", "D", seed)] = _record("steps", "D", seed, bad if seed == 1 else good,
                                             gold=(0.5,) * 2 + ((0.2,) if seed == 1 else (0.5,))
                                             * 10)
        runs[("steps", "D", seed)]["grpo"].update(
            auroc=[0.5 if seed == 0 else 0.8] * 12, gold_read=[0.0] * 12)
    online = holding(runs, "steps", "O")
    assert online["verdict"] == "holds" and online["spread"] == 0.0
    assert all(r == {"end": 0.0, "gold": 0.0, "watch": False, "read": 1.0}
               for r in online["seeds"].values())
    frozen = holding(runs, "steps", "D")
    assert frozen["seeds"][1]["end"] == pytest.approx(0.5 - 5 / 6)
    assert frozen["seeds"][1]["gold"] == pytest.approx(-0.3)
    assert frozen["spread"] == pytest.approx(0.19245, abs=1e-5)
    assert frozen["verdict"] == ("fails: seed 1 ends -0.333, spread 0.192, seed 1 gold -0.30, "
                                 "seed 0 watch")
    assert watch_fails([0.5] * 8 + [1.0] * 4) is False  # 4 windows under 0.6, then recovered
    assert watch_fails([0.5] * 9) is True and watch_fails([None, None]) is None
    text = report(load_study(SHIPPED), runs, "igrpo study report")
    assert ("| steps | O | +0.000 (+0.00) | +0.000 (+0.00) | +0.000 (+0.00) | 0.000 | 1.00 | "
            "holds |") in text
