"""An outcome reward model that learns while the policy trains (`rm.online`): GRPO's reward is the
ORM's P(+) at the solution's final tag, and after the step's samples are scored the ORM takes one
optimizer step on them, each labelled by its own exact final-answer check.

Scored first, updated after (the default, `rm.online_update=after`): no sample's reward ever
reads its own label, only the labels of samples of earlier steps (tests/test_online_rm.py flips
a label and sees the same rewards); PRIME's order, updated first (`before`), is
policy/scoring.py's `UpdatedFirst` around this class. It
is the distribution-shift fix the replication study asked for (docs/replication.md): a frozen
reward model is trained on the warm start's samples and judges a policy that has moved off them;
this one keeps learning on the policy's current samples, whose gold verdicts the check gives for
free on math. The gold it consumes: every sample's verdict, after its reward was computed
(`reward/gold_read`).

The ORM is a second DeepSpeed engine of the GRPO stage, a companion of its `StageLoop`: it saves
and resumes with the policy (`<stage>/state-online-rm/`), is partitioned like the policy under
ZeRO-2/3, and is exported beside the final policy (`<stage>/online-rm/`, a reward model like any
other: `igrpo eval-rm rm.path=...`, the next iteration's start). Its loss is the one the ORM was
trained with (`reward_model/train.py` `batch_loss`: the tag loss, plus `rm.lm_weight` x the LM
loss on right solutions); the likelihood feature's calibration, where the ORM has one, is kept as
trained (no refit online: it needs held-out labels at every step).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from policy.generation.rollout import Rollout
from policy.rewards import Scores, grade_samples
from reward_model.encoding import orm_example
from reward_model.families import FamilyError, infer_family
from reward_model.score import TagScorer
from reward_model.train import RMSpec, batch_loss, reward_model_engine
from runtime.batching import BatchPlan
from runtime.checkpoint import export
from runtime.data import MathRecord
from runtime.dist import global_sum, world
from runtime.engine import current_lr, gathered_for_generation


class Verdicts:
    """The checks of the samples an online reward model scored since its last update, keyed by
    (question's source id, completion): recorded at scoring, taken (and cleared) by the update."""

    def __init__(self):
        self.checks: dict[tuple[str, str], bool] = {}

    def record(self, records: list[MathRecord], texts: list[str], correct: torch.Tensor) -> None:
        for rec, text, ok in zip(records, texts, correct.tolist()):
            self.checks[(rec.source_id, text)] = ok

    def grade(self, records: list[MathRecord], texts: list[str], timeout_s: int) -> torch.Tensor:
        """The samples' exact checks, recorded for the update."""
        correct = grade_samples(records, texts, timeout_s)
        self.record(records, texts, correct)
        return correct

    def take(self, records: list[MathRecord], texts: list[str], rows: int, where: str
             ) -> list[bool]:
        """The recorded checks of the step's `rows` samples on this rank (all ranks take the
        same number, the update's collectives depend on it)."""
        labels = [self.checks[(rec.source_id, text)] for rec, text in zip(records, texts)]
        self.checks = {}
        if len(labels) != rows:
            raise ValueError(f"{where}: the online reward model steps on {rows} samples a rank, "
                             f"this step gave it {len(labels)}")
        return labels


class OnlineORM:
    """`policy.rewards.LearnsOnline`: an ORM rewarding the policy's samples (a `RewardFn`) and
    learning from their verdicts after it scored them (`learn`)."""

    reads_gold = True
    """Every sample's check trains it, after its reward was computed (`gold_read`)."""
    name = "online-rm"
    """Its companion state (`<stage>/state-online-rm`) and export (`<stage>/online-rm`)."""

    def __init__(self, spec: RMSpec, init: str | Path, plan: BatchPlan, lr: float,
                 timeout_s: int = 2):
        """The ORM in `init` (the tag-LM family) under a DeepSpeed engine at learning rate `lr`,
        stepping on `plan`'s rows: a GRPO step's samples (`plan_grpo_batch`'s)."""
        if spec.token_classifier or not spec.trainable or (
                not spec.settings.family and Path(init).is_dir()
                and infer_family(init) != "tag_lm"):
            raise FamilyError(f"rm.online: the online ORM is a tag_lm reward model; {init} is "
                              f"{spec.settings.family or infer_family(init)}")
        self.spec, self.init, self.plan, self.lr, self.timeout_s = spec, init, plan, lr, timeout_s
        self.engine = None  # built by the stage that uses it (`companions`), not before
        self.verdicts = Verdicts()

    def companions(self) -> dict:
        """The engines the stage saves and restores with the policy's (built at the first
        call: a finished stage never builds one)."""
        if self.engine is None:
            self.tokenizer, self.engine, self.read = reward_model_engine(
                self.spec, Path(self.name), self.init, self.plan, lr=self.lr)
        return {self.name: self.engine}

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        """The ORM's P(+) of each sample as it is now, and each sample's check (kept for the
        update, never read by the score)."""
        return self.score(records, rollout,
                          self.verdicts.grade(records, rollout.texts, self.timeout_s))

    @torch.no_grad()
    def score(self, records: list[MathRecord], rollout: Rollout, correct: torch.Tensor
              ) -> Scores:
        """The ORM's P(+) of each sample as it is now, beside the samples' checks `correct`."""
        rm = self.spec.settings
        self.companions()
        examples = [orm_example(r.question, t) for r, t in zip(records, rollout.texts)]
        with gathered_for_generation(self.engine) as module:  # every rank scores its own rows
            scores = TagScorer(module, self.tokenizer, rm.step_tag, rm.max_length,
                               rm.score_batch_size).score(examples)
        return Scores(rewards=torch.tensor([s[0] if s else 0.0 for s in scores]),
                      correct=correct)

    def learn(self, records: list[MathRecord], rollout: Rollout, backward, where: str) -> dict:
        """One optimizer step on this rank's samples of the step (`records[i]`: sample i's
        question), each labelled by the check its scoring recorded; `backward` is the stage's
        `StageLoop.backward` (checked passes, the engine's step). Every rank calls it with
        `plan.rank_sequences` samples. Returns the update's metrics (`online_rm/*`)."""
        started = time.perf_counter()
        labels = self.verdicts.take(records, rollout.texts, self.plan.rank_sequences, where)
        examples = [orm_example(rec.question, text, ok)
                    for rec, text, ok in zip(records, rollout.texts, labels)]
        batch = self.read.encode(examples)
        self.engine.train()
        sums, loss_of = batch_loss(self.engine, batch, self.read, self.spec.settings, world()[1],
                                   self.plan.micro_batch_size, [ex.question for ex in examples])
        grad_norm = backward(self.plan.grad_accum, self.plan.micro_batch_size, loss_of,
                             f"{where} (online ORM)", engine=self.engine)
        metrics = {"online_rm/loss": global_sum(sums["loss"]), "online_rm/grad_norm": grad_norm,
                   "online_rm/lr": current_lr(self.engine),
                   "online_rm/right_share": global_sum(float(sum(labels)))
                   / (self.plan.rank_sequences * world()[1]),
                   "time/online_rm": time.perf_counter() - started}
        if self.spec.settings.lm_weight:
            metrics["online_rm/lm_loss"] = global_sum(sums["lm"])
        return metrics

    def export(self, folder: Path, config_yaml: str) -> None:
        """The ORM as it ends the stage, a reward model any command reads (`rm.path`)."""
        export(self.engine, self.tokenizer, folder, config_yaml)
