"""What a GRPO stage adds to each step to see reward hacking as it happens (docs/watch.md): the
policy's KL from the run's starting policy, the `watch/*` keys over every rank's rows, the trace
of every rollout, and the guard that acts on the watch. The measures themselves are pure
functions in policy/watch.py, the trace's rows and page in policy/trace.py.

    watch = StageWatch(stage, out / "trace", trainer, reference, policy_path, reference_path,
                       first_group=rank * per_rank)
    ...  # sample the step; advantages, update, trainer.advance()
    metrics.update(watch.after_update(sampled, batch, spec, tokenizer, stats.logprobs, micro))

Every rank calls both (the KL forwards are collectives under ZeRO-3; the rows are gathered).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from policy.batch import StepBatch
from policy.generation.rollout import Rollout
from policy.engines import forward_logprobs
from policy.scoring import Sampled
from policy.stage import Evaluation, GRPOSpec, PolicyStage
from policy.trace import drop_steps_after, trace_rows, write_trace
from policy.evaluate import trace_flags
from policy.watch import (Guard, group_auroc, k3_kl, mean_token_advantage, positive_mass,
                          shared_error, watch_metrics)
from runtime.dist import gather_objects, gather_rows, gather_to_main, is_main
from runtime.engine import build_inference_engine
from runtime.models import load_causal_lm
from runtime.training import StageLoop


class StageWatch:
    """The watch, trace and guard of one GRPO stage (`stage.watch`, `stage.inspect.trace`)."""

    def __init__(self, stage: PolicyStage, trace_dir: Path, trainer: StageLoop, reference,
                 policy_path, reference_path, first_group: int = 0):
        """`reference`: the stage's frozen reference engine (or None), reused as the starting
        policy where it is one; `first_group`: this rank's first group in a step."""
        self.stage, self.trace_dir, self.trainer = stage, trace_dir, trainer
        self.first_group = first_group
        w = stage.watch
        self.guard = Guard(w.guard, w.window, w.min_group_auroc, w.max_wrong_push)
        self.initial = self._initial_policy(policy_path, reference_path, reference)
        self.seconds = 0.0
        # A fired guard ended the stage before a kill; a crash may have traced steps it redoes.
        trainer.stopped = "guard" in trainer.state
        if stage.inspect.trace and is_main():
            drop_steps_after(trace_dir, trainer.step)

    def _initial_policy(self, policy_path, reference_path, reference):
        """The model `watch/kl_init` compares the policy with: the run's starting policy
        (`stage.init_path`, default the stage's own), the reference engine where that is it,
        else a frozen engine of its own; None when the watch does not measure it."""
        w = self.stage.watch
        if not (w.enabled and w.kl_init_every):
            return None
        init = Path(self.stage.init_path or policy_path)
        if reference is not None and init == Path(reference_path or policy_path):
            return reference
        with torch.random.fork_rng(devices=[]):  # loading draws nothing the run then draws
            return build_inference_engine(
                load_causal_lm(init, self.stage.model, device=self.trainer.engine.device),
                self.stage.deepspeed)

    def kl_from_start(self, step: int, rollout: Rollout, micro: int,
                      policy_logprobs: torch.Tensor | None) -> float | None:
        """`watch/kl_init` every `watch.kl_init_every` steps (and on the first): the token mean
        of k3 KL(policy || run's starting policy) on the step's samples under the policy that
        sampled them: its log-probs from the update's first pass (`policy_logprobs`), or, when
        the update was skipped (the weights unchanged), from a forward; the starting policy's
        from a forward (every rank: a collective under ZeRO-3)."""
        if self.initial is None or step % self.stage.watch.kl_init_every:
            return None
        started = time.perf_counter()
        if policy_logprobs is None:
            policy_logprobs = forward_logprobs(self.trainer.engine.module, rollout, micro)
        start = forward_logprobs(getattr(self.initial, "module", self.initial), rollout, micro)
        mask = rollout.completion_mask.float()
        kl = k3_kl(policy_logprobs, start, mask)
        parts = gather_rows(torch.tensor([[kl * float(mask.sum()), float(mask.sum())]],
                                         device="cpu"))[0]
        self.seconds = time.perf_counter() - started
        return float(parts[:, 0].sum() / parts[:, 1].sum().clamp(min=1))

    def after_update(self, sampled: Sampled, batch: StepBatch, spec: GRPOSpec, tokenizer,
                     trainer_logprobs: torch.Tensor | None, micro: int) -> dict:
        """The step's watch keys, its trace written, the guard's verdict (`guard/*`); call after
        `trainer.advance()` (`trainer_logprobs`: the update's first pass, None if skipped)."""
        metrics = {}
        if self.stage.watch.enabled:
            kl = self.kl_from_start(self.trainer.step - 1, sampled.rollout, micro,
                                    trainer_logprobs)
            metrics.update(watch_step(sampled, batch, spec, kl, self.stage.evaluation))
            metrics["time/watch"], self.seconds = self.seconds, 0.0
        if self.stage.inspect.trace:
            started = time.perf_counter()
            rows = trace_rows(self.trainer.step, sampled.records, sampled.rollout,
                              sampled.scores, sampled.rewards, batch.advantages,
                              batch.normalised, batch.keep, tokenizer, self.first_group,
                              trainer_logprobs)
            parts = gather_to_main(rows)
            if parts is not None:
                write_trace(self.trace_dir, self.trainer.step, [r for part in parts for r in part])
            metrics["time/trace"] = time.perf_counter() - started
        metrics.update(guard_step(self.guard, self.trainer, metrics))
        return metrics


def watch_step(sampled: Sampled, batch: StepBatch, spec: GRPOSpec, kl_init: float | None,
               evaluation: Evaluation | None = None) -> dict:
    """The step's `watch/*` keys over every rank's rows (policy/watch.py), with the data's step
    oracle (`evaluation.step_oracle`) `watch/trace_auroc`, and its question ids (kept in
    metrics.jsonl; wandb takes the numbers)."""
    scores, mask, size = sampled.scores, batch.loss_mask, sampled.rollout.group_size
    if scores.correct is None:
        return {}
    rows = [sampled.rewards.float(), scores.correct.float(),
            mean_token_advantage(batch.advantages, mask), positive_mass(batch.advantages, mask)]
    traced = evaluation is not None and evaluation.step_oracle is not None
    if traced:  # the answer and every step right: punishing a lucky answer is no error here
        rows.append(torch.tensor([flag for q, record in enumerate(sampled.records)
                                  for flag in trace_flags(
                                      evaluation.step_oracle, record.question,
                                      sampled.rollout.texts[q * size:(q + 1) * size],
                                      scores.correct[q * size:(q + 1) * size].tolist(),
                                      evaluation.step_separator)],
                                 dtype=torch.float32, device=sampled.rewards.device))
    steps_at = len(rows)
    if spec.per_step and scores.step_mask is not None:
        rows += [scores.step_mask.sum(-1).float(), sampled.rollout.completion_mask.sum(-1).float()]
    members_at, members = len(rows), 0 if scores.members is None else scores.members.shape[1]
    rows += [scores.members[:, k].float() for k in range(members)]
    r = gather_rows(*rows)
    process = r[steps_at:members_at]  # (steps per solution, tokens) or nothing
    metrics = watch_metrics(r[0], r[1].bool(), r[2], r[3], size, *process)
    if traced:
        metrics["watch/trace_auroc"] = group_auroc(r[0], r[4].bool(), size)[0]
    if members:  # an ensemble: each member's ranking, and where they all err together
        each = torch.stack(list(r[members_at:]), -1)
        for k in range(members):
            metrics[f"watch/member_auroc/{k}"] = group_auroc(each[:, k], r[1].bool(), size)[0]
        metrics["watch/shared_error"] = shared_error(each, r[1].bool(), size)[0]
    if kl_init is not None:
        metrics["watch/kl_init"] = kl_init
    metrics["watch/question_ids"] = [i for ids in gather_objects(
        [record.source_id for record in sampled.records]) for i in ids]
    return metrics


def guard_step(guard: Guard, trainer: StageLoop, metrics: dict) -> dict:
    """Keep the step's watch measures in the stage's state and let the guard judge them:
    `warn` prints and logs `guard/*`, `stop` and `refresh` also end the stage, recording when
    and why in its state (and done.json)."""
    if guard.action == "off" or "watch/group_auroc" not in metrics:
        return {}
    history = trainer.state.setdefault("watch_history", [])
    history.append([metrics["watch/group_auroc"], metrics["watch/wrong_push"]])
    del history[:-guard.window]
    reason = guard.check(history)
    if reason is None:
        return {}
    if is_main():
        print(f"[igrpo] guard ({guard.action}) at step {trainer.step}: {reason}", flush=True)
    if guard.action in ("stop", "refresh"):
        trainer.stopped = True
        trainer.state["guard"] = {"fired_at": trainer.step, "reason": reason,
                                  "action": guard.action}
    return {"guard/fired": 1.0, "guard/fired_at": float(trainer.step)}
