"""Reward-model training packed (no padding, a question's tokens run once for its solutions)
against the padded forward: the margins at every label, the loss and every gradient equal to
1e-5 in float32, on each architecture the packed path serves, both trained families, with and
without gradient checkpointing."""

import pytest
import torch
import transformers

from process_supervision.formats import StepExample
from reward_model.encoding import encode, tag_tokens
from reward_model.families import Reading, classifier_margins, encode_separated
from reward_model.losses import tag_loss
from reward_model.packing import (packed_class_margins, packed_tag_margins, question_index,
                                  shared_prefixes)
from reward_model.score import tag_margins
from runtime.tiny_model import tiny_tokenizer

ARCHITECTURES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 4, "sliding_window": None}),
    "gpt_neox": ("GPTNeoXConfig", {}),
}
TAG = "ки"


def _examples() -> list[StepExample]:
    """Three questions, two with several solutions of different lengths, one alone."""
    a, b, c = ("Tom has 3 apples and buys 4 more. How many?", "What is 12 * 3 + 1?",
               "A train goes 60 km in 1 hour. How far in 3 hours?")
    return [StepExample(a, ("3 + 4 = 7", "The answer is 7"), (1.0, 1.0)),
            StepExample(a, ("3 + 4 = 8", "so 8 in all", "The answer is 8"), (0.0, 0.0, 0.0)),
            StepExample(b, ("12 * 3 = 36", "36 + 1 = 37", "The answer is 37"), (1.0, 1.0, 1.0)),
            StepExample(a, ("3 * 4 = 12", "The answer is 12"), (0.0, 0.0)),
            StepExample(c, ("60 * 3 = 180", "The answer is 180"), (1.0, 0.7)),
            StepExample(b, ("12 * 3 = 35", "The answer is 36"), (0.0, 0.0))]


def _model(architecture: str, family: str, vocab: int):
    name, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, name)(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=256, num_labels=2, **extra)
    config.classifier_dropout = 0.0
    torch.manual_seed(0)
    auto = transformers.AutoModelForTokenClassification if family == "token_classification" \
        else transformers.AutoModelForCausalLM
    return auto.from_config(config).train()


def _batch(family: str):
    if family == "token_classification":
        tokenizer = tiny_tokenizer("gpt2")
        return tokenizer, encode_separated(tokenizer, _examples(), Reading(), 256), None
    tokenizer = tiny_tokenizer("", (TAG,))
    tags = tag_tokens(tokenizer, TAG)
    return tokenizer, encode(tokenizer, _examples(), tags, TAG, 256), tags


@pytest.mark.parametrize("family", ["token_classification", "tag_lm"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_packed_reward_model_step_equals_the_padded_one(architecture, family, monkeypatch):
    from policy.generation import logprobs

    calls = []
    name = "_packed_attention"  # (the packed pass's attention, counted)
    attention = getattr(logprobs, name)
    monkeypatch.setattr(logprobs, name,
                        lambda *a, **k: calls.append(1) or attention(*a, **k))
    tokenizer, batch, tags = _batch(family)
    model = _model(architecture, family, len(tokenizer))
    group = question_index([ex.question for ex in _examples()])
    shared = shared_prefixes(batch.input_ids, batch.attention_mask, batch.label_mask, group)
    lengths = batch.attention_mask.sum(-1)
    # the three questions' prefixes: shorter than every row, at least the question's tokens
    # where a question has several rows; the question alone (c) shares its first token only
    assert shared.shape == (3,) and bool((shared[group] < lengths).all())
    assert bool((shared[:2] >= 8).all()) and shared[2] == 1
    first_label = batch.label_mask.long().argmax(-1)
    assert bool((shared[group] <= first_label).all())
    out = {}
    for packed in (True, False):
        for checkpointed in (False, True):
            if checkpointed:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
            model.zero_grad()
            ids, mask = batch.input_ids, batch.attention_mask
            if family == "token_classification":
                margin = packed_class_margins(model, ids, mask, group, shared, Reading()) \
                    if packed else classifier_margins(model, ids, mask, Reading())
            else:
                margin = packed_tag_margins(model, ids, mask, group, shared, tags) if packed \
                    else tag_margins(model, ids, mask, tags)
            loss = tag_loss(margin, batch.targets, batch.label_mask)
            loss.backward()
            out[packed, checkpointed] = (margin[batch.label_mask].detach(), loss.detach(),
                                         [p.grad.clone() for p in model.parameters()])
    # 2 layers: the packed run without checkpointing, and with it (forward and replay)
    assert len(calls) == 2 + 2 * 2
    reference = out[False, False]
    for key in ((True, False), (True, True), (False, True)):
        for a, b in zip(out[key][:2], reference[:2]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        for a, b in zip(out[key][2], reference[2]):
            assert (a - b).abs().max() <= 1e-5 * max(float(b.abs().max()), 1.0)
    assert sum(float(g.abs().sum()) for g in reference[2]) > 0


def test_a_label_on_the_first_token_leaves_no_prefix_to_share():
    """A row labelled at its first token (or one token long) cannot share: its group's prefix is
    0, and the trainer then runs the padded forward."""
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [1, 2, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    labels = torch.zeros(3, 4, dtype=torch.bool)
    labels[0, 3] = labels[1, 2] = labels[2, 0] = True
    shared = shared_prefixes(ids, mask, labels, torch.tensor([0, 0, 1]))
    assert shared.tolist() == [2, 0]  # rows 0 and 1 share [5, 6]; row 2's label is at 0
    alone = torch.zeros_like(labels)
    alone[0, 3] = alone[1, 2] = alone[2, 3] = True  # row 2 labelled late, but alone: 1 token
    assert shared_prefixes(ids, mask, alone, torch.tensor([0, 0, 1])).tolist() == [2, 1]


def test_a_deepened_reward_model_packs_every_layer():
    """A backbone deepened by `rm.extra_layers_from` (the tiny config's reward models): the
    added layer is a copy, and must read the model's own config, where the packed attention is
    switched on, or it runs plain attention across the packed rows. Its (zero) output layer's
    gradient shows it: equal to the padded forward's."""
    from reward_model.backbone import deepen

    tokenizer, batch, tags = _batch("tag_lm")
    model = _model("llama", "tag_lm", len(tokenizer))
    assert deepen(model, [0]) == 1
    group = question_index([ex.question for ex in _examples()])
    shared = shared_prefixes(batch.input_ids, batch.attention_mask, batch.label_mask, group)
    grads = {}
    for packed in (True, False):
        model.zero_grad()
        margin = packed_tag_margins(model, batch.input_ids, batch.attention_mask, group, shared,
                                    tags) if packed \
            else tag_margins(model, batch.input_ids, batch.attention_mask, tags)
        tag_loss(margin, batch.targets, batch.label_mask).backward()
        grads[packed] = model.model.layers[2].self_attn.o_proj.weight.grad.clone()
    assert float(grads[False].abs().max()) > 0
    torch.testing.assert_close(grads[True], grads[False], atol=1e-6, rtol=1e-5)
