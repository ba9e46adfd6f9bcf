"""Reward-model training (ORM and PRM alike): a causal LM learns P(+) at tag tokens.

Launch alone: `igrpo train-rm --config configs/tiny.yaml rm.kind=prm rm.data_path=labels.jsonl`
(one process), or `torchrun --nproc_per_node N -m reward_model train-rm ...`. Trains through a
DeepSpeed engine (lr 2e-5 by default, the paper's), with the loss only at labelled tag positions,
validates on a held-out split, exports with `save_pretrained`, and resumes from its last
validation when re-run. `init` may be a previous reward model: a refresh continues training it.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from tqdm import tqdm

from configs.plan import plan_batch
from process_supervision.formats import StepExample
from reward_model.backbone import added_layer_parameters, deepen
from reward_model.calibration import calibration_of, refit_or_keep, set_calibration
from reward_model.encoding import encode, ensure_tag_token, tag_tokens
from reward_model.evaluate import step_metrics
from reward_model.heads import lm_loss_sum, tag_logit_margin, tag_loss
from reward_model.score import TagScorer
from runtime.checkpoint import export, load_training_state, save_training_state
from runtime.engine import (broadcast_from_main, build_engine, checked_backward, current_lr,
                            engine_step, global_sum, is_main, world)
from runtime.rundir import atomic_write_json
from runtime.models import load_causal_lm, load_tokenizer


def question_groups(examples: list[StepExample]) -> list[list[int]]:
    """Indices of the examples, grouped by question (in order of first appearance)."""
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.question, []).append(i)
    return list(groups.values())


def split_validation(examples: list[StepExample], fraction: float, seed: int):
    """Seeded (train, validation) split of the examples, by question: no question has solutions
    on both sides."""
    groups = question_groups(examples)
    random.Random(seed).shuffle(groups)
    n_val = max(1, int(len(examples) * fraction)) if fraction > 0 else 0
    val: list[int] = []
    for group in groups:
        if len(val) >= n_val:
            break
        val += group
    held = set(val)
    return [ex for i, ex in enumerate(examples) if i not in held], [examples[i] for i in val]


def epoch_order(examples: list[StepExample], seed: int, grouped: bool) -> list[int]:
    """A seeded shuffle of the example indices; `grouped` keeps each question's solutions next
    to each other (so a batch holds them side by side: a right and a wrong solution of the same
    question differ only where the slip is)."""
    rng = random.Random(seed)
    if not grouped:
        order = list(range(len(examples)))
        rng.shuffle(order)
        return order
    groups = question_groups(examples)
    rng.shuffle(groups)
    return [i for group in groups for i in group]


def train_reward_model(cfg, out: Path, init: str | Path, examples: list[StepExample], logger,
                       config_yaml: str, step_offset: int = 0) -> Path:
    """Train on `examples` (validation split off by `rm.val_fraction`); returns `<out>/final`."""
    rm = cfg.rm
    final_dir, done_file = out / "final", out / "done.json"
    if done_file.exists():
        return final_dir
    rank, world_size = world()
    train, val = split_validation(examples, rm.val_fraction, cfg.run.seed)
    tokenizer = load_tokenizer(init, cfg.model)
    tokenizer.padding_side = "right"
    model = load_causal_lm(init, cfg.model, train=True)
    added = deepen(model, list(rm.extra_layers_from))  # (a refresh's RM is deep already)
    if added and is_main():
        print(f"[igrpo] {out.name}: {added} zero-output layers added on top of {init}")
    if ensure_tag_token(tokenizer, model, rm.step_tag, rm.add_tag_token) and is_main():
        print(f"[igrpo] {out.name}: the step tag {rm.step_tag!r} added to the tokenizer as "
              f"token {len(tokenizer) - 1}")
    tags = tag_tokens(tokenizer, rm.step_tag)
    plan = plan_batch(rm.batch_size, cfg.deepspeed.micro_batch_size, world_size,
                      f"rm.batch_size={rm.batch_size}")
    fresh = {id(p): rm.new_layer_lr for p in added_layer_parameters(model)} \
        if rm.new_layer_lr else None
    engine = build_engine(model, cfg.deepspeed, lr=rm.lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum, lr_by_param=fresh)
    steps_per_epoch = max(1, len(train) // plan.global_sequences)
    total_steps = math.ceil(rm.epochs * steps_per_epoch)
    eval_every = rm.eval_every or total_steps
    state = load_training_state(engine, out / "state") or {"step": 0}
    # Rows a crash logged past the saved state are redone: drop them.
    logger.rewind(step_offset + state["step"] if state["step"] else step_offset - 1)

    if "calibration" in state:  # the weights fitted before the interruption
        set_calibration(engine.module, state["calibration"])

    def step_values(examples: list[StepExample], scorer: TagScorer):
        """(tag margins, running-min log-likelihoods, labels) of every step that fits."""
        margins, surprises, targets = [], [], []
        for ex, (m, s) in zip(examples, scorer.tag_values(examples, with_surprise=True)):
            margins += m
            surprises += s
            targets += list(ex.labels[:len(m)])
        return margins, surprises, targets

    def calibrate() -> dict:
        """With `rm.likelihood_feature`: fit the step logit's weights on training examples, or
        keep the ones the model carries where the fit is degenerate or scores validation worse
        (`calibration.refit_or_keep`; main rank; every rank records the choice in its model
        config, which the export saves, and in the training state, which a resume restores)."""
        if not rm.likelihood_feature:
            return {}
        chosen = report = None
        if is_main():
            sample = random.Random(cfg.run.seed).sample(train, min(len(train),
                                                                   rm.calibration_examples))
            scorer = TagScorer(engine.module, tokenizer, rm.step_tag, rm.max_length)
            chosen, report = refit_or_keep(calibration_of(engine.module),
                                           step_values(sample, scorer), step_values(val, scorer))
        chosen, report = broadcast_from_main((chosen, report))
        set_calibration(engine.module, chosen)
        state["calibration"] = calibration_of(engine.module)
        return {f"rm/calibration_{k}": v for k, v in {**(chosen or {}), **report}.items()}

    def validate() -> dict:
        metrics = None
        if is_main() and val:
            scorer = TagScorer(engine.module, tokenizer, rm.step_tag, rm.max_length)
            metrics = step_metrics(scorer.score(val), [list(ex.labels) for ex in val])
        return broadcast_from_main(metrics) or {}

    bar = tqdm(total=total_steps, initial=state["step"], desc=out.name, disable=not is_main())
    checked = (None, {})  # (step, validation metrics) of the last check
    while state["step"] < total_steps:
        step = state["step"]
        epoch, index = divmod(step, steps_per_epoch)
        order = epoch_order(train, cfg.run.seed * 31 + epoch, rm.group_by_question)
        batch_ids = order[index * plan.global_sequences:(index + 1) * plan.global_sequences]
        mine = [train[i] for i in batch_ids[rank * plan.rank_sequences:
                                            (rank + 1) * plan.rank_sequences]]
        batch = encode(tokenizer, mine, tags, rm.step_tag, rm.max_length,
                       lm_targets=rm.lm_weight > 0)
        labels_total = global_sum(float(batch.label_mask.sum()))
        lm_total = global_sum(float(batch.lm_mask[:, 1:].sum())) if rm.lm_weight else 0.0
        started, loss_sum, lm_sum, grad_norm = time.perf_counter(), 0.0, 0.0, 0.0
        engine.train()
        for mb in range(plan.grad_accum):
            rows = slice(mb * plan.micro_batch_size, (mb + 1) * plan.micro_batch_size)
            logits = engine(input_ids=batch.input_ids[rows].to(engine.device),
                            attention_mask=batch.attention_mask[rows].to(engine.device)).logits
            margin = tag_logit_margin(logits, tags.plus_id, tags.minus_id)
            mask = batch.label_mask[rows].to(engine.device)
            # Mean over the step's labels: this micro-batch's share of the global count.
            loss = tag_loss(margin, batch.targets[rows].to(engine.device), mask) \
                * (float(mask.sum()) / max(labels_total, 1.0)) * world_size
            if rm.lm_weight:  # the same global mean over the LM tokens of all ranks
                lm = lm_loss_sum(logits, batch.input_ids[rows].to(engine.device),
                                 batch.lm_mask[rows].to(engine.device))
                lm_share = lm / max(lm_total, 1.0) * world_size
                loss = loss + rm.lm_weight * lm_share
                lm_sum += lm_share.item() / world_size
            where = f"{out} step {state['step'] + 1}, micro-batch {mb + 1}"
            checked_backward(engine, loss, where)
            norm = engine_step(engine, where)
            grad_norm = norm if norm is not None else grad_norm
            loss_sum += loss.item() / world_size
        state["step"] = step + 1
        bar.update(1)
        metrics = {"rm/loss": global_sum(loss_sum), "rm/lr": current_lr(engine),
                   "rm/grad_norm": grad_norm, "time/step": time.perf_counter() - started}
        if rm.lm_weight:
            metrics["rm/lm_loss"] = global_sum(lm_sum)
        if state["step"] % eval_every == 0 or state["step"] == total_steps:
            metrics.update(calibrate())
            checked = (state["step"], validate())
            metrics.update({f"rm/val_{k}": v for k, v in checked[1].items()})
            bar.set_postfix(step_acc=f"{metrics.get('rm/val_step_accuracy', float('nan')):.3f}")
        if state["step"] % rm.save_every == 0 or state["step"] == total_steps:
            save_training_state(engine, out / "state", state)
        logger.log(metrics, step=step_offset + state["step"])
    bar.close()
    if checked[0] == state["step"]:  # fitted and validated at the last step already
        final_metrics = checked[1]
    else:  # a run resumed after its last step
        calibrate()
        final_metrics = validate()
    export(engine, tokenizer, final_dir, config_yaml)
    if is_main():
        atomic_write_json(done_file, {"steps": state["step"], **final_metrics})
        logger.log_checkpoint(final_dir, f"{cfg.run.name}-{out.parent.name}-{out.name}")
    return final_dir
