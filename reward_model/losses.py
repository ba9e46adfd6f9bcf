"""Reward-model math: scores at step tags, the (soft-label) loss, and step-score aggregation.

Both reward models are causal LMs read at tag tokens, the Math-Shepherd way: the score of a tag is
P(`+`) over {`+`, `-`} from the logits at the tag's position. A PRM has one tag after every step; an
ORM has a single tag after the whole solution (one scalar per solution, read at the last token), so
pointwise binary cross-entropy on final-answer correctness is the same loss with one label.
A released Math-Shepherd PRM (e.g. peiyi9979/math-shepherd-mistral-7b-prm) scores identically.
Pure functions over tensors; shapes in the docstrings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from policy.generation.logprobs import selective_log_softmax


def tag_logit_margin(logits: torch.Tensor, plus_id: int, minus_id: int) -> torch.Tensor:
    """logit(+) - logit(-) at every position: [B, L, V] -> [B, L] (float32).

    sigmoid(margin) = softmax over {+, -} of the two logits = P(+).
    """
    return (logits[..., plus_id] - logits[..., minus_id]).float()


def tag_loss(margin: torch.Tensor, targets: torch.Tensor, label_mask: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy at labelled tag positions, soft targets allowed.

    margin: [B, L] logit(+) - logit(-); targets: [B, L] in [0, 1]; label_mask: [B, L] bool.
    Each labelled tag adds -(y log P(+) + (1 - y) log P(-)).
    """
    per_position = F.binary_cross_entropy_with_logits(margin, targets.float(), reduction="none")
    mask = label_mask.float()
    return (per_position * mask).sum() / mask.sum().clamp(min=1)


def pairwise_loss_sum(margin: torch.Tensor, targets: torch.Tensor, label_mask: torch.Tensor,
                      group: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed loss, pairs): the within-group pairwise logistic loss over solutions. A solution's
    score is its lowest labelled tag logit (the `min` aggregate), its class the label of its last
    labelled tag (right when >= 0.5); every (right i, wrong j) pair of one group adds
    softplus(s_j - s_i) = -log sigmoid(s_i - s_j). margin, targets, label_mask: [B, L];
    group: [B] ids (a question's solutions share one)."""
    has = label_mask.any(-1)
    score = margin.masked_fill(~label_mask, float("inf")).min(-1).values
    score = score.masked_fill(~has, 0.0)
    last = label_mask.long().cumsum(-1).argmax(-1)
    right = targets.gather(-1, last[:, None]).squeeze(-1) >= 0.5
    pairs = ((group[:, None] == group[None, :]) & right[:, None] & ~right[None, :]
             & has[:, None] & has[None, :])
    return F.softplus(score[None, :] - score[:, None])[pairs].sum(), int(pairs.sum())


def lm_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor, lm_mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy at the `lm_mask` tokens (each predicted from the position
    before it): the optional auxiliary loss that keeps the backbone able to read and redo the
    steps in the tagged format. logits: [B, L, V]; input_ids, lm_mask: [B, L]."""
    mask = lm_mask[:, 1:]
    if not mask.any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits[:, :-1][mask].float(), input_ids[:, 1:][mask], reduction="sum")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log P(token j | tokens before it) at every position j (0 at position 0): [B, L, V] and
    [B, L] -> [B, L] (float32), a chunk of positions at a time (a 7B vocabulary's full float32
    log-softmax would not fit)."""
    return F.pad(selective_log_softmax(logits[:, :-1], input_ids[:, 1:]), (1, 0))


def running_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """At every position, the least of `values` over the `mask` positions up to and including it
    (0 before the first one). Read at a step's tag over the solution's tokens, it is the lowest
    log-likelihood of any token so far: once a step is unlikely, so is every later prefix, the
    Math-Shepherd notion of a step being wrong. values: [B, L] (<= 0), mask: [B, L] bool."""
    return values.masked_fill(~mask, 0.0).cummin(dim=-1).values


def calibrated_margin(margin: torch.Tensor, surprise: torch.Tensor,
                      calibration: dict[str, float]) -> torch.Tensor:
    """The step logit of a reward model with a likelihood feature: a weighted sum of the tag's
    logit margin and `running_min` of its own token log-likelihoods, plus a bias
    (`reward_model/likelihood_feature.py` fits the three numbers)."""
    return (calibration["margin"] * margin + calibration["surprise"] * surprise
            + calibration["bias"])


def aggregate_min(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Math-Shepherd's choice: the weakest step. scores, mask: [N, S] -> [N]."""
    return scores.masked_fill(~mask, float("inf")).min(-1).values.masked_fill(~mask.any(-1), 0.0)


def aggregate_prod(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(~mask, 1.0).prod(-1).masked_fill(~mask.any(-1), 0.0)


def aggregate_last(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    last = (mask.long().cumsum(-1).argmax(-1))  # index of the last real step
    return scores.gather(-1, last[:, None]).squeeze(-1).masked_fill(~mask.any(-1), 0.0)


def aggregate_mean(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.float()
    return (scores * m).sum(-1) / m.sum(-1).clamp(min=1)


STEP_AGGREGATORS = {"min": aggregate_min, "prod": aggregate_prod, "last": aggregate_last,
                    "mean": aggregate_mean}
