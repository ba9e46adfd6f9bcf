"""The reward models' backbone: the policy, optionally made deeper before reward training.

A reward model judges a step at its tag by comparing what is written with what should be. A small
policy forms its next token only in its last layer (the tiny policy's next result digit read out
after layer 3 is right 32% of the time, after layer 4 97%), so the comparison needs layers after
that one. `rm.extra_layers_from` appends copies of the listed backbone layers (low layers carry
the attention patterns that gather earlier tokens) with their output projections zeroed: the
deeper model computes exactly the backbone's function when training starts, and its checkpoint
is a plain `from_pretrained` model of the same family with more layers. The count of added
layers is recorded in the model config, so a reward model that continues training (a refresh)
is not deepened again.
"""

from __future__ import annotations

import copy

ADDED_LAYERS_KEY = "igrpo_rm_added_layers"


def decoder_layers(model):
    """The model's list of decoder layers (Llama/Mistral/Qwen-style `model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"rm.extra_layers_from: cannot find decoder layers in "
                         f"{type(model).__name__} (expected `model.model.layers`)")
    return layers


def deepen(model, copy_from: list[int]) -> int:
    """Append a zero-output copy of each listed layer; returns how many were added (0 when the
    model was deepened already)."""
    if not copy_from or getattr(model.config, ADDED_LAYERS_KEY, 0):
        return 0
    layers = decoder_layers(model)
    depth = len(layers)
    for src in copy_from:
        if not -depth <= src < depth:
            raise ValueError(f"rm.extra_layers_from: layer {src} does not exist "
                             f"(the backbone has {depth} layers)")
    for src in copy_from:
        layer = copy.deepcopy(layers[src])
        index = len(layers)
        for module in layer.modules():  # the model's one config, not a copy of it: what is set
            if getattr(module, "config", None) is not None:  # on it (the attention) holds here
                module.config = model.config
        for module in (layer, getattr(layer, "self_attn", None)):
            if module is not None and hasattr(module, "layer_idx"):
                module.layer_idx = index  # the KV-cache slot of the new layer
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight.data.zero_()
            if proj.bias is not None:
                proj.bias.data.zero_()
        layers.append(layer)
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = list(model.config.layer_types) + \
            [model.config.layer_types[s] for s in copy_from]
    setattr(model.config, ADDED_LAYERS_KEY, len(copy_from))
    return len(copy_from)


def added_layer_parameters(model) -> list:
    """The parameters of the layers `deepen` added (the last ones), also after a reload."""
    count = getattr(model.config, ADDED_LAYERS_KEY, 0)
    return [p for layer in list(decoder_layers(model))[-count:] for p in layer.parameters()] \
        if count else []


def heldout_lm(path, data, seed: int, questions: int = 100) -> dict:
    """Teacher-forced next-token loss and accuracy of the model in `path` on the solution tokens
    (as SFT lays them out) of the first `questions` held-out questions of the synthetic task of
    the `data` section (drawn from `seed`):
    on their right solutions, and on the slipping student's where it slips (one row at a time,
    no padding: the same numbers on any batch size). The reward-model base's recorded numbers
    (scripts/build_rm_base.py)."""
    import dataclasses

    from tasks import synthetic
    from runtime.data import load_splits

    held = load_splits(data, seed).eval[:questions]
    slipped = [dataclasses.replace(r, solution_steps=steps) for r in held
               if (steps := synthetic.carry_slip_solution(synthetic.Problem(
                   r.question, r.solution_steps, int(r.answer)))) != r.solution_steps]
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks.prompts import prompt_format

    # On the CPU wherever it runs: the recorded numbers are CPU float32.
    model, tokenizer = load_causal_lm(path, device="cpu").eval(), load_tokenizer(path)
    fmt = prompt_format(data)
    return {"right": _lm_numbers(model, tokenizer, held, fmt),
            "slipped": _lm_numbers(model, tokenizer, slipped, fmt)}


def _lm_numbers(model, tokenizer, records, fmt) -> dict:
    import torch

    from policy.supervised import sft_tensors

    nll, right, tokens = 0.0, 0, 0
    with torch.no_grad():
        for record in records:
            ids, _, labels = sft_tensors(tokenizer, [record], fmt)
            logits = model(input_ids=ids).logits[0, :-1].double()
            target = labels[0, 1:]
            logits, target = logits[target != -100], target[target != -100]
            nll += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            right += int((logits.argmax(-1) == target).sum())
            tokens += len(target)
    return {"solutions": len(records), "tokens": tokens, "nll_per_token": nll / tokens,
            "token_accuracy": right / tokens}
