"""A study's spec (configs/studies/NAME.yaml, docs/studies.md): typed, loaded with OmegaConf like
the run configs, and checked before any run, every refusal naming the file and the key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RM_UNITS = ("rm-orm/0", "rm-prm/0", "eval/0")
"""The prefix's units that differ with an arm's reward models: redone in its fork."""
RM_GRPO_KEYS = ("rm.online", "rm.online_lr", "rm.online_update", "rm.implicit_beta",
                "rm.family=implicit", "rm.ensemble_aggregate", "rm.ensemble_lambda")
"""`rm.` overrides (a key, or key=value) that only GRPO reads, the first reward models trained
alike (the implicit PRM is GRPO's reward; the loop's own reward models stay tag LMs): an arm
setting only them keeps its prefix's reward models."""
RM_MEMBER_KEYS = ("rm.ensemble",)
"""`rm.` overrides that add reward models beside the first ones (an ensemble's members): an arm
setting them (and GRPO-time ones) keeps its prefix's reward models and trains only the members."""
PREFIX_SECTIONS = ("data", "model", "sft", "label", "eval")
"""Config sections the prefix's units read: an arm may not change them (the budget may)."""
QUESTION_STREAM = "walk"
"""How a run's GRPO stages draw their questions: `walk` on through the RL split, iteration after
iteration. Results without the key were made when every stage restarted the stream (`redraw`:
iteration 2 trained on iteration 1's questions); the report keeps the two apart."""


# -- the spec ------------------------------------------------------------------------------------
@dataclass
class ArmSpec:
    reward: str = "?"
    """What the arm is rewarded by (the report's column)."""
    advantages: str = "-"
    """How its advantages are formed (the report's column)."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides of the task's config: what the arm changes."""
    seeds: int = 1
    """Seeds 0..seeds-1."""
    tasks: list[str] = field(default_factory=list)
    """The tasks it runs on (default: the first task)."""
    strong: bool = False
    """It reads the study's strong reward models in place of the prefix's."""
    recipe: str = ""
    """A named algorithm (configs/recipes/) under the overrides."""


@dataclass
class StrongSpec:
    """Strong reward models, made once per task: the warm start sampled `samples` times on each
    of `questions` RL questions (from `offset` of seed `seed`'s pool), every sample labelled by
    the task's oracle, trained twice as deep with the `train` overrides."""
    questions: int = 640
    samples: int = 16
    offset: int = 20_000
    seed: int = 0
    train: list[str] = field(default_factory=list)


@dataclass
class Resources:
    """One run's job on a cluster (`--executor slurm`); `processes` ranks run it (torchrun)."""
    processes: int = 1
    """Processes of one run (GPUs of its node): `torchrun --nproc_per_node` when above 1."""
    cpus_per_task: int | None = None
    mem_gb: int | None = None
    timeout_min: int = 24 * 60
    partition: str | None = None
    account: str | None = None
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each job (module loads, `export KEY=VALUE`)."""


@dataclass
class StudySpec:
    title: str = "Study"
    """The document's heading."""
    command: str = "iterate"
    """What a run is: `iterate` (Algorithm 1; a seed's arms fork its shared prefix) or `grpo`
    (one policy stage from the task's warm start, then `igrpo eval`; a seed's warm start
    evaluated once)."""
    root: str = "runs/study"
    """Where the runs go (relative to the project)."""
    results: str = "docs/study"
    """Where finished runs' results are kept (and read from)."""
    doc: str = "docs/study.md"
    """The document `igrpo study report` writes."""
    tasks: dict[str, str] = field(default_factory=dict)
    """{name: config file}."""
    budget: list[str] = field(default_factory=list)
    """Overrides every arm shares (the compute budget)."""
    budget_note: str = "`igrpo iterate` with {budget}"
    """The budget as the document states it ({budget}: the overrides)."""
    arms: dict[str, ArmSpec] = field(default_factory=dict)
    comparisons: dict[str, list[str]] = field(default_factory=dict)
    """{question: ["TASK ARM - AGAINST", ...]}: each the arm minus the other, paired by seed."""
    strong: StrongSpec | None = None
    resources: Resources = field(default_factory=Resources)


@dataclass(frozen=True)
class Comparison:
    question: str
    task: str
    arm: str
    against: str


@dataclass(frozen=True)
class Study:
    """A loaded, checked spec."""
    path: Path
    spec: StudySpec
    comparisons: tuple[Comparison, ...]

    @property
    def arms(self) -> dict[str, ArmSpec]:
        return self.spec.arms

    @property
    def tasks(self) -> dict[str, str]:
        return self.spec.tasks

    @property
    def kind(self) -> RunKind:
        return RUN_KINDS[self.spec.command]

    def arm_tasks(self, arm: str) -> list[str]:
        return list(self.arms[arm].tasks) or [next(iter(self.tasks))]


class StudyError(ValueError):
    """A spec that cannot run, naming the file and the key."""


@dataclass(frozen=True)
class RunKind:
    """What a study's run is (`command`)."""
    forks_prefix: bool
    """A seed's arms fork its shared prefix (`iterate`: the warm start's labels, the first
    reward models, its evaluation); else the prefix only evaluates the warm start, and each run
    is the command, then `igrpo eval` of its `grpo/final`."""


RUN_KINDS = {"iterate": RunKind(forks_prefix=True), "grpo": RunKind(forks_prefix=False)}
COMPARISON = re.compile(r"^\s*(\S+)\s+(\S+)\s+-\s+(\S+)\s*$")


def load_study(path: str | Path, overrides: list[str] = ()) -> Study:
    """The spec at `path`, checked before any run: its keys and types (OmegaConf against
    StudySpec), every arm's tasks and overrides, every comparison's task and arms, and every
    arm's overrides loaded on each of its tasks with the budget and `overrides` (the command
    line's, for every arm alike)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(path)
    try:
        spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StudySpec),
                                                   OmegaConf.load(path)))
    except FileNotFoundError:
        raise StudyError(f"{path}: no such study file") from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise StudyError(f"{path}: {str(err).splitlines()[0]}"
                         + (f" (key {key})" if key else "")) from None
    if not spec.tasks:
        raise StudyError(f"{path}: tasks: none given")
    if spec.command not in RUN_KINDS:
        raise StudyError(f"{path}: command: {spec.command!r} is not one of "
                         f"{', '.join(RUN_KINDS)}")
    _check_arms(path, spec)
    study = Study(path, spec, tuple(_comparisons(path, spec)))
    _check_overrides(study, list(overrides))
    return study


def _check_arms(path: Path, spec: StudySpec) -> None:
    from configs.loader import recipes

    for arm, a in spec.arms.items():
        if a.recipe and a.recipe not in recipes():
            raise StudyError(f"{path}: arms.{arm}.recipe: no recipe {a.recipe!r}; the recipes "
                             f"are {', '.join(recipes())}")
        if a.strong and not RUN_KINDS[spec.command].forks_prefix:
            raise StudyError(f"{path}: arms.{arm}.strong: strong reward models are read by "
                             "`iterate` runs only")
        for task in a.tasks:
            if task not in spec.tasks:
                raise StudyError(f"{path}: arms.{arm}.tasks: unknown task {task!r}; the tasks "
                                 f"are {', '.join(spec.tasks)}")
        if a.strong and spec.strong is None:
            raise StudyError(f"{path}: arms.{arm}.strong: the study has no `strong` section")
        touched = sorted({o.split("=", 1)[0] for o in a.overrides
                          if o.split(".", 1)[0].lstrip("+") in PREFIX_SECTIONS}
                         if RUN_KINDS[spec.command].forks_prefix else ())
        if touched:
            raise StudyError(f"{path}: arms.{arm}.overrides: {', '.join(touched)} would change "
                             "the prefix every arm of a seed shares; put it in `budget`")


def _comparisons(path: Path, spec: StudySpec) -> list[Comparison]:
    comparisons = []
    for question, lines in spec.comparisons.items():
        for line in lines:
            match = COMPARISON.match(line)
            if not match:
                raise StudyError(f"{path}: comparisons.{question!r}: {line!r} is not "
                                 "'TASK ARM - AGAINST'")
            c = Comparison(question, *match.groups())
            for arm in (c.arm, c.against):
                if arm not in spec.arms:
                    raise StudyError(f"{path}: comparisons.{question!r}: {line!r} names arm "
                                     f"{arm!r}, which the study does not have")
            if c.task not in spec.tasks:
                raise StudyError(f"{path}: comparisons.{question!r}: {line!r} names task "
                                 f"{c.task!r}, which the study does not have")
            comparisons.append(c)
    return comparisons


def _check_overrides(study: Study, overrides: list[str]) -> None:
    """Every arm's overrides (and the prefix's) load on each of its tasks' configs."""
    from configs import load_config

    spec = study.spec
    for task, config in spec.tasks.items():
        checks = [("(prefix)", ["iterate.iterations=0"] if study.kind.forks_prefix else [],
                   None)]
        checks += [(arm, a.overrides, a.recipe or None) for arm, a in spec.arms.items()
                   if task in study.arm_tasks(arm)]
        for arm, extra, recipe in checks:
            try:
                load_config(str(ROOT / config) if not Path(config).is_absolute() else config,
                            [*spec.budget, *overrides, *extra], recipe=recipe)
            except (ValueError, FileNotFoundError) as err:
                where = "tasks" if arm == "(prefix)" else f"arms.{arm}.overrides"
                raise StudyError(f"{study.path}: {where} on task {task} ({config}): "
                                 f"{err}") from None

def stream_of(record: dict) -> str:
    return record.get("question_stream", "redraw")

