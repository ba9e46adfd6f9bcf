"""A policy step's batch: what its loss uses (advantages, kept rows, the loss mask and the global
normalisers), how a step's rows are cut into mini-batches, and whether the loss has any signal.
The GRPO family's update (policy/algorithms/grpo.py) reads them; the sums are over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from configs.schema import PolicyConfig
from policy.generation.rollout import Rollout
from runtime.dist import global_sum


@dataclass(frozen=True)
class StepBatch:
    """What the loss of one step uses (this rank's N rows of T completion tokens)."""
    advantages: torch.Tensor
    """[N, T] token advantages."""
    normalised: torch.Tensor
    """What they came from: [N, 1] normalised rewards (outcome), [N, S] step rewards (process;
    [N, S + 1] anchored)."""
    keep: torch.Tensor
    """[N] bool: rows in the loss."""
    broken: torch.Tensor
    """[Q] bool: groups with a non-finite reward."""
    loss_mask: torch.Tensor
    """[N, T] float: tokens in the loss."""
    num_sequences: float
    """Kept rows over every rank (the sequence normaliser)."""
    num_tokens: float
    """Loss tokens over every rank (the token normaliser; C3PO: its budget)."""
    stats: dict = field(default_factory=dict)
    """The batch's own metrics (GPG's alpha, C3PO's budget tokens)."""


def mini_batch_order(rows: int, group_size: int, count: int) -> torch.Tensor:
    """This rank's rows in mini-batch order: mini-batch m holds the m-th G/k samples of every
    question, question by question, so a mini-batch is the same set of samples whether one
    rank or several hold the step."""
    questions, size = rows // group_size, group_size // count
    return torch.tensor([q * group_size + m * size + j for m in range(count)
                         for q in range(questions) for j in range(size)], dtype=torch.long)


def in_mini_batch_order(rollout: Rollout, batch: StepBatch, g: PolicyConfig
                        ) -> tuple[Rollout, StepBatch, torch.Tensor | None]:
    """With `policy.mini_batches` > 1: the rollout and the batch with each mini-batch's rows side
    by side (`mini_batch_order`), and that order (None: as they are)."""
    if g.mini_batches == 1:
        return rollout, batch, None
    order = mini_batch_order(len(batch.keep), g.group_size, g.mini_batches).to(batch.keep.device)
    return rollout.rows(order), replace(batch, advantages=batch.advantages[order],
                                        keep=batch.keep[order],
                                        loss_mask=batch.loss_mask[order]), order


def mini_batches(batch: StepBatch, rows: int, count: int,
                 kl_term: bool) -> list[tuple[int, float, float]]:
    """(first row, global sequences, global tokens) of each of `count` mini-batches of `rows`
    rows of this rank's batch (in `mini_batch_order`) that can have a gradient (at 1: the
    step's own normalisers); a mini-batch without signal takes no optimizer step (all ranks
    agree: the sums are global)."""
    if count == 1:
        return [(0, batch.num_sequences, batch.num_tokens)]
    chunks = []
    for offset in range(0, rows * count, rows):
        part = slice(offset, offset + rows)
        sequences = global_sum(float(batch.keep[part].sum()))
        tokens = global_sum(float(batch.loss_mask[part].sum()))
        signal = kl_term or global_sum(float((batch.advantages[part]
                                              * batch.loss_mask[part]).abs().sum())) > 0
        if sequences and tokens and signal:
            chunks.append((offset, sequences, tokens))
    return chunks


def has_signal(batch: StepBatch, kl_term: bool) -> bool:
    """Whether the step's loss can have a gradient: some token is kept and either an advantage
    is non-zero or the KL term applies (all ranks agree: the sums are global)."""
    if batch.num_sequences == 0 or global_sum(float(batch.loss_mask.sum())) == 0:
        return False
    return kl_term or global_sum(float((batch.advantages * batch.loss_mask).abs().sum())) > 0


@dataclass
class UpdateStats:
    """What `update_step` measured, over every rank: the loss (a mean over the step's optimizer
    steps), token means of the KL term and of the clipped shares, the drift from the sampler's
    log-probs, the last gradient norm, the first pass's [N, T] per-token entropy, and whether
    the optimizer step was skipped (1.0: the loss had no signal)."""
    entropy: torch.Tensor
    loss: float = 0.0
    kl: float = 0.0
    clip: float = 0.0
    clip_high: float = 0.0
    logprob_diff: float = 0.0
    tis_weight: float = 0.0
    tis_capped: float = 0.0
    grad_norm: float = 0.0
    skipped: float = 0.0
    logprobs: torch.Tensor | None = None
    """[N, T] the policy's log-probs of the first pass (detached; the trace's), None if none ran."""

    def sampler_metrics(self, sampled: bool, weighted: bool) -> dict:
        """`rollout/logprob_diff` where the sampler gave log-probs (`sampled`), and the TIS
        weights' means where they weighted the loss (`weighted`)."""
        if not sampled:
            return {}
        return {"rollout/logprob_diff": self.logprob_diff, **(
            {"rollout/tis_weight": self.tis_weight, "rollout/tis_capped": self.tis_capped}
            if weighted else {})}

    def add_sampler_gap(self, drift: float, tis: tuple | None, all_tokens: float) -> None:
        """A measured share of the step's sampler gap: `rollout/logprob_diff`'s, and of the TIS
        weights (`policy.engines.tis_weights`, None where off) their token means over the
        step's `all_tokens` completion tokens."""
        self.logprob_diff += drift
        if tis is not None:
            self.tis_weight += float(tis[0].sum()) / max(all_tokens, 1.0)
            self.tis_capped += float(tis[1].sum()) / max(all_tokens, 1.0)

    def restore_order(self, order: torch.Tensor) -> None:
        """The per-row tensors, measured in mini-batch order `order`, back in the rollout's."""
        self.entropy = torch.zeros_like(self.entropy).index_copy(0, order, self.entropy)
        if self.logprobs is not None:
            self.logprobs = torch.zeros_like(self.logprobs).index_copy(0, order, self.logprobs)
