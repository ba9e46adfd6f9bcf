"""igrpo: DeepSeekMath's reinforcement-learning recipe: reward models trained on the policy's own samples, GRPO, and the outer loop that refreshes them (Algorithm 1).

    igrpo demo       --config configs/tiny.yaml        # the main job: Algorithm 1 (= iterate)
    igrpo sft        --config configs/tiny.yaml model.policy_path= sft.enabled=true
    igrpo grpo       --config configs/tiny.yaml policy.group_size=16   # GRPO -> <run>/grpo/final
    igrpo grpo       --config configs/tiny.yaml --recipe dapo        # a named algorithm
    igrpo eval       --config configs/tiny.yaml [eval.checkpoint=PATH]
    igrpo label      --config configs/tiny.yaml label.num_completions=8   # Math-Shepherd labels
    igrpo train-rm   --config configs/tiny.yaml rm.kind=prm [rm.data_path=labels.jsonl]
    igrpo eval-rm    --config configs/tiny.yaml        # step metrics and best-of-N of the RMs
    igrpo score      --config configs/tiny.yaml rm.path=DIR rm.score_input=FILE  # step scores
    igrpo plan       --config configs/deepseekmath_7b.yaml --gpus 8   # memory per GPU
    igrpo config show --config configs/tiny.yaml [key=value ...]      # the resolved config
    igrpo study run  --study configs/studies/deepseekmath.yaml --jobs 2  # arms x seeds, a report

Every command takes `--config FILE`, `--recipe NAME` (configs/recipes/) and `key=value` overrides
of the schema in configs/schema.py; a typo or a wrong type fails before any work starts. One
launcher for many processes: `torchrun ... -m igrpo COMMAND ...` (or the `deepspeed` launcher
with igrpo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

from configs import ConfigError, load_config, to_dict, to_yaml
from configs.help import key_help
from configs.loader import RENAMED, diff_configs, renamed_tree, schema_defaults
from configs.schema import Config



# The config sections every command may read.
ALL_SECTIONS = tuple(f.name for f in fields(Config))


@dataclass(frozen=True)
class Command:
    """One `igrpo` command (the table `COMMANDS`, at the end of this file)."""
    help: str
    sections: tuple[str, ...]
    """The config sections it reads (its `--help` lists them)."""
    run: Callable | None = None
    """run(session) -> its result; None: the command runs before any session (plan, config)."""
    resumes: Callable | None = None
    """cfg -> the run folder whose recorded config must match for the command to resume it."""
    ignored: tuple[str, ...] = ()
    """Keys inside its sections that it still ignores (another key decides for it)."""
    reads_tags: bool = False
    """It writes or reads step-tagged reward-model inputs: the step tag is checked first."""
    example: str = ""
    """One invocation its `--help` shows (empty: `igrpo NAME --config configs/tiny.yaml`)."""


def strip_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher passes --local_rank(=N) before the command; the rank is read from
    the environment."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            out.append(arg)
    return out


def _command_parser(name: str) -> argparse.ArgumentParser:
    command = COMMANDS[name]
    text, sections = command.help, command.sections
    if not sections:  # (inspect) reads files, no config
        sub = argparse.ArgumentParser(prog=f"igrpo {name}", description=f"{text}; reads no config.",
                                      epilog=f"example:\n  {command.example}",
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("trace_dir", help="a GRPO stage's trace folder (<stage>/trace)")
        sub.add_argument("--out", default=None,
                         help="the page (default: trace.html beside TRACE_DIR)")
        return sub
    example = command.example or f"igrpo {name} --config configs/tiny.yaml"
    sub = argparse.ArgumentParser(
        prog=f"igrpo {name}", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{text}.\n\nConfig sections read: {', '.join(sections)} "
                    "(configs/schema.py documents every key).",
        epilog=f"example:\n  {example}\n\nconfig keys it reads (key = default, then the first "
               "sentence of its docstring in configs/schema.py):\n"
               + key_help(sections, command.ignored))
    if name == "config":
        sub.add_argument("action", choices=("show",))
    sub.add_argument("--config", default=None, help="YAML file overriding the schema defaults")
    sub.add_argument("--recipe", default=None, metavar="NAME",
                     help="a named algorithm from configs/recipes/ applied over the config "
                          "file (grpo, r1, dr_grpo, dapo, gpg, cispo, c3po, gspo, online_rft, "
                          "offline_rft, dpo, online_dpo, ppo, vc_ppo, vapo, t_ppo); key=value "
                          "overrides still win")
    sub.add_argument("overrides", nargs="*", help="key=value overrides, e.g. policy.group_size=16")
    if name == "plan":
        sub.add_argument("--gpus", type=int, default=8, help="GPUs per node")
        sub.add_argument("--nodes", type=int, default=1)
        sub.add_argument("--gpu-gb", type=float, nargs="+", default=[80.0, 141.0],
                         help="GPU memory sizes to check, in GB")
        sub.add_argument("--prompt-tokens", type=int, default=None,
                         help="prompt length assumed for the rollout and update "
                              "(default: data.max_prompt_tokens)")
    return sub


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """`igrpo COMMAND [--config F] [key=value ...]`; `igrpo COMMAND --help` is the command's own."""
    stages = tuple(COMMANDS)
    argv = strip_local_rank(sys.argv[1:] if argv is None else list(argv))
    top = argparse.ArgumentParser(
        prog="igrpo", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0].split(": ", 1)[1].replace(", GRPO", ",\nGRPO"),
        epilog="commands:\n" + "\n".join(f"  {n:<10} {COMMANDS[n].help}" for n in stages)
        + "\n\n`igrpo COMMAND --help` lists a command's options and the config sections it reads.")
    top.add_argument("command", choices=stages, metavar="COMMAND")
    if not argv or argv[0] not in stages:
        top.parse_args(argv[:1] or ["--help"])  # prints the help or names the bad command
    if argv[0] == "study":  # its own options (iteration/study.py), no config
        return argparse.Namespace(stage="study", rest=argv[1:])
    args = _command_parser(argv[0]).parse_intermixed_args(argv[1:])
    args.stage = argv[0]
    return args


def unread_overrides(stage: str, overrides: list[str]) -> list[str]:
    """Keys set on the command line that `stage` does not read."""
    sections = COMMANDS[stage].sections
    keys = [RENAMED.get(k, k) for k in (o.split("=", 1)[0].lstrip("+") for o in overrides)]
    return [k for k in keys if k.split(".")[0] not in sections or k in COMMANDS[stage].ignored]


def run_plan(cfg, args: argparse.Namespace) -> None:
    """`igrpo plan`: per-GPU memory of the configured GRPO run (configs/memory.py)."""
    from configs.memory import plan, render

    prompt_tokens = args.prompt_tokens or cfg.data.max_prompt_tokens
    rows, numbers = plan(cfg, args.gpus, args.nodes, prompt_tokens)
    print(render(rows, numbers, args.gpu_gb))


# Keys that change how a run executes, not what it computes: a run may resume with them changed.
# (run.root: the run folder was moved; its manifest's paths are relative.)
RESUME_FREE = ("run.root", "run.threads", "run.dist_timeout_minutes", "run.wandb_mode",
               "run.wandb_project", "run.wandb_log_checkpoints", "rm.score_output")


class Session:
    """What every stage needs: the config, its run folder and its YAML, the metrics logger."""

    def __init__(self, cfg, stage: str):
        import torch

        from runtime.dist import broadcast_from_main, init_distributed, is_main
        from runtime.rundir import RunDir

        from iteration.resolve import resolve

        self.cfg, self.stage = cfg, stage
        self.wiring = resolve(cfg)  # the config's strings as objects, once
        os.environ.setdefault("WANDB_SILENT", "true")
        if cfg.run.threads > 0:
            torch.set_num_threads(cfg.run.threads)
        torch.manual_seed(cfg.run.seed)
        init_distributed(cfg.run.dist_timeout_minutes)
        self.run = RunDir(cfg.run.root, cfg.run.name)
        self.config_yaml = to_yaml(cfg)
        problem = None
        if is_main():
            resumes = COMMANDS[stage].resumes
            folder = resumes(cfg) if resumes is not None else None
            problem = self._check_resume(folder) if folder else None
            if problem is None:
                self.run.write_config(self.config_yaml)
        problem = broadcast_from_main(problem)  # every rank stops with it, not rank 0 alone
        if problem is not None:
            raise ConfigError(problem)

    def _check_resume(self, stage: str) -> str | None:
        """Why a stage folder made with a different config refuses to resume (naming the keys),
        or None, once its config is recorded."""
        previous = self.run.read_config(f"{stage}/config.yaml")
        if previous is not None:
            previous = renamed_tree(previous, f"{stage}/config.yaml")  # an older run's keys
            changed = [k for k in diff_configs(previous, to_dict(self.cfg),
                                               defaults=schema_defaults())
                       if k not in RESUME_FREE]
            if changed:
                return (f"{self.run.path / stage} was made with a different config; differing "
                        f"keys: {', '.join(changed)}. Use a new run.name or restore those values.")
        self.run.write_config(self.config_yaml, f"{stage}/config.yaml")
        return None

    def logger(self, stage: str):
        from runtime.dist import is_main
        from runtime.tracking import MetricsLogger

        run = self.cfg.run
        return MetricsLogger(self.run.child(stage, "metrics.jsonl"), config=to_dict(self.cfg),
                             mode=run.wandb_mode, project=run.wandb_project,
                             name=f"{run.name}-{stage}", group=run.name,
                             job_type=stage.split("/")[0], enabled=is_main(),
                             log_checkpoints=run.wandb_log_checkpoints)


def base_policy(session: Session) -> Path:
    """`model.policy_path`, or the tiny model built (once) in `<run>/base`."""
    cfg = session.cfg
    if cfg.model.policy_path:
        return Path(cfg.model.policy_path) if Path(cfg.model.policy_path).exists() \
            else cfg.model.policy_path
    base = session.run.child("base")
    from runtime.dist import barrier, is_main

    if not (base / "config.json").exists() and is_main():
        from runtime.tiny_model import build_tiny

        build_tiny(base, cfg.model.tiny, cfg.run.seed, extra_tokens=(cfg.rm.step_tag,))
        print(f"[igrpo] built the tiny tokenizer and model in {base}")
    barrier()  # the other ranks read it
    return base


def check_step_tag(session: Session) -> None:
    """Before any sampling or training: the step tag must be one token in context for the
    reward models' tokenizer, or `rm.add_tag_token` must allow adding it (exit 2 otherwise).
    A classifier family reads no tag."""
    from reward_model.encoding import TagTokenError, check_tag_tokens
    from runtime.models import load_tokenizer

    cfg = session.cfg
    if cfg.rm.family not in ("", "tag_lm", "implicit"):  # (implicit: the loop's RMs are tag LMs)
        return
    backbone = cfg.rm.init_path or base_policy(session)
    try:
        check_tag_tokens(load_tokenizer(backbone, cfg.model), cfg.rm.step_tag)
    except TagTokenError as err:
        if not cfg.rm.add_tag_token:
            raise ConfigError(str(err)) from err


def warm_start(session: Session, required: bool = True) -> Path:
    """The policy GRPO starts from: `model.policy_path` if set, else this run's SFT export (with
    `required=False`, the base model where there is none)."""
    if session.cfg.model.policy_path or not session.cfg.sft.enabled:
        return base_policy(session)
    best = session.run.child("sft", "best")
    if not (best / "config.json").exists() and not required:
        return base_policy(session)
    if not (best / "config.json").exists():
        raise SystemExit(f"no warm start at {best}: run `igrpo sft` with the same config first, "
                         "or set model.policy_path")
    return best


def run_sft(session: Session) -> Path:
    from policy.algorithms.sft import train_sft

    w = session.wiring
    if not w.sft.enabled:
        raise ConfigError("sft.enabled=false: this config starts from model.policy_path as it "
                          "is; set sft.enabled=true to train a warm start")
    splits = w.splits()
    logger = session.logger("sft")
    try:
        return train_sft(w.stage, w.sft, session.run.path, base_policy(session), splits.sft,
                         splits.val, logger, session.config_yaml)
    finally:
        logger.close()


def run_grpo(session: Session) -> Path:
    from iteration.resolve import grpo_reward_problem, make_reward
    from runtime.models import load_tokenizer

    w = session.wiring
    problem = grpo_reward_problem(w)
    if problem:
        raise ConfigError(problem)
    splits = w.splits()
    start = warm_start(session)
    reward = make_reward(w, load_tokenizer(start, w.stage.model), w.reward,
                         online_reference=start)
    folder = policy_folder(session.cfg.run, session.cfg.policy.algorithm)
    logger = session.logger(folder)
    try:
        return w.train_policy(session.run.path, start, reward, splits.rl, splits.eval, logger,
                              session.config_yaml, out_name=folder)
    finally:
        logger.close()


def policy_folder(run, algorithm: str) -> str:
    """The folder of run section `run`'s run that `igrpo grpo`'s stage writes: named for
    `policy.algorithm` (`stage_folder`)."""
    from iteration.resolve import stage_folder

    return stage_folder(Path(run.root) / run.name, algorithm)


def newest_export(run: Path, patterns: tuple[str, ...]) -> Path | None:
    """The most recently written model among a run's exports matching `patterns` (a stage
    command's own, e.g. grpo/final or ppo/final, or those `iterate` wrote,
    grpo/iteration-k/final)."""
    found = [p for pattern in patterns for p in run.glob(pattern) if (p / "config.json").exists()]
    return max(found, key=lambda p: (p / "config.json").stat().st_mtime, default=None)


def run_eval(session: Session, checkpoint: Path | None = None) -> dict:
    from iteration import stages
    from policy.algorithms import TRAINERS
    from runtime.rundir import atomic_write_json

    cfg = session.cfg
    if checkpoint is None:
        checkpoint = Path(cfg.eval.checkpoint) if cfg.eval.checkpoint else newest_export(
            session.run.path, (*(f"{a}/final" for a in TRAINERS),
                               *(f"{a}/iteration-*/final" for a in TRAINERS), "sft/best"))
    if checkpoint is None:
        raise SystemExit("nothing to evaluate: set eval.checkpoint=PATH or train first")
    w = session.wiring
    model, tokenizer = stages.load_policy(w, checkpoint)
    folder = Path(checkpoint).parent
    name = f"{folder.parent.name}-{folder.name}" if folder.name.startswith("iteration-") \
        else folder.name  # grpo/iteration-2/final -> grpo-iteration-2 (eval/iteration-k is the loop's)
    # per held-out question, what the metrics summarise (paired comparisons, `igrpo study`)
    outcomes = session.run.child("eval", f"{name}.outcomes.json")
    metrics = stages.evaluate(w, model, tokenizer, w.splits().eval, outcomes_path=outcomes)
    metrics["checkpoint"] = str(checkpoint)
    atomic_write_json(session.run.child("eval", f"{name}.json"), metrics)
    print(json.dumps(metrics, indent=2))
    return metrics


def run_label(session: Session) -> Path:
    """Sample the warm start on the RL questions that iteration 0 of `iterate` labels, label every
    step Math-Shepherd style, and write a dataset `igrpo train-rm` reads."""
    from iteration import stages
    from process_supervision.formats import write_math_shepherd_jsonl
    from process_supervision.label import label_statistics
    from runtime.dist import is_main
    from runtime.rundir import atomic_write_json

    cfg = session.cfg
    out = session.run.child("labels")
    questions = stages.label_questions(session.wiring.splits().rl, cfg.label.questions, 0)
    labelled = stages.label(session.wiring, warm_start(session), questions, out)
    dataset = out / "math_shepherd.jsonl"
    if is_main():
        write_math_shepherd_jsonl(dataset, [x.example(soft=False) for x in labelled],
                                  cfg.rm.step_tag, soft_labels=[x.soft for x in labelled])
        stats = label_statistics(labelled)
        atomic_write_json(out / "stats.json", stats)
        print(json.dumps(stats, indent=2))
    return dataset


def rm_init(session: Session) -> str | Path:
    """The backbone a reward model starts from: `rm.init_path` (nothing is built in
    `<run>/base`), else the run's warm start (the tiny base model where no SFT ran)."""
    from iteration import stages

    if session.wiring.rm.settings.init_path:
        return session.wiring.rm.settings.init_path
    return stages.rm_backbone(session.wiring, warm_start(session, required=False))


def run_train_rm(session: Session) -> Path:
    from reward_model.examples import training_examples
    from reward_model.train import train_reward_model

    cfg = session.cfg
    splits = session.wiring.splits()
    examples = training_examples(cfg.rm, splits.rl, cfg.run.seed, cfg.label.soft)
    logger = session.logger(f"rm-{cfg.rm.kind}")
    try:
        return train_reward_model(session.wiring.rm, session.run.child(f"rm-{cfg.rm.kind}"),
                                  rm_init(session), examples, logger, session.config_yaml)
    finally:
        logger.close()


def run_eval_rm(session: Session) -> dict:
    """Report reward models: `rm.path` (any family, as `rm.kind`), else the run's newest
    (rm-orm, rm-prm, `iterate`'s included): step metrics on held-out labelled solutions, the PRM
    on `eval.prm_benchmark`, and best-of-N among the warm start's samples."""
    from iteration import stages
    from runtime.rundir import atomic_write_json

    cfg, w = session.cfg, session.wiring
    if cfg.eval.prm_benchmark:  # a bad file stops here, before any model loads
        stages.prm_benchmark(cfg.eval.prm_benchmark)
    if cfg.rm.path:
        paths = {cfg.rm.kind: Path(cfg.rm.path)}
    else:
        paths = {kind: newest_export(session.run.path, (f"rm-{kind}/final",
                                                        f"rm-{kind}/iteration-*/final"))
                 for kind in stages.KINDS}
    scorers = {kind: stages.load_scorer(w, path) for kind, path in paths.items() if path}
    if not scorers:
        raise SystemExit(f"no reward model in {session.run.path}: run `igrpo train-rm` first, "
                         "or name one with rm.path")
    model, tokenizer = stages.load_policy(w, warm_start(session)) \
        if cfg.rm.bon_questions else (None, None)
    report = stages.reward_model_report(w, scorers, model, tokenizer, w.splits().eval)
    report = {**report["rm"], **report.get("benchmark", {}),
              **{f"bon/{key}": v for key, v in report["bon"].items()}}
    atomic_write_json(session.run.child("eval", "reward_models.json"), report)
    print(json.dumps(report, indent=2))
    return report


def score_folder(rm) -> str | None:
    """`igrpo score`'s folder in the run, named by `rm.score_input`'s stem (None: no input)."""
    return f"score/{Path(rm.score_input).stem or 'input'}" if rm.score_input else None


def run_score(session: Session) -> Path:
    """`igrpo score`: `rm.path`'s score of each step of each solution in `rm.score_input`, the
    solution's score under `rm.aggregate` and each question's best-of-N pick, written beside
    the row's own fields to `rm.score_output` (reward_model/score_file.py: the layouts, the
    output's fields). Shards of `rm.score_shard_rows` rows are kept under
    `<run>/score/<input stem>/`, so the same command after a kill resumes; nothing is built in
    `<run>/base`."""
    from functools import partial

    from iteration import stages
    from reward_model import score_file
    from reward_model.encoding import TagTokenError, check_tag_tokens
    from reward_model.examples import as_orm
    from reward_model.losses import STEP_AGGREGATORS
    from runtime.dist import barrier, is_main
    from runtime.rundir import atomic_write_json

    rm, separator = session.wiring.rm.settings, session.wiring.data.step_separator
    if not rm.path or not rm.score_input:
        raise ConfigError("igrpo score: name the reward model with rm.path=DIR and the "
                          "solutions with rm.score_input=FILE")
    folder = session.run.child(score_folder(rm))
    # a bad row stops here, naming file, row and field, before any model loads
    source = score_file.read_score_input(rm.score_input, rm.step_tag, separator)
    scorer = stages.load_scorer(session.wiring, rm.path)
    if hasattr(scorer, "tags"):  # a tag LM reads the step tag: one token in context
        try:
            check_tag_tokens(scorer.tokenizer, rm.step_tag)
        except TagTokenError as err:
            raise ConfigError(f"rm.path={rm.path}: {err}") from err
    transform = partial(as_orm, separator=separator) if rm.kind == "orm" else None
    shards = folder / "shards" / score_file.model_fingerprint(rm.path)  # (retrained: rescored)
    score_file.score_in_shards(scorer, source, shards, rm.score_shard_rows,
                               STEP_AGGREGATORS[rm.aggregate], transform, progress=is_main())
    out = Path(rm.score_output) if rm.score_output else folder / "scored.jsonl"
    if is_main():
        summary = score_file.write_scored(out, source, shards, rm.score_shard_rows)
        summary.update(reward_model=str(rm.path), kind=rm.kind, aggregate=rm.aggregate)
        atomic_write_json(folder / "summary.json", summary)
        if "best_of_n_curve" in summary:
            score_file.write_curve(folder, summary["best_of_n_curve"])
        print(json.dumps(summary, indent=2))
    barrier()  # the other ranks return once the output is written
    return out


def run_iterate(session: Session) -> list[dict]:
    """DeepSeekMath's Algorithm 1 end to end (iteration/loop.py); resumes an existing run."""
    from iteration.loop import IterationRun
    from iteration.summary import table

    loop = IterationRun(session.wiring, session.run.path, base_policy(session),
                        session.wiring.splits(), session.logger, session.config_yaml)
    iterations = loop.run_all()
    print("\n" + table(iterations))
    print(f"\nsummary: {session.run.path / 'summary.json'}")
    print(f"accuracy plot: {session.run.path / 'accuracy.png'}")
    return iterations


ITERATE = Command("DeepSeekMath's Algorithm 1 end to end; resumes an existing run", ALL_SECTIONS,
                  run_iterate, lambda cfg: "iterate",
                  ignored=("policy.reward", "eval.checkpoint", "rm.kind", "rm.data_path"),
                  reads_tags=True, example="igrpo iterate --config configs/tiny.yaml")
COMMANDS = {
    "build-tiny": Command("build the tiny random model and its tokenizer into <run>/base",
                          ("run", "model"), base_policy,
                          example="igrpo build-tiny --config configs/tiny.yaml "
                                  "model.tiny.architecture=qwen2"),
    "sft": Command("supervised fine-tuning on worked solutions -> <run>/sft/best",
                   ("run", "data", "model", "deepspeed", "sft"), run_sft, lambda cfg: "sft",
                   example="igrpo sft --config configs/tiny.yaml model.policy_path= "
                           "sft.enabled=true"),
    "grpo": Command("GRPO (or the policy.algorithm of --recipe) alone from the warm start, "
                    "rewarded by policy.reward -> <run>/<policy.algorithm>/final",
                    ("run", "data", "model", "deepspeed", "sft", "policy", "grpo", "ppo", "rft",
                     "controls", "inspect", "watch", "eval", "rollout", "rm"),
                    run_grpo, lambda cfg: policy_folder(cfg.run, cfg.policy.algorithm),
                    example="igrpo grpo --config configs/tiny.yaml --recipe dapo "
                            "policy.group_size=16"),
    "eval": Command("held-out greedy, mean@k, maj@k, pass@k with 95% intervals of "
                    "eval.checkpoint (default: the run's newest policy)",
                    ("run", "data", "model", "sft", "eval", "rollout"), run_eval,
                    example="igrpo eval --config configs/tiny.yaml "
                            "eval.checkpoint=runs/tiny/grpo/final"),
    "label": Command("Math-Shepherd step labels of the policy's samples -> <run>/labels",
                     ("run", "data", "model", "sft", "label", "rm", "rollout"), run_label,
                     lambda cfg: "labels", reads_tags=True,
                     example="igrpo label --config configs/tiny.yaml label.num_completions=8"),
    "train-rm": Command("train an outcome or process reward model (rm.kind) -> "
                        "<run>/rm-<kind>/final",
                        ("run", "data", "model", "deepspeed", "sft", "label", "rm"),
                        run_train_rm, lambda cfg: f"rm-{cfg.rm.kind}", reads_tags=True,
                        example="igrpo train-rm --config configs/tiny.yaml rm.kind=prm "
                                "rm.data_path=runs/tiny/labels/math_shepherd.jsonl"),
    "eval-rm": Command("step metrics and best-of-N of the run's newest reward models",
                       ("run", "data", "model", "sft", "eval", "rm", "rollout"), run_eval_rm,
                       example="igrpo eval-rm --config configs/tiny.yaml rm.bon_samples=16"),
    "score": Command("score rm.score_input's solutions (Math-Shepherd, TRL stepwise, "
                     "ProcessBench, PRM800K, or plain question/solution rows split on "
                     "data.step_separator) by rm.path: each row plus step_scores, score "
                     "(rm.aggregate) and best_of_n -> <run>/score/<input>/scored.jsonl",
                     ("run", "data", "model", "rm"), run_score, lambda cfg: score_folder(cfg.rm),
                     example="igrpo score --config configs/tiny.yaml "
                             "rm.path=runs/tiny/rm-prm/final rm.score_input=solutions.jsonl"),
    "iterate": ITERATE,
    "demo": replace(ITERATE, help="the main job: = iterate (make demo runs it on "
                                  "configs/tiny.yaml)",
                    example="igrpo demo --config configs/tiny.yaml"),
    "plan": Command("memory per GPU of every phase of one GRPO iteration of the config; nothing "
                    "is run", ("data", "model", "deepspeed", "policy", "grpo", "eval", "label",
                                "rm", "rollout"),
                    example="igrpo plan --config configs/deepseekmath_7b.yaml --gpus 8"),
    "inspect": Command("one static HTML page of a GRPO stage's rollout traces: steps, groups, "
                       "tokens coloured by advantage, the wrong answers the update pushed up",
                       (), example="igrpo inspect runs/tiny/grpo/iteration-1/trace"),
    "study": Command("run a study's arms over seeds from a spec file (configs/studies/), or "
                     "write its report from the kept results", (),
                     example="igrpo study run --study configs/studies/deepseekmath.yaml --jobs 2"),
    "config": Command("`igrpo config show`: print the resolved config", ALL_SECTIONS,
                      example="igrpo config show --config configs/tiny.yaml policy.lr=3e-6"),
}


def main(argv: list[str] | None = None) -> int:
    """The CLI: the exit code. A rank of a several-process gloo job that succeeded exits here
    (`finish_process`): in a script that runs several commands under `torchrun` on CPU, only
    the last returns. The project's scripts run their commands in one process."""
    from runtime.dist import finish_process

    return finish_process(_run(argv))


def _run(argv: list[str] | None) -> int:
    args = _parse(argv)
    from runtime.rundir import UnsafePathError

    if args.stage == "study":
        from iteration.study import main as study, stop_on_sigterm

        stop_on_sigterm()
        return study(args.rest)
    if args.stage == "inspect":  # reads a trace folder, no config
        from policy.trace import write_trace_page

        try:
            print(write_trace_page(Path(args.trace_dir), args.out and Path(args.out)))
        except FileNotFoundError as err:
            print(f"igrpo: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg = load_config(args.config, args.overrides, recipe=args.recipe)
        for key in unread_overrides(args.stage, args.overrides):
            print(f"igrpo: warning: {key} is set but `igrpo {args.stage}` does not read it",
                  file=sys.stderr)
        if args.stage == "config":
            print(to_yaml(cfg), end="")
            return 0
        if args.stage == "plan":
            run_plan(cfg, args)
            return 0
        session = Session(cfg, args.stage)
        if COMMANDS[args.stage].reads_tags:
            check_step_tag(session)
        result = COMMANDS[args.stage].run(session)
    except (ConfigError, UnsafePathError) as err:
        print(f"igrpo: {err}", file=sys.stderr)
        return 2
    if isinstance(result, Path):  # one write: the ranks of a CPU job share the pipe
        sys.stdout.write(f"{result}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
