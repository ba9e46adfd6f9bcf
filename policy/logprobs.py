"""Per-token log-probabilities of the sampled tokens, without a full-batch float32 log-softmax."""

from __future__ import annotations

import warnings

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


def prompt_runs(prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive rows with the same prompt (a question's G samples): the first row of
    each run, and each row's run index."""
    starts = torch.ones(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    starts[1:] = (prompt_ids[1:] != prompt_ids[:-1]).any(-1)
    return starts.nonzero().squeeze(-1), starts.cumsum(0) - 1


def _checkpointing(model) -> bool:
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    name = "is_activation_checkpointing" if hasattr(module, "is_activation_checkpointing") \
        else "is_gradient_checkpointing"  # renamed in transformers 5
    return bool(getattr(module, name, False)) and module.training


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_start: int, chunk_tokens: int = 4096,
                        entropy_out: torch.Tensor | None = None,
                        share_prompts: bool = True) -> torch.Tensor:
    """Log-probs of the completion tokens of left-padded `[prompt | completion]` rows.

    input_ids, attention_mask: [N, P + T], the completion starting at column `completion_start`
    (= P). Returns [N, T]: the log-prob of token `P + t` given everything before it.

    With `share_prompts`, rows that repeat the row above's prompt (a question's G samples) share
    one forward of it: the prompt runs once per question into a KV cache, which is fanned out to
    its rows (`index_select`, so the gradient of every row flows back into the one prompt pass),
    and only `[last prompt token | completion]` runs per row. Same values and gradients as the
    plain forward (to float rounding), with the prompt's FLOPs paid once per group instead of G
    times. Off under gradient checkpointing (which turns the cache off) and when no row repeats.
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    start = completion_start
    first, run = prompt_runs(input_ids[:, :start])
    if not share_prompts or start < 2 or len(first) == len(run) or _checkpointing(model):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids,
                       logits_to_keep=input_ids.shape[1] - start + 1).logits
    else:
        from transformers import DynamicCache

        cache = DynamicCache(config=getattr(model, "module", model).config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # `past_key_values` renamed `cache` in transformers 5
            model(input_ids=input_ids[first, :start - 1],
                  attention_mask=attention_mask[first, :start - 1],
                  position_ids=position_ids[first, :start - 1], past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
            cache.batch_select_indices(run)
            logits = model(input_ids=input_ids[:, start - 1:], attention_mask=attention_mask,
                           position_ids=position_ids[:, start - 1:], past_key_values=cache,
                           use_cache=True).logits
    # logits[:, j] predicts token j + 1; keep the positions that predict completion tokens.
    logits = logits[:, :-1]
    return selective_log_softmax(logits, input_ids[:, start:], chunk_tokens, entropy_out)
