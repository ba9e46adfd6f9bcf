"""Reward-model training without padding, a question's text run once for all its solutions.

A training batch holds several solutions of a question side by side (Math-Shepherd's rows repeat
each question over many solutions; `rm.group_by_question` keeps them together). Every family's
row begins with the question's tokens and carries no label before its first step, so the rows
of one question share a prefix that no label reads: `shared_prefixes` finds it, and
`policy.generation.logprobs.packed_row_logits` runs it once per question and the rows' other
real tokens as one packed sequence, the way the GRPO update shares a prompt across a group.
Equal to the padded forward at every label (tests/test_reward_model_units.py), with the padding
and the repeated questions' FLOPs gone.
"""

from __future__ import annotations

import torch

from policy.generation.logprobs import packed_row_logits
from reward_model.encoding import TagTokens
from reward_model.families import Reading, read_class
from reward_model.losses import tag_logit_margin
from reward_model.score import two_row_head

ATTENTION_BLOCKS = 4
"""The packed pass's attention runs in this many blocks of rows of similar lengths (each padded
to its longest row): a reward model's rows spread more in length than a GRPO group's, and on 2
CPU cores 4 blocks of a 16-row micro-batch measured fastest (bench/README.md)."""


def question_index(questions: list[str]) -> torch.Tensor:
    """[B] each row's question, numbered from 0 in order of first appearance."""
    ids = {q: i for i, q in enumerate(dict.fromkeys(questions))}
    return torch.tensor([ids[q] for q in questions])


def shared_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    label_mask: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[G] per group of rows (`group`: [B]), the longest prefix all its rows have in common,
    ending before any of them carries a label and leaving each row at least one token (0 where
    a row's first token is labelled or alone: such a batch cannot be packed). A group of one row
    shares with no one: its prefix is its first token, and the rest of the row runs in the
    packed pass, where no padding is computed (the prefix pass pads every group's prefix to the
    longest)."""
    rows = torch.arange(len(group), device=group.device)
    groups = int(group.max()) + 1
    first = torch.full((groups,), len(group), device=group.device).scatter_reduce(
        0, group, rows, "amin")
    same = (input_ids == input_ids[first[group]]) & attention_mask.bool()
    common = same.long().cumprod(-1).sum(-1)
    labelled = label_mask.any(-1)
    first_label = torch.where(labelled, label_mask.long().argmax(-1), attention_mask.sum(-1))
    limit = torch.minimum(torch.minimum(common, first_label), attention_mask.sum(-1) - 1)
    shared = torch.full((groups,), input_ids.shape[1], device=group.device).scatter_reduce(
        0, group, limit, "amin")
    alone = torch.bincount(group, minlength=groups) == 1
    return torch.where(alone, shared.clamp(max=1), shared)


def packed_tag_margins(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       group: torch.Tensor, shared: torch.Tensor, tags: TagTokens) -> torch.Tensor:
    """`score.tag_margins` on the packed path: [B, L] logit(+) - logit(-) past each row's
    shared prefix (0 on it and on padding), read through the output layer's two tag rows."""
    with two_row_head(model, tags):
        return tag_logit_margin(packed_row_logits(model, input_ids, attention_mask, group,
                                                  shared, _blocks(input_ids)), 0, 1)


def packed_class_margins(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         group: torch.Tensor, shared: torch.Tensor,
                         reading: Reading) -> torch.Tensor:
    """`families.classifier_margins` on the packed path: [B, L] logit of the read class past
    each row's shared prefix (0 on it and on padding)."""
    return read_class(packed_row_logits(model, input_ids, attention_mask, group, shared,
                                        _blocks(input_ids)), reading)


def _blocks(input_ids: torch.Tensor) -> int:
    return max(1, min(ATTENTION_BLOCKS, input_ids.shape[0]))
