"""GRPO (DeepSeekMath §4.1): the policy loop with outcome or process advantages, on DeepSpeed.

Launch: `igrpo grpo --config configs/tiny.yaml [key=value ...]` (one process), or
`torchrun --nproc_per_node N -m policy grpo ...`. Each step: take a batch of questions,
pi_old <- pi, roll out G samples per question, score them with the injected reward callable,
compute group-relative advantages, then `grpo.mu` updates with the reference model frozen.
Re-running the same command resumes from the last saved step.

Departures from the paper, each a config switch: the loss table offers the seed's variants
(`grpo.loss`), and the recipes (configs/recipes/) set each variant's paper settings: DAPO's
dynamic sampling (more questions sampled until the step holds enough informative groups),
overlong filtering and punishment, GPG's correction, C3PO's token budget. A step whose loss has
no signal (no kept token, or all advantages 0 and no KL term) skips the optimizer.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from configs.batching import plan_grpo_batch
from policy.advantages import (informative_groups, normalised_step_rewards, outcome_advantages,
                               rejection_sampling_advantages, step_sums_to_tokens,
                               token_budget_mask, zero_group_correction)
from policy.evaluate import evaluate_policy
from policy import inspection
from policy.logprobs import completion_logprobs
from policy.losses import POLICY_LOSSES, add_to_last_step, overlong_penalty
from policy.rewards import RewardFn, Scores, concat_scores
from policy.rollout import Rollout, concat_rollouts, generate_groups
from runtime.data import MathRecord
from runtime.engine import (broadcast_from_main, build_engine, build_inference_engine,
                            current_lr, device_memory_gib, gather_rows, gathered_for_generation,
                            global_sum, is_main, memory_metrics, world)
from runtime.models import load_causal_lm, load_tokenizer
from runtime.prompts import prompt_format
from runtime.shards import seeded
from runtime.training import Trainer, epoch_slice, stage_done


def step_questions(records: list[MathRecord], step: int, per_step: int, seed: int) -> list[MathRecord]:
    """The questions of `step`: consecutive slices of a seeded permutation, reshuffled per epoch."""
    return [records[i] for i in epoch_slice(len(records), step, per_step, seed * 7_919)[1]]


def refill_questions(records: list[MathRecord], step: int, round_: int, per_step: int, seed: int,
                     max_rounds: int) -> list[MathRecord]:
    """The questions of dynamic sampling's extra round `round_` (1-based) of `step`: a seeded
    stream of its own, so a resumed step draws the same ones."""
    index = step * max_rounds + round_ - 1
    return [records[i] for i in epoch_slice(len(records), index, per_step, seed * 7_919 + 104_729)[1]]


def compute_advantages(scores: Scores, rewards: torch.Tensor, rollout: Rollout, g, *,
                       std_normalised: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] token advantages for the configured supervision (`g` is the GRPOConfig), and the
    normalised rewards they were built from: [N, S] per step (process) or [N, 1] (outcome, rft)."""
    scale = g.scale_by_std and std_normalised
    num_tokens = rollout.completion_ids.shape[1]
    if g.supervision == "process":
        if scores.step_rewards is None:
            raise ValueError("grpo.supervision=process needs a reward that returns step rewards "
                             "(a PRM or a step oracle), but this reward returned only outcomes")
        normalised = normalised_step_rewards(scores.step_rewards.float(), scores.step_mask,
                                             g.group_size, scale_by_std=scale,
                                             unbiased=g.std_unbiased, eps=g.std_eps,
                                             min_std=g.min_reward_std)
        adv = step_sums_to_tokens(normalised, scores.step_mask, scores.step_end_index,
                                  num_tokens)
    else:
        normalised = (rejection_sampling_advantages(rewards) if g.supervision == "rft" else
                      outcome_advantages(rewards, g.group_size, scale_by_std=scale,
                                         unbiased=g.std_unbiased, eps=g.std_eps,
                                         min_std=g.min_reward_std))[:, None]
        adv = normalised.expand(-1, num_tokens)
    return adv * rollout.completion_mask, normalised


def shuffled_rewards(scores: Scores, rewards: torch.Tensor) -> tuple[Scores, torch.Tensor]:
    """The shuffled-reward control (`grpo.shuffle_rewards`): the batch's solution rewards
    permuted over its samples and, for process supervision, its step rewards permuted over all
    of its real steps, so that no reward belongs to its own sample or step any more (the same
    values, the same step layout)."""
    rewards = rewards[torch.randperm(len(rewards))]
    if scores.step_rewards is not None:
        steps = scores.step_rewards.clone()
        values = steps[scores.step_mask]
        steps[scores.step_mask] = values[torch.randperm(len(values))]
        scores = replace(scores, step_rewards=steps)
    return scores, rewards


def drop_nonfinite(scores: Scores, group_size: int) -> tuple[Scores, torch.Tensor]:
    """A reward model can return NaN/inf (a PRM on odd input). Every group holding such a value is
    left out of the step's loss (its values set to 0 so nothing non-finite propagates), and
    counted in `reward/nonfinite_groups`. Returns the cleaned scores and the [Q] broken-group mask.
    """
    bad = ~torch.isfinite(scores.rewards.float())
    if scores.step_rewards is not None:
        bad |= (~torch.isfinite(scores.step_rewards.float()) & scores.step_mask).any(-1)
    groups = bad.view(-1, group_size).any(-1)
    if not groups.any():
        return scores, groups
    rows = groups.repeat_interleave(group_size)
    step_rewards = None if scores.step_rewards is None else torch.where(
        rows[:, None] | ~torch.isfinite(scores.step_rewards), 0.0, scores.step_rewards.float())
    return replace(scores, rewards=torch.where(rows, 0.0, scores.rewards.float()),
                   step_rewards=step_rewards), groups


@torch.no_grad()
def _forward_logprobs(model, rollout: Rollout, micro: int) -> torch.Tensor:
    """[N, T] completion log-probs without gradient, a micro-batch at a time."""
    parts = []
    for start in range(0, rollout.prompt_ids.shape[0], micro):
        rows = slice(start, start + micro)
        parts.append(completion_logprobs(model, rollout.input_ids[rows],
                                         rollout.attention_mask[rows], rollout.prompt_ids.shape[1]))
    return torch.cat(parts)


def train_grpo(cfg, run_path: Path, policy_path: str | Path, reward_fn: RewardFn,
               rl_records: list[MathRecord], eval_records: list[MathRecord], logger,
               config_yaml: str, out_name: str = "grpo", reference_path: str | Path | None = None,
               evaluate_ends: bool = True) -> Path:
    """Run `cfg.grpo.steps` GRPO steps from `policy_path`; returns the final export's folder.

    The reference model is `reference_path` (default: the starting policy), frozen throughout.
    `evaluate_ends=False` skips the held-out evaluation of the starting and the final policy
    (the outer loop evaluates both in its own units; `grpo.eval_every` still applies between).
    Each step is sample (rollout + score, refilled under dynamic sampling) -> advantages ->
    update -> log, one function each. `grpo.algorithm=offline_rft` runs offline RFT in its place
    (policy/offline_rft.py; no evaluation of its own: `igrpo eval` or the outer loop's).
    """
    g = cfg.grpo
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    if g.algorithm == "offline_rft":
        from policy.offline_rft import train_offline_rft

        return train_offline_rft(cfg, run_path, policy_path, reward_fn, rl_records, logger,
                                 config_yaml, out_name)
    if g.algorithm == "ppo":
        from policy.ppo import train_ppo

        return train_ppo(cfg, run_path, policy_path, reward_fn, rl_records, eval_records, logger,
                         config_yaml, out_name, reference_path, evaluate_ends)
    rank, world_size = world()
    tokenizer, plan, engine, reference = policy_engines(cfg, policy_path, reference_path)
    fmt = prompt_format(cfg.data)
    trainer = Trainer(out, engine, logger, g.steps, desc=out_name, max_seconds=g.max_minutes * 60,
                      fresh_state={"sample_seed": sampling_seed()})
    sampler = Sampler(engine, trainer, cfg, policy_path)
    evaluate = _evaluator(cfg, sampler, tokenizer, eval_records, fmt, trainer, evaluate_ends)
    per_rank = g.questions_per_step // world_size
    while trainer.running():
        step = trainer.step
        timing = {"rollout": 0.0, "scoring": 0.0}
        sample = _sample_fn(sampler, tokenizer, fmt, reward_fn, g, rank, per_rank, timing)
        key = (trainer.state.get("sample_seed", cfg.run.seed), step)
        sampled = sample(step_questions(rl_records, step, g.questions_per_step, cfg.run.seed),
                         (*key, 0))
        if g.dynamic_sampling:
            sampled = refill_step(sampled, lambda round_: sample(refill_questions(
                rl_records, step, round_, g.questions_per_step, cfg.run.seed,
                g.dynamic_sampling_max_rounds), (*key, round_)), g, tokenizer.pad_token_id)
        updating = time.perf_counter()
        memory = device_memory_gib()  # the rollout's: vLLM's pool is awake
        sampler.rest()
        batch = advantage_step(sampled.scores, sampled.rewards, sampled.broken, sampled.rollout,
                               g, seed=cfg.run.seed * 1_000_003 + step)
        stats = update_step(trainer, reference, sampled.rollout, batch, g, plan,
                            f"{out_name} step {step + 1}",
                            is_reference=step == 0 and starts_at(reference_path, policy_path))
        timing["update"] = time.perf_counter() - updating
        trainer.advance()
        metrics = log_step(sampled.rollout, sampled.scores, sampled.rewards, batch, stats, g,
                           timing)
        metrics.update({**sampled.stats, **sampler.stats(), **memory_metrics(memory)})
        metrics["train/lr"] = current_lr(engine)
        metrics.update(due_evaluation(trainer, g, evaluate, evaluate_ends))
        media = None
        if g.inspect_every and trainer.step % g.inspect_every == 0 and is_main():
            media = _inspect(out / "inspect", trainer.step, g, tokenizer, sampled.records,
                             sampled.rollout, sampled.scores, sampled.rewards, batch.advantages,
                             batch.normalised, logger)
        trainer.log(metrics, media)
        if trainer.due(g.save_every):
            trainer.save()
    trainer.finish(tokenizer, out / "final", config_yaml,
                   {"steps": trainer.step, "seconds": trainer.state.get("seconds", 0.0)})
    return out / "final"


def sampling_seed() -> int:
    """A stage's sampling seed, drawn from the random state the stage starts in (the outer loop
    seeds each unit from its name) and kept in the stage's saved state: the rollouts of step s
    are seeded from (it, s), whatever ran before and however many processes run."""
    return broadcast_from_main(int(torch.randint(2**31 - 1, ())))


def due_evaluation(trainer: Trainer, g, evaluate, evaluate_ends: bool) -> dict:
    """The held-out metrics due after this step: greedy every `grpo.eval_every` steps, and
    (`evaluate_ends`) the sampled ones after the last step."""
    metrics = {}
    if g.eval_every and trainer.step % g.eval_every == 0 and trainer.step < g.steps:
        metrics.update(evaluate(sampled=False))
        trainer.bar.set_postfix(acc=f"{metrics['eval/greedy_accuracy']:.3f}")
    if trainer.step == g.steps and evaluate_ends:
        metrics.update(evaluate(sampled=True))
    return metrics


def starts_at(reference_path, policy_path) -> bool:
    """Whether a stage's reference is its starting policy (the default, and the outer loop's
    reset): until its first optimizer step the policy's log-probs are the reference's."""
    return reference_path is None or Path(reference_path) == Path(policy_path)


def reference_logprobs(reference, rollout: Rollout, micro: int, is_reference: bool):
    """The reference's log-probs of the rollout, or None: without a reference, and while the
    policy still is the reference (`is_reference`), where the caller uses the policy's own."""
    if reference is None or is_reference:
        return None
    return _forward_logprobs(reference, rollout, micro)


def policy_engines(cfg, policy_path, reference_path=None):
    """(tokenizer, batch plan, the policy's training engine, the frozen reference or None) of a
    policy stage; the reference (default: the starting policy) is loaded only when beta > 0,
    and ZeRO-3 partitions it like the policy."""
    g = cfg.grpo
    tokenizer = load_tokenizer(policy_path, cfg.model)
    plan = plan_grpo_batch(g.questions_per_step, g.group_size, cfg.deepspeed.micro_batch_size,
                           world()[1])
    engine = build_engine(load_causal_lm(policy_path, cfg.model, train=True), cfg.deepspeed,
                          lr=g.lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum)
    reference = None
    if g.beta > 0:
        reference = build_inference_engine(
            load_causal_lm(reference_path or policy_path, cfg.model, device=engine.device),
            cfg.deepspeed)
    return tokenizer, plan, engine, reference


def _sample_fn(sampler, tokenizer, fmt, reward_fn: RewardFn, g, rank: int, per_rank: int,
               timing: dict) -> Callable[[list[MathRecord], tuple], "Sampled"]:
    """sample(step's questions, key) -> this rank's share rolled out (seeded from `key`, see
    `rollout_step`) and scored; the seconds spent are added to `timing`."""
    def sample(records: list[MathRecord], key: tuple) -> Sampled:
        records = records[rank * per_rank:(rank + 1) * per_rank]
        started = time.perf_counter()
        rollout = rollout_step(sampler, tokenizer, fmt.prompts(tokenizer, records), g,
                               key, first=rank * per_rank)
        rolled = time.perf_counter()
        scored = score_step(reward_fn, records, rollout, g)
        timing["rollout"] += rolled - started
        timing["scoring"] += time.perf_counter() - rolled
        return Sampled(records, rollout, *scored)
    return sample


class Sampler:
    """Who generates for the training engine: its own module (`rollout.backend=hf`), or a
    colocated vLLM engine that is handed the current weights once per optimizer step
    (`rollout.backend=vllm`, policy/vllm_engine.py)."""

    def __init__(self, engine, trainer: Trainer, cfg, policy_path):
        self.engine, self.trainer = engine, trainer
        self.vllm = None
        if cfg.rollout.backend == "vllm":
            from policy.vllm_engine import engine_for

            self.vllm = engine_for(cfg, policy_path)

    @contextmanager
    def generating(self):
        """The model to generate with, inside the block (every rank enters it together): the
        training module with its weights gathered for the whole generation (hf), or the vLLM
        engine, handed the current weights inside the gather, which is released before the
        engine generates (under ZeRO-3 the full policy is not held beside vLLM's copy)."""
        with gathered_for_generation(self.engine) as module:
            if self.vllm is None:
                yield module
                return
            engine = self.vllm.sync(module, self.trainer.step)
        yield engine

    def rest(self) -> None:
        """Before a training update: a vLLM engine frees its GPU memory (`rollout.sleep`); the
        next `generating()` wakes it with the updated weights."""
        if self.vllm is not None:
            self.vllm.sleep()

    def stats(self) -> dict:
        """`time/weight_push`: seconds this rank spent pushing weights into vLLM since the last
        call ({} with the hf backend)."""
        if self.vllm is None:
            return {}
        seconds, self.vllm.push_seconds = self.vllm.push_seconds, 0.0
        return {"time/weight_push": seconds}


def _evaluator(cfg, sampler: Sampler, tokenizer, eval_records: list[MathRecord], fmt,
               trainer: Trainer, evaluate_ends: bool):
    """evaluate(sampled) -> held-out metrics, the questions spread over the ranks (every rank
    calls it). A stage at step 0 with `evaluate_ends` logs the starting policy's greedy metrics
    first."""
    def evaluate(sampled: bool) -> dict:
        with sampler.generating() as model:
            return evaluate_policy(
                model, tokenizer, eval_records, fmt,
                k=cfg.eval.k, temperature=cfg.eval.temperature,
                max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size,
                timeout_s=cfg.eval.grade_timeout_s, sampled=sampled, seed=cfg.run.seed)
    if trainer.step == 0 and evaluate_ends:
        trainer.log(evaluate(sampled=False))
    return evaluate


def rollout_step(sampler: Sampler, tokenizer, prompts: list[str], g, key: tuple = (),
                 first: int = 0) -> Rollout:
    """pi_old <- pi: the current weights sample G completions per prompt (in chunks of
    `grpo.rollout_questions` prompts where their KV cache would not fit at once). Each chunk
    samples under a random state seeded from (`key`, the step-wide index of its first
    question; this rank's prompts start at `first`): a step's samples do not depend on what
    ran before it, and with `grpo.rollout_questions` set they do not depend on the number of
    processes either."""
    chunk = g.rollout_questions or len(prompts)
    parts = []
    with sampler.generating() as model:
        for i in range(0, len(prompts), chunk):
            with seeded(*key, first + i):
                parts.append(generate_groups(
                    model, tokenizer, prompts[i:i + chunk], g.group_size,
                    max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                    greedy=g.temperature == 0))
    # every tensor of the step on the training engine's device (vLLM returns CPU tensors)
    return concat_rollouts(parts, tokenizer.pad_token_id).to(sampler.engine.device)


def score_step(reward_fn: RewardFn, records: list[MathRecord], rollout: Rollout, g,
               group_size: int | None = None):
    """(scores, [N] rewards, [Q] broken groups): the reward callable's scores with non-finite
    groups zeroed, DAPO's overlong penalty added (under process supervision to the last step's
    reward too), and with `grpo.shuffle_rewards` the control's permutation applied. Each record
    has `group_size` samples (default `grpo.group_size`; T-PPO scores single rows)."""
    group_size = group_size or g.group_size
    scores = reward_fn([r for r in records for _ in range(group_size)], rollout)
    scores = scores.to(rollout.completion_ids.device)  # every tensor of the step on one device
    scores, broken = drop_nonfinite(scores, group_size)
    penalty = overlong_penalty(rollout.lengths, g.max_new_tokens,
                               round(g.overlong_buffer_share * g.max_new_tokens),
                               g.overlong_penalty)
    rewards = scores.rewards.float() + penalty
    if scores.step_rewards is not None and bool(penalty.any()):
        scores = replace(scores, step_rewards=add_to_last_step(scores.step_rewards.float(),
                                                               scores.step_mask, penalty))
    if g.shuffle_rewards:
        scores, rewards = shuffled_rewards(scores, rewards)
    return scores, rewards, broken


@dataclass
class Sampled:
    """A step's questions, their G samples each (grouped question by question) and scores."""
    records: list[MathRecord]
    rollout: Rollout
    scores: Scores
    rewards: torch.Tensor
    """[N] solution rewards (the overlong penalty included)."""
    broken: torch.Tensor
    """[Q] groups holding a non-finite reward."""
    stats: dict = field(default_factory=dict)

    def groups(self, index: list[int]) -> "Sampled":
        """The question groups at `index`, in that order."""
        g = self.rollout.group_size
        rows = torch.tensor([q * g + j for q in index for j in range(g)], dtype=torch.long,
                            device=self.rewards.device)
        return Sampled([self.records[q] for q in index], self.rollout.rows(rows),
                       self.scores.rows(rows), self.rewards[rows],
                       self.broken[torch.tensor(index, dtype=torch.long,
                                                device=self.broken.device)])


def concat_sampled(parts: list[Sampled], pad_id: int) -> Sampled:
    return Sampled([r for p in parts for r in p.records],
                   concat_rollouts([p.rollout for p in parts], pad_id),
                   concat_scores([p.scores for p in parts]),
                   torch.cat([p.rewards for p in parts]), torch.cat([p.broken for p in parts]))


def informative(sampled: Sampled, g) -> torch.Tensor:
    """[Q] bool: groups whose advantages can be non-zero (DAPO's filter on the values the
    supervision normalises), and whose rewards are finite."""
    steps = sampled.scores.step_rewards if g.supervision == "process" else None
    return informative_groups(sampled.rewards, g.group_size, steps,
                              sampled.scores.step_mask if steps is not None else None) \
        & ~sampled.broken


def refill_step(first: Sampled, sample_more: Callable[[int], Sampled], g, pad_id: int) -> Sampled:
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): while the step holds fewer informative
    groups than questions (on any rank), sample `sample_more(round)` (round = 1, 2, ...; at most
    `grpo.dynamic_sampling_max_rounds`); then keep the first informative groups, topped up with
    uninformative ones if the cap was hit (those stay out of the loss). The batch keeps its size.
    Stats: the extra rounds and samples drawn and the informative groups kept."""
    want = len(first.records)
    parts = [first]
    found = int(informative(first, g).sum())
    rounds = 0
    while rounds < g.dynamic_sampling_max_rounds and global_sum(float(max(0, want - found))) > 0:
        rounds += 1
        parts.append(sample_more(rounds))
        found += int(informative(parts[-1], g).sum())
    joined = concat_sampled(parts, pad_id)
    good = informative(joined, g).tolist()
    chosen = ([q for q, ok in enumerate(good) if ok] + [q for q, ok in enumerate(good) if not ok])
    batch = joined.groups(sorted(chosen[:want]))
    batch.stats = {"rollout/refill_rounds": float(rounds),
                   "rollout/extra_samples": float((len(joined.records) - want) * g.group_size),
                   "train/informative_groups": float(min(sum(good), want))}
    return batch


@dataclass
class StepBatch:
    """What the loss of one step uses: token advantages, the normalised rewards they came from,
    the kept rows, the loss mask and the global normalisers (summed over ranks)."""
    advantages: torch.Tensor
    normalised: torch.Tensor
    keep: torch.Tensor
    broken: torch.Tensor
    loss_mask: torch.Tensor
    num_sequences: float
    num_tokens: float
    stats: dict = field(default_factory=dict)


def advantage_step(scores: Scores, rewards: torch.Tensor, broken: torch.Tensor,
                   rollout: Rollout, g, seed: int = 0) -> StepBatch:
    """Group-relative advantages and the loss mask: groups dropped by dynamic sampling or with
    non-finite rewards leave it, truncated samples too under overlong filtering; GPG's alpha
    scales the advantages; C3PO's token budget (drawn in an order seeded by `seed`) picks the
    tokens and becomes the token normaliser."""
    advantages, normalised = compute_advantages(
        scores, rewards, rollout, g,
        std_normalised=POLICY_LOSSES[g.loss].std_normalised_advantages)
    if g.zero_advantages:
        advantages = torch.zeros_like(advantages)
    keep = torch.ones(len(rewards), dtype=torch.bool, device=rewards.device)
    if g.dynamic_sampling:
        steps = scores.step_rewards if g.supervision == "process" else None
        keep = informative_groups(rewards, g.group_size, steps,
                                  scores.step_mask if steps is not None else None
                                  ).repeat_interleave(g.group_size)
    keep &= ~broken.repeat_interleave(g.group_size)
    if g.overlong_filter:
        keep &= ~rollout.truncated
    stats = {}
    if g.zero_group_correction:
        signal = (advantages != 0).any(-1) & keep
        alpha = zero_group_correction(global_sum(float(keep.sum())),
                                      global_sum(float((keep & ~signal).sum())))
        advantages = advantages * alpha
        stats["train/gpg_alpha"] = alpha
    loss_mask = rollout.completion_mask.float() * keep[:, None]
    num_tokens = global_sum(float(loss_mask.sum()))
    if g.token_budget_share:
        budget = round(g.token_budget_share * g.questions_per_step * g.group_size
                       * g.max_new_tokens)
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


def update_step(trainer: Trainer, reference, rollout: Rollout, batch: StepBatch, g, plan,
                where: str, is_reference: bool = False) -> dict:
    """`grpo.mu` passes over the batch, one optimizer step each, against log-probs of the
    reference and (mu > 1) of pi_old. Returns the global loss, KL and clip fraction, the gradient
    norm and the per-token entropy of the first pass. `is_reference`: the policy still is the
    reference (a stage's first step), so the reference's log-probs are pi_old's and no
    reference forward runs."""
    engine, world_size = trainer.engine, world()[1]
    entropy = torch.zeros_like(batch.loss_mask)
    if not has_signal(batch, reference is not None and g.beta > 0):
        # Nothing to learn: AdamW's momentum would still move the weights on a zero gradient.
        return {"loss": 0.0, "kl": 0.0, "clip": 0.0, "clip_high": 0.0, "logprob_diff": 0.0,
                "grad_norm": 0.0, "entropy": entropy, "skipped": 1.0}
    loss_fn = POLICY_LOSSES[g.loss].fn
    ref_logprobs = reference_logprobs(reference, rollout, plan.micro_batch_size, is_reference)
    old_logprobs = _forward_logprobs(engine.module, rollout, plan.micro_batch_size) \
        if g.mu > 1 else None
    stats = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "clip_high": 0.0, "logprob_diff": 0.0}
    sampled = rollout.sampler_logprobs
    all_tokens = global_sum(float(rollout.completion_mask.sum()))
    grad_norm = 0.0
    engine.train()
    for update in range(g.mu):
        def loss_of(rows: slice, mb: int):
            logprobs = completion_logprobs(
                engine, rollout.input_ids[rows], rollout.attention_mask[rows],
                rollout.prompt_ids.shape[1], entropy_out=entropy[rows] if update == 0 else None)
            old = logprobs.detach() if old_logprobs is None else old_logprobs[rows]
            if sampled is not None and update == 0:  # how far the sampler's numbers drift
                drift = (logprobs.detach() - sampled[rows].to(logprobs)).abs()
                stats["logprob_diff"] += float((drift * rollout.completion_mask[rows]).sum()) \
                    / max(all_tokens, 1.0)
            ref = ref_logprobs[rows] if ref_logprobs is not None else \
                old if reference is not None else None
            result = loss_fn(logprobs, old, ref, batch.advantages[rows], batch.loss_mask[rows],
                             clip_eps_low=g.clip_eps, clip_eps_high=g.clip_eps_high,
                             beta=g.beta, num_sequences=max(batch.num_sequences, 1.0),
                             num_tokens=max(batch.num_tokens, 1.0), max_tokens=g.max_new_tokens)
            # Shares of the global step: summed over micro-batches and ranks they give the
            # batch loss and the token means of KL and clip fraction.
            share = float(batch.loss_mask[rows].sum()) / max(batch.num_tokens, 1.0)
            stats["loss"] += result.loss.item() / g.mu
            stats["kl"] += result.kl.item() * share / g.mu
            stats["clip"] += result.clip_fraction.item() * share / g.mu
            stats["clip_high"] += result.clip_high.item() * share / g.mu
            return result.loss * world_size

        grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of,
                                     f"{where}, update {update + 1}", grad_norm)
    return {**{key: global_sum(value) for key, value in stats.items()},
            "grad_norm": grad_norm, "entropy": entropy, "skipped": 0.0}


def has_signal(batch: StepBatch, kl_term: bool) -> bool:
    """Whether the step's loss can have a gradient: some token is kept and either an advantage
    is non-zero or the KL term applies (all ranks agree: the sums are global)."""
    if batch.num_sequences == 0 or global_sum(float(batch.loss_mask.sum())) == 0:
        return False
    return kl_term or global_sum(float((batch.advantages * batch.loss_mask).abs().sum())) > 0


def log_step(rollout: Rollout, scores: Scores, rewards: torch.Tensor, batch: StepBatch,
             stats: dict, g, timing: dict) -> dict:
    """The step's metrics (docs/metrics.md) over every rank's samples (all ranks call it);
    `timing`: this rank's seconds of rollout, scoring and update (the ranks run side by side)."""
    mask = rollout.completion_mask.float()
    by_group = batch.normalised.reshape(-1, g.group_size * batch.normalised.shape[1])
    check = torch.tensor([inspection.group_sum_check(batch.normalised, g.group_size)],
                         device=mask.device)
    correct = [] if scores.correct is None else [scores.correct.float()]
    (rewards, lengths, truncated, entropy, tokens, seen, keep, silent, broken, check,
     *correct) = gather_rows(
        rewards.float(), rollout.lengths.float(), rollout.truncated.float(),
        (stats["entropy"] * mask).sum(-1), mask.sum(-1), rollout.attention_mask.sum(-1).float(),
        batch.keep.float(), (by_group == 0).all(-1).float(), batch.broken.float(), check,
        *correct)
    grouped = rewards.view(-1, g.group_size)
    step_time = timing["rollout"] + timing["scoring"] + timing["update"]
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/group_std": float(grouped.std(-1, unbiased=False).mean()),
        "reward/zero_std_groups": float((grouped.max(-1).values == grouped.min(-1).values)
                                        .float().mean()),
        # Groups whose advantages are all 0 (equal rewards, or a spread under the floor).
        "reward/no_signal_groups": float(silent.mean()),
        "reward/nonfinite_groups": float(broken.sum()),
        "rollout/length_mean": float(lengths.mean()),
        "rollout/length_max": float(lengths.max()),
        "rollout/truncation_rate": float(truncated.mean()),
        "rollout/tokens_per_s": float(lengths.sum()) / max(timing["rollout"], 1e-9),
        "train/loss": stats["loss"],
        "train/kl": stats["kl"],
        "train/clip_fraction": stats["clip"],
        "train/clip_high": stats["clip_high"],
        "train/entropy": float(entropy.sum() / tokens.sum().clamp(min=1)),
        "train/grad_norm": stats["grad_norm"],
        "train/kept_groups": float(keep.mean()),
        "train/skipped_step": stats["skipped"],
        "train/advantage_group_sum": float(check.max()),
        "train/tokens_per_s": float(seen.sum()) * g.mu / max(timing["update"], 1e-9),
        "time/rollout": timing["rollout"], "time/scoring": timing["scoring"],
        "time/update": timing["update"], "time/step": step_time,
        **({"rollout/logprob_diff": stats["logprob_diff"]}
           if rollout.sampler_logprobs is not None else {}),
        **batch.stats,
    }
    if correct:
        metrics["reward/accuracy"] = float(correct[0].mean())
    return metrics


def _inspect(folder: Path, step: int, g, tokenizer, records, rollout, scores, rewards,
             advantages, normalised, logger) -> dict | None:
    """Write this step's advantage table and token heatmap; return the wandb media to log."""
    per_sample = [r for r in records for _ in range(g.group_size)]
    samples = inspection.chosen_samples(len(per_sample), g.group_size, g.inspect_groups,
                                        g.inspect_samples)
    rows = inspection.advantage_rows(step, per_sample, rollout, scores, rewards, advantages,
                                     normalised, tokenizer, samples, g.supervision)
    page = inspection.render_html(step, per_sample, rollout, advantages, rows, tokenizer, samples,
                                  g.supervision)
    inspection.write_inspection(folder, step, rows, page)
    if logger.wandb_run is None:
        return None
    return inspection.wandb_media(rows, page, scores, normalised, advantages,
                                  rollout.completion_mask, g.supervision == "process")
