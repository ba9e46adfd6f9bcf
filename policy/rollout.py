"""Rollout: G samples per question with transformers `generate` (KV cache, left padding).

The G samples of a question share its prompt, so the prompt is prefilled once per question and
its KV cache repeated G times, instead of paying the prefill G times.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


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
    backend, policy/vllm_engine.py)."""
    if hasattr(model, "generate_groups"):
        return model.generate_groups(tokenizer, prompts, group_size,
                                     max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, greedy=greedy)
    from transformers import DynamicCache

    from runtime.prompts import encode_prompts

    enc = tokenizer.pad({"input_ids": encode_prompts(tokenizer, prompts)}, padding=True,
                        return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    # synced_gpus=False: under ZeRO-3 the caller gathers the weights first (see
    # runtime.engine.gathered_for_generation), so no rank waits on another while generating.
    gen_kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, use_cache=True, synced_gpus=False)
    if greedy:
        gen_kwargs.update(do_sample=False)
    else:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    was_training = model.training
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generate's deprecation notices on cache kwargs
        if share_prefill and group_size > 1 and ids.shape[1] > 1:
            # Prefill all but the last prompt token once per prompt, then fan the cache out.
            cache = DynamicCache(config=model.config)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
                  position_ids=positions[:, :-1], past_key_values=cache, use_cache=True)
            cache.batch_repeat_interleave(group_size)
            gen_kwargs["past_key_values"] = cache
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
        out = model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
    model.train(was_training)
    completion = out[:, ids.shape[1]:]
    if completion.shape[1] == 0:
        completion = torch.full((ids.shape[0], 1), tokenizer.pad_token_id, device=device)
    completion_mask, truncated = mask_after_eos(completion, tokenizer.eos_token_id)
    completion = torch.where(completion_mask.bool(), completion,
                             torch.full_like(completion, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(ids, mask, completion, completion_mask, texts, truncated, group_size)


@torch.no_grad()
def continue_rows(model, tokenizer, prefixes: list[list[int]], max_new_tokens: list[int], *,
                  temperature: float = 1.0, top_p: float = 1.0) -> list[list[int]]:
    """T-PPO's windowed generation: each row of token ids (a prompt and what it has generated so
    far) continued by up to its own `max_new_tokens`, sampled; returns the new tokens of each
    row, ending at its EOS where one came (transformers `generate`, left padding)."""
    enc = tokenizer.pad({"input_ids": prefixes}, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    was_training = model.training
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(max_new_tokens),
                             pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, use_cache=True,
                             synced_gpus=False, do_sample=True, temperature=temperature,
                             top_p=top_p, top_k=0)
    model.train(was_training)
    new = out[:, ids.shape[1]:]
    keep, _ = mask_after_eos(new, tokenizer.eos_token_id)
    return [row[:int(k.sum())][:limit].tolist() for row, k, limit in zip(new, keep, max_new_tokens)]
