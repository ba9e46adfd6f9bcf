"""Rollout: G samples per question from a transformers model (`decode`: a preallocated KV cache,
left padding, finished rows dropped from the batch), or from the vLLM engine.

The G samples of a question share its prompt, so the prompt is prefilled once per question and
its KV cache repeated G times, instead of paying the prefill G times.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import StaticLayer


class _FilledLayer(StaticLayer):
    """transformers' StaticLayer (a buffer allocated once, written in place) whose attention
    reads only the positions written so far, not the whole buffer."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.filled = 0

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.filled += key_states.shape[-2]
        return keys[:, :, :self.filled], values[:, :, :self.filled]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.filled + query_length, 0


@dataclass(frozen=True)
class Rollout:
    prompt_ids: torch.Tensor
    """[N, P] left-padded prompt tokens; N = questions x G, grouped question by question."""
    prompt_mask: torch.Tensor
    """[N, P] 1 on real prompt tokens."""
    completion_ids: torch.Tensor
    """[N, T] sampled tokens, right-padded with the pad token."""
    completion_mask: torch.Tensor
    """[N, T] 1 on real completion tokens (up to and including EOS)."""
    texts: list[str]
    """Decoded completions, without special tokens."""
    truncated: torch.Tensor
    """[N] bool: the sample hit max_new_tokens without EOS."""
    group_size: int
    sampler_logprobs: torch.Tensor | None = None
    """[N, T] the sampler's own log-probs of the sampled tokens (vLLM backend), for the drift
    check `rollout/logprob_diff` only: the loss recomputes them with the training model."""

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(-1)

    def to(self, device) -> "Rollout":
        """The same rollout on `device` (as `Scores.to`)."""
        def moved(t):
            return None if t is None else t.to(device)

        return Rollout(moved(self.prompt_ids), moved(self.prompt_mask),
                       moved(self.completion_ids), moved(self.completion_mask), self.texts,
                       moved(self.truncated), self.group_size, moved(self.sampler_logprobs))

    def rows(self, index: torch.Tensor) -> "Rollout":
        """The samples at `index` ([M] row indices), in that order."""
        return Rollout(self.prompt_ids[index], self.prompt_mask[index], self.completion_ids[index],
                       self.completion_mask[index], [self.texts[i] for i in index.tolist()],
                       self.truncated[index], self.group_size,
                       None if self.sampler_logprobs is None else self.sampler_logprobs[index])


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several (e.g. generated in chunks): prompts re-padded on the left,
    completions on the right, rows in order."""
    if len(parts) == 1:
        return parts[0]
    width_p = max(r.prompt_ids.shape[1] for r in parts)
    width_c = max(r.completion_ids.shape[1] for r in parts)

    def left(t, width, value):
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    def right(t, width, value):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    return Rollout(torch.cat([left(r.prompt_ids, width_p, pad_id) for r in parts]),
                   torch.cat([left(r.prompt_mask, width_p, 0) for r in parts]),
                   torch.cat([right(r.completion_ids, width_c, pad_id) for r in parts]),
                   torch.cat([right(r.completion_mask, width_c, 0) for r in parts]),
                   [t for r in parts for t in r.texts], torch.cat([r.truncated for r in parts]),
                   parts[0].group_size,
                   None if any(r.sampler_logprobs is None for r in parts) else
                   torch.cat([right(r.sampler_logprobs, width_c, 0.0) for r in parts]))


def mask_after_eos(completion_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1 up to and including the first EOS; also whether each row never produced EOS."""
    is_eos = completion_ids == eos_id
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(-1),
                            torch.full_like(has_eos, completion_ids.shape[1], dtype=torch.long))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions[None, :] <= first_eos[:, None]).long(), ~has_eos


@torch.no_grad()
def generate_groups(model, tokenizer, prompts: list[str], group_size: int, *,
                    max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                    greedy: bool = False, share_prefill: bool = True) -> Rollout:
    """Sample `group_size` completions for each prompt; rows are grouped prompt by prompt.
    `model` is a transformers model, or an engine with its own `generate_groups` (the vLLM
    backend, policy/vllm_engine.py). `share_prefill=False` prefills every row itself (the
    reference the shared prefill is tested against)."""
    if hasattr(model, "generate_groups"):
        return model.generate_groups(tokenizer, prompts, group_size,
                                     max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, greedy=greedy)
    from runtime.prompts import encode_prompts

    enc = tokenizer.pad({"input_ids": encode_prompts(tokenizer, prompts)}, padding=True,
                        return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    repeat = group_size if share_prefill else 1
    if not share_prefill:
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
    completion, _ = decode(model, ids, mask, repeat, max_new_tokens, tokenizer.eos_token_id,
                           tokenizer.pad_token_id, temperature=temperature, top_p=top_p,
                           greedy=greedy)
    ids, mask = ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)
    completion_mask, truncated = mask_after_eos(completion, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(ids, mask, completion, completion_mask, texts, truncated, group_size)


def _cache_rows(cache, index: torch.Tensor) -> None:
    """Keep (and repeat) the cache's rows at `index`, in every layer."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
        layer.batch_size = len(index)


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int,
           eos_id: int, pad_id: int, *, temperature: float = 1.0, top_p: float = 1.0,
           greedy: bool = False, limits: list[int] | None = None,
           compact_share: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding loop under every hf rollout: `repeat` completions of each left-padded row of
    `ids`, rows in order ([rows x repeat, T] tokens, padded after EOS; and each token's
    log-prob under the sampling distribution, 0 on padding), as wide as the longest row.

    Leaner than `model.generate` where rollout spends its time: the KV cache is preallocated
    (transformers' StaticCache: no per-token concatenation), each prompt is prefilled once and
    its cache fanned out to its `repeat` rows, and rows that have ended (EOS, or their own
    `limits` entry of new tokens) leave the batch once no more than `compact_share` of the
    batch is still running. Sampling is transformers' temperature and top-p warpers and
    `torch.multinomial`, as `generate` samples."""
    from transformers import StaticCache
    from transformers.generation.logits_process import (LogitsProcessorList,
                                                        TemperatureLogitsWarper,
                                                        TopPLogitsWarper)

    warpers = LogitsProcessorList()
    if not greedy and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if not greedy and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    rows, width = ids.shape[0] * repeat, ids.shape[1]
    device = ids.device
    limit = torch.full((rows,), max_new_tokens, device=device) if limits is None else \
        torch.tensor(limits, device=device).repeat_interleave(repeat)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_new_tokens, device=device)
    if max_new_tokens == 0 or rows == 0:
        return tokens, logprobs
    cache = StaticCache(config=model.config, max_cache_len=width + max_new_tokens)
    cache.layers = [_FilledLayer(layer.max_cache_len) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]  # sliding-window layers stay as they are
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `past_key_values` renamed `cache` in transformers 5
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        fan_out = torch.arange(ids.shape[0], device=device).repeat_interleave(repeat)
        if repeat > 1:
            _cache_rows(cache, fan_out)
        logits = logits[fan_out]
        attention = torch.cat([mask[fan_out], mask.new_ones(rows, max_new_tokens)], dim=1)
        next_position = positions[fan_out, -1] + 1
        alive = torch.arange(rows, device=device)  # the batch's rows, as rows of the output
        for t in range(max_new_tokens):
            scores = warpers(None, logits.float())
            chosen = scores.argmax(-1) if greedy else \
                torch.multinomial(torch.softmax(scores, -1), 1).squeeze(-1)
            tokens[alive, t] = chosen
            logprobs[alive, t] = torch.log_softmax(scores, -1).gather(
                -1, chosen[:, None]).squeeze(-1)
            running = (chosen != eos_id) & (limit[alive] > t + 1)
            if t + 1 == max_new_tokens or not running.any():
                break
            if running.sum() <= compact_share * len(alive):
                keep = running.nonzero().squeeze(-1)
                _cache_rows(cache, keep)
                alive, chosen = alive[keep], chosen[keep]
                attention, next_position = attention[keep], next_position[keep]
            logits = model(input_ids=chosen[:, None], attention_mask=attention,
                           position_ids=(next_position + t)[:, None], past_key_values=cache,
                           use_cache=True).logits[:, -1]
    model.train(was_training)
    ended, _ = mask_after_eos(tokens, eos_id)
    span = torch.arange(max_new_tokens, device=device)[None, :] < limit[:, None]
    keep = ended.bool() & span
    width = max(int(keep.sum(-1).max()), 1)  # no column that is padding in every row
    return (tokens.masked_fill(~keep, pad_id)[:, :width],
            logprobs.masked_fill(~keep, 0.0)[:, :width])


@torch.no_grad()
def continue_rows(model, tokenizer, prefixes: list[list[int]], max_new_tokens: list[int], *,
                  temperature: float = 1.0, top_p: float = 1.0) -> list[list[int]]:
    """T-PPO's windowed generation: each row of token ids (a prompt and what it has generated so
    far) continued by up to its own `max_new_tokens`, sampled; returns the new tokens of each
    row, ending at its EOS where one came."""
    enc = tokenizer.pad({"input_ids": prefixes}, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    new, _ = decode(model, ids, mask, 1, max(max_new_tokens), tokenizer.eos_token_id,
                    tokenizer.pad_token_id, temperature=temperature, top_p=top_p,
                    limits=max_new_tokens)
    keep, _ = mask_after_eos(new, tokenizer.eos_token_id)
    return [row[:int(k.sum())][:limit].tolist() for row, k, limit in zip(new, keep, max_new_tokens)]
