"""The reward-hacking watch: does the reward still rank the policy's *current* samples?

Every GRPO step holds each rollout's reward and its exact final-answer verdict (`Scores.correct`);
a learned reward model that GRPO is exploiting stops ranking right above wrong within a group
while its mean keeps rising (gold falls, proxy rises). These pure functions measure that from a
step's rows; `watch_metrics` turns every rank's gathered rows into the `watch/*` keys
(docs/metrics.md), and `Guard` acts when the measures stay bad (`watch.guard`).

    values = per_sample_values(advantages, loss_mask)        # [N] mean token advantage
    group_auroc(rewards, correct, group_size)                 # (AUROC, groups with both)
    wrong_push(advantages, loss_mask, correct)                # share of A+ on wrong answers
    shared_error(members, correct, group_size)                # an ensemble's common errors
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def group_auroc(values: torch.Tensor, correct: torch.Tensor, group_size: int
                ) -> tuple[float, int]:
    """(AUROC, groups counted) of `values` [N] against `correct` [N] within groups of
    `group_size` consecutive samples: over every (right, wrong) pair of the same group, the
    share where the right one scores higher (ties count half), pooled over the groups holding
    both. NaN and 0 when no group holds both."""
    v = values.float().view(-1, group_size)
    c = correct.bool().view(-1, group_size)
    pairs = c[:, :, None] & ~c[:, None, :]  # [Q, G, G]: i right, j wrong
    diff = v[:, :, None] - v[:, None, :]
    wins = (diff > 0).float() + 0.5 * (diff == 0).float()
    count = pairs.sum()
    mixed = int((c.any(-1) & ~c.all(-1)).sum())
    if count == 0:
        return math.nan, 0
    return float((wins * pairs).sum() / count), mixed


def shared_error(members: torch.Tensor, correct: torch.Tensor, group_size: int
                 ) -> tuple[float, int]:
    """(share, wrong samples counted): over the groups holding right and wrong samples, the share
    of wrong samples that every member scores above that member's median right sample of the
    group (`members` [N, K] each member's solution score, `correct` [N]; the median of an even
    count is the lower middle one, torch.median's). NaN and 0 without such a group."""
    scores = members.float().view(-1, group_size, members.shape[1])  # [Q, G, K]
    right = correct.bool().view(-1, group_size)
    shared, counted = 0, 0
    for q in range(scores.shape[0]):
        if right[q].all() or not right[q].any():
            continue
        median = scores[q][right[q]].median(0).values  # [K]
        wrong = scores[q][~right[q]]  # [W, K]
        shared += int((wrong > median).all(-1).sum())
        counted += wrong.shape[0]
    return (shared / counted if counted else math.nan), counted


def mean_token_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] each sample's mean advantage over its `mask`ed tokens ([N, T] both): what the update
    pushes the sample by, token for token."""
    mask = mask.float()
    return (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def positive_mass(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] each sample's sum of positive token advantages over its `mask`ed tokens."""
    return (advantages.clamp(min=0) * mask.float()).sum(-1)


def wrong_push(mass: torch.Tensor, correct: torch.Tensor) -> float:
    """The share of a step's positive advantage mass ([N] `positive_mass`) on samples whose
    final answer is wrong; NaN when nothing is pushed up."""
    total = float(mass.sum())
    return math.nan if total <= 0 else float(mass[~correct.bool()].sum()) / total


def k3_kl(logprobs: torch.Tensor, other_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """The token mean of k3 = exp(r) - 1 - r, r = other - policy ([N, T] log-probs of the
    policy's own samples, `mask` their completion tokens): an unbiased, non-negative estimate of
    KL(policy || other), the estimator GRPO's KL term uses."""
    r = (other_logprobs - logprobs).float()
    k3 = (torch.exp(r) - 1 - r) * mask.float()
    return float(k3.sum() / mask.float().sum().clamp(min=1))


def watch_metrics(rewards: torch.Tensor, correct: torch.Tensor, mean_advantage: torch.Tensor,
                  mass: torch.Tensor, group_size: int, steps: torch.Tensor | None = None,
                  tokens: torch.Tensor | None = None) -> dict:
    """The `watch/*` keys of a step from every rank's [N] rows: the reward's and the advantage's
    in-group AUROC against the exact verdict, the wrong answers' share of the positive
    advantage, gold (the verdicts' mean) beside proxy (the rewards'), and for process rewards
    (`steps` per sample) steps per solution and tokens per step."""
    auroc, mixed = group_auroc(rewards, correct, group_size)
    adv_auroc, _ = group_auroc(mean_advantage, correct, group_size)
    out = {"watch/group_auroc": auroc, "watch/adv_auroc": adv_auroc,
           "watch/mixed_groups": float(mixed),
           "watch/wrong_push": wrong_push(mass, correct),
           "watch/gold": float(correct.float().mean()), "watch/proxy": float(rewards.mean())}
    if steps is not None and tokens is not None:
        out["watch/steps_per_solution"] = float(steps.float().mean())
        out["watch/tokens_per_step"] = float(tokens.sum() / steps.sum().clamp(min=1))
    return out


GUARD_ACTIONS = ("off", "warn", "stop", "refresh")


@dataclass
class Guard:
    """Fires when the `window`-step mean of `watch/group_auroc` stays under `min_auroc`, or that
    of `watch/wrong_push` over `max_wrong_push` (steps where a measure is undefined, no group
    holding both right and wrong samples, are left out of its mean). `history` is the last
    `window` steps' pairs, kept in the stage's saved state so a resumed stage decides the same."""
    action: str
    window: int
    min_auroc: float
    max_wrong_push: float

    def check(self, history: list[list[float]]) -> str | None:
        """Why the guard fires on `history` ([[group_auroc, wrong_push], ...], oldest first), or
        None; it judges only full windows."""
        if self.action == "off" or len(history) < self.window:
            return None
        recent = history[-self.window:]
        auroc = _mean([a for a, _ in recent])
        push = _mean([w for _, w in recent])
        if auroc is not None and auroc < self.min_auroc:
            return f"group_auroc {auroc:.3f} < {self.min_auroc} over {self.window} steps"
        if push is not None and push > self.max_wrong_push:
            return f"wrong_push {push:.3f} > {self.max_wrong_push} over {self.window} steps"
        return None


def _mean(values: list[float]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return sum(kept) / len(kept) if kept else None
