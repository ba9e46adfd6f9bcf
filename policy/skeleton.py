"""The skeleton every online policy stage shares (GRPO and its recipes, DPO, PPO and T-PPO): its
trainer, the end of each step and the end of the stage. An algorithm's file holds only what
differs: how a step samples, learns and what it logs.

    trainer = stage_trainer(stage, out, engine, logger, desc)      # after its engines
    while trainer.running():
        ...sample, learn, trainer.advance(), metrics...
        end_step(trainer, metrics, stage.policy, evaluate, evaluate_ends)
    return finish_stage(trainer, sampler, tokenizer, out, config_yaml)

The rollouts of step s are keyed `rollout_key(trainer.state["sample_seed"], s)`
(policy/sampling.py), one convention for every algorithm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from configs.schema import PolicyConfig
from policy.engines import Sampler
from policy.evaluate import due_evaluation
from policy.sampling import sampling_seed
from policy.stage import PolicyStage
from runtime.training import StageLoop


def stage_trainer(stage: PolicyStage, out: Path, engine, logger, desc: str, *,
                  max_seconds: float | None = None, companions: dict | None = None) -> StageLoop:
    """The stage's loop in `out` over `policy.steps` steps, its wall-clock budget
    `policy.max_minutes` (or `max_seconds`: what a pretraining phase left), with the stage's
    sampling seed drawn into its fresh state (kept in its saved state; `sampling_seed`)."""
    budget = stage.policy.max_minutes * 60 if max_seconds is None else max_seconds
    return StageLoop(out, engine, logger, stage.policy.steps, desc=desc, max_seconds=budget,
                     companions=companions, fresh_state={"sample_seed": sampling_seed()})


def end_step(trainer: StageLoop, metrics: dict, p: PolicyConfig, evaluate: Callable,
             evaluate_ends: bool, inspect: Callable[[], object] = lambda: None) -> None:
    """Close a step whose update is done and counted (`trainer.advance()`, before its metrics):
    log its metrics with the held-out evaluation when one is due (and `inspect()`'s record,
    made after it), and save the state every `policy.save_every` steps and when the stage stops
    early (its budget, a guard)."""
    metrics = {**metrics, **due_evaluation(trainer, p, evaluate, evaluate_ends)}
    trainer.log(metrics, inspect())
    if trainer.due(p.save_every) or trainer.stopped:
        trainer.save()


def finish_stage(trainer: StageLoop, sampler: Sampler, tokenizer, out: Path, config_yaml: str,
                 before: Callable[[], None] = lambda: None) -> Path:
    """Export the final policy into `<out>/final` and write done.json (its steps, seconds and,
    where it fired, the guard's record); vLLM's pool is freed first (the export gathers a ZeRO-3
    policy), and `before()` exports what the stage adds (PPO's critic)."""
    sampler.rest()
    before()
    trainer.finish(tokenizer, out / "final", config_yaml,
                   {"steps": trainer.step, "seconds": trainer.state.get("seconds", 0.0),
                    **({"guard": trainer.state["guard"]} if "guard" in trainer.state else {})})
    return out / "final"
