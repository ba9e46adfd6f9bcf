"""Turn labelled solutions into tagged token batches: labels land exactly on the tag tokens.

A PRM example is the Math-Shepherd text (a tag after every step); an ORM example is the same text
with the whole solution as its one step, so its single tag sits at the last token. Inputs longer
than `max_length` are cut at the end: the tags past the cut and their labels are dropped together,
never shifted onto other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from process_supervision.formats import BAD, GOOD, StepExample, to_math_shepherd


@dataclass(frozen=True)
class TagTokens:
    tag_id: int
    plus_id: int
    minus_id: int


@dataclass(frozen=True)
class TagBatch:
    input_ids: torch.Tensor
    """[B, L] right-padded token ids."""
    attention_mask: torch.Tensor
    """[B, L] 1 on real tokens."""
    targets: torch.Tensor
    """[B, L] label of the tag at each position (0 elsewhere); soft labels allowed."""
    label_mask: torch.Tensor
    """[B, L] bool, True exactly at the tag tokens that carry a label."""
    lm_mask: torch.Tensor
    """[B, L] bool, True at the tokens of steps labelled right (>= 0.5), tags excluded: the
    targets of the optional language-model loss (`rm.lm_weight`)."""
    solution_mask: torch.Tensor
    """[B, L] bool, True at the tokens of every step (tags and the token after each tag
    excluded, whose prediction the tag loss bends): where the likelihood feature reads the
    reward model's own token log-likelihoods. Empty unless asked for."""
    steps_kept: list[int]
    """Per example: how many of its tags survived truncation."""
    prompt_tokens: list[int] = field(default_factory=list)
    """Per example: its tokens before the first step (the question as the family lays it out),
    where `rm.max_completion_length`'s budget starts; empty where the encoder does not say."""


TRUNCATION_WARN_SHARE = 0.05
"""Above this share of a training run's step tags cut off by `rm.max_length`, training warns."""


def fit_labels(batch: TagBatch, examples: list[StepExample], truncation: str,
               last_step_only: bool, max_completion: int = 0) -> tuple[TagBatch, int, int]:
    """(the batch as training reads it, step tags it dropped, its tags). A row is cut where
    `max_length` cut it or, with `max_completion` > 0, that many tokens after its question
    (`prompt_tokens`). A cut row keeps its tokens and labels up to the cut (`truncation="end"`,
    TRL's), ends at its last whole step that fits, the question kept (`"steps"`), or trains on
    nothing (`"drop"`); the tokens past a row's end are masked out as padding. With `last_step_only` a row
    keeps only its last step's label, none if the cut took it."""
    if (max_completion or truncation == "steps") and not batch.prompt_tokens:
        raise ValueError("fit_labels: a completion budget or truncation='steps' reads each "
                         "row's question length; encode with prompt_tokens=True")
    masks = {name: getattr(batch, name).clone() for name in
             ("attention_mask", "label_mask", "lm_mask", "solution_mask")}
    tags = dropped = 0
    for row, ex in enumerate(examples):
        length = int(masks["attention_mask"][row].sum())
        limit = min(length, batch.prompt_tokens[row] + max_completion) if max_completion \
            else length
        positions = [p for p in masks["label_mask"][row].nonzero().flatten().tolist()
                     if p < limit]
        tags += len(ex.steps)
        cut = len(positions) < len(ex.steps)
        if cut and truncation == "drop":
            positions, end = [], length
        elif cut and truncation == "steps":
            end = positions[-1] + 1 if positions else min(batch.prompt_tokens[row], limit)
        else:
            end = limit
        dropped += len(ex.steps) - len(positions)
        _end_row(masks, row, end)
        masks["label_mask"][row] = False
        for p in positions[-1:] if last_step_only and not cut else \
                [] if last_step_only else positions:
            masks["label_mask"][row, p] = True
        if not positions and masks["lm_mask"].numel():
            masks["lm_mask"][row] = False
    return replace(batch, **masks), dropped, tags


def _end_row(masks: dict, row: int, end: int) -> None:
    """Make row `row` of a right-padded batch end at token `end`: masked out after it."""
    masks["attention_mask"][row, end:] = 0
    for name in ("label_mask", "lm_mask", "solution_mask"):
        if masks[name].numel():
            masks[name][row, end:] = False


def tag_tokens(tokenizer, tag: str) -> TagTokens:
    """Token ids of the tag and of `+`/`-` (the last token of each, as Math-Shepherd reads them).

    `encode` then checks that every tag really is one token in context.
    """
    def last_id(text: str) -> int:
        return tokenizer(text, add_special_tokens=False)["input_ids"][-1]

    return TagTokens(last_id(tag), last_id(GOOD), last_id(BAD))


class TagTokenError(ValueError):
    """The step tag or a label token is not one token of the tokenizer in context."""


def check_tag_tokens(tokenizer, tag: str) -> TagTokens:
    """The tag's and the labels' token ids, checked in context before any work: the tag after a
    step of a Math-Shepherd text must be one token (two steps: exactly two tag tokens, each
    decoding to the tag), and `+` and `-` distinct tokens. Raises `TagTokenError` naming the
    tokenizer, the tag and its token ids."""
    tags = tag_tokens(tokenizer, tag)
    text, _ = to_math_shepherd("1 + 1 = ?", ("1 + 1 = 2", "The answer is 2"), None, tag)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    found = [i for i, t in enumerate(ids) if t == tags.tag_id]
    alone = tokenizer(tag, add_special_tokens=False)["input_ids"]
    spaced = tokenizer(" " + tag, add_special_tokens=False)["input_ids"]
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if len(found) != 2 or tokenizer.decode([tags.tag_id]).strip() != tag.strip():
        raise TagTokenError(
            f"the step tag {tag!r} is not one token for the tokenizer {name!r}: {tag!r} -> "
            f"{alone}, {' ' + tag!r} -> {spaced}. Set rm.add_tag_token=true (it is added to the "
            "reward model's tokenizer and embeddings), or choose an rm.step_tag that is one token")
    if tags.plus_id == tags.minus_id or tags.tag_id in (tags.plus_id, tags.minus_id):
        raise TagTokenError(f"the tokenizer {name!r} does not give the tag {tag!r} and the labels "
                            f"'+' / '-' three distinct tokens ({tags})")
    return tags


def ensure_tag_token(tokenizer, model, tag: str, add: bool) -> bool:
    """Make the tag one token where it is not and `add` allows: a new token in the tokenizer and
    a new embedding row in `model` (resized; saved with it). Returns whether it was added;
    raises `TagTokenError` where the tag is not one token and `add` is off."""
    try:
        check_tag_tokens(tokenizer, tag)
        return False
    except TagTokenError:
        if not add:
            raise
    tokenizer.add_tokens([tag])
    if model is not None:
        model.resize_token_embeddings(len(tokenizer))
    check_tag_tokens(tokenizer, tag)
    return True


def orm_example(question: str, solution: str, correct: float | None = None) -> StepExample:
    """An ORM example: the whole solution is one step, labelled with its correctness."""
    return StepExample(question, (solution,), (float(correct),) if correct is not None else (0.0,))


def encode(tokenizer, examples: list[StepExample], tags: TagTokens, tag: str,
           max_length: int, lm_targets: bool = False, solution_tokens: bool = False,
           prompt_tokens: bool = False) -> TagBatch:
    """Tokenise Math-Shepherd texts and put each label on its tag token; with `lm_targets`, also
    mark the tokens of right steps for the auxiliary LM loss (scoring leaves `lm_mask` empty);
    with `solution_tokens`, the tokens of all steps (`solution_mask`); with `prompt_tokens`
    (training: `fit_labels`), each question's token count (`TagBatch.prompt_tokens`). Scoring
    asks for none of them and tokenises each text once."""
    rows, targets, masks, lm_masks, solution_masks, kept, prompts = [], [], [], [], [], [], []
    for ex in examples:
        text, _ = to_math_shepherd(ex.question, ex.steps, None, tag)
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        positions = [i for i, t in enumerate(ids) if t == tags.tag_id]
        # Where the first step starts: the tokens of the question alone (a BPE merge across the
        # boundary can move it by a token, which only matters to the auxiliary LM loss).
        question_end = len(tokenizer(ex.question.replace(tag, "").strip(),
                                     add_special_tokens=True)["input_ids"]) \
            if lm_targets or solution_tokens or prompt_tokens else 0
        if len(positions) != len(ex.steps):
            raise ValueError(f"reward model: found {len(positions)} tag tokens for "
                             f"{len(ex.steps)} steps in {ex.source_id or ex.question[:40]!r}: the tag "
                             f"{tag!r} must tokenise to one token in context")
        ids = ids[:max_length]
        positions = [p for p in positions if p < len(ids)]
        target, mask, lm = [0.0] * len(ids), [False] * len(ids), [False] * len(ids)
        solution = [False] * len(ids)
        start = question_end
        for k, (p, y) in enumerate(zip(positions, ex.labels)):
            target[p], mask[p] = float(y), True
            if lm_targets and y >= 0.5:
                lm[start:p] = [True] * (p - start)
            if solution_tokens:
                first = start + (k > 0)  # the token after the previous tag
                solution[first:p] = [True] * max(0, p - first)
            start = p + 1
        rows.append(ids)
        targets.append(target)
        masks.append(mask)
        lm_masks.append(lm)
        solution_masks.append(solution)
        kept.append(len(positions))
        if prompt_tokens:
            prompts.append(question_end)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id

    def padded(values, fill):
        return [v + [fill] * (width - len(v)) for v in values]

    return TagBatch(torch.tensor(padded(rows, pad)),
                    torch.tensor(padded([[1] * len(r) for r in rows], 0)),
                    torch.tensor(padded(targets, 0.0)),
                    torch.tensor(padded(masks, False)), torch.tensor(padded(lm_masks, False)),
                    torch.tensor(padded(solution_masks, False)), kept, prompts)
