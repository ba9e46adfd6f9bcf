"""DPO (Rafailov et al. 2023) as DeepSeekMath §5.2.1 and Appendix A.1.4 write it.

Each step samples G completions for each of its questions and judges them with the reward
callable (the rule, or a reward model under `igrpo iterate`); within a question, the best
sample is paired with the worst, the second best with the second worst, and so on while the
first is rewarded above the second (a question whose samples are all alike gives no pair). The
loss is DeepSeekMath's (eq. 14), over the step's pairs:

    -log sigmoid(beta * (lr(o+) - lr(o-))),  lr(o) = 1/|o| sum_t log pi/pi_ref (o_t)

(Rafailov et al. sum the log-ratios instead of averaging them), with `policy.beta` as DPO's beta
and the reference frozen for the stage (the outer loop resets it to the current policy every
iteration, as Algorithm 1 does for GRPO). Its gradient is the paper's: a coefficient
beta * sigmoid(beta * (lr(o-) - lr(o+))) on every token of o+ and its negative on o-, under
1/|o| (docs/grpo.md, "One gradient").

Two data sources, one trainer each (`policy.algorithm`):
- `dpo`: pairs from the starting policy's samples (the paper's DPO: the SFT model's samples),
  drawn with transformers from a frozen copy of it, seeded by the step, so a resumed run draws
  the same pairs.
- `online_dpo`: pairs from the current policy's samples, drawn as GRPO draws them (either
  rollout backend).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import torch

from configs.schema import ModelConfig
from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import Rollout
from policy.engines import Sampler, policy_engines, reference_logprobs, starts_at
from policy.evaluate import make_evaluator
from policy.sampling import make_sample, rollout_key, step_questions
from policy.scoring import Sampled
from policy.skeleton import end_step, finish_stage, stage_trainer
from policy.math.losses import dpo_loss
from policy.rewards import RewardFn
from policy.stage import DPOSpec, PolicyStage
from runtime.data import MathRecord
from runtime.dist import gather_rows, global_sum, world
from runtime.engine import current_lr, rank_loss
from runtime.models import load_causal_lm
from runtime.training import StageLoop, stage_done


class StartingPolicySampler(Sampler):
    """Generates with a frozen copy of the starting policy (on the engine's device, with
    transformers): offline DPO's data source."""

    def __init__(self, engine, trainer: StageLoop, model: ModelConfig, policy_path):
        self.engine, self.trainer, self.vllm = engine, trainer, None
        self.model = load_causal_lm(policy_path, model, device=engine.device).eval()

    @contextmanager
    def generating(self):
        yield self.model


def preference_pairs(rewards: torch.Tensor, group_size: int,
                     broken: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [N], role [N]): the rows of a step rearranged so that each pair sits at an even
    position (chosen) and the next (rejected), the unpaired rows after them; role is +1 on a
    chosen row, -1 on a rejected one, 0 elsewhere. Within a group the i-th best sample pairs
    with the i-th worst while its reward is higher (ties keep the rollout's order); a group with
    a non-finite reward (`broken`) gives none."""
    pairs, rest = [], []
    for q, group in enumerate(rewards.detach().float().cpu().view(-1, group_size)):
        ranked = sorted(range(group_size), key=lambda j: (-float(group[j]), j))
        used = set()
        for i in range(group_size // 2):
            best, worst = ranked[i], ranked[group_size - 1 - i]
            if bool(broken[q]) or not group[best] > group[worst]:
                break
            pairs += [q * group_size + best, q * group_size + worst]
            used |= {best, worst}
        rest += [q * group_size + j for j in range(group_size) if j not in used]
    role = torch.tensor([1.0, -1.0] * (len(pairs) // 2) + [0.0] * len(rest))
    return torch.tensor(pairs + rest, dtype=torch.long), role


def dpo_update(trainer: StageLoop, reference, rollout: Rollout, role: torch.Tensor, beta: float,
               plan, where: str, is_reference: bool) -> dict:
    """One optimizer step of DPO's loss over the step's pairs (rows already in pair order:
    `preference_pairs`). `is_reference`: the policy still is the reference, whose log-probs are
    then the policy's own (no reference forward). Returns the global loss, the pairs' mean
    implicit-reward margin and accuracy (margin > 0), and the gradient norm."""
    engine, world_size = trainer.engine, world()[1]
    role = role.to(rollout.completion_ids.device)
    num_pairs = global_sum(float((role > 0).sum()))
    stats = {"loss": 0.0, "margin": 0.0, "accuracy": 0.0}
    if num_pairs == 0:  # no pair anywhere: AdamW's momentum alone would move the weights
        return {**stats, "grad_norm": 0.0, "pairs": 0.0, "skipped": 1.0}
    ref_logprobs = reference_logprobs(reference, rollout, plan.micro_batch_size, is_reference)
    engine.train()

    def loss_of(rows: slice, mb: int):
        logprobs = completion_logprobs(engine, rollout.input_ids[rows],
                                       rollout.attention_mask[rows], rollout.prompt_ids.shape[1])
        ref = logprobs.detach() if ref_logprobs is None else ref_logprobs[rows]
        result = dpo_loss(logprobs, ref, rollout.completion_mask[rows], role[rows], beta=beta,
                          num_pairs=num_pairs)
        stats["loss"] += result.loss.item()
        stats["margin"] += result.margin_sum.item() / num_pairs
        stats["accuracy"] += result.right_sum.item() / num_pairs
        return rank_loss(result.loss, world_size)

    grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of, where)
    return {**{key: global_sum(value) for key, value in stats.items()},
            "grad_norm": grad_norm, "pairs": num_pairs, "skipped": 0.0}


def train_dpo(stage: PolicyStage, spec: DPOSpec, run_path: Path, policy_path: str | Path,
              reward_fn: RewardFn, rl_records: list[MathRecord], eval_records: list[MathRecord],
              logger, config_yaml: str, out_name: str = "dpo",
              reference_path: str | Path | None = None, evaluate_ends: bool = True) -> Path:
    """DPO on pairs from the starting policy's samples (or, `spec.online`, the current
    policy's, every step); train_grpo's contract."""
    p, seed = stage.policy, stage.seed
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    tokenizer, plan, reference, trainer, policy_sampler = start_stage(
        stage, out, out_name, logger, policy_path, reference_path)
    sampler = policy_sampler if spec.online else StartingPolicySampler(
        trainer.engine, trainer, stage.model, policy_path)
    evaluate = make_evaluator(stage.evaluation, policy_sampler, tokenizer, eval_records,
                              stage.prompts, trainer, evaluate_ends)
    rank, world_size = world()
    while trainer.running():
        step, timing = trainer.step, {"rollout": 0.0, "scoring": 0.0}
        sample = make_sample(sampler, tokenizer, reward_fn, stage, rank,
                             p.questions_per_step // world_size, timing)
        sampled = sample(step_questions(rl_records, stage.question_offset + step,
                                        p.questions_per_step, seed),
                         rollout_key(trainer.state.get("sample_seed", seed), step))
        updating = time.perf_counter()
        policy_sampler.rest()
        order, role = preference_pairs(sampled.rewards, p.group_size, sampled.broken)
        stats = dpo_update(trainer, reference, sampled.rollout.rows(order.to(
            sampled.rewards.device)), role, p.beta, plan, f"{out_name} step {step + 1}",
            is_reference=step == 0 and starts_at(reference_path, policy_path))
        timing["update"] = time.perf_counter() - updating
        trainer.advance()
        end_step(trainer, dpo_metrics(sampled, stats, timing, current_lr(trainer.engine),
                                      policy_sampler.stats()), p, evaluate, evaluate_ends)
    return finish_stage(trainer, policy_sampler, tokenizer, out, config_yaml)


def start_stage(stage: PolicyStage, out: Path, out_name: str, logger, policy_path,
                reference_path) -> tuple:
    """(tokenizer, batch plan, reference, trainer, the policy's sampler) of a DPO stage in
    `out`, after DPO's own checks: a beta above 0, micro-batches that hold whole pairs."""
    if stage.policy.beta <= 0:
        raise ValueError(f"DPO ({out}): policy.beta={stage.policy.beta}; DPO's beta must be "
                         "above 0 (the dpo and online_dpo recipes set 0.1)")
    tokenizer, plan, engine, reference = policy_engines(stage, policy_path, reference_path)
    if plan.micro_batch_size % 2:
        raise ValueError(f"DPO ({out}): micro-batches of {plan.micro_batch_size} rows would "
                         "split a pair; set deepspeed.micro_batch_size (and the samples per "
                         "rank) even")
    trainer = stage_trainer(stage, out, engine, logger, out_name)
    return tokenizer, plan, reference, trainer, Sampler(engine, trainer, stage.vllm, policy_path)


def dpo_metrics(sampled: Sampled, stats: dict, timing: dict, lr: float,
                sampler_stats: dict) -> dict:
    """A DPO step's metrics over every rank's samples (all ranks call it)."""
    rewards, lengths = gather_rows(sampled.rewards.float(), sampled.rollout.lengths.float())
    metrics = {"reward/mean": float(rewards.mean()),
               "rollout/length_mean": float(lengths.mean()),
               "train/loss": stats["loss"], "train/grad_norm": stats["grad_norm"],
               "train/skipped_step": stats["skipped"], "dpo/pairs": stats["pairs"],
               "dpo/margin": stats["margin"], "dpo/accuracy": stats["accuracy"],
               "train/lr": lr, "time/rollout": timing["rollout"],
               "time/scoring": timing["scoring"], "time/update": timing["update"],
               **sampler_stats}
    if sampled.scores.correct is not None:
        metrics["reward/accuracy"] = float(gather_rows(sampled.scores.correct.float())[0].mean())
    return metrics
