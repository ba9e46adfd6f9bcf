"""PPO with a critic (DeepSeekMath §4.1, the baseline GRPO replaces) and its value-based
successors VC-PPO and VAPO, on DeepSpeed engines for the actor and the critic.

Launch as GRPO with `policy.algorithm=ppo` (recipes ppo, vc_ppo, vapo). Each step draws the
questions GRPO would, G samples each, scored by the same reward callable. The token rewards
are the reward at the last token (process supervision: each step's reward at the step's last
token) plus the KL penalty -beta * log(pi/pi_ref) on every token (eq. 2); the critic values
every state; GAE gives the policy's advantages (`ppo.lam_actor`, or VAPO's length-adaptive
lambda) and the critic's targets (`ppo.lam_critic`). Then `policy.mu` passes, each one optimizer
step of the policy (the clipped surrogate of `policy.loss`, no KL term: it is in the reward) and
one of the critic (the clipped value loss). VC-PPO pretrains the critic on the starting policy's
samples first (`ppo.value_pretrain_steps`), VAPO adds an LM loss on right samples.
The critic is exported beside the policy (`<out>/critic`); resume restores both engines.
"""

from __future__ import annotations

import time
from pathlib import Path

from configs.schema import PolicyConfig
from policy.actor_critic import (end_value_step, finish_value_stage, forward_values, ppo_targets,
                                 rollout_logprobs, train_passes, value_metrics, value_stage)
from policy.engines import starts_at
from policy.sampling import make_sample, rollout_key, step_questions
from policy.scoring import Sampled
from policy.rewards import RewardFn
from policy.stage import PolicyStage, PPOSpec
from runtime.data import MathRecord
from runtime.dist import global_sum, world
from runtime.training import StageLoop, stage_done


def train_ppo(stage: PolicyStage, spec: PPOSpec, run_path: Path, policy_path: str | Path,
              reward_fn: RewardFn, rl_records: list[MathRecord], eval_records: list[MathRecord],
              logger, config_yaml: str, out_name: str = "ppo",
              reference_path: str | Path | None = None, evaluate_ends: bool = True) -> Path:
    """`policy.steps` PPO steps from `policy_path` (train_grpo's contract); returns the policy's
    export (`<run>/<out_name>/final`)."""
    p, seed = stage.policy, stage.seed
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    value = value_stage(stage, spec, out, f"{out_name} (ppo)", policy_path, reward_fn,
                        rl_records, eval_records, logger, reference_path, evaluate_ends)
    trainer = value.trainer
    rank, world_size = world()
    per_rank = p.questions_per_step // world_size
    while trainer.running():
        step = trainer.step
        started = time.perf_counter()
        timing = {"rollout": 0.0, "scoring": 0.0}
        sampled = make_sample(value.sampler, value.tokenizer, reward_fn, stage, rank, per_rank,
                              timing)(
            step_questions(rl_records, stage.question_offset + step, p.questions_per_step, seed),
            rollout_key(trainer.state.get("sample_seed", seed), step))
        value.sampler.rest()
        metrics = ppo_update(trainer, value.critic, value.reference, sampled, p, spec, value.plan,
                             f"{out_name} step {step + 1}",
                             step == 0 and starts_at(reference_path, policy_path))
        end_value_step(value, metrics, timing, started, p, evaluate_ends)
    return finish_value_stage(value, out, config_yaml)


def ppo_update(trainer: StageLoop, critic, reference, sampled: Sampled, p: PolicyConfig,
               spec: PPOSpec, plan, where: str, is_reference: bool = False) -> dict:
    """The rollout's log-probs and values, the targets, then `policy.mu` passes of one policy and
    one critic step each; returns the step's metrics."""
    rollout = sampled.rollout
    critic.eval()
    old_logprobs, ref_logprobs = rollout_logprobs(trainer, rollout, reference, p.mu, plan,
                                                  is_reference)
    values = forward_values(critic.module, rollout, plan.micro_batch_size)
    # groups holding a non-finite reward are left out of both losses (as GRPO leaves them out)
    kept = ~sampled.broken.repeat_interleave(p.group_size)
    targets = ppo_targets(rollout, sampled.scores, sampled.rewards, old_logprobs, ref_logprobs,
                          values, p.beta, spec, loss_mask=rollout.completion_mask * kept[:, None])
    right = sampled.scores.correct if sampled.scores.correct is not None \
        else sampled.rewards >= 0.5
    stats = train_passes(trainer, critic, rollout, targets, right, p, spec, plan, where)
    return {**value_metrics(rollout, sampled.rewards, sampled.scores.correct, targets,
                            ref_logprobs, stats),
            "reward/nonfinite_groups": global_sum(float(sampled.broken.sum()))}
