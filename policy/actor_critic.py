"""The actor and the critic of the value-based algorithms (PPO and its successors in ppo.py,
T-PPO in tppo.py): the value model, the step's targets (token rewards, GAE advantages, returns),
the actor's optimizer step (`actor_step`: the clipped surrogate on GAE advantages) and the
critic's (`critic_step`), the stage both run in (`ValueStage`) and their metrics. Both algorithms
import it; neither imports the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from configs.schema import PolicyConfig, PPOConfig
from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import Rollout
from policy.engines import Sampler, forward_logprobs, policy_engines, reference_logprobs
from policy.evaluate import make_evaluator
from policy.sampling import make_sample, rollout_key, sampling_seed, step_questions
from policy.math.value import (clipped_value_loss, gae, kl_penalty_rewards, last_token_rewards,
                               length_adaptive_lambda, positive_nll, step_end_rewards, whiten)
from policy.rewards import RewardFn, ValueSource
from policy.skeleton import end_step, finish_stage, stage_trainer
from policy.stage import PolicyStage, PPOSpec
from runtime.checkpoint import export
from runtime.data import MathRecord
from runtime.dist import gather_rows, global_sum, world
from runtime.engine import build_engine, current_lr, rank_loss
from runtime.models import accelerator, load_causal_lm, load_model, load_tokenizer
from runtime.tracking import MetricsLogger
from runtime.training import StageLoop, stage_done
from runtime.seeds import derive_seed


def critic_from(lm, score: torch.Tensor | None = None):
    """A value model: `lm`'s backbone under a scalar head per token (transformers'
    `*ForTokenClassification` with one label, no dropout). The head starts at `score` ([H], e.g.
    a reward model's P(+) logit direction) or at zero (no opinion yet)."""
    from transformers import AutoModelForTokenClassification

    config = lm.config.__class__.from_dict(lm.config.to_dict())
    config.num_labels, config.classifier_dropout = 1, 0.0
    critic = AutoModelForTokenClassification.from_config(config, dtype=lm.dtype)
    critic.base_model.load_state_dict(lm.base_model.state_dict())
    with torch.no_grad():
        critic.score.weight.zero_()
        if score is not None:
            critic.score.weight[0] = score.to(critic.score.weight)
        if getattr(critic.score, "bias", None) is not None:
            critic.score.bias.zero_()
    return critic


def load_critic(stage: PolicyStage, spec: PPOSpec, policy_path, reward_fn: RewardFn,
                path: Path | None = None):
    """The critic: a saved one (`path`: value pretraining's export), else built as
    `ppo.critic_init` says, from the starting policy or from the reward model GRPO is rewarded
    by (its head: the lm_head rows of '+' minus '-', so V starts as the RM's logit margin)."""
    from transformers import AutoModelForTokenClassification

    if path is not None:
        return load_model(path, AutoModelForTokenClassification, stage.model)
    if not spec.critic_from_reward_model:
        return critic_from(load_causal_lm(policy_path, stage.model, device="cpu")
                           ).to(accelerator())
    if not isinstance(reward_fn, ValueSource):
        raise ValueError("ppo.critic_init=reward_model: the reward here is not a reward model "
                         "(policy.reward rule or step_oracle); use ppo.critic_init=policy, or "
                         "`igrpo iterate`, whose GRPO is rewarded by the reward models")
    return critic_from(*reward_fn.value_init()).to(accelerator())


def state_values(critic, rollout: Rollout, with_last: bool = False) -> torch.Tensor:
    """[N, T] the critic's value of the state before each completion token (read where the
    policy's logits for that token are), float32; `with_last`: [N, T + 1], column `length` of
    each row being the state after its last token (T-PPO's bootstrap)."""
    ids, mask = rollout.input_ids, rollout.attention_mask
    start = rollout.prompt_ids.shape[1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = critic(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[..., 0]
    return out[:, start - 1:].float() if with_last else out[:, start - 1:-1].float()


@torch.no_grad()
def forward_values(critic, rollout: Rollout, micro: int, with_last: bool = False
                    ) -> torch.Tensor:
    n, device = rollout.prompt_ids.shape[0], rollout.prompt_ids.device
    return torch.cat([state_values(critic, rollout.rows(torch.arange(
        s, min(s + micro, n), device=device)), with_last) for s in range(0, n, micro)])


@dataclass
class Targets:
    """A step's fixed quantities: the token rewards, the rollout's log-probs and values, the
    policy's advantages and the critic's returns, [N, T] each, the tokens both losses train on
    (`mask`: the completion, or T-PPO's window) and their global count."""
    rewards: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    num_tokens: float


def ppo_targets(rollout: Rollout, scores, rewards: torch.Tensor, old_logprobs, ref_logprobs,
                values: torch.Tensor, beta: float, spec: PPOSpec, lam_critic: float | None = None,
                last_values: torch.Tensor | None = None,
                loss_mask: torch.Tensor | None = None) -> Targets:
    """Token rewards (eq. 2), GAE advantages (whitened over the trained tokens) and critic
    targets. `lam_critic`: in place of `ppo.lam_critic` (value pretraining's 1.0);
    `last_values`: T-PPO's bootstrap for unfinished rows; `loss_mask`: the tokens trained
    (default: every completion token)."""
    ppo = spec.settings
    mask = rollout.completion_mask.float()
    width = mask.shape[1]
    if spec.per_step:
        placed = step_end_rewards(scores.step_rewards, scores.step_mask, scores.step_end_index,
                                  width)
    else:
        placed = last_token_rewards(rewards, mask)
    token_rewards = placed + kl_penalty_rewards(old_logprobs, ref_logprobs, mask, beta)
    lam = length_adaptive_lambda(rollout.lengths, ppo.length_adaptive_alpha) \
        if ppo.length_adaptive_alpha else ppo.lam_actor
    advantages, _ = gae(token_rewards, values, mask, ppo.gamma, lam, last_values)
    _, returns = gae(token_rewards, values, mask, ppo.gamma,
                     ppo.lam_critic if lam_critic is None else lam_critic, last_values)
    trained = mask if loss_mask is None else loss_mask.float()
    num_tokens = global_sum(float(trained.sum()))
    if ppo.whiten_advantages:
        mean = global_sum(float((advantages * trained).sum())) / max(num_tokens, 1.0)
        var = global_sum(float((((advantages - mean) * trained) ** 2).sum())) \
            / max(num_tokens, 1.0)
        advantages = whiten(advantages, trained, mean, var ** 0.5)
    return Targets(token_rewards, old_logprobs, values, advantages * trained, returns, trained,
                   num_tokens)


def critic_step(trainer: StageLoop, critic, rollout: Rollout, targets: Targets, ppo: PPOConfig,
                plan, where: str) -> dict:
    """One optimizer step of the critic on the clipped value loss."""
    stats = {"value_loss": 0.0}
    mask = targets.mask

    def loss_of(rows: slice, mb: int):
        values = state_values(critic, rollout.rows(torch.arange(rows.start, min(
            rows.stop, mask.shape[0]), device=mask.device)))
        loss = clipped_value_loss(values, targets.old_values[rows], targets.returns[rows],
                                  mask[rows], ppo.value_clip, max(targets.num_tokens, 1.0))
        stats["value_loss"] += loss.item()
        return rank_loss(loss, world()[1])

    grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of,
                                 f"{where} (critic)", engine=critic)
    return {"value_loss": global_sum(stats["value_loss"]), "critic_grad_norm": grad_norm}


def actor_step(trainer: StageLoop, rollout: Rollout, targets: Targets, right: torch.Tensor,
               p: PolicyConfig, spec: PPOSpec, plan, where: str) -> dict:
    """One optimizer step of the policy: `policy.loss`'s clipped surrogate on the GAE advantages
    (no KL term: it is in the rewards), plus VAPO's LM loss on right samples."""
    engine, world_size = trainer.engine, world()[1]
    mask = targets.mask
    right_tokens = global_sum(float((mask * right.float()[:, None]).sum()))
    num_sequences = global_sum(float(mask.shape[0]))
    stats = {"loss": 0.0, "clip": 0.0, "clip_high": 0.0, "nll": 0.0}

    def loss_of(rows: slice, mb: int):
        logprobs = completion_logprobs(engine, rollout.input_ids[rows],
                                       rollout.attention_mask[rows], rollout.prompt_ids.shape[1])
        old = logprobs.detach() if targets.old_logprobs is None else targets.old_logprobs[rows]
        result = spec.loss(
            logprobs, old, None, targets.advantages[rows], mask[rows],
            clip_eps_low=p.clip_eps, clip_eps_high=p.clip_eps_high, beta=0.0,
            num_sequences=num_sequences, num_tokens=max(targets.num_tokens, 1.0),
            max_tokens=p.max_new_tokens)
        loss = result.loss
        if spec.settings.positive_nll_weight:
            nll = positive_nll(logprobs, mask[rows], right[rows], right_tokens)
            stats["nll"] += nll.item()
            loss = loss + spec.settings.positive_nll_weight * nll
        share = float(mask[rows].sum()) / max(targets.num_tokens, 1.0)
        stats["loss"] += loss.item()
        stats["clip"] += result.clip_fraction.item() * share
        stats["clip_high"] += result.clip_high.item() * share
        return rank_loss(loss, world_size)

    grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of, where)
    return {**{k: global_sum(v) for k, v in stats.items()}, "grad_norm": grad_norm}


def rollout_logprobs(trainer: StageLoop, rollout: Rollout, reference, mu: int, plan,
                     is_reference: bool = False):
    """(pi_old, reference) log-probs of the rollout before the update, where something needs
    them: the KL penalty (a reference) or the ratio of later passes (mu > 1); None otherwise
    (with one pass the ratio is exactly 1 and the loss detaches its own log-probs). While the
    policy still is the reference (`is_reference`) one forward serves both."""
    old = None if reference is None and mu == 1 else \
        forward_logprobs(trainer.engine.module, rollout, plan.micro_batch_size)
    ref = reference_logprobs(reference, rollout, plan.micro_batch_size, is_reference)
    return old, old if reference is not None and ref is None else ref


def train_passes(trainer: StageLoop, critic, rollout: Rollout, targets: Targets,
                 right: torch.Tensor, p: PolicyConfig, spec: PPOSpec, plan, where: str) -> dict:
    """`policy.mu` passes of one policy and one critic step each; their stats averaged."""
    trainer.engine.train()
    critic.train()
    stats: dict = {}
    for update in range(p.mu):
        at = f"{where}, update {update + 1}"
        for key, value in {**actor_step(trainer, rollout, targets, right, p, spec, plan, at),
                           **critic_step(trainer, critic, rollout, targets, spec.settings, plan,
                                         at)}.items():
            stats[key] = stats.get(key, 0.0) + value / p.mu
    return stats


def value_metrics(rollout: Rollout, rewards: torch.Tensor, correct: torch.Tensor | None,
                  targets: Targets, ref_logprobs, stats: dict) -> dict:
    """The step's metrics over every rank's rows (all ranks call it): rewards, the losses,
    clipping, the critic's fit (explained variance of its targets) and the KL to the reference
    (mean log-ratio per token). `rewards` and `correct` may hold fewer rows than the rollout
    (T-PPO: the sequences that ended this step), or none."""
    mask = targets.mask
    returns, residual = targets.returns * mask, (targets.returns - targets.old_values) * mask
    kl = (targets.old_logprobs - ref_logprobs) * mask if ref_logprobs is not None else mask * 0
    (lengths, truncated, tokens, total, squares, misfit, values, kl, rewards,
     *correct) = gather_rows(
        rollout.lengths.float(), rollout.truncated.float(), mask.sum(-1), returns.sum(-1),
        (returns * targets.returns).sum(-1), (residual ** 2).sum(-1),
        (targets.old_values * mask).sum(-1), kl.sum(-1), rewards.float(),
        *([] if correct is None else [correct.float()]))
    count = max(float(tokens.sum()), 1.0)
    spread = float(squares.sum()) - float(total.sum()) ** 2 / count  # sum of centred squares
    metrics = {
        "rollout/length_mean": float(lengths.mean()),
        "rollout/truncation_rate": float(truncated.mean()),
        "train/loss": stats["loss"], "train/clip_fraction": stats["clip"],
        "train/clip_high": stats["clip_high"], "train/grad_norm": stats["grad_norm"],
        "train/positive_nll": stats["nll"],
        "critic/value_loss": stats["value_loss"], "critic/grad_norm": stats["critic_grad_norm"],
        "critic/value_mean": float(values.sum()) / count,
        "critic/explained_variance": 1.0 - float(misfit.sum()) / max(spread, 1e-12),
    }
    if ref_logprobs is not None:
        metrics["train/kl"] = float(kl.sum()) / count
    if len(rewards):  # (T-PPO: the sequences that ended this step; none may have)
        metrics["reward/mean"] = float(rewards.mean())
    if correct and len(correct[0]):
        metrics["reward/accuracy"] = float(correct[0].mean())
    return metrics


@dataclass
class ValueStage:
    """What a value-based algorithm's loop works with: the engines (policy, frozen reference,
    critic), the batch plan, the stage's trainer (the critic its companion), the sampler and
    the held-out evaluator."""
    tokenizer: object
    plan: object
    engine: object
    reference: object
    critic: object
    trainer: StageLoop
    sampler: Sampler
    evaluate: Callable[[bool], dict]
    fmt: object


def value_stage(stage: PolicyStage, spec: PPOSpec, out: Path, desc: str, policy_path,
                reward_fn: RewardFn,
                rl_records: list[MathRecord], eval_records: list[MathRecord], logger,
                reference_path=None, evaluate_ends: bool = True) -> ValueStage:
    """Build a value-based stage in `out`: the policy and reference engines, the critic (after
    VC-PPO's value pretraining where `ppo.value_pretrain_steps` asks for it), and a trainer
    whose wall-clock budget (`policy.max_minutes`) is what value pretraining left."""
    p, ppo = stage.policy, spec.settings
    tokenizer, plan, engine, reference = policy_engines(stage, policy_path, reference_path)
    sampler = Sampler(engine, None, stage.vllm, policy_path)
    pretrained = pretrain_values(stage, spec, out, sampler, policy_path, reward_fn, rl_records,
                                 plan) if ppo.value_pretrain_steps else None
    critic = build_engine(load_critic(stage, spec, policy_path, reward_fn, pretrained),
                          stage.deepspeed, lr=ppo.critic_lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum)
    fmt = stage.prompts
    budget = p.max_minutes * 60
    if budget and pretrained is not None:
        budget = max(budget - pretrain_seconds(pretrained), 1e-3)
    trainer = stage_trainer(stage, out, engine, logger, desc, max_seconds=budget,
                            companions={"critic": critic})
    sampler.trainer = trainer
    evaluate = make_evaluator(stage.evaluation, sampler, tokenizer, eval_records, fmt, trainer,
                              evaluate_ends)
    return ValueStage(tokenizer, plan, engine, reference, critic, trainer, sampler, evaluate, fmt)


def end_value_step(stage: ValueStage, metrics: dict, timing: dict, started: float,
                   p: PolicyConfig, evaluate_ends: bool) -> None:
    """Close a step: its update's seconds, the optimizer step count, the metrics (with the
    evaluation due), and the state when a save is due."""
    timing["update"] = time.perf_counter() - started - timing["rollout"] - timing["scoring"]
    stage.trainer.advance()
    metrics.update({"train/lr": current_lr(stage.engine), "time/rollout": timing["rollout"],
                    "time/scoring": timing["scoring"], "time/update": timing["update"]})
    end_step(stage.trainer, metrics, p, stage.evaluate, evaluate_ends)


def finish_value_stage(stage: ValueStage, out: Path, config_yaml: str) -> Path:
    """Export the critic (`<out>/critic`) and the policy (`<out>/final`); returns the latter."""
    return finish_stage(stage.trainer, stage.sampler, stage.tokenizer, out, config_yaml,
                        lambda: export(stage.critic, stage.tokenizer, out / "critic", config_yaml))


def pretrain_seconds(critic_path: Path) -> float:
    """Wall clock value pretraining spent (its done.json)."""
    import json

    return json.loads((Path(critic_path).parent / "done.json").read_text()).get("seconds", 0.0)


def pretrain_values(stage: PolicyStage, spec: PPOSpec, out: Path, sampler: Sampler, policy_path,
                    reward_fn: RewardFn, rl_records: list[MathRecord], plan) -> Path:
    """VC-PPO's value pretraining (Yuan et al. 2025, §4.1): `ppo.value_pretrain_steps` critic
    steps on samples of the starting policy (`sampler`, not trained meanwhile), fit to lambda =
    1 targets (Monte Carlo returns). Its own resumable stage `<out>/value-pretrain`, on
    questions of a stream the PPO steps do not draw from; returns the critic's export."""
    p, ppo, seed = stage.policy, spec.settings, stage.seed
    folder = out / "value-pretrain"
    if stage_done(folder):
        return folder / "critic"
    rank, world_size = world()
    tokenizer = load_tokenizer(policy_path, stage.model)
    critic = build_engine(load_critic(stage, spec, policy_path, reward_fn), stage.deepspeed,
                          lr=ppo.critic_lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum)
    # its metrics go to a file of its own: the PPO stage's logger rewinds to PPO's steps
    own = MetricsLogger(folder / "metrics.jsonl", config={}, mode="disabled", project="",
                        name="value-pretrain")
    trainer = StageLoop(folder, critic, own, ppo.value_pretrain_steps, desc="value pretraining",
                      max_seconds=p.max_minutes * 60, fresh_state={"sample_seed": sampling_seed()})
    sampler.trainer = trainer
    sample = make_sample(sampler, tokenizer, reward_fn, stage, rank,
                         p.questions_per_step // world_size, {"rollout": 0.0, "scoring": 0.0})
    while trainer.running():
        step = trainer.step
        sampled = sample(step_questions(rl_records, step, p.questions_per_step,
                                        derive_seed(seed, "value-pretrain")),
                         rollout_key(trainer.state.get("sample_seed", seed), step))
        sampler.rest()
        critic.eval()
        values = forward_values(critic.module, sampled.rollout, plan.micro_batch_size)
        targets = ppo_targets(sampled.rollout, sampled.scores, sampled.rewards,
                              torch.zeros_like(values), None, values, p.beta, spec,
                              lam_critic=1.0)
        critic.train()
        stats = critic_step(trainer, critic, sampled.rollout, targets, ppo, plan,
                            f"value pretraining step {step + 1}")
        trainer.advance()
        trainer.log({"critic/pretrain_value_loss": stats["value_loss"],
                     "critic/pretrain_grad_norm": stats["critic_grad_norm"]})
        if trainer.due(p.save_every):
            trainer.save()
    trainer.finish(tokenizer, folder / "critic", "",
                   {"steps": trainer.step, "seconds": trainer.state.get("seconds", 0.0)})
    own.close()
    return folder / "critic"
