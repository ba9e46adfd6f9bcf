"""Reward models by family: how each kind of checkpoint the field ships is read.

- `tag_lm`: a causal LM read at a Math-Shepherd tag after each step, P(+) over {+, -}
  (`reward_model/score.py`'s `TagScorer`; Math-Shepherd's released PRMs, and this project's own).
- `token_classification`: a `*ForTokenClassification` model (or a remote-code
  `*ForProcessRewardModel`) whose input holds a separator after each step, read at the last token
  of each separator: class `rm.label_index` under `rm.activation` (softmax over the classes, or a
  sigmoid of that one logit). TRL's PRMTrainer saves this family (2 labels, separator "\\n", the
  prompt after a BOS); Qwen2.5-Math-PRM reads class 1 of a softmax at `<extra_0>`, its prompt in
  the chat template (`rm.chat_template`, `rm.system_prompt`).
- `sequence_classification`: a `*ForSequenceClassification` model with one label, its scalar
  under a sigmoid at the last real token (TRL's RewardTrainer, Skywork and InternLM2 reward
  models): an outcome reward model. As a process reward it scores each step's prefix.

Every family's scorer has the `TagScorer` surface the rest of the project uses (`score` of
`StepExample`s: a probability per step that fits in `max_length`; `batch_size`; `value_init`), so
GRPO's rewards, best-of-N, the reports and `igrpo eval-rm` take any of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from process_supervision.formats import StepExample
from reward_model.encoding import TagBatch

FAMILIES = ("tag_lm", "token_classification", "sequence_classification")
ONLINE_ONLY = ("implicit",)
"""Families only GRPO's online reward reads (`rm.online`; reward_model/implicit.py), never
loaded from a folder here."""


class FamilyError(ValueError):
    """A reward model's family cannot be told, or does not fit the model it names."""


def architectures(path: str | Path) -> list[str]:
    """The `architectures` of the checkpoint's config; `FamilyError` naming the file where it
    cannot be read."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError) as err:
        raise FamilyError(f"{config}: cannot read the reward model's config ({err}); set "
                          f"rm.family to one of {', '.join(FAMILIES)}") from err


def infer_family(path: str | Path) -> str:
    """The family of the checkpoint in `path`, from its config's `architectures`; raises
    `FamilyError` (naming the folder and what it found) where it cannot be told."""
    found = architectures(path)
    for name in found:
        if name.endswith("ForCausalLM"):
            return "tag_lm"
        if name.endswith(("ForTokenClassification", "ForProcessRewardModel")):
            return "token_classification"
        if name.endswith("ForSequenceClassification"):
            return "sequence_classification"
    raise FamilyError(f"{Path(path) / 'config.json'}: architectures {found} name no "
                      f"reward-model family this project reads; set rm.family to one of "
                      f"{', '.join(FAMILIES)}")


@dataclass(frozen=True)
class Reading:
    """How a classifier reward model's output is read: `separator` after each step (the label
    sits at its last token), class `label_index`, `activation` softmax or sigmoid, and the
    prompt's layout (`chat_template` with `system_prompt`, else BOS + question as TRL lays it)."""

    separator: str = "\n"
    label_index: int = 1
    activation: str = "softmax"
    chat_template: bool = False
    system_prompt: str = ""

    @classmethod
    def of(cls, rm) -> "Reading":
        """The reading the config's `rm` section describes."""
        return cls(rm.separator, rm.label_index, rm.activation, rm.chat_template,
                   rm.system_prompt)


def prompt_ids(tokenizer, question: str, reading: Reading) -> list[int]:
    """The question's tokens as the family lays them before the first step: the chat template's
    system and user turns up to the assistant's turn, or BOS (where the tokenizer has one) and
    the question's own tokens, as TRL's PRMTrainer does."""
    if reading.chat_template:
        turns = ([{"role": "system", "content": reading.system_prompt}]
                 if reading.system_prompt else []) + [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def encode_separated(tokenizer, examples: list[StepExample], reading: Reading,
                     max_length: int) -> TagBatch:
    """Each example as its prompt, then each step's tokens followed by the separator's, every
    piece tokenised on its own (TRL's layout); the step's label on the separator's last token.
    Rows longer than `max_length` are cut at the end, the labels past the cut dropped with them.
    Right-padded."""
    separator = tokenizer(reading.separator, add_special_tokens=False)["input_ids"]
    if not separator:
        raise FamilyError(f"rm.separator={reading.separator!r} gives no token")
    rows, targets, masks, kept, prompts = [], [], [], [], []
    for ex in examples:
        ids = prompt_ids(tokenizer, ex.question, reading)
        prompts.append(len(ids))
        ends = []
        for step in ex.steps:
            ids = ids + tokenizer(step, add_special_tokens=False)["input_ids"] + separator
            ends.append(len(ids) - 1)
        ids = ids[:max_length]
        ends = [e for e in ends if e < len(ids)]
        target, mask = [0.0] * len(ids), [False] * len(ids)
        for e, y in zip(ends, ex.labels):
            target[e], mask[e] = float(y), True
        rows.append(ids)
        targets.append(target)
        masks.append(mask)
        kept.append(len(ends))
    return _right_padded(tokenizer, rows, targets, masks, kept, prompts)


def _right_padded(tokenizer, rows: list[list[int]], targets: list[list[float]],
                  masks: list[list[bool]], kept: list[int], prompts: list[int]) -> TagBatch:
    """Rows, their targets and label masks, right-padded into a `TagBatch` (no LM or solution
    masks: the classifier families read labels only); `prompts`: each row's tokens before its
    first step."""
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def padded(values, fill):
        return torch.tensor([v + [fill] * (width - len(v)) for v in values])

    empty = torch.zeros(len(rows), width, dtype=torch.bool)
    return TagBatch(padded(rows, pad), padded([[1] * len(r) for r in rows], 0),
                    padded(targets, 0.0), padded(masks, False), empty, empty, kept, prompts)


def classifier_margins(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       reading: Reading) -> torch.Tensor:
    """[B, L] float32 logit of the read class at every position: sigmoid of it is the class's
    probability (softmax over the classes, or a sigmoid of its own logit), with gradients."""
    out = model(input_ids=input_ids, attention_mask=attention_mask)
    return read_class(out.logits if hasattr(out, "logits") else out[0], reading)


def read_class(logits: torch.Tensor, reading: Reading) -> torch.Tensor:
    """[..., C] a classifier's logits -> [...] float32 logit of the read class (sigmoid of it is
    the class's probability)."""
    logits = logits.float()
    picked = logits[..., reading.label_index]
    if reading.activation == "sigmoid":
        return picked
    if logits.shape[-1] == 2:  # softmax over two classes: the difference of their logits
        return picked - logits[..., 1 - reading.label_index]
    log_p = torch.log_softmax(logits, -1)[..., reading.label_index]
    return log_p - torch.log1p(-log_p.exp().clamp(max=1 - 1e-7))


def head_of(model) -> torch.nn.Linear:
    """A classifier's output layer (`score` in transformers' decoder classifiers, `classifier`
    elsewhere)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise FamilyError(f"{type(model).__name__}: no linear `score` or `classifier` head")


class _Classifier:
    """What the two classifier families share: the batches, the device, the no-grad loop."""

    def __init__(self, model, tokenizer, max_length: int, batch_size: int = 64):
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size = max_length, batch_size

    @torch.no_grad()
    def _probabilities(self, examples: list[StepExample], encode, margins) -> list[list[float]]:
        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(examples), self.batch_size):
            batch = encode(examples[start:start + self.batch_size])
            margin = margins(batch.input_ids.to(device), batch.attention_mask.to(device))
            for row in range(len(batch.steps_kept)):
                out.append(torch.sigmoid(margin[row][batch.label_mask[row].to(device)]).tolist())
        self.model.train(was_training)
        return out


class TokenClassScorer(_Classifier):
    """A token-classification PRM: the read class's probability at each step's separator."""

    def __init__(self, model, tokenizer, max_length: int, reading: Reading,
                 batch_size: int = 64):
        super().__init__(model, tokenizer, max_length, batch_size)
        self.reading = reading

    def encode(self, examples: list[StepExample]) -> TagBatch:
        return encode_separated(self.tokenizer, examples, self.reading, self.max_length)

    def margins(self, model, input_ids, attention_mask) -> torch.Tensor:
        return classifier_margins(model, input_ids, attention_mask, self.reading)

    def score(self, examples: list[StepExample]) -> list[list[float]]:
        return self._probabilities(examples, self.encode,
                                   lambda ids, mask: self.margins(self.model, ids, mask))

    def value_init(self) -> tuple[torch.nn.Module, torch.Tensor]:
        """(the model, the head's direction whose dot product is the read class's logit)."""
        weight = head_of(self.model).weight
        direction = weight[self.reading.label_index]
        if self.reading.activation == "softmax" and weight.shape[0] == 2:
            direction = direction - weight[1 - self.reading.label_index]
        return self.model, direction


class SequenceScorer(_Classifier):
    """A sequence-classification ORM: sigmoid of its scalar at the last real token of the
    question and the solution so far; one score per step prefix (an outcome example, whose
    whole solution is one step, gets one)."""

    def __init__(self, model, tokenizer, max_length: int, reading: Reading = Reading(),
                 batch_size: int = 64):
        super().__init__(model, tokenizer, max_length, batch_size)
        self.reading = reading

    def encode(self, examples: list[StepExample]) -> TagBatch:
        """One row per step prefix, labelled at its last real token."""
        prefixes = [StepExample(ex.question, ("\n".join(ex.steps[:k + 1]),), (0.0,))
                    for ex in examples for k in range(len(ex.steps))]
        return _encode_whole(self.tokenizer, prefixes, self.reading, self.max_length)

    def margins(self, model, input_ids, attention_mask) -> torch.Tensor:
        """[B, L] the head's scalar at every position (the backbone's hidden states under the
        head: what the model pools at its last token, read wherever the caller asks)."""
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask)[0]
        return head_of(model)(hidden)[..., 0].float()

    def score(self, examples: list[StepExample]) -> list[list[float]]:
        flat = iter(p[0] if p else 0.0 for p in self._probabilities(
            examples, self.encode, lambda ids, mask: self.margins(self.model, ids, mask)))
        return [[next(flat) for _ in ex.steps] for ex in examples]

    def value_init(self) -> tuple[torch.nn.Module, torch.Tensor]:
        return self.model, head_of(self.model).weight[0]


def _encode_whole(tokenizer, examples: list[StepExample], reading: Reading,
                  max_length: int) -> TagBatch:
    """Prompt and solution (on a new line after a plain prompt; the assistant's turn after a
    chat template's), labelled at the last real token, cut at `max_length` (the score is then
    read at the last token kept). Right-padded: the padding side cannot move the read-out."""
    rows, masks, prompts = [], [], []
    for ex in examples:
        solution = ex.steps[0] if reading.chat_template else "\n" + ex.steps[0]
        prompt = prompt_ids(tokenizer, ex.question, reading)
        ids = (prompt + tokenizer(solution, add_special_tokens=False)["input_ids"])[:max_length]
        rows.append(ids)
        masks.append([False] * (len(ids) - 1) + [True])
        prompts.append(len(prompt))
    return _right_padded(tokenizer, rows, [[0.0] * len(r) for r in rows], masks,
                         [1] * len(rows), prompts)


def _merged_adapter(path: str | Path, model_cfg=None) -> Path:
    """A peft adapter folder merged onto its base, in a temporary folder of this process (the
    adapter's folder is left as it is)."""
    import atexit
    import shutil
    import tempfile

    from runtime.lora import merge_adapter_folder

    out = Path(tempfile.mkdtemp(prefix="igrpo-merged-adapter-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return merge_adapter_folder(path, out / "model", bool(model_cfg is not None
                                                          and model_cfg.trust_remote_code))


def load_reward_model(path: str | Path, rm, model_cfg=None, batch_size: int | None = None,
                      family: str = ""):
    """The scorer of the reward model in `path` (a model, or a peft adapter folder, merged onto
    the base its `adapter_config.json` names): its family from `family`, else `rm.family`,
    else the checkpoint's architecture (`infer_family`); read as `rm` says (`Reading.of`),
    `batch_size` rows a forward (default `rm.score_batch_size`)."""
    batch_size = batch_size or getattr(rm, "score_batch_size", 64)
    from transformers import (AutoModel, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification)

    from runtime.lora import is_adapter_folder

    if is_adapter_folder(path):  # a peft adapter: merged onto its base once, then read as one
        path = _merged_adapter(path, model_cfg)

    from reward_model.score import TagScorer
    from runtime.models import load_model, load_tokenizer

    # (an online-only family names GRPO's reward; the reward models read here are another)
    family = family or (rm.family if rm.family not in ONLINE_ONLY else "") or infer_family(path)
    if family not in FAMILIES:
        raise FamilyError(f"rm.family={family!r}: expected one of {', '.join(FAMILIES)}")
    if family == "tag_lm":
        return TagScorer.from_pretrained(path, rm.step_tag, rm.max_length, model_cfg, batch_size)
    tokenizer = load_tokenizer(path, model_cfg)
    tokenizer.padding_side = "right"
    if family == "sequence_classification":
        model = load_model(path, AutoModelForSequenceClassification, model_cfg).eval()
        return SequenceScorer(model, tokenizer, rm.max_length, Reading.of(rm), batch_size)
    remote = any(a.endswith("ForProcessRewardModel") for a in architectures(path))
    model = load_model(path, AutoModel if remote else AutoModelForTokenClassification,
                       model_cfg).eval()
    return TokenClassScorer(model, tokenizer, rm.max_length, Reading.of(rm), batch_size)

