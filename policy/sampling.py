"""What every policy algorithm builds its loop from (policy/algorithms/): the step's
questions, the engines (policy, frozen reference), the sampler (the training module, or a
colocated vLLM engine), the seeded rollout, the scoring step, the sampled batch and the
held-out evaluator (supervised fine-tuning's tensors and step: policy/supervised.py; a step's
batch and mini-batches: policy/batch.py). An algorithm file imports these, the math
(policy/math/) and the generation engines (policy/generation/), never another algorithm.

    tokenizer, plan, engine, reference = policy_engines(stage, policy_path)
    sampler = Sampler(engine, trainer, stage.vllm, policy_path)
    sample = make_sample(sampler, tokenizer, reward_fn, stage, rank, per_rank, timing)
    sampled = sample(step_questions(records, step, stage.policy.questions_per_step, seed), key)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from configs.batching import plan_grpo_batch
from configs.schema import PolicyConfig
from policy.evaluate import evaluate_policy
from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import Rollout, concat_rollouts, generate_groups
from policy.math.shaping import add_to_last_step, overlong_penalty
from policy.rewards import RewardFn, Scores, concat_scores
from policy.stage import Evaluation, PolicyStage, Shaping, VLLMSettings
from runtime.data import MathRecord
from runtime.dist import broadcast_from_main, world
from runtime.engine import build_engine, build_inference_engine, gathered_for_generation
from runtime.memory import device_memory_gib, memory_phase
from runtime.models import load_causal_lm, load_tokenizer
from runtime.shards import seeded
from runtime.training import StageLoop, epoch_slice
from runtime.seeds import derive_seed


def step_questions(records: list[MathRecord], step: int, per_step: int, seed: int
                   ) -> list[MathRecord]:
    """The questions of `step`: consecutive slices of a seeded permutation, reshuffled per epoch."""
    return [records[i] for i in epoch_slice(len(records), step, per_step,
                                                  derive_seed(seed, "questions"))[1]]


def refill_questions(records: list[MathRecord], step: int, round_: int, per_step: int, seed: int,
                     max_rounds: int) -> list[MathRecord]:
    """The questions of dynamic sampling's extra round `round_` (1-based) of `step`: a seeded
    stream of its own, so a resumed step draws the same ones."""
    index = step * max_rounds + round_ - 1
    order = epoch_slice(len(records), index, per_step, derive_seed(seed, "refill"))[1]
    return [records[i] for i in order]


def sampling_seed() -> int:
    """A stage's sampling seed, drawn from the random state the stage starts in (the outer loop
    seeds each unit from its name) and kept in the stage's saved state: the rollouts of step s
    are seeded from (it, s), whatever ran before and however many processes run."""
    return broadcast_from_main(int(torch.randint(2**31 - 1, ())))


def starts_at(reference_path, policy_path) -> bool:
    """Whether a stage's reference is its starting policy (the default, and the outer loop's
    reset): until its first optimizer step the policy's log-probs are the reference's."""
    return reference_path is None or Path(reference_path) == Path(policy_path)


def policy_engines(stage: PolicyStage, policy_path, reference_path=None):
    """(tokenizer, batch plan, the policy's training engine, the frozen reference or None) of a
    policy stage; the reference (default: the starting policy) is loaded only when beta > 0,
    and ZeRO-3 partitions it like the policy."""
    p, model = stage.policy, stage.model
    tokenizer = load_tokenizer(policy_path, model)
    plan = plan_grpo_batch(p.questions_per_step, p.group_size, stage.deepspeed.micro_batch_size,
                           world()[1], p.mini_batches)
    engine = build_engine(load_causal_lm(policy_path, model, train=True), stage.deepspeed,
                          lr=p.lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum)
    reference = None
    if p.beta > 0:
        reference = build_inference_engine(
            load_causal_lm(reference_path or policy_path, model, device=engine.device),
            stage.deepspeed)
    return tokenizer, plan, engine, reference


@torch.no_grad()
def forward_logprobs(model, rollout: Rollout, micro: int,
                     entropy_out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, T] completion log-probs without gradient, a micro-batch at a time (and the per-token
    entropy into `entropy_out` [N, T], where given)."""
    parts = []
    for start in range(0, rollout.prompt_ids.shape[0], micro):
        rows = slice(start, start + micro)
        parts.append(completion_logprobs(
            model, rollout.input_ids[rows], rollout.attention_mask[rows],
            rollout.prompt_ids.shape[1],
            entropy_out=None if entropy_out is None else entropy_out[rows]))
    return torch.cat(parts)


def sampler_drift(logprobs: torch.Tensor, rollout: Rollout, all_tokens: float,
                  rows: slice = slice(None)) -> float:
    """The rollout's `rows`' share of the step's mean |log-prob - the sampler's| over its
    `all_tokens` completion tokens (`rollout/logprob_diff`: how far vLLM's numbers are from the
    training model's); 0 where the sampler gave none."""
    sampled = rollout.sampler_logprobs
    if sampled is None:
        return 0.0
    drift = (logprobs - sampled[rows].to(logprobs)).abs() * rollout.completion_mask[rows]
    return float(drift.sum()) / max(all_tokens, 1.0)


def reference_logprobs(reference, rollout: Rollout, micro: int, is_reference: bool):
    """The reference's log-probs of the rollout, or None: without a reference, and while the
    policy still is the reference (`is_reference`), where the caller uses the policy's own."""
    if reference is None or is_reference:
        return None
    return forward_logprobs(reference, rollout, micro)


class Sampler:
    """Who generates for the training engine: its own module (`rollout.backend=hf`), or a
    colocated vLLM engine that is handed the current weights once per optimizer step
    (`rollout.backend=vllm`, policy/generation/vllm.py)."""

    def __init__(self, engine, trainer: StageLoop, vllm: VLLMSettings | None, policy_path):
        self.engine, self.trainer = engine, trainer
        self.vllm, self.start = None, ("checkpoint", str(policy_path))
        if vllm is not None:
            from policy.generation.vllm import engine_for

            self.vllm = engine_for(vllm, policy_path)

    def push_due(self) -> bool:
        """Whether vLLM lacks the current weights: it holds neither this step's pushed ones nor,
        before the first optimizer step, the starting checkpoint (no push is needed then)."""
        held = self.vllm.version
        return held != self.trainer.step and not (self.trainer.step == 0 and held == self.start)

    @contextmanager
    def generating(self):
        """The model to generate with, inside the block (every rank enters it together): the
        training module with its weights gathered for the whole generation (hf), or the vLLM
        engine. A push, where due, runs with vLLM's KV pool freed (it sleeps first): under the
        gather the full policy sits beside vLLM's weights only, and the gather is released
        before the KV cache wakes to generate."""
        if self.vllm is None:
            with gathered_for_generation(self.engine) as module:
                yield module
            return
        if self.push_due():
            self.vllm.sleep()
            with memory_phase("push"), gathered_for_generation(self.engine) as module:
                self.vllm.sync(module, self.trainer.step)
        yield self.vllm

    def rest(self) -> None:
        """The end of a generation phase, before scoring, an update or an export: a vLLM
        engine frees its GPU memory (`rollout.sleep`); the next `generating()` wakes it (with the
        updated weights)."""
        if self.vllm is not None:
            self.vllm.sleep()

    def stats(self) -> dict:
        """`time/weight_push`: seconds this rank spent pushing weights into vLLM since the last
        call ({} with the hf backend)."""
        if self.vllm is None:
            return {}
        seconds, self.vllm.push_seconds = self.vllm.push_seconds, 0.0
        return {"time/weight_push": seconds}


def rollout_step(sampler: Sampler, tokenizer, prompts: list[str], g: PolicyConfig, key: tuple = (),
                 first: int = 0) -> Rollout:
    """pi_old <- pi: the current weights sample G completions per prompt (in chunks of
    `policy.rollout_questions` prompts where their KV cache would not fit at once). Each chunk
    samples under a random state seeded from (`key`, the step-wide index of its first
    question; this rank's prompts start at `first`): a step's samples do not depend on what
    ran before it, and with `policy.rollout_questions` set they do not depend on the number of
    processes either."""
    chunk = g.rollout_questions or len(prompts)
    parts = []
    with sampler.generating() as model, memory_phase("rollout"):
        for i in range(0, len(prompts), chunk):
            with seeded(*key, first + i):
                parts.append(generate_groups(
                    model, tokenizer, prompts[i:i + chunk], g.group_size,
                    max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
                    greedy=g.temperature == 0, sampler_logprobs=True))
    # every tensor of the step on the training engine's device (vLLM returns CPU tensors)
    return concat_rollouts(parts, tokenizer.pad_token_id).to(sampler.engine.device)


def shuffled_rewards(scores: Scores, rewards: torch.Tensor) -> tuple[Scores, torch.Tensor]:
    """The shuffled-reward control (`controls.shuffle_rewards`): the batch's solution rewards
    permuted over its samples (its final-answer checks `correct` with them: the anchored
    process credit trains on those) and, for process supervision, its step rewards permuted over
    all of its real steps, so that no reward belongs to its own sample or step any more (the same
    values, the same step layout)."""
    order = torch.randperm(len(rewards))
    rewards = rewards[order]
    if scores.correct is not None:
        scores = replace(scores, correct=scores.correct[order])
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


def score_step(reward_fn: RewardFn, records: list[MathRecord], rollout: Rollout,
               p: PolicyConfig, shaping: Shaping, group_size: int | None = None):
    """(scores, [N] rewards, [Q] broken groups): the reward callable's scores with non-finite
    groups zeroed, DAPO's overlong penalty added (under process supervision to the last step's
    reward too), and with `controls.shuffle_rewards` the control's permutation applied. Each record
    has `group_size` samples (default `policy.group_size`; T-PPO scores single rows)."""
    group_size = group_size or p.group_size
    scores = reward_fn([r for r in records for _ in range(group_size)], rollout)
    scores = scores.to(rollout.completion_ids.device)  # every tensor of the step on one device
    scores, broken = drop_nonfinite(scores, group_size)
    penalty = overlong_penalty(rollout.lengths, p.max_new_tokens, shaping.overlong_buffer,
                               shaping.overlong_penalty)
    rewards = scores.rewards.float() + penalty
    if scores.step_rewards is not None and bool(penalty.any()):
        scores = replace(scores, step_rewards=add_to_last_step(scores.step_rewards.float(),
                                                               scores.step_mask, penalty))
    if shaping.shuffle:
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
        size = self.rollout.group_size
        rows = torch.tensor([q * size + j for q in index for j in range(size)], dtype=torch.long,
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


def make_sample(sampler: Sampler, tokenizer, reward_fn: RewardFn, stage: PolicyStage, rank: int,
                per_rank: int, timing: dict) -> Callable[[list[MathRecord], tuple], Sampled]:
    """sample(step's questions, key) -> this rank's share rolled out (seeded from `key`, see
    `rollout_step`) and scored; the seconds spent are added to `timing`."""
    def sample(records: list[MathRecord], key: tuple) -> Sampled:
        records = records[rank * per_rank:(rank + 1) * per_rank]
        started = time.perf_counter()
        rollout = rollout_step(sampler, tokenizer, stage.prompts.prompts(tokenizer, records),
                               stage.policy, key, first=rank * per_rank)
        rolled = time.perf_counter()
        timing["rollout_memory"] = device_memory_gib()  # vLLM's pool awake
        sampler.rest()  # scoring never needs vLLM: its pool is freed first
        with memory_phase("scoring"):
            scored = score_step(reward_fn, records, rollout, stage.policy, stage.shaping)
        timing["rollout"] += rolled - started
        timing["scoring"] += time.perf_counter() - rolled
        return Sampled(records, rollout, *scored)
    return sample


def make_evaluator(evaluation: Evaluation, sampler: Sampler, tokenizer,
                   eval_records: list[MathRecord], fmt, trainer: StageLoop, evaluate_ends: bool):
    """evaluate(sampled) -> held-out metrics, the questions spread over the ranks (every rank
    calls it). A stage at step 0 with `evaluate_ends` logs the starting policy's greedy metrics
    first."""
    def evaluate(sampled: bool) -> dict:
        with sampler.generating() as model:
            e = evaluation
            return evaluate_policy(
                model, tokenizer, eval_records, fmt, k=e.k, temperature=e.temperature,
                max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, timeout_s=e.timeout_s,
                sampled=sampled, seed=e.seed, step_oracle=e.step_oracle,
                step_separator=e.step_separator)
    if trainer.step == 0 and evaluate_ends:
        trainer.log(evaluate(sampled=False))
    return evaluate


def due_evaluation(trainer: StageLoop, g: PolicyConfig, evaluate, evaluate_ends: bool) -> dict:
    """The held-out metrics due after this step: greedy every `policy.eval_every` steps, and
    (`evaluate_ends`) the sampled ones after the last step, or the step a guard ended on."""
    metrics = {}
    if g.eval_every and trainer.step % g.eval_every == 0 and trainer.step < g.steps:
        metrics.update(evaluate(sampled=False))
        trainer.bar.set_postfix(acc=f"{metrics['eval/greedy_accuracy']:.3f}")
    if (trainer.step == g.steps or trainer.stopped) and evaluate_ends:
        metrics.update(evaluate(sampled=True))
    return metrics
