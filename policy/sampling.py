"""What every policy algorithm builds its loop from (policy/algorithms/): the step's questions
and the seeded rollout and scoring of a step (`make_sample`); the engines and the sampler are
policy/engines.py, the scoring and the sampled batch policy/scoring.py, the held-out evaluator
and its schedule policy/evaluate.py (supervised fine-tuning's tensors and step:
policy/supervised.py; a step's batch and mini-batches: policy/batch.py). An algorithm file imports these, the math
(policy/math/) and the generation engines (policy/generation/), never another algorithm.

    tokenizer, plan, engine, reference = policy_engines(stage, policy_path)
    sampler = Sampler(engine, trainer, stage.vllm, policy_path)
    sample = make_sample(sampler, tokenizer, reward_fn, stage, rank, per_rank, timing)
    sampled = sample(step_questions(records, step, stage.policy.questions_per_step, seed), key)
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from configs.schema import PolicyConfig
from policy.engines import Sampler
from policy.generation.rollout import Rollout, concat_rollouts, generate_groups
from policy.rewards import RewardFn
from policy.scoring import Sampled, score_step
from policy.stage import PolicyStage
from runtime.data import MathRecord
from runtime.dist import broadcast_from_main
from runtime.memory import device_memory_gib, memory_phase
from runtime.shards import seeded
from runtime.training import epoch_slice
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
    are seeded from `rollout_key`(it, s), whatever ran before and however many processes run."""
    return broadcast_from_main(int(torch.randint(2**31 - 1, ())))


def rollout_key(sample_seed: int, step: int, round_: int = 0) -> tuple[int, int, int]:
    """The key of a step's rollouts, one convention for every algorithm that samples per step
    (GRPO and its recipes, DPO, PPO and its value pretraining): (the stage's sampling seed, the
    step, the round: 0, then dynamic sampling's refills 1, 2, ...). `rollout_step` seeds each
    sample from it and the sample's index in the step."""
    return sample_seed, step, round_


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
