"""The resolver: the config's strings turned into objects once, at start-up.

Every variant named in the config (`policy.algorithm`, `policy.supervision`, `policy.loss`,
`grpo.process_credit`, `rollout.backend`) is looked up here, in the tables that define it, and
nowhere else: a loop receives the function or the flag, never the name. The command line's
allowed values come from the same tables (`configs/loader.py` `CHOICES`, checked against them
by tests/test_architecture.py).

    stage = policy_stage(cfg)             # PolicyStage: what every policy method reads
    train = policy_trainer(cfg)           # the method's trainer with its stage and spec bound
    train(run_path, policy_path, reward_fn, rl, held_out, logger, config_yaml)
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from policy.algorithms import TRAINERS
from policy.math.advantages import ADVANTAGE_ESTIMATORS, PROCESS_CREDIT, GroupNorm
from policy.math.losses import POLICY_LOSSES, PolicyLoss
from policy.stage import (DPOSpec, Evaluation, GRPOSpec, PolicyStage, PPOSpec, RFTSpec, Shaping,
                          VLLMSettings)
from runtime.data import step_oracle
from runtime.prompts import prompt_format


def per_step(supervision: str) -> bool:
    """Whether `policy.supervision` asks for a reward per step (process supervision)."""
    return supervision == "process"


def policy_loss(name: str, supervision: str) -> PolicyLoss:
    """`policy.loss`'s entry; gspo under process supervision is GSPO-token, the paper's form
    for per-token advantages (equal to GSPO wherever a sequence's tokens share one)."""
    if name == "gspo" and per_step(supervision):
        name = "gspo_token"
    return POLICY_LOSSES[name]


def grpo_spec(policy, grpo, controls) -> GRPOSpec:
    """GRPO's objective from the `policy`, `grpo` and `controls` sections. The one place that
    decides whether advantages are divided by the group std: `grpo.scale_by_std`, unless the
    loss's own convention is not to (Dr. GRPO, GPG)."""
    loss = policy_loss(policy.loss, policy.supervision)
    norm = GroupNorm(policy.group_size, grpo.scale_by_std and loss.std_normalised_advantages,
                     grpo.std_unbiased, grpo.std_eps, grpo.min_reward_std)
    process = per_step(policy.supervision)
    budget = round(grpo.token_budget_share * policy.questions_per_step * policy.group_size
                   * policy.max_new_tokens)
    return GRPOSpec(
        loss=loss.fn, norm=norm,
        estimator=None if process else ADVANTAGE_ESTIMATORS[policy.supervision],
        credit=PROCESS_CREDIT[grpo.process_credit] if process else None,
        process_weight=grpo.process_weight,
        dynamic_rounds=grpo.dynamic_sampling_max_rounds if grpo.dynamic_sampling else 0,
        overlong_filter=grpo.overlong_filter, zero_group_correction=grpo.zero_group_correction,
        token_budget=budget, zero_advantages=controls.zero_advantages)


def method_spec(cfg):
    """The spec of the method `policy.algorithm` names."""
    p, name = cfg.policy, cfg.policy.algorithm
    if name == "grpo":
        return grpo_spec(p, cfg.grpo, cfg.controls)
    if name in ("ppo", "t_ppo"):
        return PPOSpec(policy_loss(p.loss, p.supervision).fn, per_step(p.supervision), cfg.ppo,
                       critic_from_reward_model=cfg.ppo.critic_init == "reward_model")
    if name == "offline_rft":
        return RFTSpec(cfg.rft.sampling_share)
    return DPOSpec(online=name == "online_dpo")


def vllm_settings(model, rollout, data, lengths: tuple[int, int, int], seed: int
                  ) -> VLLMSettings | None:
    """The colocated vLLM engine's settings (None: `rollout.backend=hf`); `lengths`: the new
    tokens of the policy's rollouts, of evaluation and of Math-Shepherd's completions."""
    if rollout.backend != "vllm":
        return None
    return VLLMSettings(model.dtype, model.trust_remote_code, data.max_prompt_tokens,
                        lengths[0], max(lengths), seed, rollout.memory_fraction,
                        rollout.kv_cache_gb, rollout.prefix_caching, rollout.sleep,
                        rollout.cuda_graphs)


def evaluation(evals, data, seed: int) -> Evaluation:
    """The held-out evaluation of the `eval` section on the `data` section's task."""
    return Evaluation(evals.k, evals.temperature, evals.max_new_tokens, evals.batch_size,
                      evals.grade_timeout_s, seed, step_oracle(data), data.step_separator)


def policy_stage(cfg) -> PolicyStage:
    """What every policy method reads, from the config."""
    p = cfg.policy
    return PolicyStage(
        seed=cfg.run.seed, policy=p, model=cfg.model, deepspeed=cfg.deepspeed,
        vllm=vllm_settings(cfg.model, cfg.rollout, cfg.data, (
            p.max_new_tokens, cfg.eval.max_new_tokens, cfg.label.max_new_tokens), cfg.run.seed),
        prompts=prompt_format(cfg.data), evaluation=evaluation(cfg.eval, cfg.data, cfg.run.seed),
        shaping=Shaping(round(cfg.grpo.overlong_buffer_share * p.max_new_tokens),
                        cfg.grpo.overlong_penalty, cfg.controls.shuffle_rewards),
        inspect=cfg.inspect)


def policy_trainer(cfg) -> Callable:
    """train(run_path, policy_path, reward_fn, rl_records, eval_records, logger, config_yaml,
    **options): the trainer `policy.algorithm` names, with its stage and spec bound."""
    return partial(TRAINERS[cfg.policy.algorithm], policy_stage(cfg), method_spec(cfg))


def train_policy(cfg, run_path, policy_path, reward_fn, rl_records, eval_records, logger,
                 config_yaml: str, **options):
    """Resolve the config and run the policy method it names (train_grpo's contract)."""
    return policy_trainer(cfg)(run_path, policy_path, reward_fn, rl_records, eval_records, logger,
                               config_yaml, **options)
