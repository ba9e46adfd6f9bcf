"""Studies: arms that differ in one thing, run over seeds from one spec file, compared paired by
seed, with a report that regenerates from the kept results alone.

    igrpo study run    --study configs/studies/deepseekmath.yaml --jobs 2
    igrpo study run    --study configs/studies/deepseekmath.yaml --arms A,B --seeds 0 --tasks tiny
    igrpo study run    --study configs/studies/deepseekmath.yaml --executor slurm
    igrpo study report --study configs/studies/deepseekmath.yaml   # the document, nothing run

A spec (`StudySpec`, below) names the tasks (a config each), the budget every arm shares, the arms
(override sets with their seeds and tasks), the comparisons (an arm minus another, paired by
seed), the strong reward models some arms read, and the resources of one run. Every run is
`igrpo iterate` (`torchrun --nproc_per_node G -m igrpo iterate ...` for G > 1 processes),
submitted through submitit: `--executor local` runs them as local processes, `--executor slurm`
as SLURM jobs of the spec's resources. Per task and seed the units every arm shares (the warm
start's labels, the first reward models, the warm start's evaluation) run once in a prefix run
that each arm's folder forks (`Manifest.fork`), resuming at GRPO. A finished run's results go to
<results>/<task>/seed<S>-<arm>.json (iteration/study_results.py), which the report reads and a
rerun skips: a study resumes from what finished, whichever executor ran it, and a stopped run
from its folder under --root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from iteration import study_results as sr
from iteration.manifest import fork
from iteration.study_spec import (QUESTION_STREAM, ROOT, RM_GRPO_KEYS, RM_MEMBER_KEYS, RM_UNITS,
                                  RUN_KINDS,
                                  Resources, StrongSpec, Study, StudyError, load_study, stream_of)


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


# -- the runs ------------------------------------------------------------------------------------
@dataclass
class Job:
    """One arm of one seed of one task: its run goes to root/seed<seed>-<arm>."""
    task: str
    config: str
    root: Path
    seed: int
    arm: str
    args: list[str]
    strong: bool = False
    result: Path | None = None  # where the finished run's results are kept
    recipe: str = ""
    command: str = "iterate"

    def policy_folder(self, overrides: list[str]) -> str:
        """Its run's folder of policy stages (`grpo`, `ppo`, ...: `policy.algorithm` under the
        study's `overrides` and the arm's own)."""
        from configs import load_config
        from iteration.resolve import stage_folder

        config = self.config if Path(self.config).is_absolute() else str(ROOT / self.config)
        cfg = load_config(config, [*overrides, *self.args], recipe=self.recipe or None)
        return stage_folder(self.root / f"seed{self.seed}-{self.arm}", cfg.policy.algorithm)


def igrpo_command(config: str, root: Path, name: str, seed: int, overrides: list[str],
                    processes: int = 1, command: str = "iterate", recipe: str = "") -> list[str]:
    """`igrpo iterate` (or `command`) of one run, as the job runs it (from the project's
    folder). One process runs without the launcher variables of whatever started the study (a
    process that joined a torch.distributed group holds them; the run would try to listen on
    that group's port); torchrun sets its own."""
    launch = ["env", *(f"-u{k}" for k in LAUNCHER_VARS), sys.executable, "-m", "igrpo"] \
        if processes <= 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={processes}", "-m", "igrpo"]
    return [*launch, command, "--config", config, *(["--recipe", recipe] if recipe else []),
            f"run.root={Path(root).resolve()}", f"run.name={name}", f"run.seed={seed}",
            "run.wandb_mode=disabled", *overrides]


class Commands:
    """A job of several commands run one after the other from the project's folder (a `grpo`
    study's run: the policy stage, then its evaluation); the first failure fails the job with
    its stderr (submitit's CommandFunction)."""

    def __init__(self, commands: list[list[str]]):
        self.commands = commands

    def __call__(self) -> None:
        for command in self.commands:
            command_function(command)()


def warm_start(config: str, overrides: list[str]) -> str:
    """The task's warm start (`model.policy_path` under the study's shared overrides)."""
    from configs import load_config

    return load_config(config, overrides).model.policy_path


def start_arm(prefix_run: Path, arm_run: Path, arm_args: list[str],
              reward_models: dict[str, str] | None = None) -> None:
    """A new arm folder (overrides `arm_args`) holding the prefix's finished units (its manifest
    resumes at GRPO). An arm reading its reward models otherwise (an `rm.` override other than
    the GRPO-time ones, `RM_GRPO_KEYS`) redoes them; one adding an ensemble's members
    (`RM_MEMBER_KEYS`) keeps them and trains the members; `reward_models` ({kind: path}) puts
    given ones in their place."""
    def keys(known):
        return [a for a in rm_args if a in known or a.split("=")[0] in known]

    rm_args = [a.lstrip("+") for a in arm_args if a.lstrip("+").startswith("rm.")]
    if reward_models:
        made = {f"rm-{kind}/0": {"path": os.path.relpath(Path(path).resolve(), arm_run.resolve())}
                for kind, path in _paths(reward_models).items()}  # (relative: the root may move)
        fork(prefix_run, arm_run, keep=lambda unit: unit != "eval/0", replace=made,
             drop=[f"rm-{kind}/iteration-0" for kind in ("orm", "prm")])
    elif len(keys(RM_GRPO_KEYS)) + len(keys(RM_MEMBER_KEYS)) < len(rm_args):
        fork(prefix_run, arm_run, keep=lambda unit: unit not in RM_UNITS,
             drop=[f"rm-{kind}/iteration-0" for kind in ("orm", "prm")])
    elif keys(RM_MEMBER_KEYS):  # the units redone find the prefix's models trained: members only
        fork(prefix_run, arm_run, keep=lambda unit: unit not in RM_UNITS)
    else:
        fork(prefix_run, arm_run)


def study_jobs(study: Study, root: Path, tasks: list[str], arms: list[str],
               seeds: list[int] | None, results: Path,
               overrides: list[str] | None = None) -> list[Job]:
    """Every (task, seed, arm) the study asks for (an arm's own seed count, or `seeds`) whose
    results are not kept yet, seed by seed. A kept result made with other shared overrides or
    on another question stream stops the study (they would be mixed)."""
    work = []
    for task in tasks:
        for arm in arms:
            spec = study.arms[arm]
            if task not in study.arm_tasks(arm):
                continue
            for seed in (seeds if seeds is not None else range(spec.seeds)):
                result = results / task / f"seed{seed}-{arm}.json"
                if result.exists() and overrides is not None:
                    kept = json.loads(result.read_text())
                    if kept.get("common_overrides") != common_overrides(overrides):
                        raise StudyError(
                            f"{result} was made with the overrides {kept.get('common_overrides')}, "
                            f"not {common_overrides(overrides)}: every run of a study shares "
                            "them; give this one another --results folder")
                    if stream_of(kept) != QUESTION_STREAM:
                        raise StudyError(
                            f"{result} was made on the older question stream "
                            f"({stream_of(kept)}); give this study another --results folder")
                if not result.exists():
                    work.append(Job(task, study.tasks[task], root / task, seed, arm,
                                    [*spec.overrides], spec.strong, result, spec.recipe,
                                    study.spec.command))
    # Seed by seed (every arm of seed 0 first), so that a stopped study leaves whole seeds.
    return sorted(work, key=lambda j: j.seed)



def make_executor(kind: str, folder: Path, resources: Resources):
    """submitit's executor for `kind` (local processes, or SLURM jobs of `resources`)."""
    import submitit

    if kind == "slurm":
        executor = submitit.SlurmExecutor(folder=folder)
        params = dict(time=resources.timeout_min, nodes=1, ntasks_per_node=1,
                      gpus_per_node=resources.processes, setup=list(resources.setup),
                      cpus_per_task=resources.cpus_per_task, partition=resources.partition,
                      account=resources.account,
                      mem=f"{resources.mem_gb}GB" if resources.mem_gb else None)
        executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
        return executor
    if kind == "local":
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=resources.timeout_min,
                                   setup=list(resources.setup))
        return executor
    raise StudyError(f"--executor: unknown {kind!r}; known: local, slurm")


def run_jobs(study: Study, work: list[Job], overrides: list[str], jobs: int, executor,
             share_cores: bool = False, local_gpus: int = 0) -> None:
    """The jobs in their order, each after its prefix (one per task and seed) and, for a strong
    arm, the task's strong reward models; `jobs` at a time, a free slot taking the first item of
    the list whose inputs are done, so that seeds finish one after another. With `share_cores`
    (local processes on CPUs) each run gets its share of the cores (run.threads); with `local_gpus`
    (a local executor on a GPU machine) each slot gets GPUs of its own. A failed job stops the
    study with its error; stopping it cancels every job still running."""
    if not work:
        return
    if jobs > 1 and share_cores:
        overrides = [*overrides, f"run.threads={max(1, (os.cpu_count() or 1) // jobs)}"]
    Schedule(study, work, overrides, executor, bool(local_gpus)).run(jobs)


class Schedule:
    """The study's items (a seed's prefix, a task's strong reward models, a run) submitted to
    `executor` in order as their inputs finish."""

    def __init__(self, study: Study, work: list[Job], overrides: list[str], executor,
                 own_gpus: bool):
        self.study, self.work, self.overrides, self.executor = study, work, overrides, executor
        self.own_gpus, self.processes = own_gpus, study.spec.resources.processes
        self.started, self.finished, self.made = set(), set(), {}

    def run(self, jobs: int) -> None:
        from tqdm import tqdm

        running, free_slots = {}, list(range(jobs))
        ledger = Ledger(getattr(self.executor, "folder", None))
        ledger.claim()
        ledger.cancel_leftovers()
        self.progress = tqdm(total=len(self.work), desc="study", unit="run", dynamic_ncols=True)
        try:
            while True:
                while free_slots and (item := self.next_item()) is not None:
                    self.started.add(item)
                    slot = free_slots.pop(0)
                    running[self.submit(item, slot)] = (item, slot, time.time())
                    ledger.write(running)
                if not running:
                    return
                done = [h for h in running if h.done()]
                if not done:
                    time.sleep(1)
                for handle in done:
                    item, slot, began = running.pop(handle)
                    ledger.write(running)
                    free_slots.append(slot)
                    try:
                        outcome = handle.result()
                    except Exception as err:  # submitit's FailedJobError holds the stderr
                        raise RuntimeError(f"{_describe(item, self.work)} failed:\n"
                                           f"{str(err)[-3000:]}") from None
                    self.finish(item, outcome, began)
        finally:
            self.progress.close()
            for handle in running:  # stopped or failed: no job is left running
                cancel_job(handle)
            ledger.write({})

    def next_item(self):
        for i, j in enumerate(self.work):
            needs = [("prefix", j.task, j.root, j.seed)]
            if j.strong:
                needs += [("prefix", j.task, j.root, self.study.spec.strong.seed),
                          ("strong", j.task, j.root)]
            needs.append(("run", i))
            for item in needs:
                if item not in self.started:
                    return item
                if item not in self.finished:
                    break
        return None

    def submit(self, item, slot: int):
        executor, processes, overrides = self.executor, self.processes, self.overrides
        if self.own_gpus:
            executor.update_parameters(gpus_per_node=processes, visible_gpus=list(
                range(slot * processes, (slot + 1) * processes)))
        if item[0] == "prefix" and not self.study.kind.forks_prefix:
            _, task, root, seed = item  # the seed's warm start, evaluated once
            _name(executor, f"{task}-seed{seed}-prefix")
            return executor.submit(command_function(self.eval_command(
                task, root, f"seed{seed}-prefix", seed, warm_start(self.study.tasks[task],
                                                                   overrides))))
        if item[0] == "prefix":
            _, task, root, seed = item
            name = f"seed{seed}-prefix"
            _name(executor, f"{task}-{name}")
            return executor.submit(command_function(igrpo_command(
                self.study.tasks[task], root, name, seed, [*overrides, "iterate.iterations=0"],
                processes)))
        if item[0] == "strong":
            _, task, root = item
            _name(executor, f"{task}-strong")
            return executor.submit(strong_reward_models, self.study.tasks[task], root, overrides,
                                   self.study.spec.strong)
        j = self.work[item[1]]
        run = j.root / f"seed{j.seed}-{j.arm}"
        _name(executor, f"{j.task}-seed{j.seed}-{j.arm}")
        if not RUN_KINDS[j.command].forks_prefix:  # the stage from the warm start, then eval
            return executor.submit(Commands([
                igrpo_command(j.config, j.root, run.name, j.seed, [*overrides, *j.args],
                                processes, j.command, j.recipe),
                self.eval_command(j.task, j.root, run.name, j.seed,
                                  str(run.resolve() / j.policy_folder(overrides) / "final"),
                                  j.args)]))
        start_arm(j.root / f"seed{j.seed}-prefix", run, j.args, self.reward_models(j))
        return executor.submit(command_function(igrpo_command(
            j.config, j.root, run.name, j.seed, [*overrides, *j.args], processes)))

    def eval_command(self, task: str, root: Path, name: str, seed: int, checkpoint: str,
                     args: list[str] = ()) -> list[str]:
        """`igrpo eval` of `checkpoint` into run `name` (its outcomes file per question)."""
        return igrpo_command(self.study.tasks[task], root, name, seed,
                               [*self.overrides, *args, f"eval.checkpoint={checkpoint}"],
                               self.processes, "eval")

    def reward_models(self, job: Job) -> dict[str, str] | None:
        return _paths(self.made.get((job.task, job.root))) if job.strong else None

    def finish(self, item, outcome, began: float) -> None:
        self.finished.add(item)
        if item[0] == "prefix" and not self.study.kind.forks_prefix:
            (item[2] / f"seed{item[3]}-prefix" / "minutes.json").write_text(
                json.dumps(round((time.time() - began) / 60, 2)))
        if item[0] == "strong":
            self.made[item[1:]] = outcome
        if item[0] == "run":
            j = self.work[item[1]]
            keep_result(j, time.time() - began, self.overrides, self.reward_models(j))
            self.progress.update()
            self.progress.write(f"[study] {j.task} seed {j.seed} {j.arm}: done")


class Ledger:
    """The study's jobs still running, in <jobs folder>/running.json. A study stopped without its
    `finally` (SIGKILL, a lost login node) leaves its jobs running; the next `study run` cancels
    them before it submits anything, so that no two jobs ever write one run folder (the runs then
    resume from their folders)."""

    def __init__(self, folder: Path | None):
        self.path = None if folder is None else Path(folder) / "running.json"

    def write(self, running: dict) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entries = [{"job_id": str(h.job_id), "slurm": type(h).__name__ == "SlurmJob"}
                       for h in running]
            self.path.write_text(json.dumps(entries))

    def claim(self) -> None:
        """Hold the study's jobs folder for this invocation (`owner.pid`), refusing while
        another live `igrpo study run` on this machine holds it: its running jobs would look
        like a stopped study's leftovers and be cancelled."""
        if self.path is None:
            return
        import psutil

        owner = self.path.with_name("owner.pid")
        try:
            pid = int(owner.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and psutil.pid_exists(pid) and \
                "study" in " ".join(_cmdline(pid)):
            raise StudyError(f"{owner.parent}: another `igrpo study run` (pid {pid}) is running "
                             "on this study's root; wait for it or stop it, then run again "
                             "(the runs resume from their folders)")
        owner.parent.mkdir(parents=True, exist_ok=True)
        owner.write_text(str(os.getpid()), encoding="utf-8")

    def cancel_leftovers(self) -> list[str]:
        """Cancel what a stopped study left running; the job ids it had recorded."""
        if self.path is None or not self.path.exists():
            return []
        import submitit

        left = json.loads(self.path.read_text())
        for entry in left:
            if entry["slurm"]:
                submitit.SlurmJob(folder=self.path.parent, job_id=entry["job_id"]).cancel(
                    check=False)
            else:  # a local job's id is its controller's pid
                _stop_local(int(entry["job_id"]))
        self.path.unlink()
        if left:
            print(f"[study] cancelled {len(left)} jobs a stopped study left running: "
                  + ", ".join(e["job_id"] for e in left), flush=True)
        return [e["job_id"] for e in left]


def cancel_job(handle) -> None:
    """SLURM's scancel; a local job's controller killed with the run under it (the SIGINT that
    LocalJob.cancel sends is ignored by a study started in the background)."""
    if type(handle).__name__ == "LocalJob":
        _stop_local(int(handle.job_id))
    else:
        handle.cancel(check=False)


def _cmdline(pid: int) -> list[str]:
    """The command line of process `pid` ([] where it is gone or not ours to read)."""
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def _stop_local(pid: int, timeout: float = 30.0) -> None:
    """Kill a local submitit controller still running, with every process under it (its task
    and the run the task started), as a preemption would: each run resumes from its folder. Only
    if `pid` still is such a controller (a pid may have been reused). (Not SIGINT, as
    LocalJob.cancel sends: a process started in the background inherits SIGINT ignored.)"""
    import psutil

    try:
        controller = psutil.Process(pid)
        if "submitit" not in " ".join(controller.cmdline()):
            return
        procs = [controller, *controller.children(recursive=True)]
    except psutil.Error:  # gone, or not ours to read
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def _name(executor, name: str) -> None:
    """The job's name, where the executor has names (SLURM's job name)."""
    import submitit

    if isinstance(executor, submitit.SlurmExecutor):
        executor.update_parameters(job_name=name)
    elif hasattr(executor, "name"):  # (the tests' recording executor)
        executor.name = name


def command_function(command: list[str]):
    """The job: `command` from the project's folder (its output in the job's log)."""
    import submitit

    return submitit.helpers.CommandFunction(command, cwd=str(ROOT))


def _describe(item, work) -> str:
    if item[0] == "prefix":
        return f"{item[1]} seed {item[3]}: the prefix (seed{item[3]}-prefix)"
    if item[0] == "strong":
        return f"{item[1]}: the strong reward models"
    j = work[item[1]]
    return f"{j.task} seed {j.seed} {j.arm} (seed{j.seed}-{j.arm})"


def keep_result(job: Job, seconds: float, overrides: list[str],
                reward_models: dict[str, str] | None) -> None:
    if job.result is not None:
        sr.write_run(job.result, run_record(job.root / f"seed{job.seed}-{job.arm}", job, seconds,
                                            overrides, reward_models))


def keep_strong(study: Study, root: Path, results: Path) -> None:
    """Each task's strong reward models' record (size, minutes, weights' sha256; no paths) into
    `results`/<task>/strong.json, beside the runs that read them."""
    for task in study.tasks:
        done = root / task / "strong" / "done.json"
        if done.exists():
            made = {k: v for k, v in json.loads(done.read_text()).items()
                    if k not in ("orm", "prm")}
            sr.write_run(results / task / "strong.json", made)


def read_strong(results: Path) -> dict:
    return {path.parent.name: json.loads(path.read_text())
            for path in sorted(results.glob("*/strong.json"))}


def _paths(made: dict | None) -> dict[str, str] | None:
    """{kind: path} of strong_reward_models' record."""
    return None if made is None else {kind: made[kind] for kind in ("orm", "prm")}


def strong_reward_models(config: str, root: Path, overrides: list[str],
                         strong: StrongSpec) -> dict[str, str]:
    """{kind: path} of the task's strong ORM and PRM, made once under root/strong from the warm
    start's `strong.samples` samples of each of `strong.questions` RL questions (a job of its
    own: it runs where the executor puts it)."""
    out = root / "strong"
    done = out / "done.json"
    if done.exists():
        made = json.loads(done.read_text())
        if (made.get("questions"), made.get("samples")) != (strong.questions, strong.samples):
            raise RuntimeError(f"{out}: strong reward models made from {made.get('questions')} "
                               f"questions x {made.get('samples')} samples; this study asks for "
                               f"{strong.questions} x {strong.samples}: remove the folder or use "
                               "another --root")
        return made
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = {"prm": out / "prm.jsonl", "orm": out / "orm.jsonl"}
    manifest = json.loads((root / f"seed{strong.seed}-prefix" / "manifest.json").read_text())
    warm = Path(manifest["units"]["sft"]["outputs"]["policy"])
    warm = warm if warm.is_absolute() else root / f"seed{strong.seed}-prefix" / warm
    if not all(p.exists() for p in data.values()):
        _strong_data(config, overrides, data, str(warm), strong)
    layers = json.loads((warm / "config.json").read_text())["num_hidden_layers"]
    deeper = f"rm.extra_layers_from=[{','.join(str(i) for i in range(layers))}]"
    made = {}
    for kind, path in data.items():
        code = subprocess.run(
            [sys.executable, "-m", "igrpo", "train-rm", "--config", config, f"run.root={root}",
             "run.name=strong", f"run.seed={strong.seed}", "run.wandb_mode=disabled",
             f"rm.kind={kind}", f"rm.data_path={path}", f"rm.init_path={warm}", *overrides,
             *strong.train, deeper], cwd=ROOT).returncode
        if code != 0:
            raise RuntimeError(f"{config}: the strong {kind.upper()} did not train (exit {code})")
        made[kind] = str((root / "strong" / f"rm-{kind}" / "final").resolve())
    made.update(questions=strong.questions, samples=strong.samples,
                minutes=round((time.perf_counter() - start) / 60, 2),
                sha256={kind: weights_sha256(made[kind]) for kind in data})
    done.write_text(json.dumps(made, indent=2))
    return made


def weights_sha256(folder: str | Path) -> str:
    """The first 16 hex digits of the sha256 of a model's weight files: the same model on any
    machine."""
    digest = hashlib.sha256()
    for weights in sorted(Path(folder).glob("*.safetensors")):
        digest.update(weights.read_bytes())
    return digest.hexdigest()[:16]


def _strong_data(config: str, overrides: list[str], paths: dict[str, Path], policy: str,
                 strong: StrongSpec) -> None:
    """The warm start's (`policy`) samples of the strong set (the labelling stage's sampler,
    its solutions cached beside `paths`), labelled by the task's oracle, as Math-Shepherd rows:
    every step for the PRM, the whole solution by its final answer for the ORM."""
    import torch

    from configs import load_config
    from process_supervision.formats import StepExample, write_math_shepherd_jsonl
    from process_supervision.sampling import sample_solutions
    from runtime.data import load_splits
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks import synthetic
    from tasks.grading import grade
    from tasks.prompts import prompt_format

    cfg = load_config(config, overrides)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    rl = load_splits(cfg.data, strong.seed).rl
    offset = min(strong.offset, max(0, len(rl) - strong.questions))  # (a small test config's pool)
    model, tokenizer = load_causal_lm(policy).eval(), load_tokenizer(policy)
    solutions = sample_solutions(model, tokenizer, rl[offset:offset + strong.questions],
                                 prompt_format(cfg.data), strong.samples,
                                 cfg.policy.max_new_tokens, 1.0,
                                 cache=paths["prm"].with_name("samples.jsonl"), seed=strong.seed)
    prm, orm = [], []
    for s in solutions:
        truth = synthetic.step_correctness(s.record.question, s.steps)
        prm.append(StepExample(s.record.question, s.steps, tuple(float(x) for x in truth)))
        text = cfg.data.step_separator.join(s.steps)
        orm.append(StepExample(s.record.question, (text,),
                               (float(grade(text, s.record.answer, cfg.eval.grade_timeout_s)),)))
    write_math_shepherd_jsonl(paths["prm"], prm, cfg.rm.step_tag)
    write_math_shepherd_jsonl(paths["orm"], orm, cfg.rm.step_tag)


def compute_minutes(run: Path, without: Path | None = None) -> float:
    """Minutes the units of one run folder took (a copied prefix's units included), less the
    units it shares with the run folder `without` (its prefix)."""
    def units(folder):
        return json.loads((folder / "manifest.json").read_text())["units"]

    shared = {name: (u.get("started"), u.get("finished"))
              for name, u in (units(without) if without is not None else {}).items()}
    return sum(u["finished"] - u["started"] for name, u in units(run).items()
               if u.get("state") == "done"
               and shared.get(name) != (u["started"], u["finished"])) / 60


def finished(run: Path) -> bool:
    """Every iteration of the arm's run is in its summary (a running arm is left out)."""
    import yaml

    if not (run / "summary.json").exists() or not (run / "config.yaml").exists():
        return False
    planned = yaml.safe_load((run / "config.yaml").read_text())["iterate"]["iterations"]
    return len(json.loads((run / "summary.json").read_text())["iterations"]) == planned + 1


def proxy_and_gold(run: Path, folder: str = "grpo") -> dict[str, list]:
    """Per policy step of every iteration in order (the stages in the run's `folder`), the
    proxy reward (`reward/mean`: what the run is trained on) and the gold one
    (`reward/accuracy`: the share of the step's samples whose final answer is right), the
    watch's in-group AUROC of the reward against the check (`watch/group_auroc`, None where no
    group was mixed) and the share of checks the reward read (`reward/gold_read`); `ends`: the
    steps at which each iteration ends."""
    from runtime.tracking import read_metrics

    proxy, gold, auroc, read, ends = [], [], [], [], []
    stages = [run / folder / "metrics.jsonl"] if (run / folder / "metrics.jsonl").exists() \
        else []  # (`igrpo grpo`'s one stage; `iterate`'s below)
    k = 1
    while (run / folder / f"iteration-{k}" / "metrics.jsonl").exists():
        stages.append(run / folder / f"iteration-{k}" / "metrics.jsonl")
        k += 1
    for metrics in stages:
        rows = [r for r in read_metrics(metrics) if "reward/mean" in r]
        proxy += [r["reward/mean"] for r in rows]
        gold += [r.get("reward/accuracy", float("nan")) for r in rows]
        auroc += [r.get("watch/group_auroc") if isinstance(r.get("watch/group_auroc"), float)
                  else None for r in rows]
        read += [r.get("reward/gold_read") for r in rows]
        ends.append(len(proxy))
    return {"proxy": proxy, "gold": gold, "auroc": auroc, "gold_read": read, "ends": ends}


def run_record(run: Path, job: Job, seconds: float, overrides: list[str] = (),
               reward_models: dict[str, str] | None = None) -> dict:
    """What the study keeps of a finished run (iteration/study_results.py): with the overrides
    every arm shared (`overrides`, less how it ran: run.threads), the question stream and, for a
    strong arm, its reward models' weights (sha256)."""
    prefix = job.root / f"seed{job.seed}-prefix"
    folder = job.policy_folder(overrides)
    if not RUN_KINDS[job.command].forks_prefix:  # warm start's eval in the prefix, the run's own
        (warm,), (final,) = (sorted((folder / "eval").glob("*.outcomes.json"))
                             for folder in (prefix, run))
        minutes, prefix_minutes = seconds / 60, json.loads((prefix / "minutes.json").read_text())
        last = {}
        done = json.loads((run / folder / "done.json").read_text())
        steps = {"steps": done.get("steps")}  # what a wall-clock budget allowed
    else:
        evals = sorted((run / "eval").glob("iteration-*.json"),
                       key=lambda p: int(p.stem.split("-")[1]))
        warm, final = evals[0], evals[-1]
        minutes, prefix_minutes = compute_minutes(run, prefix), compute_minutes(prefix)
        last = json.loads((run / "summary.json").read_text())["iterations"][-1]
        steps = {}
    rewards = proxy_and_gold(run, folder)
    proxy, gold, auroc, read = ([None if x is None else round(x, 5) for x in rewards[key]]
                                for key in ("proxy", "gold", "auroc", "gold_read"))
    return {"task": job.task, "arm": job.arm, "seed": job.seed,
            "config": job.config, "overrides": job.args,
            **({"recipe": job.recipe} if job.recipe else {}),
            "minutes": round(minutes, 2), "prefix_minutes": round(prefix_minutes, 2), **steps,
            "common_overrides": common_overrides(overrides),
            "question_stream": QUESTION_STREAM,
            **({"strong_sha256": {k: weights_sha256(v) for k, v in _paths(reward_models).items()}}
               if reward_models else {}),
            "wall_minutes": round(seconds / 60, 2), "commit": _commit(),
            "warm": sr.compact_outcomes(json.loads(warm.read_text())),
            "final": sr.compact_outcomes(json.loads(final.read_text())),
            "grpo": {"proxy": proxy, "gold": gold, "auroc": auroc, "gold_read": read},
            "reward_models": {k: v for k, v in last.get("rm", {}).items()
                              if isinstance(v, (int, float))}}


def common_overrides(overrides) -> list[str]:
    """The overrides that change what a run computes (run.* keys say how it ran)."""
    return [o for o in overrides if not o.startswith("run.")]


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# -- the command -----------------------------------------------------------------------------------
def study_parser(description: str, root: Path, flag: str, arms, jobs: int):
    """The options a study script shares: --root, --seeds, the arms, --jobs, --report-only."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", type=Path, default=root)
    parser.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    parser.add_argument(flag, default=",".join(arms),
                        help=f"comma-separated arms of {', '.join(arms)}")
    parser.add_argument("--jobs", type=int, default=jobs,
                        help="runs at a time, the CPU cores shared among them")
    parser.add_argument("--report-only", action="store_true")
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="igrpo study", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a study's arms over seeds (`run`), or write its document from the kept "
                    "results (`report`); reads no config of its own (the spec names one per "
                    "task; docs/studies.md).",
        epilog="example:\n  igrpo study run --study configs/studies/deepseekmath.yaml --jobs 2\n\n"
               "more:\n" + __doc__.split("\n\n")[1])
    parser.add_argument("action", choices=("run", "report"))
    parser.add_argument("--study", required=True, type=Path, help="a spec file (configs/studies/)")
    parser.add_argument("--arms", default=None, help="comma-separated arms (default: every arm)")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks (default: every one)")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated seeds (default: each arm's own count)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs at a time (local: the CPU cores or GPUs shared among them)")
    parser.add_argument("--executor", choices=("local", "slurm"), default="local",
                        help="submitit's local processes, or SLURM jobs of the spec's resources")
    parser.add_argument("--root", type=Path, default=None, help="where the runs go (the spec's)")
    parser.add_argument("--results", type=Path, default=None,
                        help="where finished runs' results are kept and read (the spec's)")
    parser.add_argument("--doc", type=Path, default=None, help="the document (the spec's)")
    parser.add_argument("overrides", nargs="*",
                        help="key=value overrides for every arm alike (the compute budget)")
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    try:
        study = load_study(args.study, args.overrides)
    except StudyError as err:
        parser.error(str(err))
    spec = study.spec
    root = (args.root or ROOT / spec.root).resolve()
    results = args.results or ROOT / spec.results
    doc = args.doc or ROOT / spec.doc
    arms = args.arms.split(",") if args.arms else list(study.arms)
    tasks = args.tasks.split(",") if args.tasks else list(study.tasks)
    for flag, given, known in (("--arms", arms, study.arms), ("--tasks", tasks, study.tasks)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; {args.study} has "
                         f"{', '.join(known)}")
    seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",")]
    command = " ".join(["igrpo study", *argv])
    shared = [*spec.budget, *args.overrides]
    if args.action == "run":
        try:
            work = study_jobs(study, root, tasks, arms, seeds, results, shared)
        except StudyError as err:
            parser.error(str(err))
        print(f"[study] {len(work)} runs to do", flush=True)
        start = time.perf_counter()
        try:
            gpus = _local_gpus() if args.executor == "local" else 0
            if gpus:
                args.jobs = min(args.jobs, gpus // spec.resources.processes)
            executor = make_executor(args.executor, root / "jobs", spec.resources)
            run_jobs(study, work, shared, args.jobs, executor,
                     share_cores=args.executor == "local" and not gpus, local_gpus=gpus)
        finally:  # (a stopped invocation's hours count too)
            if work:
                sr.log_invocation(results, command, time.perf_counter() - start,
                                  sum(j.result.exists() for j in work))
            keep_strong(study, root, results)
    invocations = sr.read_invocations(results)
    if args.action == "report" and invocations:  # the document names the last invocation
        command = invocations[-1]["command"]
    from iteration.study_report import report, write_doc

    text = report(study, sr.read_runs(results), command, invocations, read_strong(results),
                  results)
    print(f"wrote {write_doc(doc, text)}")
    return 0


def _local_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def stop_on_sigterm() -> None:
    """Stopped by a signal, the study's `finally` cancels its jobs and logs the invocation."""
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
