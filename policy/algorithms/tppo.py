"""T-PPO (Fan et al. 2025, "Truncated Proximal Policy Optimization"): PPO whose rollout advances
a window of tokens per step, so that the update need not wait for the longest response.

Launch as GRPO with `policy.algorithm=t_ppo` (the `t_ppo` recipe; `ppo.window_share` sets the
window). The batch is a pool of `questions_per_step x G` sequences in flight. Each step: empty
slots take the next samples of a seeded stream (G consecutive samples per question); every
sequence is extended by up to one window under the current policy; those that end (an end
token, or `policy.max_new_tokens`) are scored by the reward callable. Extended GAE: the
advantages of a sequence still unfinished bootstrap from the critic's value of the state after
its last token. Token filtering: the policy and the critic train on this window's tokens only
(earlier windows were trained when an older policy wrote them), and sequences that ended leave
the pool, their slots going to new samples. The pool is part of the saved state: a resumed run
continues the same sequences. Outcome rewards only (a PRM's step scores would need every
window rescored). The critic and its targets: policy/actor_critic.py, as PPO's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from policy.actor_critic import (ValueStage, end_value_step, finish_value_stage, forward_values,
                                 ppo_targets, rollout_logprobs, train_passes, value_metrics,
                                 value_stage)
from policy.generation.rollout import Rollout, continue_rows
from policy.engines import starts_at
from policy.scoring import score_step
from policy.rewards import RewardFn, Scores
from policy.stage import PolicyStage, PPOSpec
from runtime.data import MathRecord
from runtime.dist import gather_objects, gather_rows, global_sum, world
from runtime.models import end_token_ids
from tasks.prompts import encode_prompts
from runtime.training import epoch_slice, stage_done
from runtime.seeds import derive_seed


def train_tppo(stage: PolicyStage, spec: PPOSpec, run_path: Path, policy_path: str | Path,
               reward_fn: RewardFn, rl_records: list[MathRecord], eval_records: list[MathRecord],
               logger, config_yaml: str, out_name: str = "t_ppo",
               reference_path: str | Path | None = None, evaluate_ends: bool = True) -> Path:
    """`policy.steps` T-PPO steps from `policy_path` (train_grpo's contract); returns the
    policy's export (`<run>/<out_name>/final`)."""
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    value = value_stage(stage, spec, out, f"{out_name} (t_ppo)", policy_path, reward_fn,
                        rl_records, eval_records, logger, reference_path, evaluate_ends)
    while value.trainer.running():
        step = value.trainer.step
        started = time.perf_counter()
        metrics, timing = tppo_step(value, stage, spec, reward_fn, rl_records,
                                    f"{out_name} step {step + 1}",
                                    step == 0 and starts_at(reference_path, policy_path))
        end_value_step(value, metrics, timing, started, stage.policy, evaluate_ends)
    return finish_value_stage(value, out, config_yaml)


def sample_record(records: list[MathRecord], k: int, group_size: int, seed: int) -> MathRecord:
    """The question of sample number `k` of the stream: samples k // G of a seeded order."""
    order = epoch_slice(len(records), k // group_size, 1, derive_seed(seed, "window-stream"))
    return records[order[1][0]]


def window_tokens(window_share: float, max_new_tokens: int) -> int:
    """Tokens per window: `ppo.window_share` of `policy.max_new_tokens`, at least one."""
    return max(1, round(window_share * max_new_tokens))


def fill_pool(pool: list[dict], size: int, next_sample: int) -> tuple[list[dict], int]:
    """The pool topped up to `size` rows with new samples ({"k": number, "tokens": []})."""
    pool = list(pool)
    while len(pool) < size:
        pool.append({"k": next_sample, "tokens": []})
        next_sample += 1
    return pool, next_sample


def window_rollout(pad_id: int, eos_id: int | list[int], prompts: list[list[int]],
                   before: list[list[int]], new: list[list[int]], texts: list[str],
                   max_new_tokens: int,
                   group_size: int) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    """(the rows as a Rollout of everything generated so far, the [N, T] mask of this window's
    tokens, the [N] rows that ended: an end token (`eos_id`: one or several) or out of
    tokens)."""
    rows = [b + n for b, n in zip(before, new)]
    width_p, width_c = max(map(len, prompts)), max(1, max(map(len, rows)))
    prompt_ids = torch.tensor([[pad_id] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion = torch.tensor([r + [pad_id] * (width_c - len(r)) for r in rows])
    completion_mask = torch.tensor([[1] * len(r) + [0] * (width_c - len(r)) for r in rows])
    window = torch.tensor([[0] * len(b) + [1] * len(n) + [0] * (width_c - len(b) - len(n))
                           for b, n in zip(before, new)])
    ends = set(eos_id) if isinstance(eos_id, list) else {eos_id}
    has_eos = torch.tensor([bool(r) and r[-1] in ends for r in rows])
    ended = has_eos | torch.tensor([len(r) >= max_new_tokens for r in rows])
    return (Rollout(prompt_ids, prompt_mask, completion, completion_mask, texts, ended & ~has_eos,
                    group_size), window, ended)


@dataclass
class Window:
    """A step's window over this rank's share of the pool: the rows' questions, the rollout of
    everything generated so far, this window's [N, T] tokens, the [N] rows that ended, the new
    tokens per row, and the sampling's seconds."""
    mine: list[dict]
    records: list[MathRecord]
    rollout: Rollout
    window: torch.Tensor
    ended: torch.Tensor
    new: list[list[int]]
    seconds: float
    rolled: float
    """`time.perf_counter()` when the generation ended (what follows it counts as scoring)."""


def roll_window(value: ValueStage, stage: PolicyStage, spec: PPOSpec,
                rl_records: list[MathRecord], pool: list[dict]) -> Window:
    """Every row of this rank's share of `pool` continued by one window of tokens."""
    p, tokenizer = stage.policy, value.tokenizer
    rank, world_size = world()
    share = len(pool) // world_size
    mine = pool[rank * share:(rank + 1) * share]
    # (the stream goes on from the questions earlier stages' steps drew, `question_offset`)
    first = stage.question_offset * p.questions_per_step * p.group_size
    records = [sample_record(rl_records, first + row["k"], p.group_size, stage.seed)
               for row in mine]
    prompts = encode_prompts(tokenizer, stage.prompts.prompts(tokenizer, records))
    started = time.perf_counter()
    size = window_tokens(spec.settings.window_share, p.max_new_tokens)
    with value.sampler.generating() as model:
        new = continue_rows(model, tokenizer,
                            [q + row["tokens"] for q, row in zip(prompts, mine)],
                            [min(size, p.max_new_tokens - len(row["tokens"])) for row in mine],
                            temperature=p.temperature, top_p=p.top_p)
    rolled = time.perf_counter()
    texts = tokenizer.batch_decode([row["tokens"] + n for row, n in zip(mine, new)],
                                   skip_special_tokens=True)
    rollout, window, ended = window_rollout(
        tokenizer.pad_token_id, end_token_ids(tokenizer), prompts, [r["tokens"] for r in mine],
        new, texts, p.max_new_tokens, p.group_size)
    device = value.sampler.engine.device
    return Window(mine, records, rollout.to(device), window.to(device), ended.to(device), new,
                  rolled - started, rolled)


def tppo_step(value: ValueStage, stage: PolicyStage, spec: PPOSpec, reward_fn: RewardFn,
              rl_records: list[MathRecord], where: str,
              is_reference: bool = False) -> tuple[dict, dict]:
    """One T-PPO step on the pool in `trainer.state` (updated in place); returns the metrics
    and the seconds of rollout and scoring."""
    p, trainer, plan = stage.policy, value.trainer, value.plan
    pool, next_sample = fill_pool(trainer.state.get("pool", []),
                                  p.questions_per_step * p.group_size,
                                  trainer.state.get("next_sample", 0))
    w = roll_window(value, stage, spec, rl_records, pool)
    rewards, correct, broken = _score_ended(reward_fn, w.records, w.rollout, w.ended, stage)
    scored = time.perf_counter()
    value.critic.eval()
    old_logprobs, ref_logprobs = rollout_logprobs(trainer, w.rollout, value.reference, p.mu,
                                                  plan, is_reference)
    values = forward_values(value.critic.module, w.rollout, plan.micro_batch_size, True)
    last = values.gather(1, w.rollout.lengths[:, None].long())[:, 0] * (~w.ended).float()
    # a row whose reward is not finite is left out of the loss (dropped, as GRPO drops its group)
    targets = ppo_targets(w.rollout, Scores(rewards), rewards, old_logprobs, ref_logprobs,
                          values[:, :-1], p.beta, spec, last_values=last,
                          loss_mask=w.window * ~broken[:, None])
    stats = train_passes(trainer, value.critic, w.rollout, targets, correct & w.ended, p, spec,
                         plan, where)
    kept = [{"k": row["k"], "tokens": row["tokens"] + n}
            for row, n, done in zip(w.mine, w.new, w.ended.tolist()) if not done]
    trainer.state["pool"] = [row for part in gather_objects(kept) for row in part]
    trainer.state["next_sample"] = next_sample
    metrics = value_metrics(w.rollout, rewards[w.ended], correct[w.ended], targets,
                            ref_logprobs, stats)
    metrics.update({"tppo/ended": global_sum(float(w.ended.sum())),
                    "reward/nonfinite_groups": global_sum(float(broken.sum())),
                    "tppo/carried": float(len(trainer.state["pool"])),
                    "tppo/window_tokens": targets.num_tokens})
    finished, = gather_rows(w.rollout.lengths[w.ended].float())
    if len(finished):
        metrics["rollout/length_mean"] = float(finished.mean())
    return metrics, {"rollout": w.seconds, "scoring": scored - w.rolled}


def _score_ended(reward_fn: RewardFn, records: list[MathRecord], rollout: Rollout,
                 ended: torch.Tensor, stage: PolicyStage
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N] rewards, right flags and non-finite flags: GRPO's scoring step (`score_step`: the
    reward callable, non-finite rewards dropped, the overlong penalty, the control's shuffle) on
    the rows that ended, each row its own group; 0 / False elsewhere."""
    rewards = torch.zeros(len(records), device=rollout.completion_ids.device)
    correct = torch.zeros(len(records), dtype=torch.bool, device=rewards.device)
    broken = torch.zeros(len(records), dtype=torch.bool, device=rewards.device)
    index = ended.nonzero()[:, 0]
    if len(index):
        scores, scored, dropped = score_step(reward_fn, [records[i] for i in index.tolist()],
                                             rollout.rows(index), stage.policy, stage.shaping,
                                             group_size=1)
        rewards[index] = scored.to(rewards)
        correct[index] = scores.correct if scores.correct is not None else scored >= 0.5
        broken[index] = dropped
    return rewards, correct, broken
