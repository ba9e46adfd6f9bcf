"""The resolver: the config's strings turned into objects once, at start-up.

Every variant named in the config (`policy.algorithm`, `policy.supervision`, `policy.loss`,
`grpo.process_credit`, `rollout.backend`) is looked up here, in the tables that define it, and
nowhere else: a loop receives the function or the flag, never the name. The command line's
allowed values come from the same tables (`configs/loader.py` `CHOICES`, checked against them
by tests/test_architecture.py).

    w = resolve(cfg)                      # once, at start-up: a `Resolved`
    w.stage                               # PolicyStage: what every policy method reads
    w.train_policy(run_path, policy_path, reward_fn, rl, held_out, logger, config_yaml)
    w.rm                                  # RMSpec: what reward-model training reads
    w.rm.settings                         # its `rm` section

The stages (iteration/stages.py) and the outer loop (iteration/loop.py) take the `Resolved`;
below them, every function takes its explicit arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import yaml

from configs.schema import DataConfig, EvalConfig, IterateConfig, LabelConfig, SFTConfig

from policy.algorithms import TRAINERS
from policy.math.advantages import ADVANTAGE_ESTIMATORS, PROCESS_CREDIT, GroupNorm
from policy.math.losses import POLICY_LOSSES, PolicyLoss
from policy.stage import (DPOSpec, Evaluation, GRPOSpec, PolicyStage, PPOSpec, RFTSpec, Shaping,
                          VLLMSettings)
from reward_model.train import RMSpec
from runtime.data import Splits, load_splits, step_oracle
from tasks.prompts import prompt_format


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
        loss=loss.fn, norm=norm, beta=policy.beta, clip_low=policy.clip_eps,
        clip_high=policy.clip_eps_high, max_tokens=policy.max_new_tokens,
        estimator=None if process else ADVANTAGE_ESTIMATORS[policy.supervision],
        credit=PROCESS_CREDIT[grpo.process_credit] if process else None,
        process_weight=grpo.process_weight,
        filter_groups=grpo.dynamic_sampling, dynamic_rounds=grpo.dynamic_sampling_max_rounds,
        overlong_filter=grpo.overlong_filter, zero_group_correction=grpo.zero_group_correction,
        token_budget=budget if grpo.token_budget_share else None,
        zero_advantages=controls.zero_advantages, supervision=policy.supervision,
        tis_cap=policy.tis_cap)


def _method_spec(cfg):
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
                        rollout.cuda_graphs,
                        model.lora.rank if rollout.lora_push == "adapter" else 0)


def evaluation(evals, data, seed: int) -> Evaluation:
    """The held-out evaluation of the `eval` section on the `data` section's task."""
    return Evaluation(evals.k, evals.temperature, evals.max_new_tokens, evals.batch_size,
                      evals.grade_timeout_s, seed, step_oracle(data), data.step_separator)


def rm_spec(rm, model, deepspeed, seed: int, run_name: str) -> RMSpec:
    """What reward-model training reads. It trains the tag LM and the token-classification
    families; a sequence classifier (an ORM read as it is) is only scored with. Under
    `rm.family=implicit` (GRPO's online reward) the outer loop's own reward models, which its
    reports read, are tag LMs."""
    return RMSpec(rm, model, deepspeed, seed, run_name,
                  token_classifier=rm.family == "token_classification",
                  trainable=rm.family in ("", "tag_lm", "token_classification", "implicit"),
                  pooled=rm.backend == "vllm")


@dataclass(frozen=True)
class Resolved:
    """The config resolved once: what the stages of Algorithm 1 and the outer loop read. The
    policy side's objects (`stage`, `method`, `train_policy`) and the reward models' (`rm`),
    the switches decided here (`per_step`: process supervision), and the sections the stages
    read as they are."""
    seed: int
    stage: PolicyStage
    method: object
    """The spec of `policy.algorithm` (GRPOSpec, PPOSpec, RFTSpec, DPOSpec)."""
    train_policy: Callable
    """train(run_path, policy_path, reward_fn, rl_records, eval_records, logger, config_yaml,
    **options): that method's trainer with `stage` and `method` bound."""
    algorithm: str
    """`policy.algorithm`: its trainer's, and its stages' folder's, name (`stage_folder`)."""
    per_step: bool
    reward: str
    """`policy.reward` (`igrpo grpo`'s reward: rule, step_oracle, rm; see `make_reward`)."""
    rm: RMSpec
    data: DataConfig
    evals: EvalConfig
    label: LabelConfig
    sft: SFTConfig
    iterate: IterateConfig

    @property
    def worked_questions(self) -> int:
        """Real data: the training questions that leave the RL pool as worked solutions,
        `data.sft_questions` with an SFT stage, else the first reward models'
        `rm.worked_solutions` (0 by default): a run from an instruct model keeps every one."""
        return self.data.sft_questions if self.sft.enabled else self.rm.settings.worked_solutions

    def policy_trainer(self, question_offset: int, init_path: str | None = None,
                       steps: int | None = None) -> Callable:
        """`train_policy` drawing its questions from step `question_offset` of the RL question
        stream on (`PolicyStage.question_offset`), its watch measuring KL from `init_path`, for
        `steps` steps (default `policy.steps`)."""
        from omegaconf import OmegaConf

        policy = self.stage.policy if steps is None else \
            OmegaConf.merge(self.stage.policy, {"steps": steps})  # (a structured config)
        return partial(TRAINERS[self.stage.policy.algorithm],
                       replace(self.stage, question_offset=question_offset, init_path=init_path,
                               policy=policy), self.method)

    def splits(self) -> Splits:
        """The run's splits (`runtime.data.load_splits`), `worked_questions` out of RL's."""
        return load_splits(self.data, self.seed, worked_questions=self.worked_questions)


def resolve(cfg) -> Resolved:
    """The config's strings turned into objects, once."""
    p, seed = cfg.policy, cfg.run.seed
    stage = PolicyStage(
        seed=seed, policy=p, model=cfg.model, deepspeed=cfg.deepspeed,
        vllm=vllm_settings(cfg.model, cfg.rollout, cfg.data, (
            p.max_new_tokens, cfg.eval.max_new_tokens, cfg.label.max_new_tokens), seed),
        prompts=prompt_format(cfg.data), evaluation=evaluation(cfg.eval, cfg.data, seed),
        shaping=Shaping(round(cfg.grpo.overlong_buffer_share * p.max_new_tokens),
                        cfg.grpo.overlong_penalty, cfg.controls.shuffle_rewards,
                        cfg.grpo.gold_share, seed),
        inspect=cfg.inspect, watch=cfg.watch)
    method = _method_spec(cfg)
    return Resolved(seed, stage, method,
                  partial(TRAINERS[p.algorithm], stage, method), p.algorithm,
                  per_step(p.supervision),
                  p.reward, rm_spec(cfg.rm, cfg.model, cfg.deepspeed, seed, cfg.run.name),
                  cfg.data, cfg.eval, cfg.label, cfg.sft, cfg.iterate)


def make_reward(w: Resolved, policy_tokenizer, choice: str,
                load_scorers: Callable[[list[str]], dict] | None = None,
                online_init: str | Path | None = None,
                online_reference: str | Path | None = None):
    """The GRPO reward callable `choice` names: `rule` (the final answer against the gold
    one), `step_oracle` (synthetic task: each step's true correctness), or `rm`: the PRM's step
    scores under process supervision, else the ORM's. `load_scorers(kinds)` gives the reward
    models ({kind: scorer of any family, or a list of them: an ensemble's members, rewarding by
    their aggregate, reward_model/ensemble.py}); without it, `rm.path`'s. With `rm.online` the reward
    model learns during the stage, started from `online_init` (default `rm.path`): the ORM
    (`OnlineORM`), or with `rm.family=implicit` PRIME's implicit PRM (`OnlineImplicitPRM`)
    against the frozen `online_reference` (the policy's warm start)."""
    from policy.rewards import RuleReward
    from process_supervision.oracle import StepOracleReward
    from reward_model.score import ORMReward, PRMReward
    from reward_model.vllm_scorer import load_scorer

    timeout = w.stage.evaluation.timeout_s
    if choice == "rule":
        return RuleReward(timeout)
    if choice == "step_oracle":
        return StepOracleReward(policy_tokenizer, timeout)
    kind = "prm" if w.per_step else "orm"
    if w.rm.settings.online:
        from reward_model.implicit import OnlineImplicitPRM
        from policy.scoring import UpdatedFirst
        from reward_model.online import OnlineORM
        from runtime.batching import plan_grpo_batch
        from runtime.dist import world

        p, rm = w.stage.policy, w.rm.settings
        plan = plan_grpo_batch(p.questions_per_step, p.group_size,
                               w.stage.deepspeed.micro_batch_size, world()[1])
        if rm.family == "implicit":
            learner = OnlineImplicitPRM(w.stage.model, w.stage.deepspeed,
                                        online_init or rm.path or online_reference,
                                        online_reference, plan, rm.online_lr or rm.lr,
                                        rm.implicit_beta, policy_tokenizer,
                                        w.data.step_separator, timeout)
        else:
            learner = OnlineORM(w.rm, online_init or rm.path, plan, rm.online_lr or rm.lr,
                                timeout)
        return UpdatedFirst(learner) if rm.online_update == "before" else learner
    rm = w.rm.settings
    loaded = load_scorers([kind])[kind] if load_scorers is not None else \
        load_scorer(rm.path, rm, w.stage.model, w.rm.pooled)

    def reward_of(scorer):
        if w.per_step:
            return PRMReward(scorer, policy_tokenizer, rm.aggregate, timeout,
                             w.data.step_separator)
        return ORMReward(scorer, timeout)

    if not isinstance(loaded, list):
        return reward_of(loaded)
    from reward_model.ensemble import EnsembleReward
    from reward_model.losses import STEP_AGGREGATORS

    return EnsembleReward([reward_of(s) for s in loaded], rm.ensemble_aggregate,
                          rm.ensemble_lambda, STEP_AGGREGATORS[rm.aggregate])


def grpo_reward_problem(w: Resolved) -> str | None:
    """Why `igrpo grpo`'s reward (`policy.reward`) cannot train this config, or None (the outer
    loop rewards with the reward models it trains, `iterate.reward`)."""
    if w.reward == "rm" and not w.rm.settings.path and not w.rm.settings.family == "implicit":
        return ("policy.reward=rm: name the reward model with rm.path (any family); "
                "`igrpo iterate` rewards with the reward models it trains")
    if w.rm.settings.online and w.reward != "rm":
        return (f"rm.online with policy.reward={w.reward}: the online reward model is the "
                "reward it trains; set policy.reward=rm (and rm.path to the ORM it starts "
                "from; the implicit PRM starts from the warm start without one)")
    if w.per_step and w.reward == "rule":
        return ("policy.supervision=process needs step rewards: set policy.reward=step_oracle, "
                "or run `igrpo iterate` (which rewards with the PRM)")
    if w.rm.settings.ensemble > 1 and w.reward == "rm":
        return (f"rm.ensemble={w.rm.settings.ensemble} with `igrpo grpo`: the ensemble's members "
                "are trained by `igrpo iterate`, which rewards GRPO with them; rm.path names one "
                "reward model")
    return None


def loop_reward_problem(w: Resolved) -> str | None:
    """Why `igrpo iterate` cannot reward GRPO as configured, or None: the online ORM is GRPO's
    reward (`iterate.reward=rm`) carried from one iteration to the next, which a refresh (each
    iteration's, or the guard's) would replace."""
    if w.rm.settings.online and (w.iterate.refresh or w.iterate.reward != "rm"
                                 or w.stage.watch.guard == "refresh"):
        return (f"rm.online with iterate.reward={w.iterate.reward}, iterate.refresh="
                f"{w.iterate.refresh}, watch.guard={w.stage.watch.guard}: the online ORM is "
                "GRPO's reward (iterate.reward=rm) and learns at every step, carried from one "
                "iteration to the next; a refresh would replace it. Set iterate.refresh=false "
                "(and a watch.guard other than refresh)")
    if w.rm.settings.ensemble > 1 and w.iterate.reward != "rm":
        return (f"rm.ensemble={w.rm.settings.ensemble} with iterate.reward={w.iterate.reward}: "
                "the ensemble rewards GRPO (iterate.reward=rm); its members would be trained "
                "for nothing")
    return None


def stage_folder(run_path: Path, algorithm: str) -> str:
    """The folder of a run that its policy stage of `algorithm` (`policy.algorithm`) writes:
    named for the algorithm (`grpo/`, `ppo/`, `t_ppo/`, `dpo/`, `online_dpo/`, `offline_rft/`;
    the outer loop's stages go in it as `iteration-K/`). Runs made while every algorithm wrote
    into `grpo/` resume there: a `grpo/` whose recorded config (its own, else the run's) names
    `algorithm`, beside no folder of the algorithm's name."""
    if algorithm == "grpo" or (run_path / algorithm).exists() or not (run_path / "grpo").is_dir():
        return algorithm
    for recorded in (run_path / "grpo" / "config.yaml", run_path / "config.yaml"):
        if recorded.exists():
            policy = (yaml.safe_load(recorded.read_text(encoding="utf-8")) or {}).get("policy")
            return "grpo" if (policy or {}).get("algorithm", "grpo") == algorithm else algorithm
    return algorithm
