"""Offline rejection-sampling fine-tuning (DeepSeekMath §5.2.1), the paper's RFT baseline.

The starting policy is sampled once: the questions `policy.steps` GRPO steps would draw, G samples
each, as many samples as GRPO generates but all from the starting policy. The reward (the rule:
final answer against the gold one) keeps the right ones, and the policy is fine-tuned on them with
the SFT loss in one pass, at GRPO's batch size (questions_per_step x G sequences) and learning
rate. `<out>/samples.jsonl` holds every sample with its grade, written a step's samples at a
time, so a resumed run draws only the steps still missing; `<out>/final` is the result.
Selected by `policy.algorithm=offline_rft` (the `offline_rft` recipe) wherever GRPO runs.

Under a wall-clock budget (`policy.max_minutes`) the sampling and the fine-tuning share it, as GRPO's
steps share theirs between rollout and update: sampling stops after the step that spends
`rft.sampling_share` of it, and the fine-tuning gets what sampling left.
"""

from __future__ import annotations

import json
from time import perf_counter
from pathlib import Path

import torch
from tqdm import tqdm

from configs.schema import PolicyConfig
from policy.engines import trainable_policy
from policy.generation.rollout import generate_groups
from policy.sampling import step_questions
from policy.supervised import sft_tensors, supervised_step
from policy.rewards import RewardFn
from policy.stage import PolicyStage, RFTSpec
from runtime.batching import plan_batch
from runtime.data import MathRecord
from runtime.dist import broadcast_from_main, is_main, world
from runtime.engine import build_engine, current_lr
from runtime.models import load_causal_lm, load_tokenizer
from runtime.training import StageLoop, epoch_slice, stage_done
from runtime.seeds import derive_seed


def _finished_steps(path: Path, per_step: int) -> dict[int, list[dict]]:
    """The steps of `samples.jsonl` written whole (a crash can cut the last one short)."""
    steps: dict[int, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            steps.setdefault(row["step"], []).append(row)
    return {step: rows for step, rows in steps.items() if len(rows) == per_step}


def budget_split(max_minutes: float, sampling_share: float,
                 sampled_seconds: float) -> tuple[float, float]:
    """(seconds sampling may spend, seconds left to fine-tuning) of a `max_minutes` budget that
    sampling shares by `sampling_share`; (inf, 0) without a budget (0 = no limit for StageLoop).
    Fine-tuning always gets some time: at worst the one step a StageLoop runs before it stops."""
    if not max_minutes:
        return float("inf"), 0.0
    budget = max_minutes * 60
    return budget * sampling_share, max(budget - sampled_seconds, 1e-3)


def sampled_seconds(rows: list[dict]) -> float:
    """Wall clock the sampled steps took (each row carries its step's seconds)."""
    return sum({r["step"]: r.get("seconds", 0.0) for r in rows}.values())


def sample_once(stage: PolicyStage, spec: RFTSpec, out: Path, policy_path, reward_fn: RewardFn,
                rl_records: list[MathRecord]) -> list[dict]:
    """Every sample of the starting policy with its grade (main rank; every rank gets the rows)."""
    g = stage.policy
    rows = None
    if is_main():
        path = out / "samples.jsonl"
        done = _finished_steps(path, g.questions_per_step * g.group_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for s in sorted(done) for r in done[s]))
        missing = [s for s in range(g.steps) if s not in done]
        spent = sampled_seconds([r for rows_ in done.values() for r in rows_])
        budget = budget_split(g.max_minutes, spec.sampling_share, spent)[0]
        if missing and spent < budget:
            sample_steps(stage, policy_path, reward_fn, rl_records, missing, path, done,
                         spent, budget)
        rows = [r for s in sorted(done) for r in done[s]]
    return broadcast_from_main(rows)


def sample_steps(stage: PolicyStage, policy_path, reward_fn: RewardFn,
                 rl_records: list[MathRecord], missing: list[int], path: Path,
                 done: dict[int, list[dict]], spent: float, budget: float) -> None:
    """Sample and grade the `missing` steps while `spent` seconds stay under `budget`, each
    step's rows appended to `path` and to `done`."""
    g, seed = stage.policy, stage.seed
    tokenizer = load_tokenizer(policy_path, stage.model)
    model = load_causal_lm(policy_path, stage.model)
    for step in tqdm(missing, desc="offline RFT: sampling"):
        if spent >= budget:
            break
        started = perf_counter()
        records = step_questions(rl_records, stage.question_offset + step, g.questions_per_step,
                                 seed)
        torch.manual_seed(derive_seed(seed, "rft-sampling", step))
        rollout = generate_groups(model, tokenizer, stage.prompts.prompts(tokenizer, records),
                                  g.group_size, max_new_tokens=g.max_new_tokens,
                                  temperature=g.temperature, top_p=g.top_p)
        per_sample = [r for r in records for _ in range(g.group_size)]
        right = reward_fn(per_sample, rollout).rewards >= 0.5
        seconds = perf_counter() - started
        spent += seconds
        lines = [{"step": step, "question": r.question, "answer": r.answer,
                  "source_id": r.source_id, "text": text, "right": bool(ok), "seconds": seconds}
                 for r, text, ok in zip(per_sample, rollout.texts, right.tolist())]
        with path.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in lines))
        done[step] = lines


def train_offline_rft(stage: PolicyStage, spec: RFTSpec, run_path: Path,
                      policy_path: str | Path, reward_fn: RewardFn,
                      rl_records: list[MathRecord], eval_records: list[MathRecord], logger,
                      config_yaml: str, out_name: str = "offline_rft",
                      reference_path: str | Path | None = None,
                      evaluate_ends: bool = True) -> Path:
    """Sample the starting policy once, keep the right solutions, fine-tune on them; returns
    the export's folder (`<run>/<out_name>/final`). train_grpo's contract; no evaluation of its
    own and no reference (`igrpo eval` or the outer loop evaluates)."""
    out = run_path / out_name
    if stage_done(out):
        return out / "final"
    rows = sample_once(stage, spec, out, policy_path, reward_fn, rl_records)
    kept = [MathRecord(r["question"], r["answer"], (r["text"],), r["source_id"])
            for r in rows if r["right"]]
    if not kept:
        raise ValueError(f"offline RFT ({out}): none of the {len(rows)} samples of the starting "
                         "policy is right; there is nothing to fine-tune on")
    plan = fine_tune_plan(len(kept), stage.policy, stage.deepspeed.micro_batch_size,
                          world()[1], out)
    tokenizer = load_tokenizer(policy_path, stage.model)
    engine = build_engine(trainable_policy(policy_path, stage.model), stage.deepspeed,
                          lr=stage.policy.lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum)
    sampling = sampled_seconds(rows)
    trainer = StageLoop(out, engine, logger, max(1, len(kept) // plan.global_sequences),
                      desc=f"{out_name} (offline RFT)",
                      max_seconds=budget_split(stage.policy.max_minutes, spec.sampling_share,
                                               sampling)[1])
    fine_tune(trainer, tokenizer, kept, plan, stage, {
        "rft/samples": float(len(rows)), "rft/kept": float(len(kept)),
        "rft/sampling_seconds": sampling, "reward/accuracy": len(kept) / len(rows)})
    trainer.finish(tokenizer, out / "final", config_yaml,
                   {"steps": trainer.step, "samples": len(rows), "kept": len(kept),
                    # the question stream's steps it drew (the next stage goes on from there)
                    "question_steps": len({row["step"] for row in rows}),
                    "sampling_seconds": sampling,
                    "fine_tune_seconds": trainer.state.get("seconds", 0.0)})
    return out / "final"


def fine_tune(trainer: StageLoop, tokenizer, kept: list[MathRecord], plan, stage: PolicyStage,
              counts: dict) -> None:
    """Supervised steps on the kept solutions (a seeded order, reshuffled per epoch), each
    logged with the sampling's `counts`."""
    rank = world()[0]
    trainer.engine.train()
    while trainer.running():
        step = trainer.step
        ids = epoch_slice(len(kept), step, plan.global_sequences,
                          derive_seed(stage.seed, "rft-order"))[1]
        mine = ids[rank * plan.rank_sequences:(rank + 1) * plan.rank_sequences]
        batch = sft_tensors(tokenizer, [kept[i] for i in mine], stage.prompts)
        loss, grad_norm = supervised_step(trainer, batch, plan, f"offline RFT step {step + 1}")
        trainer.advance()
        trainer.log({"train/loss": loss, "train/grad_norm": grad_norm,
                     "train/lr": current_lr(trainer.engine), **counts})
        if trainer.due(stage.policy.save_every):
            trainer.save()


def fine_tune_plan(kept: int, g: PolicyConfig, micro_batch_size: int, world_size: int,
                   out: Path):
    """GRPO's batch (questions_per_step x G sequences), or one no larger than the kept set in
    whole micro-batches."""
    unit = micro_batch_size * world_size
    per_step = g.questions_per_step * g.group_size
    if kept < per_step:
        per_step = kept // unit * unit or kept // world_size * world_size
    if per_step == 0:
        raise ValueError(f"offline RFT ({out}): {kept} right samples cannot be shared "
                         f"over {world_size} ranks")
    return plan_batch(per_step, micro_batch_size, world_size,
                      f"offline RFT batch of {per_step}")
