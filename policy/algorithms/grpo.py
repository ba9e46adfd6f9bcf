"""GRPO (DeepSeekMath §4.1): the policy loop with outcome or process advantages, on DeepSpeed.

Launch: `igrpo grpo --config configs/tiny.yaml [key=value ...]` (one process), or `torchrun
--nproc_per_node N -m igrpo grpo ...`; the same command resumes. Each step: take a batch of
questions, pi_old <- pi, roll out G samples per question, score them with the injected reward
callable, compute group-relative advantages, then `policy.mu` updates, the reference frozen.

Departures from the paper, each a config switch: the loss variants (`policy.loss`), process credit
forms (`grpo.process_credit`) and recipes (configs/recipes/: DAPO's dynamic sampling, overlong
filtering and punishment, GPG's correction, C3PO's token budget). A step whose loss has no signal
(no kept token, or all advantages 0 and no KL term) skips the optimizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from configs.schema import PolicyConfig
from policy import inspection
from policy.batch import StepBatch, UpdateStats, has_signal, in_mini_batch_order, mini_batches
from policy.engines import (Sampler, forward_logprobs, policy_engines, reference_logprobs,
                            sampler_drift, starts_at, tis_weights)
from policy.evaluate import make_evaluator
from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import Rollout
from policy.math.advantages import informative_groups, token_budget_mask, zero_group_correction
from policy.rewards import LearnsOnline, RewardFn, Scores, gold_read
from policy.sampling import make_sample, refill_questions, rollout_key, step_questions
from policy.scoring import Sampled, concat_sampled, learn_reward
from policy.skeleton import end_step, finish_stage, stage_trainer
from policy.stage import GRPOSpec, PolicyStage
from policy.stage_watch import StageWatch
from runtime.data import MathRecord
from runtime.dist import gather_rows, global_sum, world
from runtime.engine import current_lr, rank_loss
from runtime.memory import memory_metrics, memory_phase
from runtime.training import StageLoop, stage_done
from runtime.seeds import derive_seed


def train_grpo(stage: PolicyStage, spec: GRPOSpec, run_path: Path, policy_path: str | Path,
               reward_fn: RewardFn, rl_records: list[MathRecord], eval_records: list[MathRecord],
               logger, config_yaml: str, out_name: str = "grpo",
               reference_path: str | Path | None = None, evaluate_ends: bool = True) -> Path:
    """Run `policy.steps` GRPO steps from `policy_path` against the frozen `reference_path`
    (default: the starting policy); returns the final export's folder. `evaluate_ends=False`
    skips the held-out evaluation of the first and last policy (the outer loop runs its own).
    Each step: sample (refilled under dynamic sampling) -> advantages and update -> log."""
    p, seed = stage.policy, stage.seed
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    tokenizer, plan, reference, trainer, sampler, watch, online = start_stage(
        stage, out, out_name, logger, policy_path, reference_path, reward_fn)
    evaluate = make_evaluator(stage.evaluation, sampler, tokenizer, eval_records, stage.prompts,
                              trainer, evaluate_ends)
    rank, per_rank = world()[0], p.questions_per_step // world()[1]
    while trainer.running():
        step, timing = trainer.step, {"rollout": 0.0, "scoring": 0.0}
        sampled = sample_step(make_sample(sampler, tokenizer, reward_fn, stage, rank, per_rank,
                                          timing), rl_records, step, p, spec, seed,
                              trainer.state.get("sample_seed", seed), tokenizer.pad_token_id,
                              stage.question_offset)
        batch, stats = learn_step(trainer, reference, sampled, p, spec, plan, seed, timing,
                                  f"{out_name} step {step + 1}",
                                  step == 0 and starts_at(reference_path, policy_path))
        learned = learn_reward(online, sampled, trainer, f"{out_name} step {step + 1}")
        trainer.advance()
        metrics = {**learned, **log_step(sampled.rollout, sampled.scores, sampled.rewards, batch,
                                         stats, p, timing),
                   **sampled.stats, **sampler.stats(), **memory_metrics(timing["rollout_memory"]),
                   "train/lr": current_lr(trainer.engine),
                   **watch.after_update(sampled, batch, spec, tokenizer, stats.logprobs,
                                        plan.micro_batch_size)}
        metrics["reward/gold_read"] = gold_read(reward_fn, spec.credit, metrics)
        end_step(trainer, metrics, p, evaluate, evaluate_ends, lambda: inspection.inspect_step(
            out / "inspect", trainer.step, stage.inspect, spec, tokenizer, sampled, batch, logger))
    return finish_stage(trainer, sampler, tokenizer, out, config_yaml,
                        lambda: online and online.export(out / online.name, config_yaml))


def start_stage(stage: PolicyStage, out: Path, out_name: str, logger, policy_path,
                reference_path, reward_fn: RewardFn) -> tuple:
    """(tokenizer, batch plan, reference, trainer, sampler, watch, the reward if it learns
    online, else None) of a GRPO stage in `out`; a reward that learns online
    (`policy.rewards.LearnsOnline`) has its engines saved and restored with the policy's."""
    online = reward_fn if isinstance(reward_fn, LearnsOnline) else None
    with memory_phase("start-up"):
        companions = online.companions() if online else None
        tokenizer, plan, engine, reference = policy_engines(stage, policy_path, reference_path)
        trainer = stage_trainer(stage, out, engine, logger, out_name, companions=companions)
        if hasattr(online, "bind"):  # it steps while scoring (`rm.online_update=before`)
            online.bind(trainer)
        sampler = Sampler(engine, trainer, stage.vllm, policy_path)
        rank, size = world()
        watch = StageWatch(stage, out / "trace", trainer, reference, policy_path, reference_path,
                           first_group=rank * stage.policy.questions_per_step // size)
    return tokenizer, plan, reference, trainer, sampler, watch, online


def learn_step(trainer: StageLoop, reference, sampled: Sampled, p: PolicyConfig, spec: GRPOSpec,
               plan, seed: int, timing: dict, where: str, is_reference: bool
               ) -> tuple[StepBatch, UpdateStats]:
    """A sampled step's advantages, then its update (`is_reference`: the policy still is the
    reference); the seconds both took into `timing["update"]`."""
    updating = time.perf_counter()
    batch = advantage_step(sampled.scores, sampled.rewards, sampled.broken, sampled.rollout,
                           spec, p.group_size, seed=derive_seed(seed, "token-budget", trainer.step))
    with memory_phase("update"):
        stats = update_step(trainer, reference, sampled.rollout, batch, p, spec, plan, where,
                            is_reference=is_reference)
    timing["update"] = time.perf_counter() - updating
    return batch, stats


def sample_step(sample: Callable[[list[MathRecord], tuple], Sampled],
                rl_records: list[MathRecord], step: int, p: PolicyConfig, spec: GRPOSpec,
                seed: int, sample_seed: int, pad_id: int, offset: int = 0) -> Sampled:
    """The step's questions (the stream's step `offset + step`) rolled out and scored
    (`make_sample`, seeded from the stage's sampling seed, the step and the round), refilled
    under DAPO's dynamic sampling."""
    sampled = sample(step_questions(rl_records, offset + step, p.questions_per_step, seed),
                     rollout_key(sample_seed, step))
    if spec.filter_groups:
        sampled = refill_step(sampled, lambda round_: sample(refill_questions(
            rl_records, offset + step, round_, p.questions_per_step, seed, spec.dynamic_rounds),
            rollout_key(sample_seed, step, round_)), spec, p.group_size, pad_id)
    return sampled


def compute_advantages(scores: Scores, rewards: torch.Tensor, rollout: Rollout,
                       spec: GRPOSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] token advantages (process supervision: the spec's credit form over the step
    rewards; else its estimator over the rewards) and the normalised values they came from
    ([N, S], anchored [N, S + 1], outcome [N, 1])."""
    num_tokens = rollout.completion_ids.shape[1]
    if spec.credit is not None:
        if scores.step_rewards is None:
            raise ValueError("policy.supervision=process needs a reward that returns step "
                             "rewards (a PRM or a step oracle); this one returned only outcomes")
        advantages, normalised = spec.credit.estimate(
            scores.step_rewards, scores.step_mask, scores.step_end_index, scores.correct,
            num_tokens, spec.norm, spec.process_weight, revealed=scores.revealed)
    else:
        advantages, normalised = spec.estimator(rewards, num_tokens, spec.norm)
    return advantages * rollout.completion_mask, normalised


def signal_groups(scores: Scores, rewards: torch.Tensor, spec: GRPOSpec, group_size: int
                  ) -> torch.Tensor:
    """[Q] bool: groups whose advantages can be non-zero, DAPO's filter (Yu et al. 2025, eq. 11)
    on what the advantages normalise (the rewards, or `ProcessCredit.informative`)."""
    if spec.credit is None or scores.step_rewards is None:
        return informative_groups(rewards, group_size)
    return spec.credit.informative(scores.step_rewards, scores.step_mask, scores.correct,
                                   group_size, revealed=scores.revealed)


def informative(sampled: Sampled, spec: GRPOSpec) -> torch.Tensor:
    """[Q] bool: groups with signal (`signal_groups`) whose rewards are finite."""
    return signal_groups(sampled.scores, sampled.rewards, spec, sampled.rollout.group_size) \
        & ~sampled.broken


def refill_step(first: Sampled, sample_more: Callable[[int], Sampled], spec: GRPOSpec,
                group_size: int, pad_id: int) -> Sampled:
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): while the step holds fewer informative
    groups than questions (on any rank), sample `sample_more(round)` (round = 1, 2, ...; at most
    `spec.dynamic_rounds`); then keep the first informative groups, topped up with
    uninformative ones if the cap was hit (those stay out of the loss). The batch keeps its size.
    Stats: the extra rounds and samples drawn and the informative groups kept."""
    want = len(first.records)
    parts = [first]
    found = int(informative(first, spec).sum())
    rounds = 0
    while rounds < spec.dynamic_rounds and global_sum(float(max(0, want - found))) > 0:
        rounds += 1
        parts.append(sample_more(rounds))
        found += int(informative(parts[-1], spec).sum())
    joined = concat_sampled(parts, pad_id)
    good = informative(joined, spec).tolist()
    chosen = ([q for q, ok in enumerate(good) if ok] + [q for q, ok in enumerate(good) if not ok])
    batch = joined.groups(sorted(chosen[:want]))
    batch.stats = {"rollout/refill_rounds": float(rounds),
                   "rollout/extra_samples": float((len(joined.records) - want) * group_size),
                   "train/informative_groups": float(min(sum(good), want))}
    return batch


def advantage_step(scores: Scores, rewards: torch.Tensor, broken: torch.Tensor,
                   rollout: Rollout, spec: GRPOSpec, group_size: int, seed: int = 0
                   ) -> StepBatch:
    """Group-relative advantages and the loss mask: groups dropped by dynamic sampling or with
    non-finite rewards leave it, truncated samples too under overlong filtering; GPG's alpha
    scales the advantages; C3PO's token budget (drawn in an order seeded by `seed`) picks the
    tokens and becomes the token normaliser."""
    advantages, normalised = compute_advantages(scores, rewards, rollout, spec)
    if spec.zero_advantages:
        advantages = torch.zeros_like(advantages)
    keep = torch.ones(len(rewards), dtype=torch.bool, device=rewards.device)
    if spec.filter_groups:
        keep = signal_groups(scores, rewards, spec, group_size).repeat_interleave(group_size)
    keep &= ~broken.repeat_interleave(group_size)
    if spec.overlong_filter:
        keep &= ~rollout.truncated
    stats = {}
    if spec.zero_group_correction:
        signal = (advantages != 0).any(-1) & keep
        alpha = zero_group_correction(global_sum(float(keep.sum())),
                                      global_sum(float((keep & ~signal).sum())))
        advantages = advantages * alpha
        stats["train/gpg_alpha"] = alpha
    loss_mask = rollout.completion_mask.float() * keep[:, None]
    num_tokens = global_sum(float(loss_mask.sum()))
    if spec.token_budget is not None:
        budget = spec.token_budget
        order = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(seed))
        lengths = (loss_mask.sum(-1)).long().cpu()
        kept = token_budget_mask(lengths, budget // world()[1], order).to(loss_mask.device)
        positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
        loss_mask = loss_mask * (positions[None, :] < kept[:, None])
        keep = keep & (kept > 0)
        stats["train/budget_tokens"] = global_sum(float(loss_mask.sum()))
        num_tokens = float(budget)
    return StepBatch(advantages, normalised, keep, broken, loss_mask,
                     global_sum(float(keep.sum())), num_tokens, stats)


@dataclass
class MicroBatchLoss:
    """One update's loss on a micro-batch of rows (what `trainer.backward` calls), adding its
    shares of the step's statistics to `stats`: every micro-batch of an update reads the same
    rollout, batch, pi_old and reference log-probs (None: the policy's own, detached)."""
    engine: object
    rollout: Rollout
    batch: StepBatch
    spec: GRPOSpec
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    has_reference: bool
    all_tokens: float
    passes: int
    stats: UpdateStats

    def __call__(self, rows: slice, num_sequences: float, num_tokens: float,
                 measure: bool) -> torch.Tensor:
        """The loss of `rows` in an optimizer step over `num_sequences` sequences and
        `num_tokens` tokens (every rank's); `measure`: this pass records the entropy and the
        sampler's drift (the first pass, unless pi_old's own forward did)."""
        spec, rollout, batch, stats = self.spec, self.rollout, self.batch, self.stats
        logprobs = completion_logprobs(
            self.engine, rollout.input_ids[rows], rollout.attention_mask[rows],
            rollout.prompt_ids.shape[1], entropy_out=stats.entropy[rows] if measure else None)
        old = logprobs.detach() if self.old_logprobs is None else self.old_logprobs[rows]
        tis = tis_weights(old, rollout, rows, spec.tis_cap)
        if measure:
            stats.add_sampler_gap(sampler_drift(logprobs.detach(), rollout, self.all_tokens, rows),
                                  tis, self.all_tokens)
            if stats.logprobs is None:
                stats.logprobs = torch.zeros_like(batch.loss_mask)
            stats.logprobs[rows] = logprobs.detach().to(stats.logprobs)
        ref = self.ref_logprobs[rows] if self.ref_logprobs is not None else \
            old if self.has_reference else None
        advantages = batch.advantages[rows] if tis is None else batch.advantages[rows] * tis[0]
        result = spec.loss(
            logprobs, old, ref, advantages, batch.loss_mask[rows],
            clip_eps_low=spec.clip_low, clip_eps_high=spec.clip_high, beta=spec.beta,
            num_sequences=max(num_sequences, 1.0), num_tokens=max(num_tokens, 1.0),
            max_tokens=spec.max_tokens)
        # Shares of the optimizer step: summed over micro-batches and ranks they give its loss
        # and the token means of KL and clip fraction.
        share = float(batch.loss_mask[rows].sum()) / max(num_tokens, 1.0) / self.passes
        stats.loss += result.loss.item() / self.passes
        stats.kl += result.kl.item() * share
        stats.clip += result.clip_fraction.item() * share
        stats.clip_high += result.clip_high.item() * share
        return rank_loss(result.loss, world()[1])


def update_step(trainer: StageLoop, reference, rollout: Rollout, batch: StepBatch, g: PolicyConfig,
                spec: GRPOSpec, plan, where: str, is_reference: bool = False) -> UpdateStats:
    """`policy.mu` passes over the batch, each `policy.mini_batches` optimizer steps (each
    normalised by its own counts), of `spec`'s loss against log-probs of the reference and (mu >
    1 or mini-batches) of pi_old. `is_reference`: the policy is the reference (its first step)."""
    engine = trainer.engine
    kl_term = reference is not None and spec.beta > 0
    rollout, batch, order = in_mini_batch_order(rollout, batch, g)
    stats = UpdateStats(entropy=torch.zeros_like(batch.loss_mask))
    if not has_signal(batch, kl_term):
        # Nothing to learn: AdamW's momentum would still move the weights on a zero gradient.
        stats.skipped = 1.0
        return stats
    ref_logprobs = reference_logprobs(reference, rollout, plan.micro_batch_size, is_reference)
    # pi_old's entropy and sampler drift: in pi_old's own forward when mini-batches move it
    before, all_tokens = g.mini_batches > 1, global_sum(float(rollout.completion_mask.sum()))
    old_logprobs = forward_logprobs(engine.module, rollout, plan.micro_batch_size, stats.entropy
                                    if before else None) if g.mu > 1 or before else None
    if before:
        stats.add_sampler_gap(sampler_drift(old_logprobs, rollout, all_tokens), tis_weights(
            old_logprobs, rollout, slice(None), spec.tis_cap), all_tokens)
        stats.logprobs = old_logprobs
    chunks = mini_batches(batch, plan.rank_sequences, g.mini_batches, kl_term)
    loss = MicroBatchLoss(engine, rollout, batch, spec, old_logprobs, ref_logprobs,
                          reference is not None, all_tokens, g.mu * len(chunks), stats)
    engine.train()
    for update in range(g.mu):
        for offset, num_sequences, num_tokens in chunks:
            def loss_of(rows: slice, mb: int, offset=offset, sequences=num_sequences,
                        tokens=num_tokens, measure=update == 0 and not before):
                return loss(slice(offset + rows.start, offset + rows.stop), sequences, tokens,
                            measure)

            stats.grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of,
                                               f"{where}, update {update + 1}", stats.grad_norm)
    if order is not None:  # back in the rollout's order, for the step's metrics
        stats.restore_order(order)
    for name in ("loss", "kl", "clip", "clip_high", "logprob_diff", "tis_weight", "tis_capped"):
        setattr(stats, name, global_sum(getattr(stats, name)))
    return stats


def log_step(rollout: Rollout, scores: Scores, rewards: torch.Tensor, batch: StepBatch,
             stats: UpdateStats, g: PolicyConfig, timing: dict) -> dict:
    """The step's metrics (docs/metrics.md) over every rank's samples (all ranks call it);
    `timing`: this rank's seconds of rollout, scoring and update (the ranks run side by side)."""
    mask = rollout.completion_mask.float()
    by_group = batch.normalised.reshape(-1, g.group_size * batch.normalised.shape[1])
    rows = {"rewards": rewards.float(), "lengths": rollout.lengths.float(),
            "truncated": rollout.truncated.float(), "entropy": (stats.entropy * mask).sum(-1),
            "tokens": mask.sum(-1), "seen": rollout.attention_mask.sum(-1).float(),
            "keep": batch.keep.float(), "silent": (by_group == 0).all(-1).float(),
            "broken": batch.broken.float(), "check": torch.tensor(
                [inspection.group_sum_check(batch.normalised, g.group_size)], device=mask.device),
            **({} if scores.correct is None else {"correct": scores.correct.float()}),
            **({} if scores.revealed is None else {"revealed": scores.revealed.float()})}
    r = dict(zip(rows, gather_rows(*rows.values())))  # every rank's rows
    lengths, step_time = r["lengths"], timing["rollout"] + timing["scoring"] + timing["update"]
    metrics = {
        **reward_metrics(r["rewards"], g.group_size),
        # Groups whose advantages are all 0 (equal rewards, or a spread under the floor).
        "reward/no_signal_groups": float(r["silent"].mean()),
        "reward/nonfinite_groups": float(r["broken"].sum()),
        "rollout/length_mean": float(lengths.mean()), "rollout/length_max": float(lengths.max()),
        "rollout/truncation_rate": float(r["truncated"].mean()),
        "rollout/tokens_per_s": float(lengths.sum()) / max(timing["rollout"], 1e-9),
        "train/loss": stats.loss, "train/kl": stats.kl, "train/clip_fraction": stats.clip,
        "train/clip_high": stats.clip_high,
        "train/entropy": float(r["entropy"].sum() / r["tokens"].sum().clamp(min=1)),
        "train/grad_norm": stats.grad_norm, "train/kept_groups": float(r["keep"].mean()),
        "train/skipped_step": stats.skipped, "train/advantage_group_sum": float(r["check"].max()),
        "train/tokens_per_s": float(r["seen"].sum()) * g.mu / max(timing["update"], 1e-9),
        "time/rollout": timing["rollout"], "time/scoring": timing["scoring"],
        "time/update": timing["update"], "time/step": step_time,
        **stats.sampler_metrics(rollout.sampler_logprobs is not None, g.tis_cap > 0),
        **batch.stats}
    if "correct" in r:
        metrics["reward/accuracy"] = float(r["correct"].mean())
    if "revealed" in r:  # the gold budget: the share of the step's samples whose check was read
        metrics["reward/gold_revealed"] = float(r["revealed"].mean())
    return metrics


def reward_metrics(rewards: torch.Tensor, group_size: int) -> dict:
    """The reward's mean and spreads over a step's [N] rewards (groups of `group_size`)."""
    grouped = rewards.view(-1, group_size)
    return {"reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/group_std": float(grouped.std(-1, unbiased=False).mean()),
            "reward/zero_std_groups": float((grouped.max(-1).values == grouped.min(-1).values)
                                            .float().mean())}
