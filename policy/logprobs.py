"""Per-token log-probabilities of the sampled tokens, without a full-batch float32 log-softmax."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096,
                          entropy_out: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits)[label] for every position, in float32, a chunk of rows at a time.

    logits: [N, T, V] (any float dtype); labels: [N, T] token ids. Returns [N, T] float32.
    Only a [chunk_tokens, V] float32 slice exists at once instead of the whole [N, T, V] tensor:
    log p(y) = logit_y - logsumexp(logits). With `entropy_out` ([N, T] float32), also writes the
    policy entropy at every position there (no gradient).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = torch.empty(flat_labels.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_labels.numel(), chunk_tokens):
        rows = flat_logits[start:start + chunk_tokens].float()
        picked = rows.gather(-1, flat_labels[start:start + chunk_tokens, None]).squeeze(-1)
        lse = torch.logsumexp(rows, dim=-1)
        out[start:start + chunk_tokens] = picked - lse
        if entropy_out is not None:
            with torch.no_grad():
                probs = torch.softmax(rows, dim=-1)
                entropy_out.view(-1)[start:start + chunk_tokens] = lse - (probs * rows).sum(-1)
    return out.view(labels.shape)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_start: int, chunk_tokens: int = 4096,
                        entropy_out: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of the completion tokens of left-padded `[prompt | completion]` rows.

    input_ids, attention_mask: [N, P + T], the completion starting at column `completion_start`
    (= P). Returns [N, T]: the log-prob of token `P + t` given everything before it.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=input_ids.shape[1] - completion_start + 1).logits
    # logits[:, j] predicts token j + 1; keep the positions that predict completion tokens.
    logits = logits[:, :-1]
    return selective_log_softmax(logits, input_ids[:, completion_start:], chunk_tokens,
                                 entropy_out)
