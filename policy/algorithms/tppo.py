"""T-PPO (Fan et al. 2025, "Truncated Proximal Policy Optimization"): PPO whose rollout advances
a window of tokens per step, so that the update need not wait for the longest response.

Launch as GRPO with `grpo.algorithm=t_ppo` (the `t_ppo` recipe; `ppo.window_share` sets the
window). The batch is a pool of `questions_per_step x G` sequences in flight. Each step: empty
slots take the next samples of a seeded stream (G consecutive samples per question); every
sequence is extended by up to one window under the current policy; those that end (an end
token, or `grpo.max_new_tokens`) are scored by the reward callable. Extended GAE: the
advantages of a sequence still unfinished bootstrap from the critic's value of the state after
its last token. Token filtering: the policy and the critic train on this window's tokens only
(earlier windows were trained when an older policy wrote them), and sequences that ended leave
the pool, their slots going to new samples. The pool is part of the saved state: a resumed run
continues the same sequences. Outcome rewards only (a PRM's step scores would need every
window rescored). The critic and its targets: policy/critic.py, as PPO's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from configs.schema import Config
from policy.critic import (end_value_step, finish_value_stage, forward_values, ppo_targets,
                           rollout_logprobs, train_passes, value_metrics, value_stage)
from policy.generation.rollout import Rollout, continue_rows
from policy.kit import score_step, starts_at
from policy.rewards import RewardFn, Scores
from runtime.data import MathRecord
from runtime.engine import gather_objects, gather_rows, global_sum, world
from runtime.models import end_token_ids
from runtime.prompts import encode_prompts
from runtime.training import Trainer, epoch_slice, stage_done


def train_tppo(cfg: Config, run_path: Path, policy_path: str | Path, reward_fn: RewardFn,
               rl_records: list[MathRecord], eval_records: list[MathRecord], logger,
               config_yaml: str, out_name: str = "grpo",
               reference_path: str | Path | None = None, evaluate_ends: bool = True) -> Path:
    """`grpo.steps` T-PPO steps from `policy_path` (train_grpo's contract); returns the
    policy's export (`<run>/<out_name>/final`)."""
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    stage = value_stage(cfg, out, f"{out_name} (t_ppo)", policy_path, reward_fn, rl_records,
                        eval_records, logger, reference_path, evaluate_ends)
    while stage.trainer.running():
        step = stage.trainer.step
        started = time.perf_counter()
        metrics, timing = tppo_step(stage.trainer, stage.critic, stage.reference, stage.sampler,
                                    stage.tokenizer, stage.fmt, reward_fn, rl_records, cfg,
                                    stage.plan, f"{out_name} step {step + 1}",
                                    step == 0 and starts_at(reference_path, policy_path))
        end_value_step(stage, metrics, timing, started, cfg.grpo, evaluate_ends)
    return finish_value_stage(stage, out, config_yaml)


def sample_record(records: list[MathRecord], k: int, group_size: int, seed: int) -> MathRecord:
    """The question of sample number `k` of the stream: samples k // G of a seeded order."""
    return records[epoch_slice(len(records), k // group_size, 1, seed * 7_919 + 11)[1][0]]


def window_tokens(cfg) -> int:
    """Tokens per window: `ppo.window_share` of `grpo.max_new_tokens`, at least one."""
    return max(1, round(cfg.ppo.window_share * cfg.grpo.max_new_tokens))


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


def tppo_step(trainer: Trainer, critic, reference, sampler, tokenizer, fmt, reward_fn: RewardFn,
              rl_records: list[MathRecord], cfg, plan, where: str,
              is_reference: bool = False) -> tuple[dict, dict]:
    """One T-PPO step on the pool in `trainer.state` (updated in place); returns the metrics
    and the seconds of rollout, scoring and update."""
    g = cfg.grpo
    rank, world_size = world()
    pool, next_sample = fill_pool(trainer.state.get("pool", []),
                                  g.questions_per_step * g.group_size,
                                  trainer.state.get("next_sample", 0))
    share = len(pool) // world_size
    mine = pool[rank * share:(rank + 1) * share]
    records = [sample_record(rl_records, row["k"], g.group_size, cfg.run.seed) for row in mine]
    prompts = encode_prompts(tokenizer, fmt.prompts(tokenizer, records))
    started = time.perf_counter()
    with sampler.generating() as model:
        new = continue_rows(model, tokenizer,
                            [q + row["tokens"] for q, row in zip(prompts, mine)],
                            [min(window_tokens(cfg), g.max_new_tokens - len(row["tokens"]))
                             for row in mine], temperature=g.temperature, top_p=g.top_p)
    rolled = time.perf_counter()
    texts = tokenizer.batch_decode([row["tokens"] + n for row, n in zip(mine, new)],
                                   skip_special_tokens=True)
    rollout, window, ended = window_rollout(
        tokenizer.pad_token_id, end_token_ids(tokenizer), prompts, [r["tokens"] for r in mine],
        new, texts, g.max_new_tokens, g.group_size)
    device = sampler.engine.device
    rollout, window, ended = rollout.to(device), window.to(device), ended.to(device)
    rewards, correct, broken = _score_ended(reward_fn, records, rollout, ended, g)
    scored = time.perf_counter()
    critic.eval()
    old_logprobs, ref_logprobs = rollout_logprobs(trainer, rollout, reference, g.mu, plan,
                                                  is_reference)
    values = forward_values(critic.module, rollout, plan.micro_batch_size, with_last=True)
    last = values.gather(1, rollout.lengths[:, None].long())[:, 0] * (~ended).float()
    # a row whose reward is not finite is left out of the loss (dropped, as GRPO drops its group)
    targets = ppo_targets(rollout, Scores(rewards), rewards, old_logprobs, ref_logprobs,
                          values[:, :-1], cfg, last_values=last,
                          loss_mask=window * ~broken[:, None])
    stats = train_passes(trainer, critic, rollout, targets, correct & ended, cfg, plan, where)
    kept = [{"k": row["k"], "tokens": row["tokens"] + n}
            for row, n, done in zip(mine, new, ended.tolist()) if not done]
    trainer.state["pool"] = [row for part in gather_objects(kept) for row in part]
    trainer.state["next_sample"] = next_sample
    metrics = value_metrics(rollout, rewards[ended], correct[ended], targets, ref_logprobs,
                            stats)
    metrics.update({"tppo/ended": global_sum(float(ended.sum())),
                    "reward/nonfinite_groups": global_sum(float(broken.sum())),
                    "tppo/carried": float(len(trainer.state["pool"])),
                    "tppo/window_tokens": targets.num_tokens})
    finished, = gather_rows(rollout.lengths[ended].float())
    if len(finished):
        metrics["rollout/length_mean"] = float(finished.mean())
    return metrics, {"rollout": rolled - started, "scoring": scored - rolled}


def _score_ended(reward_fn: RewardFn, records: list[MathRecord], rollout: Rollout,
                 ended: torch.Tensor, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N] rewards, right flags and non-finite flags: GRPO's scoring step (`score_step`: the
    reward callable, non-finite rewards dropped, the overlong penalty, the control's shuffle) on
    the rows that ended, each row its own group; 0 / False elsewhere."""
    rewards = torch.zeros(len(records), device=rollout.completion_ids.device)
    correct = torch.zeros(len(records), dtype=torch.bool, device=rewards.device)
    broken = torch.zeros(len(records), dtype=torch.bool, device=rewards.device)
    index = ended.nonzero()[:, 0]
    if len(index):
        scores, scored, dropped = score_step(reward_fn, [records[i] for i in index.tolist()],
                                             rollout.rows(index), g, group_size=1)
        rewards[index] = scored.to(rewards)
        correct[index] = scores.correct if scores.correct is not None else scored >= 0.5
        broken[index] = dropped
    return rewards, correct, broken
