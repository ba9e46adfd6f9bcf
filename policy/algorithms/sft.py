"""SFT warm start: supervised training on a fixed, limited set of worked solutions.

Launch: `igrpo sft --config configs/tiny.yaml [key=value ...]` (one process), or under
`torchrun --nproc_per_node N -m igrpo sft ...`. Trains through the same DeepSpeed engine as GRPO,
evaluates greedy accuracy on validation questions (`data.val_questions`, disjoint from the
held-out set the loop reports) every `sft.eval_every` steps, keeps the best export (`sft/best`;
with `sft.export_final` also the last, `sft/final`), and stops
early once `sft.patience` evaluations in a row bring no new best: the warm start is trained
until more SFT on its set stops helping (as the paper's instruct model is, before RL).
Re-running the same command resumes from the last evaluation.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from configs.schema import SFTConfig
from policy.evaluate import evaluate_policy
from policy.engines import trainable_policy
from policy.stage import Evaluation, PolicyStage
from policy.supervised import sft_tensors, supervised_step
from runtime.batching import plan_batch
from runtime.checkpoint import export, recover_export
from runtime.data import MathRecord
from runtime.dist import world
from runtime.engine import build_engine, current_lr, gathered_for_generation
from runtime.models import load_tokenizer
from runtime.training import StageLoop, epoch_slice, stage_done
from runtime.seeds import derive_seed


def _check_worked_solutions(records: list[MathRecord]) -> None:
    """SFT needs a worked solution in every record; stop before training, naming the first."""
    missing = [r.source_id for r in records if not r.solution_steps]
    if missing:
        raise ValueError(f"sft: {len(missing)} of {len(records)} SFT records have no worked "
                         f"solution (first: {missing[0]}): set data.solution_field, or "
                         "sft.enabled=false to start from model.policy_path as it is")


def train_sft(stage: PolicyStage, sft: SFTConfig, run_path: Path, policy_path: str | Path,
              sft_records: list[MathRecord], val_records: list[MathRecord], logger,
              config_yaml: str) -> Path:
    """Train the warm start; returns the folder of the best export (`<run>/sft/best`), the best
    by greedy accuracy on `val_records` (not the held-out questions the policy is scored on)."""
    out = run_path / "sft"
    best_dir = out / "best"
    if stage_done(out):
        return best_dir
    _check_worked_solutions(sft_records)
    recover_export(best_dir)
    tokenizer = load_tokenizer(policy_path, stage.model)
    model = trainable_policy(policy_path, stage.model)
    plan = plan_batch(sft.batch_size, stage.deepspeed.micro_batch_size, world()[1],
                      f"sft.batch_size={sft.batch_size}")
    total_steps = math.ceil(sft.epochs * max(1, len(sft_records) // plan.global_sequences))
    engine = build_engine(model, stage.deepspeed, lr=sft.lr,
                          micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum,
                          decay_steps=total_steps if sft.lr_decay else 0)
    trainer = StageLoop(out, engine, logger, total_steps, desc="sft",
                      fresh_state={"best": -1.0, "stale": 0})
    validate = validator(engine, tokenizer, val_records, stage.prompts, stage.evaluation)
    if trainer.state["step"] == 0:
        trainer.state["best"] = validate()
        export(engine, tokenizer, best_dir, config_yaml)
        trainer.log({"val/greedy_accuracy": trainer.state["best"]})
    sft_steps(trainer, tokenizer, sft_records, plan, stage, sft, validate,
              lambda: export(engine, tokenizer, best_dir, config_yaml))
    trainer.finish(tokenizer, out / "final" if sft.export_final else None, config_yaml,
                   {"steps": trainer.state["step"],
                    "best_val_greedy_accuracy": trainer.state["best"]})
    return best_dir


def sft_steps(trainer: StageLoop, tokenizer, sft_records: list[MathRecord], plan,
              stage: PolicyStage, sft: SFTConfig, validate, export_best) -> None:
    """The supervised steps (a seeded order, reshuffled per epoch), validated every
    `sft.eval_every` steps, a new best exported (`export_best`) and the state saved then."""
    rank, engine = world()[0], trainer.engine
    engine.train()
    while trainer.running():
        step = trainer.state["step"]
        epoch, batch_ids = epoch_slice(len(sft_records), step, plan.global_sequences,
                                       derive_seed(stage.seed, "sft-order"))
        mine = batch_ids[rank * plan.rank_sequences:(rank + 1) * plan.rank_sequences]
        started = time.perf_counter()
        batch = sft_tensors(tokenizer, [sft_records[i] for i in mine], stage.prompts)
        loss, grad_norm = supervised_step(trainer, batch, plan, f"sft step {step + 1}")
        trainer.advance()
        metrics = {"train/loss": loss, "train/lr": current_lr(engine),
                   "train/grad_norm": grad_norm, "time/step": time.perf_counter() - started,
                   "train/epoch": epoch}
        validated = trainer.due(sft.eval_every)
        if validated:
            metrics["val/greedy_accuracy"] = _keep_best(trainer, validate(), sft, export_best)
        trainer.log(metrics)  # (before the save: a kill between the two redoes this step)
        if validated:
            trainer.save()


def validator(engine, tokenizer, val_records: list[MathRecord], fmt, evaluation: Evaluation):
    """validate() -> greedy accuracy of the model in training on `val_records`, the questions
    spread over the ranks (every rank calls it)."""
    def validate() -> float:
        with gathered_for_generation(engine):
            return evaluate_policy(
                engine.module, tokenizer, val_records, fmt, k=1, temperature=0.0,
                max_new_tokens=evaluation.max_new_tokens, batch_size=evaluation.batch_size,
                timeout_s=evaluation.timeout_s, sampled=False)["eval/greedy_accuracy"]
    return validate


def _keep_best(trainer: StageLoop, accuracy: float, sft, export_best) -> float:
    """After a validation: export a new best, stop at `sft.stop_at` or after `sft.patience`
    validations without a new best (the caller saves the state)."""
    state = trainer.state
    if accuracy > state["best"]:
        state["best"], state["stale"] = accuracy, 0
        export_best()
    else:
        state["stale"] += 1
    trainer.bar.set_postfix(acc=f"{accuracy:.3f}", best=f"{state['best']:.3f}")
    reached = sft.stop_at and accuracy >= sft.stop_at
    trainer.stopped = bool(reached or (sft.patience and state["stale"] >= sft.patience))
    return accuracy
