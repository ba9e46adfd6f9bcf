"""SFT warm start: supervised training on a fixed, limited set of worked solutions.

Launch: `igrpo sft --config configs/tiny.yaml [key=value ...]` (one process), or under
`torchrun --nproc_per_node N -m policy sft ...`. Trains through the same DeepSpeed engine as GRPO,
evaluates greedy accuracy on validation questions (`data.val_questions`, disjoint from the
held-out set the loop reports) every `sft.eval_every` steps, keeps the best export, and stops
early once `sft.patience` evaluations in a row bring no new best: the warm start is trained
until more SFT on its set stops helping (as the paper's instruct model is, before RL).
Re-running the same command resumes from the last evaluation.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from configs.plan import plan_batch
from policy.evaluate import evaluate_policy
from runtime.checkpoint import (export, load_training_state, recover_export,
                                save_training_state)
from runtime.data import MathRecord
from runtime.engine import (broadcast_from_main, build_engine, checked_backward, current_lr,
                            engine_step, gathered_for_generation, global_sum, is_main, world)
from runtime.prompts import PromptFormat, encode_prompts, prompt_format
from runtime.rundir import atomic_write_json
from runtime.models import load_causal_lm, load_tokenizer


def sft_tensors(tokenizer, records: list[MathRecord], fmt: PromptFormat):
    """Right-padded [prompt | solution | EOS] rows with labels only on solution tokens; the
    prompt tokenised as the rollout tokenises it (BOS where the model expects one).

    Returns input_ids, attention_mask, labels: [B, L] each (labels -100 on prompt and padding).
    """
    rows, label_rows = [], []
    prompts = encode_prompts(tokenizer, fmt.prompts(tokenizer, records))
    for rec, prompt in zip(records, prompts):
        answer = tokenizer(fmt.join(rec.solution_steps),
                           add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows])
    return input_ids, mask, labels


def token_nll_sum(model, input_ids, attention_mask, labels) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over labelled positions, and their count."""
    from policy.logprobs import selective_log_softmax

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = labels[:, 1:]
    valid = targets != -100
    logp = selective_log_softmax(logits, targets.clamp(min=0))
    return -(logp * valid).sum(), int(valid.sum())


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return order


def _check_worked_solutions(records: list[MathRecord]) -> None:
    """SFT needs a worked solution in every record; stop before training, naming the first."""
    missing = [r.source_id for r in records if not r.solution_steps]
    if missing:
        raise ValueError(f"sft: {len(missing)} of {len(records)} SFT records have no worked "
                         f"solution (first: {missing[0]}): set data.solution_field, or "
                         "sft.enabled=false to start from model.policy_path as it is")


def train_sft(cfg, run_path: Path, policy_path: str | Path, sft_records: list[MathRecord],
              val_records: list[MathRecord], logger, config_yaml: str) -> Path:
    """Train the warm start; returns the folder of the best export (`<run>/sft/best`), the best
    by greedy accuracy on `val_records` (not the held-out questions the policy is scored on)."""
    out = run_path / "sft"
    best_dir, done_file = out / "best", out / "done.json"
    if done_file.exists():
        return best_dir
    _check_worked_solutions(sft_records)
    recover_export(best_dir)
    rank, world_size = world()
    tokenizer = load_tokenizer(policy_path, cfg.model)
    model = load_causal_lm(policy_path, cfg.model, train=True)
    plan = plan_batch(cfg.sft.batch_size, cfg.deepspeed.micro_batch_size, world_size,
                      f"sft.batch_size={cfg.sft.batch_size}")
    steps_per_epoch = max(1, len(sft_records) // plan.global_sequences)
    total_steps = math.ceil(cfg.sft.epochs * steps_per_epoch)
    engine = build_engine(model, cfg.deepspeed, lr=cfg.sft.lr,
                          micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum,
                          decay_steps=total_steps if cfg.sft.lr_decay else 0)
    state = load_training_state(engine, out / "state") or {"step": 0, "best": -1.0, "stale": 0}
    # Rows a crash logged past the saved state are redone: drop them.
    logger.rewind(state["step"] if state["step"] else -1)
    eval_every = cfg.sft.eval_every or total_steps

    def evaluate() -> float | None:
        """Greedy validation accuracy on rank 0 (None elsewhere); every rank joins the gather."""
        with gathered_for_generation(engine):
            if not is_main():
                return None
            return evaluate_policy(engine.module, tokenizer, val_records,
                                   prompt_format(cfg.data), k=1, temperature=0.0,
                                   max_new_tokens=cfg.eval.max_new_tokens,
                                   batch_size=cfg.eval.batch_size,
                                   timeout_s=cfg.eval.grade_timeout_s,
                                   sampled=False)["eval/greedy_accuracy"]

    if state["step"] == 0:
        state["best"] = broadcast_from_main(evaluate())
        export(engine, tokenizer, best_dir, config_yaml)
        logger.log({"val/greedy_accuracy": state["best"]}, step=0)
    bar = tqdm(total=total_steps, initial=state["step"], desc="sft", disable=not is_main())
    engine.train()
    while state["step"] < total_steps:
        step = state["step"]
        epoch, index = divmod(step, steps_per_epoch)
        order = _epoch_order(len(sft_records), cfg.run.seed, epoch)
        batch_ids = order[index * plan.global_sequences:(index + 1) * plan.global_sequences]
        mine = batch_ids[rank * plan.rank_sequences:(rank + 1) * plan.rank_sequences]
        tensors = sft_tensors(tokenizer, [sft_records[i] for i in mine], prompt_format(cfg.data))
        global_tokens = global_sum(int((tensors[2][:, 1:] != -100).sum()))
        started, loss_sum, grad_norm = time.perf_counter(), 0.0, 0.0
        for mb in range(plan.grad_accum):
            rows = slice(mb * plan.micro_batch_size, (mb + 1) * plan.micro_batch_size)
            ids, mask, labels = (t[rows].to(engine.device) for t in tensors)
            nll, _ = token_nll_sum(engine, ids, mask, labels)
            loss = nll / global_tokens * world_size
            where = f"sft step {step + 1}, micro-batch {mb + 1}"
            checked_backward(engine, loss, where)
            norm = engine_step(engine, where)
            grad_norm = norm if norm is not None else grad_norm
            loss_sum += loss.item()
        state["step"] = step + 1
        bar.update(1)
        metrics = {"train/loss": global_sum(loss_sum) / world_size, "train/lr": current_lr(engine),
                   "train/grad_norm": grad_norm,
                   "time/step": time.perf_counter() - started, "train/epoch": epoch}
        if state["step"] % eval_every == 0 or state["step"] == total_steps:
            accuracy = broadcast_from_main(evaluate())
            metrics["val/greedy_accuracy"] = accuracy
            if accuracy > state["best"]:
                state["best"], state["stale"] = accuracy, 0
                export(engine, tokenizer, best_dir, config_yaml)
            else:
                state["stale"] += 1
            bar.set_postfix(acc=f"{accuracy:.3f}", best=f"{state['best']:.3f}")
            save_training_state(engine, out / "state", state)
            reached = cfg.sft.stop_at and accuracy >= cfg.sft.stop_at
            if reached or (cfg.sft.patience and state["stale"] >= cfg.sft.patience):
                logger.log(metrics, step=state["step"])
                break
        logger.log(metrics, step=state["step"])
    bar.close()
    if is_main():
        atomic_write_json(done_file, {"steps": state["step"], "best_val_greedy_accuracy": state["best"]})
    return best_dir
