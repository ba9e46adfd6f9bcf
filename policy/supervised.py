"""Supervised fine-tuning on worked solutions (the SFT warm start, offline RFT): the tensors of a
batch (labels on the solution tokens only) and one optimizer step of the next-token loss.
"""

from __future__ import annotations

import torch

from policy.generation.logprobs import selective_log_softmax
from runtime.data import MathRecord
from runtime.dist import global_sum, world
from runtime.engine import rank_loss
from tasks.prompts import PromptFormat, encode_prompts
from runtime.training import StageLoop


def sft_tensors(tokenizer, records: list[MathRecord], fmt: PromptFormat):
    """Right-padded [prompt | solution | EOS] rows with labels only on solution tokens; the
    prompt tokenised as the rollout tokenises it (BOS where the model expects one).

    Returns input_ids, attention_mask, labels: [B, L] each (labels -100 on prompt and padding).
    """
    rows, label_rows = [], []
    prompts = encode_prompts(tokenizer, fmt.prompts(tokenizer, records))
    for rec, prompt in zip(records, prompts):
        answer = tokenizer(fmt.join(rec.solution_steps),
                           add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        label_rows.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows])
    return input_ids, mask, labels


def token_nll_sum(model, input_ids, attention_mask, labels) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over labelled positions, and their count."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = labels[:, 1:]
    valid = targets != -100
    logp = selective_log_softmax(logits, targets.clamp(min=0))
    return -(logp * valid).sum(), int(valid.sum())


def supervised_step(trainer: StageLoop, tensors, plan, where: str) -> tuple[float, float]:
    """One optimizer step of the next-token loss on this rank's share of a batch of worked
    solutions (`sft_tensors`), the mean over the step's tokens of every rank; returns the loss
    and the gradient norm."""
    engine, world_size = trainer.engine, world()[1]
    tokens = global_sum(int((tensors[2][:, 1:] != -100).sum()))
    losses = []

    def loss_of(rows_: slice, mb: int):
        batch = (t[rows_].to(engine.device) for t in tensors)
        loss = rank_loss(token_nll_sum(engine, *batch)[0] / tokens, world_size)
        losses.append(loss.item())
        return loss

    grad_norm = trainer.backward(plan.grad_accum, plan.micro_batch_size, loss_of, where)
    return global_sum(sum(losses)) / world_size, grad_norm
