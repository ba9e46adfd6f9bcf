"""One GRPO step or one reward-model step, run under `torchrun` with any number of processes;
tests/test_distributed.py compares 1 process against 2 (ZeRO-2 and ZeRO-3) on the same global batch.

    torchrun --nproc_per_node 2 tests/dist_check.py grpo OUT BASE ZERO_STAGE
    torchrun --nproc_per_node 2 tests/dist_check.py ppo OUT BASE ZERO_STAGE
    torchrun --nproc_per_node 2 tests/dist_check.py rm OUT BASE ZERO_STAGE DATA.jsonl

Rollouts are greedy (grpo.temperature=0), so they do not depend on how questions are spread over
ranks; the process reward cuts every completion into 3-token steps and scores each step from its
tokens and index, so advantages are non-zero although a greedy group's samples are identical. Each rank
writes the advantage tensor the loss received to OUT/advantages-rank<r>.pt.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402

from small_config import SMALL  # noqa: E402

GRPO = [*SMALL, "grpo.steps=1", "grpo.questions_per_step=4", "grpo.group_size=4",
        "grpo.temperature=0", "grpo.max_new_tokens=10", "grpo.eval_every=0", "grpo.mu=2",
        "grpo.inspect_every=0", "deepspeed.micro_batch_size=4", "run.wandb_mode=disabled",
        "run.threads=1", "grpo.supervision=process", "eval.k=1", "data.eval_questions=2"]
RM = [*SMALL, "rm.kind=prm", "rm.batch_size=8", "rm.epochs=1", "rm.eval_every=0",
      "rm.val_fraction=0", "deepspeed.micro_batch_size=2", "run.wandb_mode=disabled",
      "run.threads=1"]


class ChunkStepReward:
    """Steps of 3 tokens; a step's reward is the parity of its token-id sum plus its index (a
    random model's greedy text repeats itself: the index keeps the rewards varied)."""

    def __call__(self, records, rollout):
        from policy.rewards import Scores
        from runtime.steps import pad_steps

        values, ends = [], []
        for i in range(len(rollout.texts)):
            ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
            cut = list(range(2, len(ids), 3)) or [len(ids) - 1]
            if cut[-1] != len(ids) - 1:
                cut.append(len(ids) - 1)
            values.append([float((sum(ids[max(0, e - 2):e + 1]) + k) % 2)
                           for k, e in enumerate(cut)])
            ends.append(cut)
        step_rewards, step_mask, step_end = pad_steps(values, ends)
        return Scores(rewards=step_rewards.sum(-1), step_rewards=step_rewards,
                      step_mask=step_mask, step_end_index=step_end)


def main() -> None:
    kind, out, base, stage = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    from configs import load_config
    from runtime.engine import init_distributed, is_main, world
    from runtime.tracking import MetricsLogger

    torch.set_num_threads(1)
    init_distributed()
    rank, _ = world()
    overrides = [f"run.root={out}", f"deepspeed.zero_stage={stage}"]
    logger = MetricsLogger(out / "metrics.jsonl", config={}, mode="disabled", project="",
                           name="", enabled=is_main())
    torch.manual_seed(0)
    if kind == "ppo":  # PPO with its critic, process rewards at the steps' last tokens
        from policy.grpo import train_grpo
        from runtime.data import load_splits

        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides, "ppo.critic_lr=1e-3"],
                          recipe="ppo")
        splits = load_splits(cfg.data, 0)
        train_grpo(cfg, out, base, ChunkStepReward(), splits.rl, splits.eval, logger, "")
    elif kind == "grpo":
        from policy import grpo as grpo_module
        from runtime.data import load_splits

        cfg = load_config("configs/tiny.yaml", [*GRPO, *overrides])
        spec = grpo_module.POLICY_LOSSES["grpo"]
        seen = []

        def recording(logprobs, old, ref, advantages, mask, **kw):
            seen.append(advantages.detach().clone())
            return spec.fn(logprobs, old, ref, advantages, mask, **kw)

        grpo_module.POLICY_LOSSES["grpo"] = dataclasses.replace(spec, fn=recording)
        splits = load_splits(cfg.data, 0)
        grpo_module.train_grpo(cfg, out, base, ChunkStepReward(), splits.rl, splits.eval, logger,
                               "")
        first_update = seen[:len(seen) // cfg.grpo.mu]  # the same tensors again for update 2
        torch.save(torch.cat(first_update), out / f"advantages-rank{rank}.pt")
    else:
        from process_supervision.formats import load_step_examples
        from reward_model.train import train_reward_model

        cfg = load_config("configs/tiny.yaml", [*RM, *overrides])
        examples, _ = load_step_examples(sys.argv[5])
        train_reward_model(cfg, out / "rm", base, examples, logger, "")


if __name__ == "__main__":
    main()
