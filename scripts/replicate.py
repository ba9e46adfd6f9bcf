"""The replication study: DeepSeekMath's RL questions asked with arms that separate the method from
the reward model from the task, every arm from the task's shipped warm start at the same budget,
over seeds; writes docs/replication.md.

    python scripts/replicate.py --jobs 2                 # every arm at its seeds, both tasks
    python scripts/replicate.py --jobs 2 --arms A,B --seeds 0,1 --tasks steps
    python scripts/replicate.py --report-only            # the document from the kept results

Arms (the issue's letters; overrides of the task's config, all run `igrpo iterate`, 2 iterations
of `policy.steps` GRPO steps, the reference reset between them; G = 64, beta = 0.04):

  A   the exact final-answer check, outcome advantages                  5 seeds, both tasks
  B   the task's true step labels (a perfect PRM), process, sum form     5 seeds, both tasks
  C   the learned ORM, frozen, outcome                                   5 seeds
  D   the learned PRM, frozen, process, sum form (the paper's)           5 seeds
  E   the learned PRM, frozen, process, min form (PURE)                  3 seeds
  F   the exact check + the learned PRM, anchored credit                 3 seeds
  G   the learned reward models refreshed every iteration (Algorithm 1),
      process, sum form (the demo's default); its frozen twin is D      5 seeds, both tasks
  C+  a strong ORM, outcome; D+ a strong PRM, process, sum form: both
      trained once per task on 10,240 oracle-labelled samples of the warm
      start, twice as deep, read the paper's way; shared by the seeds    3 seeds
  H   online RFT on the exact check (beta = 0, as the paper runs it)     3 seeds
  I   D with each step's rewards shuffled across the batch (control)     3 seeds

Tasks: `steps` (configs/tiny_steps.yaml, where steps matter; every arm) and `tiny`
(configs/tiny.yaml; A and B, to show how much room each task leaves, and G, the demo's default,
against which an arm must win on both tasks for `make demo` to adopt it).

Per task and seed, the units every arm shares (the warm start's labels, the first reward models,
the warm start's evaluation) run once in a prefix run and are copied into each arm's folder,
whose manifest then resumes at GRPO. A finished run's results go to
docs/replication/<task>/seed<S>-<arm>.json (scripts/study_results.py), which the report reads
and a rerun skips: the study resumes across machines from the repository alone, and a stopped
run resumes from its folder under --root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import igrpo  # noqa: E402
from iteration.manifest import fork  # noqa: E402
import study_results as sr  # noqa: E402

CONFIG = "configs/tiny.yaml"
TASKS = {"steps": "configs/tiny_steps.yaml", "tiny": "configs/tiny.yaml"}
RESULTS = ROOT / "docs" / "replication"
BUDGET = ("policy.steps=20",)
"""Every arm alike: 2 iterations x 20 GRPO steps of 2 questions x G = 64."""
FROZEN = "iterate.refresh=false"
PROCESS = "policy.supervision=process"
OUTCOME = "policy.supervision=outcome"
STRONG_READ = ("rm.likelihood_feature=false",)
"""How the arms read the strong reward models: P(+) at the tag, the paper's read-out."""


@dataclass(frozen=True)
class Arm:
    reward: str
    advantages: str
    overrides: tuple[str, ...]
    seeds: int
    tasks: tuple[str, ...] = ("steps",)
    strong: bool = False


ARMS = {
    "A": Arm("exact final-answer check", "outcome",
             (OUTCOME, "iterate.reward=rule", FROZEN), 5, ("steps", "tiny")),
    "B": Arm("true step labels (`step_oracle`)", "process, sum",
             (PROCESS, "iterate.reward=step_oracle", FROZEN), 5, ("steps", "tiny")),
    "C": Arm("learned ORM, frozen", "outcome", (OUTCOME, FROZEN), 5),
    "D": Arm("learned PRM, frozen", "process, sum (the paper)",
             (PROCESS, "grpo.process_credit=sum", FROZEN), 5),
    "E": Arm("learned PRM, frozen", "process, min (PURE)",
             (PROCESS, "grpo.process_credit=min", FROZEN), 3),
    "F": Arm("exact check + learned PRM, frozen", "anchored",
             (PROCESS, "grpo.process_credit=anchored", FROZEN), 3),
    "G": Arm("learned ORM/PRM refreshed each iteration (Algorithm 1)", "process, sum",
             (PROCESS, "grpo.process_credit=sum", "iterate.refresh=true"), 5, ("steps", "tiny")),
    "C+": Arm("strong ORM, frozen", "outcome", (OUTCOME, FROZEN, *STRONG_READ), 3, strong=True),
    "D+": Arm("strong PRM, frozen", "process, sum",
              (PROCESS, "grpo.process_credit=sum", FROZEN, *STRONG_READ), 3, strong=True),
    "H": Arm("online RFT, exact check", "-",
             ("policy.supervision=rft", "iterate.reward=rule", FROZEN, "policy.beta=0"), 3),
    "I": Arm("learned PRM, rewards shuffled (control)", "process, sum",
             (PROCESS, "grpo.process_credit=sum", FROZEN, "controls.shuffle_rewards=true"), 3),
}

# The strong reward models: the warm start sampled on STRONG_QUESTIONS RL questions (from
# STRONG_OFFSET of seed 0's pool) STRONG_SAMPLES times each at temperature 1, every sample
# labelled by the task's oracle (PRM: each step; ORM: the final answer), trained once per task
# twice as deep (docs/reward_models.md: in-group AUROC 0.95 on the tiny task this way).
STRONG_QUESTIONS, STRONG_SAMPLES, STRONG_OFFSET, STRONG_SEED = 640, 16, 20_000, 0
STRONG_TRAIN = ("rm.likelihood_feature=false", "rm.epochs=1", "rm.lr=3e-4", "rm.eval_every=0",
                "rm.new_layer_lr=1e-3")
"""With `rm.extra_layers_from` every layer of the warm start (twice as deep)."""
# Units that differ with an arm's reward models: redone in its copy of the prefix.
RM_UNITS = ("rm-orm/0", "rm-prm/0", "eval/0")


def iterate(root: Path, name: str, seed: int, *overrides: str, config: str = CONFIG) -> None:
    code = igrpo.main(["iterate", "--config", config, f"run.root={root}", f"run.name={name}",
                       f"run.seed={seed}", "run.wandb_mode=disabled", *overrides])
    if code != 0:
        # (not SystemExit: a pool worker reports an Exception, and dies silently on SystemExit)
        raise RuntimeError(f"{name}: igrpo iterate exited {code}")


def prefix(root: Path, seed: int, extra: list[str], config: str = CONFIG) -> Path:
    """The shared iteration-0 units of one seed."""
    iterate(root, f"seed{seed}-prefix", seed, *extra, "iterate.iterations=0", config=config)
    return root / f"seed{seed}-prefix"


def start_arm(prefix_run: Path, arm_run: Path, arm_args: list[str],
              reward_models: dict[str, str] | None = None) -> None:
    """A new arm folder (overrides `arm_args`) holds the prefix's finished units (its manifest
    resumes at GRPO). An arm reading its reward models otherwise (the likelihood feature off)
    redoes them; `reward_models` ({kind: path}) puts given ones in their place."""
    if reward_models:
        made = {f"rm-{kind}/0": {"path": os.path.relpath(Path(path).resolve(), arm_run.resolve())}
                for kind, path in _paths(reward_models).items()}  # (relative: the root may move)
        fork(prefix_run, arm_run, keep=lambda unit: unit != "eval/0", replace=made,
             drop=[f"rm-{kind}/iteration-0" for kind in ("orm", "prm")])
    elif "rm.likelihood_feature=false" in arm_args:
        fork(prefix_run, arm_run, keep=lambda unit: unit not in RM_UNITS,
             drop=[f"rm-{kind}/iteration-0" for kind in ("orm", "prm")])
    else:
        fork(prefix_run, arm_run)


def run_arm(root: Path, seed: int, arm: str, arm_args: list[str], overrides: list[str],
            config: str = CONFIG, reward_models: dict[str, str] | None = None) -> Path:
    """One arm's run (a worker process gets the arm's overrides, not this module's table)."""
    run = root / f"seed{seed}-{arm}"
    start_arm(root / f"seed{seed}-prefix", run, arm_args, reward_models)
    print(f"[study] {config} seed {seed}: {arm}", flush=True)
    iterate(root, run.name, seed, *overrides, *arm_args, config=config)
    return run


def run_study(root: Path, seeds: list[int], arms: list[str], overrides: list[str],
              jobs: int, table: dict[str, list[str]], config: str = CONFIG) -> None:
    """Every seed's prefix, then its arms (their overrides from `table`) for one config; with
    `jobs` > 1, that many runs at a time, the cores shared out (run.threads). (The arms of
    experiments/reward_hacking.py run this way.)"""
    work = [Job(config, root, s, a, list(table[a])) for s in seeds for a in arms]
    run_jobs(work, overrides, jobs)


@dataclass
class Job:
    """One arm of one seed of one task: its run goes to root/seed<seed>-<arm>."""
    config: str
    root: Path
    seed: int
    arm: str
    args: list[str]
    strong: bool = False
    result: Path | None = None  # where the finished run's results are kept


def run_job(job: Job, overrides: list[str], reward_models: dict[str, str] | None) -> Path:
    """The job's run, then its results file (if it keeps one)."""
    start = time.perf_counter()
    run = run_arm(job.root, job.seed, job.arm, job.args, overrides, job.config, reward_models)
    if job.result is not None:
        sr.write_run(job.result, run_record(run, job, time.perf_counter() - start, overrides,
                                            reward_models))
    return run


def run_jobs(work: list[Job], overrides: list[str], jobs: int,
             strong_size: tuple[int, int] = (STRONG_QUESTIONS, STRONG_SAMPLES)) -> None:
    """The jobs in their order, each after its prefix (one per task and seed) and, for a strong
    arm, the task's strong reward models (`strong_size`: questions, samples of each; made from
    seed STRONG_SEED's prefix); `jobs` at a time, a free slot taking the first item of the list
    whose inputs are done, so that seeds finish one after another."""
    if not work:
        return
    if jobs > 1:
        overrides = [*overrides, f"run.threads={max(1, (os.cpu_count() or 1) // jobs)}"]
    started, finished, made = set(), set(), {}

    def next_item():
        for i, j in enumerate(work):
            needs = [("prefix", j.config, j.root, j.seed)]
            if j.strong:
                needs += [("prefix", j.config, j.root, STRONG_SEED), ("strong", j.config, j.root)]
            needs.append(("run", i))
            for item in needs:
                if item not in started:
                    return item
                if item not in finished:
                    break
        return None

    def call(item):
        if item[0] == "prefix":
            return prefix, (item[2], item[3], overrides, item[1])
        if item[0] == "strong":
            return strong_reward_models, (item[1], item[2], overrides, *strong_size)
        j = work[item[1]]
        return run_job, (j, overrides, _paths(made.get((j.config, j.root))) if j.strong else None)

    def finish(item, outcome):
        finished.add(item)
        if item[0] == "strong":
            made[item[1:]] = outcome

    if jobs <= 1:
        while (item := next_item()) is not None:
            started.add(item)
            fn, args = call(item)
            finish(item, fn(*args))
        return
    # A fresh process a job; leaving the block (finished, failed or stopped) ends every worker.
    with multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=1) as pool:
        running = {}
        while True:
            while len(running) < jobs and (item := next_item()) is not None:
                started.add(item)
                fn, args = call(item)
                running[pool.apply_async(fn, args)] = item
            if not running:
                return
            done = [r for r in running if r.ready()]
            if not done:
                time.sleep(1)
            for result in done:
                finish(running.pop(result), result.get())


def keep_strong(root: Path, results: Path) -> None:
    """Each task's strong reward models' record (size, minutes, weights' sha256; no paths) into
    `results`/<task>/strong.json, beside the runs that read them."""
    for task in TASKS:
        done = root / task / "strong" / "done.json"
        if done.exists():
            made = {k: v for k, v in json.loads(done.read_text()).items() if k not in ("orm", "prm")}
            sr.write_run(results / task / "strong.json", made)


def read_strong(results: Path) -> dict:
    return {path.parent.name: json.loads(path.read_text())
            for path in sorted(results.glob("*/strong.json"))}


def _paths(made: dict | None) -> dict[str, str] | None:
    """{kind: path} of strong_reward_models' record."""
    return None if made is None else {kind: made[kind] for kind in ("orm", "prm")}


def strong_reward_models(config: str, root: Path, overrides: list[str],
                         questions: int = STRONG_QUESTIONS,
                         samples: int = STRONG_SAMPLES) -> dict[str, str]:
    """{kind: path} of the task's strong ORM and PRM, made once under root/strong from the warm
    start's `samples` samples of each of `questions` RL questions."""
    out = root / "strong"
    done = out / "done.json"
    if done.exists():
        made = json.loads(done.read_text())
        if (made.get("questions"), made.get("samples")) != (questions, samples):
            raise RuntimeError(f"{out}: strong reward models made from {made.get('questions')} "
                               f"questions x {made.get('samples')} samples; this study asks for "
                               f"{questions} x {samples}: remove the folder or use another --root")
        return made
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    data = {"prm": out / "prm.jsonl", "orm": out / "orm.jsonl"}
    manifest = json.loads((root / f"seed{STRONG_SEED}-prefix" / "manifest.json").read_text())
    warm = Path(manifest["units"]["sft"]["outputs"]["policy"])
    warm = warm if warm.is_absolute() else root / f"seed{STRONG_SEED}-prefix" / warm
    if not all(p.exists() for p in data.values()):
        _strong_data(config, overrides, data, str(warm), questions, samples)
    layers = json.loads((warm / "config.json").read_text())["num_hidden_layers"]
    deeper = f"rm.extra_layers_from=[{','.join(str(i) for i in range(layers))}]"
    made = {}
    for kind, path in data.items():
        code = igrpo.main(["train-rm", "--config", config, f"run.root={root}",
                           "run.name=strong", f"run.seed={STRONG_SEED}",
                           "run.wandb_mode=disabled", f"rm.kind={kind}", f"rm.data_path={path}",
                           f"rm.init_path={warm}", *overrides, *STRONG_TRAIN, deeper])
        if code != 0:
            raise RuntimeError(f"{config}: the strong {kind.upper()} did not train (exit {code})")
        made[kind] = str((root / "strong" / f"rm-{kind}" / "final").resolve())
    made.update(questions=questions, samples=samples,
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
                 questions: int, samples: int) -> None:
    """The warm start's (`policy`) samples of the strong set (the labelling stage's sampler,
    its solutions cached beside `paths`), labelled by the task's oracle, as Math-Shepherd rows:
    every step for the PRM, the whole solution by its final answer for the ORM."""
    import torch

    from process_supervision.formats import StepExample, write_math_shepherd_jsonl
    from process_supervision.sampling import sample_solutions
    from runtime.data import load_splits
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks import synthetic
    from tasks.grading import grade
    from tasks.prompts import prompt_format

    cfg = igrpo.load_config(config, overrides)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    rl = load_splits(cfg.data, STRONG_SEED).rl
    offset = min(STRONG_OFFSET, max(0, len(rl) - questions))  # (a small test config's pool)
    model, tokenizer = load_causal_lm(policy).eval(), load_tokenizer(policy)
    solutions = sample_solutions(model, tokenizer, rl[offset:offset + questions],
                                 prompt_format(cfg.data), samples, cfg.policy.max_new_tokens, 1.0,
                                 cache=paths["prm"].with_name("samples.jsonl"), seed=STRONG_SEED)
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
               if u.get("state") == "done" and shared.get(name) != (u["started"], u["finished"])) / 60


def finished(run: Path) -> bool:
    """Every iteration of the arm's run is in its summary (a running arm is left out)."""
    import yaml

    if not (run / "summary.json").exists() or not (run / "config.yaml").exists():
        return False
    planned = yaml.safe_load((run / "config.yaml").read_text())["iterate"]["iterations"]
    return len(json.loads((run / "summary.json").read_text())["iterations"]) == planned + 1


def proxy_and_gold(run: Path) -> dict[str, list]:
    """Per GRPO step of every iteration in order, the proxy reward (`reward/mean`: what the run
    is trained on) and the gold one (`reward/accuracy`: the share of the step's samples whose
    final answer is right); `ends`: the steps at which each iteration ends."""
    from runtime.tracking import read_metrics

    proxy, gold, ends = [], [], []
    k = 1
    while (run / "grpo" / f"iteration-{k}" / "metrics.jsonl").exists():
        rows = [r for r in read_metrics(run / "grpo" / f"iteration-{k}" / "metrics.jsonl")
                if "reward/mean" in r]
        proxy += [r["reward/mean"] for r in rows]
        gold += [r.get("reward/accuracy", float("nan")) for r in rows]
        ends.append(len(proxy))
        k += 1
    return {"proxy": proxy, "gold": gold, "ends": ends}


def run_record(run: Path, job: Job, seconds: float, overrides: list[str] = (),
               reward_models: dict[str, str] | None = None) -> dict:
    """What the study keeps of a finished run (scripts/study_results.py): with the overrides
    every arm shared (`overrides`, less how it ran: run.threads) and, for a strong arm, its
    reward models' weights (sha256)."""
    iterations = json.loads((run / "summary.json").read_text())["iterations"]
    evals = sorted((run / "eval").glob("iteration-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    rewards = proxy_and_gold(run)
    proxy, gold = ([round(x, 5) for x in rewards[key]] for key in ("proxy", "gold"))
    last = iterations[-1]
    return {"task": _task_of(job.config), "arm": job.arm, "seed": job.seed,
            "config": job.config, "overrides": job.args,
            "minutes": round(compute_minutes(run, job.root / f"seed{job.seed}-prefix"), 2),
            "prefix_minutes": round(compute_minutes(job.root / f"seed{job.seed}-prefix"), 2),
            "common_overrides": common_overrides(overrides),
            **({"strong_sha256": {k: weights_sha256(v) for k, v in _paths(reward_models).items()}}
               if reward_models else {}),
            "wall_minutes": round(seconds / 60, 2), "commit": _commit(),
            "warm": sr.compact_outcomes(json.loads(evals[0].read_text())),
            "final": sr.compact_outcomes(json.loads(evals[-1].read_text())),
            "grpo": {"proxy": proxy, "gold": gold},
            "reward_models": {k: v for k, v in last.get("rm", {}).items()
                              if isinstance(v, (int, float))}}


def common_overrides(overrides) -> list[str]:
    """The overrides that change what a run computes (run.* keys say how it ran)."""
    return [o for o in overrides if not o.startswith("run.")]


def _task_of(config: str) -> str:
    return next((t for t, c in TASKS.items() if c == config), Path(config).stem)


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def study_jobs(root: Path, tasks: list[str], arms: list[str], seeds: list[int] | None,
               results: Path, overrides: list[str] | None = None) -> list[Job]:
    """Every (task, seed, arm) the study asks for (an arm's own seed count, or `seeds`) whose
    results are not kept yet, seed by seed."""
    work = []
    for task in tasks:
        for arm in arms:
            spec = ARMS[arm]
            if task not in spec.tasks:
                continue
            for seed in (seeds if seeds is not None else range(spec.seeds)):
                result = results / task / f"seed{seed}-{arm}.json"
                if result.exists() and overrides is not None:
                    kept = json.loads(result.read_text()).get("common_overrides")
                    if kept != common_overrides(overrides):
                        raise ValueError(
                            f"{result} was made with the overrides {kept}, not "
                            f"{common_overrides(overrides)}: every run of a study shares "
                            "them; give this one another --results folder")
                if not result.exists():
                    work.append(Job(TASKS[task], root / task, seed, arm,
                                    [*spec.overrides], spec.strong, result))
    # Seed by seed (every arm of seed 0 first), so that a stopped study leaves whole seeds.
    return sorted(work, key=lambda j: j.seed)


# -- the report ---------------------------------------------------------------------------------
COMPARISONS = (
    ("1. How much can process supervision give here?", "steps", "B", "A"),
    ("1. How much can process supervision give here?", "tiny", "B", "A"),
    ("2. Process against outcome supervision, learned reward models", "steps", "D", "C"),
    ("2. Process against outcome supervision, learned reward models", "steps", "E", "C"),
    ("2. Process against outcome supervision, learned reward models", "steps", "D+", "C+"),
    ("3. Does iterating the reward models help?", "steps", "G", "D"),
    ("4. Which credit form makes a learned PRM safe?", "steps", "E", "D"),
    ("4. Which credit form makes a learned PRM safe?", "steps", "F", "D"),
    ("4. Which credit form makes a learned PRM safe?", "steps", "F", "E"),
    ("4. Which credit form makes a learned PRM safe?", "steps", "D", "A"),
    ("4. Which credit form makes a learned PRM safe?", "steps", "E", "A"),
    ("4. Which credit form makes a learned PRM safe?", "steps", "F", "A"),
    ("5. Uesato: fewer lucky answers at a similar final-answer accuracy?", "steps", "C", "A"),
    ("Controls", "steps", "H", "A"),
    ("Controls", "steps", "I", "D"),
    ("The demo's default (G) against the arms run on both tasks", "steps", "A", "G"),
    ("The demo's default (G) against the arms run on both tasks", "tiny", "A", "G"),
    ("The demo's default (G) against the arms run on both tasks", "steps", "B", "G"),
    ("The demo's default (G) against the arms run on both tasks", "tiny", "B", "G"),
)
WINDOW = 5


def _ci(e: dict, scale: float = 1.0, sign: bool = False) -> str:
    fmt = "{:+.3f}" if sign else "{:.3f}"
    if e["seeds"] < 2:
        return fmt.format(e["mean"] * scale) + " (1 seed)"
    return (fmt.format(e["mean"] * scale) + " [" + fmt.format(e["lo"] * scale) + ", "
            + fmt.format(e["hi"] * scale) + "]")


def report(runs: dict, command: str, tasks: list[str], invocations: list[dict] = (),
           strong: dict | None = None) -> str:
    """docs/replication.md's generated part from the kept `runs`, the study's `invocations` and
    the strong reward models' record (`strong`: {task: strong_reward_models' record})."""
    lines = ["# Replication study: DeepSeekMath's RL questions on the tiny tasks", "",
             "Generated by `scripts/replicate.py` from the kept results (docs/replication/); do "
             "not edit above the reading section.", "",
             f"- Command: `{command}` (the last invocation; each one continues the study, "
             "skipping the runs it has kept)",
             f"- The whole study: {len(runs)} runs kept, {_compute_hours(runs, strong):.1f} "
             "hours of compute (the runs, each task's and seed's shared prefix, the strong "
             f"reward models); {sum(i['wall_minutes'] for i in invocations) / 60:.1f} hours of "
             f"wall time over {len(invocations)} invocations on 2 CPU cores "
             "(docs/replication/invocations.jsonl)",
             "- Overrides every run shared: " + (", ".join(
                 "`" + " ".join(s) + "`" for s in sorted({tuple(r.get("common_overrides", ()))
                                                         for r in runs.values()})) or "-"),
             "- Budget, every arm alike: `igrpo iterate`, 2 iterations x "
             f"{' '.join(f'`{b}`' for b in BUDGET)} GRPO steps of 2 questions x G = 64, beta "
             "= 0.04, the reference reset between the iterations; 500 held-out questions a seed "
             "(k = 4 at temperature 1, and greedy).",
             "- Tasks: " + "; ".join(f"`{t}` = `{c}`" for t, c in TASKS.items())]
    lines += _strong_lines(runs, strong or {}) + [""]
    lines += (_arms_section(runs, tasks) + _runs_section(runs, tasks)
              + _comparison_section(runs) + _proxy_gold_section(runs))
    return "\n".join(lines) + "\n"


def _arms_section(runs: dict, tasks: list[str]) -> list[str]:
    lines = ["## Every arm after RL", "",
             "Mean over the arm's seeds with the 95% t interval over seeds (the spread between "
             "training runs). `trace acc`: samples whose answer and every step are right; `lucky "
             "answers`: of the right samples, the share reached through a wrong step "
             "(docs/metrics.md). `minutes`: one run's compute, mean over seeds (one thread, two "
             "runs side by side on 2 cores), without the seed's shared prefix (the warm start's "
             "labels, the first reward models and its evaluation: "
             f"{_prefix_minutes(runs)} minutes a seed).", "",
             "| task | arm | reward | advantages | seeds | "
             + " | ".join(sr.LABELS[m] for m in sr.METRICS) + " | minutes |",
             "|---|---|---|---|---|" + "---|" * (len(sr.METRICS) + 1)]
    for task in tasks:
        warm = sr.warm_summary(runs, task)
        if warm:
            seeds = warm["mean_at_k"]["seeds"]
            lines.append(f"| {task} | warm start | - | - | {seeds} | "
                         + " | ".join(_ci(warm[m]) if m in warm else "-" for m in sr.METRICS)
                         + " | - |")
        for arm, spec in ARMS.items():
            summary = sr.arm_summary(runs, task, arm)
            if not summary:
                continue
            mins = [r["minutes"] for (t, a, _), r in runs.items() if t == task and a == arm]
            lines.append(f"| {task} | {arm} | {spec.reward} | {spec.advantages} | "
                         f"{summary['mean_at_k']['seeds']} | "
                         + " | ".join(_ci(summary[m]) if m in summary else "-"
                                      for m in sr.METRICS)
                         + f" | {sum(mins) / len(mins):.1f} |")
    return lines


def _ends(values: list[float]) -> tuple[float, float] | None:
    """The mean of a per-step series over its first and its last WINDOW GRPO steps (None when
    the run logged fewer steps than that)."""
    if len(values) < WINDOW:
        return None
    return sum(values[:WINDOW]) / WINDOW, sum(values[-WINDOW:]) / WINDOW


def _runs_section(runs: dict, tasks: list[str]) -> list[str]:
    """Each training run's mean@4, seed by seed, with its gold reward over GRPO's first and last
    steps: the spread between training runs that the intervals over seeds summarise."""
    seeds = sorted({s for (_, _, s) in runs})
    lines = ["", "## Every training run", "",
             "mean@4 of each run after RL, seed by seed, and in brackets its gold reward (the share "
             f"of GRPO's samples answered right) over the first and the last {WINDOW} GRPO steps.",
             "", "| task | arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for task in tasks:
        warm = {s: r["warm"] for (t, _, s), r in runs.items() if t == task}
        if not warm:
            continue
        lines.append(f"| {task} | warm start | " + " | ".join(
            f"{sr.metric(sr.per_question(warm[s]), 'mean_at_k'):.3f}" if s in warm else "-"
            for s in seeds) + " |")
        for arm in ARMS:
            cells = []
            for s in seeds:
                record = runs.get((task, arm, s))
                if record is None:
                    cells.append("-")
                    continue
                cell = f"{sr.metric(sr.per_question(record['final']), 'mean_at_k'):.3f}"
                ends = _ends(record["grpo"]["gold"])
                if ends:
                    cell += f" ({ends[0]:.2f} -> {ends[1]:.2f})"
                cells.append(cell)
            if any(c != "-" for c in cells):
                lines.append(f"| {task} | {arm} | " + " | ".join(cells) + " |")
    return lines


def _strong_lines(runs: dict, strong: dict) -> list[str]:
    """What the strong arms read, and whether every one of their runs read the same weights."""
    lines = []
    for task, made in strong.items():
        read = {json.dumps(r["strong_sha256"], sort_keys=True) for (t, _, _), r in runs.items()
                if t == task and "strong_sha256" in r}
        same = read <= {json.dumps(made["sha256"], sort_keys=True)}
        lines.append(f"- Strong reward models ({task}): {made['questions']} questions x "
                     f"{made['samples']} samples of the warm start, oracle-labelled, twice as "
                     f"deep; {made['minutes']:.0f} minutes to make; weights sha256 "
                     + ", ".join(f"{k.upper()} `{v}`" for k, v in sorted(made["sha256"].items()))
                     + ("; every strong run read them" if same else
                        "; **some strong runs read other weights**: " + "; ".join(sorted(read))))
    return lines


def _compute_hours(runs: dict, strong: dict | None) -> float:
    """Hours of one core: every kept run's own units, each (task, seed) prefix once, each task's
    strong reward models once."""
    prefixes = {(task, seed): r.get("prefix_minutes", 0.0) for (task, _, seed), r in runs.items()}
    made = sum(s.get("minutes", 0.0) for s in (strong or {}).values())
    return (sum(r["minutes"] for r in runs.values()) + sum(prefixes.values()) + made) / 60


def _prefix_minutes(runs: dict) -> str:
    """The shared prefix's compute per task: `steps 17.1, tiny 12.0` (mean over seeds)."""
    by_task: dict[str, dict[int, float]] = {}
    for (task, _, seed), r in runs.items():
        if "prefix_minutes" in r:
            by_task.setdefault(task, {})[seed] = r["prefix_minutes"]
    return ", ".join(f"{task} {sum(m.values()) / len(m):.1f}" for task, m in by_task.items()) \
        or "-"


def _comparison_section(runs: dict) -> list[str]:
    lines = ["", "## The questions, arm against arm", "",
             "Each cell: the mean over seeds of the per-seed difference (the first arm minus the "
             "second, both of a seed on the same held-out questions) with its 95% t interval "
             "over seeds, then after `q` the interval over held-out "
             "questions (a paired bootstrap over every seed's questions together), which leaves "
             "out the spread between training runs. **Bold**: the interval over seeds leaves out "
             "0 (resolved at 95%). Lucky answers: the mean of the per-seed differences of each "
             "run's share; its `q` interval is that of the share pooled over every seed's "
             "questions.", "",
             "| question | task | difference | seeds | "
             + " | ".join(sr.LABELS[m] for m in sr.METRICS) + " |",
             "|---|---|---|---|" + "---|" * len(sr.METRICS)]
    for question, task, arm, against in COMPARISONS:
        diff = sr.compare(runs, task, arm, against)
        if not diff:
            continue
        cells = []
        for m in sr.METRICS:
            if m not in diff:
                cells.append("-")
                continue
            e = diff[m]
            text = _ci(e, sign=True)
            cells.append((f"**{text}**" if e["resolved"] else text)
                         + f" q [{e['q_lo']:+.3f}, {e['q_hi']:+.3f}]")
        seeds = diff["mean_at_k"]["seeds"]
        lines.append(f"| {question} | {task} | {arm} - {against} | {seeds} | "
                     + " | ".join(cells) + " |")
    return lines


def _proxy_gold_section(runs: dict) -> list[str]:
    lines = ["", "## Proxy and gold reward during GRPO", "",
             "Proxy: the reward the arm is trained on (`reward/mean`); gold: the share of the "
             f"step's samples whose final answer is right (`reward/accuracy`). Means over the "
             f"first and the last {WINDOW} GRPO steps, then over seeds. Reward hacking shows as "
             "the proxy rising while gold stays flat or falls.", "",
             "| task | arm | seeds | proxy first -> last | gold first -> last |",
             "|---|---|---|---|---|"]
    for task in TASKS:
        for arm in ARMS:
            series = [r["grpo"] for (t, a, _), r in runs.items() if t == task and a == arm]
            if not series:
                continue
            cells = []
            for key in ("proxy", "gold"):
                ends = [e for e in (_ends(s[key]) for s in series) if e]
                cells.append(f"{sum(e[0] for e in ends) / len(ends):.3f} -> "
                             f"{sum(e[1] for e in ends) / len(ends):.3f}" if ends else "-")
            lines.append(f"| {task} | {arm} | {len(series)} | " + " | ".join(cells) + " |")
    return lines


def finish_figure(fig, axes, ylabel: str, path: Path, legend_on: int = 0) -> None:
    """Label the first panel, put the legend on one, save `path` and close the figure (the
    study scripts' plots end alike)."""
    import matplotlib.pyplot as plt

    axes[0].set_ylabel(ylabel)
    axes[legend_on].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_doc(doc: Path, text: str, script: str = "scripts/replicate.py") -> Path:
    """`doc`: the generated part, then the hand-written reading below the marker kept."""
    marker = f"<!-- reading: kept by {script} -->"
    reading = doc.read_text().split(marker, 1)[1] if doc.exists() and marker in doc.read_text() \
        else "\n## Reading\n\n(what the numbers say)\n"
    doc.parent.mkdir(exist_ok=True)
    doc.write_text(text + "\n" + marker + reading)
    return doc


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


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__doc__.split("\n\n")[0], ROOT / "runs" / "study", "--arms", ARMS, 2)
    parser.set_defaults(seeds=None)
    parser.add_argument("--tasks", default=",".join(TASKS),
                        help=f"comma-separated tasks of {', '.join(TASKS)}")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where finished runs' results are kept (and read from)")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "replication.md")
    parser.add_argument("--strong-questions", type=int, default=STRONG_QUESTIONS,
                        help="RL questions the strong reward models' samples are drawn on")
    parser.add_argument("--strong-samples", type=int, default=STRONG_SAMPLES,
                        help="the warm start's samples of each of them")
    parser.add_argument("overrides", nargs="*",
                        help="key=value overrides for every arm alike (the compute budget)")
    args = parser.parse_intermixed_args(argv)
    seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",")]
    arms, tasks = args.arms.split(","), args.tasks.split(",")
    for flag, given, known in (("--arms", arms, ARMS), ("--tasks", tasks, TASKS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    for task in tasks:  # a bad key or value stops here, before any run starts
        for arm in ["(prefix)", *(a for a in arms if task in ARMS[a].tasks)]:
            extra = ARMS[arm].overrides if arm in ARMS else ("iterate.iterations=0",)
            try:
                igrpo.load_config(TASKS[task], [*BUDGET, *args.overrides, *extra])
            except ValueError as e:
                parser.error(f"{TASKS[task]}, arm {arm}, with the given overrides: {e}")
    command = " ".join(["python scripts/replicate.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.perf_counter()
    if not args.report_only:
        try:
            work = study_jobs(args.root, tasks, arms, seeds, args.results,
                              [*BUDGET, *args.overrides])
        except ValueError as e:
            parser.error(str(e))
        print(f"[study] {len(work)} runs to do", flush=True)
        try:
            run_jobs(work, [*BUDGET, *args.overrides], args.jobs,
                     (args.strong_questions, args.strong_samples))
        finally:  # (a stopped invocation's hours count too)
            if work:
                sr.log_invocation(args.results, command, time.perf_counter() - start,
                                  sum(j.result.exists() for j in work))
            keep_strong(args.root, args.results)
    keep_strong(args.root, args.results)
    invocations = sr.read_invocations(args.results)
    if args.report_only and invocations:  # the document names the study's last invocation
        command = invocations[-1]["command"]
    text = report(sr.read_runs(args.results), command, list(TASKS), invocations,
                  read_strong(args.results))
    doc = write_doc(args.doc, text)
    print(f"wrote {doc}")
    return 0


if __name__ == "__main__":
    # Stopped by a signal, the workers end and the invocation is logged (main's `finally`).
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    sys.exit(main())
