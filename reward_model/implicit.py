"""PRIME's implicit process reward model, online (`rm.family=implicit rm.online=true`; Cui et al.
2025, "Process Reinforcement through Implicit Rewards", and verl's `recipe/prime`).

A causal LM pi_phi, started from the policy's warm start, against a frozen reference pi_ref (the
warm start): each completion token's reward is r_t = beta * (log pi_phi(y_t | y_<t) - log
pi_ref(y_t | y_<t)), a step's reward the sum of its tokens' (`step_sums`), the solution's score
sigmoid(sum_t r_t). It is trained as an outcome model: binary cross-entropy of sigmoid(sum_t r_t)
against each sample's exact final-answer check (`implicit_loss_sum`), and yet gives a reward per
step, which GRPO's process credit forms (`grpo.process_credit` sum, min, anchored) read like any
PRM's. It reads the policy's own tokens, so it shares the policy's tokenizer.

Like the online ORM (reward_model/online.py), each GRPO step's samples are scored first and the
model takes its step on their checks after the policy's update, so no reward reads its own
sample's label; pi_phi is the stage's companion engine (saved, resumed, partitioned with the
policy), pi_ref a frozen model like the policy's reference, and pi_phi is exported to
`<stage>/online-rm/`, where the next iteration starts it from. PRIME's own default, updating
before scoring (`rm.online_update=before`, policy/scoring.py `UpdatedFirst`) with its gold term
(`grpo.process_credit=prime`), is a setting. Not built yet: training one offline (`igrpo
train-rm`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import Rollout
from policy.rewards import Scores
from runtime.batching import BatchPlan
from runtime.checkpoint import export
from runtime.data import MathRecord
from runtime.dist import global_sum, world
from runtime.engine import (build_engine, build_inference_engine, current_lr,
                            gathered_for_generation, rank_loss)
from runtime.steps import pad_steps, step_end_token_indices
from reward_model.online import Verdicts


def token_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                  beta: float) -> torch.Tensor:
    """[N, T] r_t = beta * (log pi_phi - log pi_ref) on the completion's tokens (`mask`), 0 on
    padding."""
    return beta * (logprobs - ref_logprobs) * mask


def step_sums(rewards: torch.Tensor, step_end_index: torch.Tensor,
              step_mask: torch.Tensor) -> torch.Tensor:
    """[N, S] each step's reward: the sum of the token rewards `rewards` [N, T] after the
    previous step's end token up to its own (`step_end_index`, inclusive), 0 past a sample's
    steps (`step_mask`)."""
    through = rewards.cumsum(-1).gather(1, step_end_index.clamp(min=0))
    before = torch.cat([torch.zeros_like(through[:, :1]), through[:, :-1]], dim=1)
    return (through - before) * step_mask


def implicit_loss_sum(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                      labels: torch.Tensor, beta: float) -> torch.Tensor:
    """The sum over samples of the binary cross-entropy of sigmoid(sum_t r_t) against each
    sample's outcome label (PRIME's loss, before its mean)."""
    logit = token_rewards(logprobs, ref_logprobs, mask, beta).sum(-1)
    return F.binary_cross_entropy_with_logits(logit, labels.to(logit), reduction="sum")


class OnlineImplicitPRM:
    """`policy.rewards.LearnsOnline`: the implicit PRM rewarding the policy's samples step by
    step (a `RewardFn`) and learning from their checks after it scored them (`learn`)."""

    reads_gold = True
    """Every sample's check trains it, after its rewards were computed (`gold_read`)."""
    name = "online-rm"
    """Its companion state (`<stage>/state-online-rm`) and export (`<stage>/online-rm`)."""

    def __init__(self, model_cfg, deepspeed, init: str | Path, reference: str | Path,
                 plan: BatchPlan, lr: float, beta: float, policy_tokenizer, separator: str,
                 timeout_s: int = 2):
        """pi_phi from `init` under a DeepSpeed engine at learning rate `lr` stepping on `plan`'s
        rows (a GRPO step's samples), pi_ref from `reference`; `separator` ends a step in the
        policy's completions (`data.step_separator`)."""
        self.model_cfg, self.deepspeed, self.init, self.reference_path = (model_cfg, deepspeed,
                                                                          init, reference)
        self.plan, self.lr, self.beta, self.timeout_s = plan, lr, beta, timeout_s
        self.tokenizer, self.separator = policy_tokenizer, separator
        self.engine = self.reference = None  # built by the stage that uses them (`companions`)
        self.verdicts = Verdicts()

    def companions(self) -> dict:
        """The engine the stage saves and restores with the policy's (pi_phi; pi_ref is frozen),
        both built at the first call."""
        if self.engine is None:
            from runtime.models import load_causal_lm

            self.engine = build_engine(load_causal_lm(self.init, self.model_cfg, train=True),
                                       self.deepspeed, lr=self.lr,
                                       micro_batch_size=self.plan.micro_batch_size,
                                       grad_accum=self.plan.grad_accum)
            self.reference = build_inference_engine(load_causal_lm(
                self.reference_path, self.model_cfg, device=self.engine.device), self.deepspeed)
        return {self.name: self.engine}

    def _logprobs(self, model, rollout: Rollout) -> torch.Tensor:
        """[N, T] the completion's log-probs under `model`, a micro-batch at a time."""
        micro = self.plan.micro_batch_size
        return torch.cat([completion_logprobs(model, rollout.input_ids[k:k + micro],
                                              rollout.attention_mask[k:k + micro],
                                              rollout.prompt_ids.shape[1])
                          for k in range(0, rollout.input_ids.shape[0], micro)])

    def __call__(self, records: list[MathRecord], rollout: Rollout) -> Scores:
        """Each sample's step rewards (and sigmoid of their sum as its score) as pi_phi is now,
        and each sample's check (kept for the update, never read by the rewards)."""
        return self.score(records, rollout,
                          self.verdicts.grade(records, rollout.texts, self.timeout_s))

    @torch.no_grad()
    def score(self, records: list[MathRecord], rollout: Rollout, correct: torch.Tensor
              ) -> Scores:
        """Each sample's step rewards (and sigmoid of their sum as its score) as pi_phi is now,
        beside the samples' checks `correct`."""
        self.companions()
        with gathered_for_generation(self.engine) as module:  # every rank scores its own rows
            logprobs = self._logprobs(module, rollout)
        ref = self._logprobs(self.reference, rollout)
        rewards = token_rewards(logprobs, ref, rollout.completion_mask, self.beta)
        ends = [step_end_token_indices(self.tokenizer, rollout.completion_ids[i][
            rollout.completion_mask[i].bool()].tolist(), text, self.separator)
            for i, text in enumerate(rollout.texts)]
        _, step_mask, step_end = pad_steps([[0.0] * len(e) for e in ends], ends)
        step_mask, step_end = step_mask.to(rewards.device), step_end.to(rewards.device)
        return Scores(rewards=torch.sigmoid(rewards.sum(-1)), correct=correct,
                      step_rewards=step_sums(rewards, step_end, step_mask), step_mask=step_mask,
                      step_end_index=step_end)

    def learn(self, records: list[MathRecord], rollout: Rollout, backward, where: str) -> dict:
        """One optimizer step of pi_phi on this rank's samples of the step, each labelled by
        the check its scoring recorded (`backward`: the stage's `StageLoop.backward`); every
        rank calls it with `plan.rank_sequences` samples. Returns its metrics (`online_rm/*`)."""
        started = time.perf_counter()
        labels = self.verdicts.take(records, rollout.texts, self.plan.rank_sequences, where)
        target = torch.tensor(labels, dtype=torch.float32, device=rollout.input_ids.device)
        with torch.no_grad():
            ref = self._logprobs(self.reference, rollout)
        total, size = global_sum(float(len(labels))), world()[1]
        sums = {"loss": 0.0}
        self.engine.train()

        def loss_of(rows: slice, mb: int):
            logprobs = completion_logprobs(self.engine, rollout.input_ids[rows],
                                           rollout.attention_mask[rows],
                                           rollout.prompt_ids.shape[1])
            loss = rank_loss(implicit_loss_sum(logprobs, ref[rows], rollout.completion_mask[rows],
                                               target[rows], self.beta) / total, size)
            sums["loss"] += loss.item() / size
            return loss

        grad_norm = backward(self.plan.grad_accum, self.plan.micro_batch_size, loss_of,
                             f"{where} (implicit PRM)", engine=self.engine)
        return {"online_rm/loss": global_sum(sums["loss"]), "online_rm/grad_norm": grad_norm,
                "online_rm/lr": current_lr(self.engine),
                "online_rm/right_share": global_sum(float(sum(labels))) / total,
                "time/online_rm": time.perf_counter() - started}

    def export(self, folder: Path, config_yaml: str) -> None:
        """pi_phi as it ends the stage (the next iteration's start)."""
        export(self.engine, self.tokenizer, folder, config_yaml)
