"""Batched, no-grad reward-model scoring, and the ORM/PRM rewards the GRPO loop takes.

`PRMReward` returns per-step scores and the token index where each step ends in the policy's
completion (what process advantages need), plus their aggregate as the solution score;
`ORMReward` returns one scalar per sample. Both satisfy `policy.rewards.RewardFn`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from policy.rewards import Scores, grade_samples
from policy.generation.rollout import Rollout
from process_supervision.formats import StepExample
from runtime.steps import pad_steps, split_steps, step_end_token_indices
from reward_model.encoding import TagTokens, encode, orm_example, tag_tokens
from reward_model.likelihood_feature import calibration_of
from reward_model.losses import (STEP_AGGREGATORS, calibrated_margin, running_min, tag_logit_margin,
                                 token_logprobs)
from runtime.data import MathRecord


@contextmanager
def two_row_head(model, tags: TagTokens):
    """Inside it, `model`'s output layer holds only the rows of `+` and `-`: its forward returns
    [B, L, 2] logits (column 0: `+`, 1: `-`) from the final hidden states, instead of [B, L, V]
    over the whole vocabulary (20 GB in bf16 for a scoring batch of 64 x 1,536 tokens at
    DeepSeek's 102K vocabulary, 30 GB at Qwen's 152K) to read two numbers. The layer stays the
    module it was, so its hooks (ZeRO-3's parameter gather) run, and gradients reach its two
    rows; elementwise steps the model applies after it (a logit scale, soft-capping) apply to
    the two columns as they would to all of them."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    head = module.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"{type(module).__name__}: its output layer is a "
                        f"{type(head).__name__}, not a linear layer the tag rows can be read from")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = torch.tensor([tags.plus_id, tags.minus_id], device=head.weight.device)
        bias = None if head.bias is None else head.bias.index_select(0, rows)
        return F.linear(hidden, head.weight.index_select(0, rows), bias)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def tag_margins(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                tags: TagTokens) -> torch.Tensor:
    """logit(+) - logit(-) at every position, [B, L] float32, read through `two_row_head`:
    equal to `tag_logit_margin` of the full logits (tested to 1e-5), with gradients."""
    with two_row_head(model, tags):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return tag_logit_margin(logits, 0, 1)


class TagScorer:
    """P(+) at every tag of Math-Shepherd-format inputs, a batch at a time, without gradients."""

    def __init__(self, model, tokenizer, tag: str, max_length: int, batch_size: int = 64):
        self.model, self.tokenizer, self.tag = model, tokenizer, tag
        self.max_length, self.batch_size = max_length, batch_size
        self.tags = tag_tokens(tokenizer, tag)

    @classmethod
    def from_pretrained(cls, path, tag: str, max_length: int, model_cfg=None,
                        batch_size: int = 64) -> "TagScorer":
        """A reward model from its folder, loaded as `model_cfg` (a `ModelConfig`) says, on the
        accelerator where there is one."""
        from runtime.models import load_causal_lm, load_tokenizer

        model = load_causal_lm(path, model_cfg).eval()
        return cls(model, load_tokenizer(path, model_cfg), tag, max_length, batch_size)

    def value_init(self) -> tuple[torch.nn.Module, torch.Tensor]:
        """(the model, [H] lm_head['+'] - lm_head['-']): the hidden-state direction whose dot
        product is the tag's logit margin (a critic starts from it)."""
        head = self.model.get_output_embeddings().weight
        return self.model, head[self.tags.plus_id] - head[self.tags.minus_id]

    @torch.no_grad()
    def tag_values(self, examples: list[StepExample], with_surprise: bool
                   ) -> list[tuple[list[float], list[float]]]:
        """Per example, for each step whose tag fits in `max_length` (later ones dropped): the
        tag's logit margin and, `with_surprise`, the running min of the model's own token
        log-likelihoods over the solution up to that tag (empty list otherwise)."""
        was_training = self.model.training
        self.model.eval()
        out = []
        device = next(self.model.parameters()).device
        for start in range(0, len(examples), self.batch_size):
            batch = encode(self.tokenizer, examples[start:start + self.batch_size], self.tags,
                           self.tag, self.max_length, solution_tokens=with_surprise)
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            surprise = None
            if with_surprise:  # the likelihood feature reads every token's log-probability
                logits = self.model(input_ids=ids, attention_mask=mask).logits
                margin = tag_logit_margin(logits, self.tags.plus_id, self.tags.minus_id)
                surprise = running_min(token_logprobs(logits, ids), batch.solution_mask.to(device))
            else:
                margin = tag_margins(self.model, ids, mask, self.tags)
            for row in range(len(batch.steps_kept)):
                at = batch.label_mask[row].to(device)
                out.append((margin[row][at].tolist(),
                            surprise[row][at].tolist() if with_surprise else []))
        self.model.train(was_training)
        return out

    def score(self, examples: list[StepExample]) -> list[list[float]]:
        """Per example, the score of each step whose tag fits in `max_length`: P(+) at the tag,
        or, for a reward model with a fitted likelihood feature (`reward_model/likelihood_feature.py`),
        the calibrated probability."""
        calibration = calibration_of(self.model)
        out = []
        for margins, surprises in self.tag_values(examples, with_surprise=calibration is not None):
            logit = torch.tensor(margins)
            if calibration is not None:
                logit = calibrated_margin(logit, torch.tensor(surprises), calibration)
            out.append(torch.sigmoid(logit).tolist())
        return out


def spread_tag_values(scorer: TagScorer, examples: list[StepExample], with_surprise: bool
                      ) -> list[tuple[list[float], list[float]]]:
    """`scorer.tag_values(examples, with_surprise)`, its batches spread over the ranks (every
    rank calls it and gets every example's values; `runtime.shards`)."""
    return _spread(scorer, examples, lambda part: scorer.tag_values(part, with_surprise))


def spread_score(scorer: TagScorer, examples: list[StepExample]) -> list[list[float]]:
    """`scorer.score(examples)`, its batches spread over the ranks (every rank calls it)."""
    return _spread(scorer, examples, scorer.score)


def _spread(scorer: TagScorer, examples: list, work) -> list:
    from runtime.shards import map_chunks

    size = scorer.batch_size
    starts = list(range(0, len(examples), size))
    parts = map_chunks(len(starts), lambda c: work(examples[starts[c]:starts[c] + size]),
                       costs=[len(examples[s:s + size]) for s in starts])
    return [row for part in parts for row in part]


class PRMReward:
    """Process reward: each step's P(+), the step's end token in the policy's completion, and
    the aggregated solution score (`min` by default)."""

    def __init__(self, scorer: TagScorer, policy_tokenizer, aggregate: str = "min",
                 timeout_s: int = 2, separator: str = "\n"):
        """`separator`: what ends a step in the policy's completions (`data.step_separator`)."""
        self.scorer, self.policy_tokenizer = scorer, policy_tokenizer
        self.separator = separator
        self.aggregate = STEP_AGGREGATORS[aggregate]
        self.timeout_s = timeout_s

    def value_init(self):
        """`policy.rewards.ValueSource`: this reward model's backbone and its `+` - `-` rows."""
        return self.scorer.value_init()

    def __call__(self, records: list[MathRecord], rollout: Rollout,
                 correct: torch.Tensor | None = None) -> Scores:
        """`correct`: the samples' checks where the caller graded them already (an ensemble's
        members share one grading)."""
        step_lists = [split_steps(t, self.separator) for t in rollout.texts]
        examples = [StepExample(r.question, tuple(steps), (0.0,) * len(steps))
                    for r, steps in zip(records, step_lists) if steps]
        scored = iter(self.scorer.score(examples))
        values, ends = [], []
        for i, (text, steps) in enumerate(zip(rollout.texts, step_lists)):
            ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
            step_scores = next(scored) if steps else []
            step_ends = step_end_token_indices(self.policy_tokenizer, ids, text, self.separator)
            # Steps cut off by the reward model's max_length get no score and no reward.
            values.append(step_scores)
            ends.append(step_ends[:len(step_scores)])
        step_rewards, step_mask, step_end = pad_steps(values, ends)
        if correct is None:
            correct = grade_samples(records, rollout.texts, self.timeout_s)
        return Scores(rewards=self.aggregate(step_rewards, step_mask), correct=correct,
                      step_rewards=step_rewards, step_mask=step_mask, step_end_index=step_end)


class ORMReward:
    """Outcome reward: the ORM's P(+) at the solution's final tag, one scalar per sample."""

    def __init__(self, scorer: TagScorer, timeout_s: int = 2):
        self.scorer, self.timeout_s = scorer, timeout_s

    def value_init(self):
        """`policy.rewards.ValueSource`: this reward model's backbone and its `+` - `-` rows."""
        return self.scorer.value_init()

    def __call__(self, records: list[MathRecord], rollout: Rollout,
                 correct: torch.Tensor | None = None) -> Scores:
        examples = [orm_example(r.question, t) for r, t in zip(records, rollout.texts)]
        scores = [s[0] if s else 0.0 for s in self.scorer.score(examples)]
        if correct is None:
            correct = grade_samples(records, rollout.texts, self.timeout_s)
        return Scores(rewards=torch.tensor(scores), correct=correct)
