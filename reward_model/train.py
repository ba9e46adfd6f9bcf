"""Reward-model training (ORM and PRM alike): a causal LM learns P(+) at tag tokens.

Launch alone: `igrpo train-rm --config configs/tiny.yaml rm.kind=prm rm.data_path=labels.jsonl`
(one process), or `torchrun --nproc_per_node N -m igrpo train-rm ...`. Trains through a
DeepSpeed engine (lr 2e-5 by default, the paper's), with the loss only at labelled tag positions,
validates on a held-out split, exports with `save_pretrained`, and resumes from its last
validation when re-run. `init` may be a previous reward model: a refresh continues training it.
"""

from __future__ import annotations

import math
import random
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from configs.schema import DeepSpeedConfig, ModelConfig, RewardModelConfig
from process_supervision.formats import StepExample, StepRows
from reward_model.backbone import added_layer_parameters, deepen
from reward_model.likelihood_feature import calibration_of, refit_or_keep, set_calibration
from reward_model.encoding import (TRUNCATION_WARN_SHARE, TagBatch, encode, ensure_tag_token,
                                   fit_labels, tag_tokens)
from reward_model.families import Reading, TokenClassScorer
from reward_model.evaluate import step_metrics
from reward_model.export import CardFacts, model_card, name_labels
from policy.generation.logprobs import packs
from reward_model.packing import (packed_class_margins, packed_tag_margins, question_index,
                                  shared_prefixes)
from reward_model.losses import lm_loss_sum, pairwise_loss_sum, tag_logit_margin, tag_loss
from reward_model.score import TagScorer, spread_score, spread_tag_values, tag_margins
from runtime.batching import plan_batch
from runtime.dist import broadcast_from_main, global_sum, global_sums, is_main, world
from runtime.engine import build_engine, current_lr, gathered_for_generation, rank_loss
from runtime.lora import LoraSettings, with_adapter
from runtime.models import load_causal_lm, load_tokenizer
from runtime.training import StageLoop, epoch_slice, seeded_order, stage_done
from runtime.seeds import derive_seed


def question_groups(examples) -> list[list[int]]:
    """Indices of the examples, grouped by question (in order of first appearance); a file's
    `StepRows` give their questions without parsing the rows again."""
    questions = getattr(examples, "questions", None) or [ex.question for ex in examples]
    groups: dict[str, list[int]] = {}
    for i, question in enumerate(questions):
        groups.setdefault(question, []).append(i)
    return list(groups.values())


def example_lengths(examples) -> list[int]:
    """Characters of each example's question and steps (a file's `StepRows` know them from
    reading): what `rm.group_by_length` sorts by."""
    lengths = getattr(examples, "lengths", None)
    if lengths is not None:
        return lengths
    return [len(ex.question) + sum(map(len, ex.steps)) for ex in examples]


def split_validation(examples: list[StepExample], fraction: float, seed: int, cap: int = 0):
    """Seeded (train, validation) split of the examples, by question: no question has solutions
    on both sides; the validation side holds `fraction` of them, at most about `cap` (0: no
    cap; a question's solutions stay together)."""
    groups = question_groups(examples)
    groups = [groups[i] for i in seeded_order(len(groups), seed)]
    n_val = max(1, int(len(examples) * fraction)) if fraction > 0 else 0
    n_val = min(n_val, cap) if cap > 0 else n_val
    val: list[int] = []
    for group in groups:
        if len(val) >= n_val:
            break
        val += group
    held = set(val)
    train = [i for i in range(len(examples)) if i not in held]
    if isinstance(examples, StepRows):  # the training rows stay on disk; validation is small
        return examples.view(train), [examples[i] for i in val]
    return [examples[i] for i in train], [examples[i] for i in val]


@dataclass(frozen=True)
class RMSpec:
    """What reward-model training reads, resolved once from the config
    (iteration/resolve.py): the `rm` section, the model's loading options, the engine's
    settings, the run's seed and name (its wandb artifact), and whether the family trained is a
    token classifier (TRL's layout) or the tag LM."""
    settings: RewardModelConfig
    model: ModelConfig
    deepspeed: DeepSpeedConfig
    seed: int
    run_name: str
    token_classifier: bool = False
    trainable: bool = True
    """False for a family that is only read (a sequence classifier)."""
    pooled: bool = False
    """Scored through vLLM's pooling runner (`rm.backend=vllm`; reward_model/vllm_scorer.py)."""


def train_reward_model(spec: RMSpec, out: Path, init: str | Path, examples: list[StepExample],
                       logger, config_yaml: str, epochs: float | None = None) -> Path:
    """Train on `examples` (validation split off by `rm.val_fraction`) for `epochs` (default
    `rm.epochs`; a refresh passes `iterate.refresh_epochs`); returns `<out>/final`."""
    rm, seed = spec.settings, spec.seed
    final_dir = out / "final"
    if stage_done(out):
        return final_dir
    rank, world_size = world()
    train, val = split_validation(examples, rm.val_fraction, seed, rm.val_rows)
    plan = plan_batch(rm.batch_size, spec.deepspeed.micro_batch_size, world_size,
                      f"rm.batch_size={rm.batch_size}")
    tokenizer, engine, read = reward_model_engine(spec, out, init, plan)
    epochs = rm.epochs if epochs is None else epochs
    trainer = StageLoop(out, engine, logger, math.ceil(
        epochs * max(1, len(train) // plan.global_sequences)), desc=out.name)
    state = trainer.state
    if "calibration" in state:  # the weights fitted before the interruption
        set_calibration(engine.module, state["calibration"])
    check = _Checks(rm, seed, engine, read, train, val, state)
    groups = question_groups(train) if rm.group_by_question else None
    lengths = example_lengths(train) if rm.group_by_length else None
    checked = (None, {})  # (step, validation metrics) of the last check
    while trainer.running():
        epoch, batch_ids = epoch_slice(len(train), state["step"], plan.global_sequences,
                                       derive_seed(seed, "rm-order"), groups, lengths)
        mine, batch, dropped = _training_batch(read, train, batch_ids[
            rank * plan.rank_sequences:(rank + 1) * plan.rank_sequences], rm, state)
        started = time.perf_counter()
        engine.train()
        sums, loss_of = batch_loss(engine, batch, read, rm, world_size, plan.micro_batch_size,
                                    [ex.question for ex in mine])
        grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of,
                                     f"{out} step {state['step'] + 1}")
        trainer.advance()
        metrics = {"rm/loss": global_sum(sums["loss"]), "rm/lr": current_lr(engine),
                   "rm/grad_norm": grad_norm, "rm/tags_dropped": dropped,
                   "time/step": time.perf_counter() - started}
        if rm.lm_weight:
            metrics["rm/lm_loss"] = global_sum(sums["lm"])
        if rm.pairwise_weight:
            metrics["rm/pairwise_loss"] = global_sum(sums["pairwise"])
        if trainer.due(rm.eval_every):
            metrics.update(check.calibrate())
            checked = (state["step"], check.validate())
            metrics.update({f"rm/val_{k}": v for k, v in checked[1].items()})
            trainer.bar.set_postfix(
                step_acc=f"{metrics.get('rm/val_step_accuracy', float('nan')):.3f}")
        trainer.log(metrics)  # (before the save: a kill between the two redoes this step)
        if trainer.due(rm.save_every):
            trainer.save()
    if checked[0] != state["step"]:  # resumed after its last step: fit and validate again
        check.calibrate()
        checked = (state["step"], check.validate())
    trainer.finish(tokenizer, final_dir, config_yaml, {"steps": state["step"], **checked[1],
                                                       **truncation_report(out, rm, state)},
                   files=_for_export(spec, engine.module, tokenizer, init, examples, val, checked))
    if is_main():
        logger.log_checkpoint(final_dir, f"{spec.run_name}-{out.parent.name}-{out.name}")
    return final_dir


def _training_batch(read, train, ids: list[int], rm: RewardModelConfig, state: dict):
    """(this rank's examples, `train[i]` for `ids`; their encoding as training reads it,
    `fit_labels`; the step tags every rank's rows lost to `rm.max_length`). The run's count of
    tags lost and seen is kept in `state["tags_cut"]` (saved and resumed with the stage)."""
    examples = [train[i] for i in ids]
    batch, dropped, tags = fit_labels(read.encode(examples), examples, rm.truncation,
                                      rm.train_on_last_step_only, rm.max_completion_length)
    cut = global_sums([float(dropped), float(tags)])
    state["tags_cut"] = [a + b for a, b in zip(state.get("tags_cut", [0.0, 0.0]), cut)]
    return examples, batch, cut[0]


def truncation_report(out: Path, rm: RewardModelConfig, state: dict) -> dict:
    """What `rm.max_length` and `rm.max_completion_length` cut from a training run (every step's rows, every rank's:
    `state["tags_cut"]`), printed on the main rank, with a warning above
    `TRUNCATION_WARN_SHARE` of the tags."""
    dropped, tags = state.get("tags_cut", [0.0, 0.0])
    share = dropped / tags if tags else 0.0
    if is_main() and dropped:
        limits = f"rm.max_length={rm.max_length}" + (
            f", rm.max_completion_length={rm.max_completion_length}"
            if rm.max_completion_length else "")
        print(f"[igrpo] {out.name}: {limits} (rm.truncation={rm.truncation}) left "
              f"{int(dropped):,} of {int(tags):,} step tags untrained ({100 * share:.1f}%)",
              flush=True)
        if share > TRUNCATION_WARN_SHARE:
            warnings.warn(f"{out.name}: {100 * share:.1f}% of the step tags seen in training "
                          f"were cut off by {limits}: raise it, or shorten the rows",
                          stacklevel=2)
    return {"tags_dropped": int(dropped), "tags_dropped_share": share}


def _for_export(spec: RMSpec, module, tokenizer, init, examples, val, checked) -> dict:
    """What the export adds for readers outside the project (`reward_model/export.py`): a token
    classifier's classes named in its config (config.json: every rank sets it, the main rank
    saves it), and the model card (README.md) of the model as `checked` = (optimizer steps,
    final validation metrics) leaves it."""
    rm = spec.settings
    if spec.token_classifier:
        name_labels(module.config, rm.label_index)
    facts = CardFacts(spec.token_classifier, type(module).__name__, Reading.of(rm), rm.step_tag,
                      rm.kind, rm.max_length,
                      examples.where if isinstance(examples, StepRows) else "",
                      (len(examples) - len(val), len(val)), checked[0], checked[1], str(init),
                      calibration_of(module) is not None, bool(spec.model.trust_remote_code))
    return {"README.md": model_card(tokenizer, facts)}


@dataclass(frozen=True)
class _Read:
    """How the reward model in training is fed and read, by its family: `encode` labelled
    examples into a batch, the [B, L] `margins` (logit of "right") of a model's forward, a
    `scorer` over a module (the validation's), and the tag tokens (tag LM only)."""

    encode: Callable[[list[StepExample]], TagBatch]
    margins: Callable
    scorer: Callable
    packed: Callable
    """(model, ids, mask, group, shared) -> the margins on the packed path
    (`reward_model/packing.py`)."""
    tags: object = None


def reward_model_engine(spec: RMSpec, out: Path, init: str | Path, plan,
                        lr: float | None = None):
    """The tokenizer, the engine over the (possibly deepened) backbone at `lr` (default
    `rm.lr`), and how the family (`rm.family`: the tag LM, or a token-classification PRM) is fed
    and read."""
    rm = spec.settings
    lr = rm.lr if lr is None else lr
    if not spec.trainable:
        raise ValueError(f"rm.family={rm.family}: `igrpo train-rm` trains the tag_lm and "
                         "token_classification families")
    tokenizer = load_tokenizer(init, spec.model)
    tokenizer.padding_side = "right"
    lora = LoraSettings.of(rm.lora)
    if spec.token_classifier:
        model = token_classifier(init, spec.model, spec.seed)
        if lora is not None:  # the fresh head trains whole (peft's modules_to_save)
            model = with_adapter(model, lora, task_type="TOKEN_CLS", announce=out.name,
                                 modules_to_save=[classifier_head(model)])
        engine = build_engine(model, spec.deepspeed, lr=lr,
                              micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum)
        reading = Reading.of(rm)

        def scorer(module):
            return TokenClassScorer(module, tokenizer, rm.max_length, reading)
        reader = scorer(None)  # (its encoding and read-out need no model of their own)
        return tokenizer, engine, _Read(reader.encode, reader.margins, scorer, partial(
            packed_class_margins, reading=reading))
    model = load_causal_lm(init, spec.model, train=True)
    added = deepen(model, list(rm.extra_layers_from))  # (a refresh's RM is deep already)
    if added and is_main():
        print(f"[igrpo] {out.name}: {added} zero-output layers added on top of {init}")
    if ensure_tag_token(tokenizer, model, rm.step_tag, rm.add_tag_token) and is_main():
        print(f"[igrpo] {out.name}: the step tag {rm.step_tag!r} added to the tokenizer as "
              f"token {len(tokenizer) - 1}")
    if lora is not None:  # (after the tag token: its embedding row is the base's, frozen)
        model = with_adapter(model, lora, announce=out.name)
    fresh = {id(p): rm.new_layer_lr for p in added_layer_parameters(model)} \
        if rm.new_layer_lr and lora is None else None
    engine = build_engine(model, spec.deepspeed, lr=lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum, lr_by_param=fresh)
    tags = tag_tokens(tokenizer, rm.step_tag)
    return tokenizer, engine, _Read(
        lambda examples: encode(tokenizer, examples, tags, rm.step_tag, rm.max_length,
                                lm_targets=rm.lm_weight > 0, prompt_tokens=True),
        lambda model_, ids, mask: tag_margins(model_, ids, mask, tags),
        lambda module: TagScorer(module, tokenizer, rm.step_tag, rm.max_length),
        partial(packed_tag_margins, tags=tags), tags)


def classifier_head(model) -> str:
    """The name of a token classifier's output layer (Llama, Qwen: `score`; others:
    `classifier`)."""
    for name in ("score", "classifier"):
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise TypeError(f"{type(model).__name__}: no `score` or `classifier` head to train whole "
                    "under rm.lora")


def token_classifier(init: str | Path, model_cfg: ModelConfig, seed: int):
    """A 2-label token classifier from `init`: a causal LM's backbone under a fresh head (the
    layout TRL's PRMTrainer trains and saves), or a token-classification PRM to refresh. A
    fresh head is drawn from `run.seed`, the same on every rank (ZeRO-3 partitions each rank's
    own copy) and in every run; no dropout before it (transformers' default is 0.1, which TRL
    turns off too): each rank would draw its own mask, and 2 processes not train as 1 does."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    from runtime.models import load_model
    from runtime.shards import seeded

    config = AutoConfig.from_pretrained(str(init), num_labels=2,
                                        trust_remote_code=bool(model_cfg.trust_remote_code))
    config.classifier_dropout = 0.0  # (not a field of decoder configs: kwargs would drop it)
    with seeded("token-classification head", seed):
        model = load_model(init, AutoModelForTokenClassification, model_cfg, train=True,
                           config=config)
    model.config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id \
        is not None else model.config.eos_token_id
    return model


def batch_loss(engine, batch, read: _Read, rm, world_size: int, micro_batch_size: int,
                questions: list[str]):
    """(running sums, loss of a micro-batch): the tag loss as a mean over the step's labels of
    all ranks, plus `rm.lm_weight` x the next-token loss, the same global mean over LM tokens,
    plus `rm.pairwise_weight` x the within-question pairwise loss, a global mean over the pairs
    (a pair is two solutions of one question in one micro-batch)."""
    lm_weight, pair_weight = rm.lm_weight, rm.pairwise_weight
    pack = rm.pack and not lm_weight and packs(engine)  # (the LM loss reads every token)
    labels_total = global_sum(float(batch.label_mask.sum()))
    lm_total = global_sum(float(batch.lm_mask[:, 1:].sum())) if lm_weight else 0.0
    group = question_index(questions)
    if pair_weight:
        pairs_total = global_sum(float(sum(
            pairwise_loss_sum(torch.zeros(batch.targets[k:k + micro_batch_size].shape),
                              batch.targets[k:k + micro_batch_size],
                              batch.label_mask[k:k + micro_batch_size],
                              group[k:k + micro_batch_size])[1]
            for k in range(0, len(questions), micro_batch_size))))
    sums = {"loss": 0.0, "lm": 0.0, "pairwise": 0.0}

    def loss_of(rows: slice, mb: int):
        ids = batch.input_ids[rows].to(engine.device)
        attention = batch.attention_mask[rows].to(engine.device)
        mask = batch.label_mask[rows].to(engine.device)
        shared = None
        if pack:  # no padding, a question's tokens run once for its solutions
            in_batch = question_index(questions[rows]).to(engine.device)
            shared = shared_prefixes(ids, attention, mask, in_batch)
        # Every rank takes the same path (under ZeRO-3 each forward gathers the layers with
        # the others): packed only where no rank's micro-batch has a row that cannot share.
        if shared is not None and global_sum(float(not bool((shared > 0).all()))) == 0:
            margin = read.packed(engine, ids, attention, in_batch, shared)
        elif lm_weight:  # the LM loss reads every token's logits
            logits = engine(input_ids=ids, attention_mask=attention).logits
            margin = tag_logit_margin(logits, read.tags.plus_id, read.tags.minus_id)
        else:  # the tag loss reads two rows of the output layer (`two_row_head`)
            margin = read.margins(engine, ids, attention)
        targets = batch.targets[rows].to(engine.device)
        # Mean over the step's labels: this micro-batch's share of the global count.
        loss = rank_loss(tag_loss(margin, targets, mask)
                         * (float(mask.sum()) / max(labels_total, 1.0)), world_size)
        if lm_weight:
            lm = lm_loss_sum(logits, ids, batch.lm_mask[rows].to(engine.device))
            lm_share = rank_loss(lm / max(lm_total, 1.0), world_size)
            loss = loss + lm_weight * lm_share
            sums["lm"] += lm_share.item() / world_size
        if pair_weight:
            pair_sum, _ = pairwise_loss_sum(margin, targets, mask, group[rows].to(engine.device))
            pair_share = rank_loss(pair_sum / max(pairs_total, 1.0), world_size)
            loss = loss + pair_weight * pair_share
            sums["pairwise"] += pair_share.item() / world_size
        sums["loss"] += loss.item() / world_size
        return loss
    return sums, loss_of


class _Checks:
    """The likelihood feature's fit and the validation of a reward model in training. Both score
    with the model in training, their batches spread over the ranks (every rank calls them at
    the same steps): under ZeRO-3 each rank scores with the gathered weights, so no forward
    needs the others."""

    def __init__(self, rm: RewardModelConfig, seed: int, engine, read: _Read, train, val, state):
        self.rm, self.seed, self.engine, self.read = rm, seed, engine, read
        self.train, self.val, self.state = train, val, state

    def _scorer(self, module):
        return self.read.scorer(module)

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
        rm = self.rm
        if not rm.likelihood_feature:
            return {}
        sample = random.Random(self.seed).sample(
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
