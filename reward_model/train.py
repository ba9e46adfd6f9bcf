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

from configs.batching import plan_batch
from process_supervision.formats import StepExample
from reward_model.backbone import added_layer_parameters, deepen
from reward_model.likelihood_feature import calibration_of, refit_or_keep, set_calibration
from reward_model.encoding import encode, ensure_tag_token, tag_tokens
from reward_model.evaluate import step_metrics
from reward_model.tag_scores import lm_loss_sum, tag_logit_margin, tag_loss
from reward_model.score import TagScorer, spread_score, spread_tag_values, tag_margins
from runtime.engine import (broadcast_from_main, build_engine, current_lr,
                            gathered_for_generation, global_sum, is_main, world)
from runtime.models import load_causal_lm, load_tokenizer
from runtime.training import Trainer, epoch_slice, seeded_order, stage_done


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
    groups = [groups[i] for i in seeded_order(len(groups), seed)]
    n_val = max(1, int(len(examples) * fraction)) if fraction > 0 else 0
    val: list[int] = []
    for group in groups:
        if len(val) >= n_val:
            break
        val += group
    held = set(val)
    return [ex for i, ex in enumerate(examples) if i not in held], [examples[i] for i in val]


def train_reward_model(cfg, out: Path, init: str | Path, examples: list[StepExample], logger,
                       config_yaml: str) -> Path:
    """Train on `examples` (validation split off by `rm.val_fraction`); returns `<out>/final`."""
    rm = cfg.rm
    final_dir = out / "final"
    if stage_done(out):
        return final_dir
    rank, world_size = world()
    train, val = split_validation(examples, rm.val_fraction, cfg.run.seed)
    plan = plan_batch(rm.batch_size, cfg.deepspeed.micro_batch_size, world_size,
                      f"rm.batch_size={rm.batch_size}")
    tokenizer, engine, tags = _reward_model_engine(cfg, out, init, plan)
    trainer = Trainer(out, engine, logger,
                      math.ceil(rm.epochs * max(1, len(train) // plan.global_sequences)),
                      desc=out.name)
    state = trainer.state
    if "calibration" in state:  # the weights fitted before the interruption
        set_calibration(engine.module, state["calibration"])
    check = _Checks(cfg, engine, tokenizer, train, val, state)
    groups = question_groups(train) if rm.group_by_question else None
    checked = (None, {})  # (step, validation metrics) of the last check
    while trainer.running():
        epoch, batch_ids = epoch_slice(len(train), state["step"], plan.global_sequences,
                                       cfg.run.seed * 31, groups)
        mine = [train[i] for i in batch_ids[rank * plan.rank_sequences:
                                            (rank + 1) * plan.rank_sequences]]
        batch = encode(tokenizer, mine, tags, rm.step_tag, rm.max_length,
                       lm_targets=rm.lm_weight > 0)
        started = time.perf_counter()
        engine.train()
        sums, loss_of = _batch_loss(engine, batch, tags, rm.lm_weight, world_size)
        grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of,
                                     f"{out} step {state['step'] + 1}")
        trainer.advance()
        metrics = {"rm/loss": global_sum(sums["loss"]), "rm/lr": current_lr(engine),
                   "rm/grad_norm": grad_norm, "time/step": time.perf_counter() - started}
        if rm.lm_weight:
            metrics["rm/lm_loss"] = global_sum(sums["lm"])
        if trainer.due(rm.eval_every):
            metrics.update(check.calibrate())
            checked = (state["step"], check.validate())
            metrics.update({f"rm/val_{k}": v for k, v in checked[1].items()})
            trainer.bar.set_postfix(
                step_acc=f"{metrics.get('rm/val_step_accuracy', float('nan')):.3f}")
        trainer.log(metrics)  # (before the save: a kill between the two redoes this step)
        if trainer.due(rm.save_every):
            trainer.save()
    if checked[0] == state["step"]:  # fitted and validated at the last step already
        final_metrics = checked[1]
    else:  # a run resumed after its last step
        check.calibrate()
        final_metrics = check.validate()
    trainer.finish(tokenizer, final_dir, config_yaml, {"steps": state["step"], **final_metrics})
    if is_main():
        logger.log_checkpoint(final_dir, f"{cfg.run.name}-{out.parent.name}-{out.name}")
    return final_dir


def _reward_model_engine(cfg, out: Path, init: str | Path, plan):
    """The tokenizer (with the step tag), the engine over the (possibly deepened) backbone, and
    the tag token ids."""
    rm = cfg.rm
    tokenizer = load_tokenizer(init, cfg.model)
    tokenizer.padding_side = "right"
    model = load_causal_lm(init, cfg.model, train=True)
    added = deepen(model, list(rm.extra_layers_from))  # (a refresh's RM is deep already)
    if added and is_main():
        print(f"[igrpo] {out.name}: {added} zero-output layers added on top of {init}")
    if ensure_tag_token(tokenizer, model, rm.step_tag, rm.add_tag_token) and is_main():
        print(f"[igrpo] {out.name}: the step tag {rm.step_tag!r} added to the tokenizer as "
              f"token {len(tokenizer) - 1}")
    fresh = {id(p): rm.new_layer_lr for p in added_layer_parameters(model)} \
        if rm.new_layer_lr else None
    engine = build_engine(model, cfg.deepspeed, lr=rm.lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum, lr_by_param=fresh)
    return tokenizer, engine, tag_tokens(tokenizer, rm.step_tag)


def _batch_loss(engine, batch, tags, lm_weight: float, world_size: int):
    """(running sums, loss of a micro-batch): the tag loss as a mean over the step's labels of
    all ranks, plus `lm_weight` x the next-token loss, the same global mean over LM tokens."""
    labels_total = global_sum(float(batch.label_mask.sum()))
    lm_total = global_sum(float(batch.lm_mask[:, 1:].sum())) if lm_weight else 0.0
    sums = {"loss": 0.0, "lm": 0.0}

    def loss_of(rows: slice, mb: int):
        ids = batch.input_ids[rows].to(engine.device)
        attention = batch.attention_mask[rows].to(engine.device)
        if lm_weight:  # the LM loss reads every token's logits
            logits = engine(input_ids=ids, attention_mask=attention).logits
            margin = tag_logit_margin(logits, tags.plus_id, tags.minus_id)
        else:  # the tag loss reads two rows of the output layer (`two_row_head`)
            margin = tag_margins(engine, ids, attention, tags)
        mask = batch.label_mask[rows].to(engine.device)
        # Mean over the step's labels: this micro-batch's share of the global count.
        loss = tag_loss(margin, batch.targets[rows].to(engine.device), mask) \
            * (float(mask.sum()) / max(labels_total, 1.0)) * world_size
        if lm_weight:
            lm = lm_loss_sum(logits, ids, batch.lm_mask[rows].to(engine.device))
            lm_share = lm / max(lm_total, 1.0) * world_size
            loss = loss + lm_weight * lm_share
            sums["lm"] += lm_share.item() / world_size
        sums["loss"] += loss.item() / world_size
        return loss
    return sums, loss_of


class _Checks:
    """The likelihood feature's fit and the validation of a reward model in training. Both score
    with the model in training, their batches spread over the ranks (every rank calls them at
    the same steps): under ZeRO-3 each rank scores with the gathered weights, so no forward
    needs the others."""

    def __init__(self, cfg, engine, tokenizer, train, val, state):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.train, self.val, self.state = train, val, state

    def _scorer(self, module) -> TagScorer:
        rm = self.cfg.rm
        return TagScorer(module, self.tokenizer, rm.step_tag, rm.max_length)

    @staticmethod
    def step_values(examples: list[StepExample], scorer: TagScorer):
        """(tag margins, running-min log-likelihoods, labels) of every step that fits."""
        margins, surprises, targets = [], [], []
        for ex, (m, s) in zip(examples, spread_tag_values(scorer, examples, with_surprise=True)):
            margins += m
            surprises += s
            targets += list(ex.labels[:len(m)])
        return margins, surprises, targets

    def calibrate(self) -> dict:
        """With `rm.likelihood_feature`: fit the step logit's weights on training examples, or
        keep the ones the model carries where the fit is degenerate or scores validation worse
        (`likelihood_feature.refit_or_keep`, on the main rank; every rank records the choice in
        its model config, which the export saves, and in the training state, which a resume
        restores)."""
        rm = self.cfg.rm
        if not rm.likelihood_feature:
            return {}
        sample = random.Random(self.cfg.run.seed).sample(
            self.train, min(len(self.train), rm.calibration_examples))
        with gathered_for_generation(self.engine) as module:
            scorer = self._scorer(module)
            fit_on, check_on = self.step_values(sample, scorer), self.step_values(self.val, scorer)
        chosen = report = None
        if is_main():
            chosen, report = refit_or_keep(calibration_of(self.engine.module), fit_on, check_on)
        chosen, report = broadcast_from_main((chosen, report))
        set_calibration(self.engine.module, chosen)
        self.state["calibration"] = calibration_of(self.engine.module)
        return {f"rm/calibration_{k}": v for k, v in {**(chosen or {}), **report}.items()}

    def validate(self) -> dict:
        if not self.val:
            return {}
        with gathered_for_generation(self.engine) as module:
            predicted = spread_score(self._scorer(module), self.val)
        return step_metrics(predicted, [list(ex.labels) for ex in self.val])
