"""Rollout: G samples per question from a transformers model (`decode`: a preallocated KV cache,
left padding, finished rows dropped from the batch), or from the vLLM engine.

The G samples of a question share its prompt, so the prompt is prefilled once per question, and
its keys and values are stored and read once per group rather than once per sample.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from transformers.cache_utils import StaticLayer

from runtime.models import end_token_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class FilledLayer(StaticLayer):
    """transformers' StaticLayer (a buffer allocated once, written in place) whose attention
    reads only the positions written so far, not the whole buffer. Written by slice: at a
    decoding step's size StaticLayer's positions tensor and `index_copy_` cost more than a
    strided copy (bench/README.md, each speed lever)."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.filled = 0

    @property
    def cumulative_length(self) -> torch.Tensor:
        """transformers' count of written positions, read from `filled` (one counter, not two)."""
        return torch.tensor(self.filled)

    @cumulative_length.setter
    def cumulative_length(self, value) -> None:
        self.filled = int(value)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # StaticLayer's checks
        self.filled -= abs(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.filled = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, self.filled = self.filled, self.filled + key_states.shape[-2]
        self.keys[:, :, start:self.filled] = key_states
        self.values[:, :, start:self.filled] = value_states
        return self.keys[:, :, :self.filled], self.values[:, :, :self.filled]

    def get_seq_length(self) -> int:
        return self.filled

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


def mask_after_eos(completion_ids: torch.Tensor, eos_id: int | Sequence[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """1 up to and including the first end token (`eos_id`: one id, or every end token's);
    also whether each row never produced one."""
    ends = torch.as_tensor(eos_id, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, ends)
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(-1),
                            torch.full_like(has_eos, completion_ids.shape[1], dtype=torch.long))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions[None, :] <= first_eos[:, None]).long(), ~has_eos


@torch.no_grad()
def rest(model) -> None:
    """The end of a generation phase: a vLLM engine frees its GPU memory (sleeps, where
    `rollout.sleep` and a GPU allow) before anything else large runs; a module, nothing."""
    if hasattr(model, "sleep"):
        model.sleep()


def generate_groups(model, tokenizer, prompts: list[str], group_size: int, *,
                    max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                    greedy: bool = False, share_prefill: bool = True,
                    sampler_logprobs: bool = False) -> Rollout:
    """Sample `group_size` completions for each prompt; rows are grouped prompt by prompt.
    `model` is a transformers model, or an engine with its own `generate_groups` (the vLLM
    backend, policy/generation/vllm.py; with `sampler_logprobs` it also returns its own
    log-probs of the sampled tokens, for the drift check). `share_prefill=False` prefills every
    row itself (the reference the shared prefill is tested against)."""
    if hasattr(model, "generate_groups"):
        return model.generate_groups(tokenizer, prompts, group_size,
                                     max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, greedy=greedy, logprobs=sampler_logprobs)
    from tasks.prompts import encode_prompts

    enc = tokenizer.pad({"input_ids": encode_prompts(tokenizer, prompts)}, padding=True,
                        return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    repeat = group_size if share_prefill else 1
    if not share_prefill:
        ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)
    ends = end_token_ids(tokenizer)
    completion, _ = decode(model, ids, mask, repeat, max_new_tokens, ends,
                           tokenizer.pad_token_id, temperature=temperature, top_p=top_p,
                           greedy=greedy)
    ids, mask = ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)
    completion_mask, truncated = mask_after_eos(completion, ends)
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(ids, mask, completion, completion_mask, texts, truncated, group_size)


class _PromptKV:
    """A decoding step's view of the prompts' keys and values, kept once per prompt while each
    row's own cache holds only the tokens it generated: rows are grouped by prompt, and a group's
    queries meet their prompt's keys in one matmul (the prompt is read once per group, not once
    per row). `keep(index)` follows the rows that stay in the batch."""

    def __init__(self, cache, mask: torch.Tensor, repeat: int):
        self.keys = [layer.keys[:, :, :layer.filled] for layer in cache.layers]
        self.values = [layer.values[:, :, :layer.filled] for layer in cache.layers]
        self.mask = mask.bool()  # [prompts, P]: left padding is False
        self.group = torch.arange(mask.shape[0], device=mask.device).repeat_interleave(repeat)
        self._arrange()

    def keep(self, index: torch.Tensor) -> None:
        self.group = self.group[index]
        used = torch.unique(self.group)  # sorted: rows stay grouped prompt by prompt
        if len(used) < len(self.mask):
            self.keys = [k.index_select(0, used) for k in self.keys]
            self.values = [v.index_select(0, used) for v in self.values]
            self.mask = self.mask[used]
            self.group = torch.searchsorted(used, self.group)
        self._arrange()

    def _arrange(self) -> None:
        counts = torch.bincount(self.group, minlength=len(self.mask))
        starts = counts.cumsum(0) - counts
        self.width = int(counts.max())  # queries of a group, padded to the largest group
        self.full = len(self.group) == len(self.mask) * self.width
        self.slot = self.group * self.width + torch.arange(
            len(self.group), device=self.group.device) - starts[self.group]
        self.blocked = ~self.mask[self.group][:, None, None, :]  # [rows, 1, 1, P]
        self._bias = None

    def prompt_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[prompts, 1, 1, P] additive mask: -inf on the left padding of each prompt."""
        if self._bias is None or self._bias.dtype != dtype:
            self._bias = torch.zeros(self.mask.shape[0], 1, 1, self.mask.shape[1], dtype=dtype,
                                     device=self.mask.device).masked_fill(
                ~self.mask[:, None, None, :], float("-inf"))
        return self._bias


def _prompt_shared_attention(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, prompt_kv: _PromptKV | None = None, **kwargs):
    """One decoding step's attention (a query token a row) over [the row's prompt | its own
    tokens], the prompt's keys and values stored once per group (`_PromptKV`): the same values
    as SDPA over every row's full cache (tested token for token in tests/test_rollout.py)."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    keys, values = prompt_kv.keys[module.layer_idx], prompt_kv.values[module.layer_idx]
    groups, prompt = keys.shape[0], keys.shape[2]
    width, slot = prompt_kv.width, prompt_kv.slot
    full = prompt_kv.full  # every group at its full width: rows are the slots, in order

    def to_slots(x):  # [rows, ...] -> [groups, kv_heads, width x query heads, last]
        if not full:
            padded = x.new_zeros(groups * width, *x.shape[1:])
            padded[slot] = x
            x = padded
        x = x.reshape(groups, width, kv_heads, -1, x.shape[-1]).permute(0, 2, 1, 3, 4)
        return x.reshape(groups, kv_heads, -1, x.shape[-1])

    def to_rows(x):  # the inverse of to_slots
        x = x.view(groups, kv_heads, width, -1, x.shape[-1]).permute(0, 2, 1, 3, 4)
        x = x.reshape(groups * width, kv_heads, -1, x.shape[-1])
        return x if full else x[slot]

    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # a key head's query heads
    if query.device.type == "cpu" and query.dtype != torch.float32:
        # bf16/fp16 matmuls on CPU copy their strided operands (the filled part of the cache)
        # every step; the flash kernel reads them in place. The softmax over both parts is the
        # two parts' outputs mixed by the prompt's share of the probability mass,
        # sigmoid(lse_prompt - lse_own), in fp32.
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        on_prompt, prompt_lse = flash(to_slots(q), keys, values,
                                      attn_mask=prompt_kv.prompt_bias(query.dtype), scale=scaling)
        on_own, own_lse = flash(q, key, value, scale=scaling)
        share = torch.sigmoid(to_rows(prompt_lse[..., None]) - own_lse[..., None])
        out = torch.lerp(on_own.float(), to_rows(on_prompt).float(), share)
        return out.to(query.dtype).reshape(rows, 1, heads, dim), None
    on_prompt = to_rows(to_slots(q) @ keys.transpose(-1, -2))
    on_prompt = on_prompt.masked_fill(prompt_kv.blocked, torch.finfo(on_prompt.dtype).min)
    scores = torch.cat([on_prompt, q @ key.transpose(-1, -2)], -1) * (
        dim ** -0.5 if scaling is None else scaling)
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(query.dtype)
    out = to_rows(to_slots(weights[..., :prompt]) @ values) + weights[..., prompt:] @ value
    return out.reshape(rows, 1, heads, dim), None


PROMPT_SHARED = "igrpo_prompt_shared"
# Architectures whose attention modules pass the forward's keyword arguments to the attention
# function (and so reach `_prompt_shared_attention`), tested in tests/test_rollout.py.
PROMPT_SHARED_MODELS = ("llama", "qwen2", "mistral", "gpt_neox")


def serves_custom_attention(hf_config: PretrainedConfig) -> bool:
    """Whether the model's attention can run through a function of ours (`custom_attention`):
    the PROMPT_SHARED_MODELS families on sdpa or eager attention, without sliding windows."""
    return (hf_config.model_type in PROMPT_SHARED_MODELS
            and hf_config._attn_implementation in ("sdpa", "eager")
            and getattr(hf_config, "sliding_window", None) is None)


@contextmanager
def custom_attention(hf_config: PretrainedConfig, name: str, function):
    """Inside the block the model's attention modules call `function` (registered with
    transformers' AttentionInterface as `name`), which receives the forward's keyword
    arguments; the model's own attention is restored after, whatever happens."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)
    implementation, hf_config._attn_implementation = hf_config._attn_implementation, name
    try:
        yield
    finally:
        hf_config._attn_implementation = implementation


def _shares_prompts(model, cache) -> bool:
    return serves_custom_attention(model.config) and all(
        type(layer) is FilledLayer for layer in cache.layers)


def _cache_rows(cache, index: torch.Tensor) -> None:
    """Keep (and repeat) the cache's rows at `index`, in every layer (a layer not written yet
    has none: it takes its rows from its first write)."""
    for layer in cache.layers:
        if layer.keys is None:
            continue
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
        layer.batch_size = len(index)


def _filled_cache(model, length: int):
    """transformers' StaticCache of `length` positions whose full-attention layers read only
    what is filled (sliding-window layers stay as they are)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    cache.layers = [FilledLayer(layer.max_cache_len) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]
    return cache


def _prefill(model, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int,
             share_prompts: bool):
    """Run each prompt once and set up its `repeat` rows: (the cache the rows decode into, each
    row's first logits, the rows' attention mask, each row's next position, the prompts' keys
    and values kept once per group or None). Prompt sharing (`_PromptKV`) applies to repeated
    prompts on the architectures that serve it; otherwise the prompt's cache is copied to its
    rows and the mask covers prompt and new tokens."""
    rows, width = ids.shape[0] * repeat, ids.shape[1]
    cache = _filled_cache(model, width + max_new_tokens)
    shared = share_prompts and repeat > 1 and _shares_prompts(model, cache)
    if shared:
        cache = _filled_cache(model, width)  # the prompts only
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    fan_out = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(repeat)
    next_position = positions[fan_out, -1] + 1
    if shared:
        prompt_kv = _PromptKV(cache, mask, repeat)
        return _filled_cache(model, max_new_tokens), logits[fan_out], None, next_position, \
            prompt_kv
    if repeat > 1:
        _cache_rows(cache, fan_out)
    attention = torch.cat([mask[fan_out], mask.new_ones(rows, max_new_tokens)], dim=1)
    return cache, logits[fan_out], attention, next_position, None


def decode(model, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int,
           eos_id: int | Sequence[int], pad_id: int, *, temperature: float = 1.0,
           top_p: float = 1.0, greedy: bool = False, limits: list[int] | None = None,
           compact_share: float = 0.9,
           share_prompts: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoding loop under every hf rollout: `repeat` completions of each left-padded row of
    `ids`, rows in order ([rows x repeat, T] tokens, padded after EOS; and each token's
    log-prob under the sampling distribution, 0 on padding), as wide as the longest row. A row
    ends at any of the end tokens `eos_id` (one id or several).

    Leaner than `model.generate` where rollout spends its time: the KV cache is preallocated
    (transformers' StaticCache: no per-token concatenation), each prompt is prefilled once and
    its keys and values are kept once for its `repeat` rows, whose attention reads them once per
    group (`_PromptKV`; `share_prompts=False`, or an architecture outside
    PROMPT_SHARED_MODELS, copies the prompt's cache to every row instead), and rows that have
    ended (EOS, or their own `limits` entry of new tokens) leave the batch once no more than
    `compact_share` of the batch is still running. Sampling is transformers' temperature and
    top-p warpers and `torch.multinomial`, as `generate` samples.

    Prefill and loop run under `torch.inference_mode` (no bookkeeping of versions and views on
    a few hundred small operations a step: docs/rollout.md); the outputs are made outside it,
    so the loss may save them for backward."""
    warpers = _warpers(temperature, top_p, greedy)
    rows, device = ids.shape[0] * repeat, ids.device
    ends = torch.as_tensor(eos_id, device=device).reshape(-1)
    limit = torch.full((rows,), max_new_tokens, device=device) if limits is None else \
        torch.tensor(limits, device=device).repeat_interleave(repeat)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_new_tokens, device=device)
    if max_new_tokens == 0 or rows == 0:
        return tokens, logprobs
    was_training = model.training
    model.eval()
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # `past_key_values` renamed `cache` in transformers 5
            cache, logits, attention, next_position, prompt_kv = _prefill(
                model, ids, mask, repeat, max_new_tokens, share_prompts)
            step = {} if prompt_kv is None else {"prompt_kv": prompt_kv}
            attend = nullcontext() if prompt_kv is None else custom_attention(
                model.config, PROMPT_SHARED, _prompt_shared_attention)
            alive = torch.arange(rows, device=device)  # the batch's rows, as rows of the output
            with attend:
                for t in range(max_new_tokens):
                    chosen, logprob = _draw(warpers, logits, greedy)
                    tokens[alive, t], logprobs[alive, t] = chosen, logprob
                    running = ~torch.isin(chosen, ends) & (limit[alive] > t + 1)
                    if t + 1 == max_new_tokens or not running.any():
                        break
                    if running.sum() <= compact_share * len(alive):
                        alive, chosen, next_position, attention = _compacted(
                            running.nonzero().squeeze(-1), cache, prompt_kv, alive, chosen,
                            next_position, attention)
                    logits = model(input_ids=chosen[:, None], attention_mask=attention,
                                   position_ids=(next_position + t)[:, None],
                                   past_key_values=cache, use_cache=True, **step).logits[:, -1]
    finally:
        model.train(was_training)
    return _trimmed(tokens, logprobs, limit, eos_id, pad_id)


def _draw(warpers, logits: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token (the argmax, or drawn as `generate` draws it) and its log-prob
    under the warped distribution. logits: [rows, V] -> ([rows], [rows])."""
    scores = warpers(None, logits.float())
    chosen = scores.argmax(-1) if greedy else \
        torch.multinomial(torch.softmax(scores, -1), 1).squeeze(-1)
    return chosen, torch.log_softmax(scores, -1).gather(-1, chosen[:, None]).squeeze(-1)


def _compacted(keep: torch.Tensor, cache, prompt_kv, alive, chosen, next_position, attention):
    """The batch narrowed to the rows at `keep` (the cache, and the prompt view or the
    attention mask, in place or returned): (alive, chosen, next_position, attention)."""
    _cache_rows(cache, keep)
    if prompt_kv is not None:
        prompt_kv.keep(keep)
    else:
        attention = attention[keep]
    return alive[keep], chosen[keep], next_position[keep], attention


def _warpers(temperature: float, top_p: float, greedy: bool):
    """transformers' temperature and top-p warpers, as `generate` applies them."""
    from transformers.generation.logits_process import (LogitsProcessorList,
                                                        TemperatureLogitsWarper, TopPLogitsWarper)

    warpers = LogitsProcessorList()
    if not greedy and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if not greedy and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def _trimmed(tokens: torch.Tensor, logprobs: torch.Tensor, limit: torch.Tensor,
             eos_id: int | Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens after a row's end token or past its limit become padding (log-prob 0), and
    columns that are padding in every row go."""
    ended, _ = mask_after_eos(tokens, eos_id)
    span = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < limit[:, None]
    keep = ended.bool() & span
    width = max(int(keep.sum(-1).max()), 1)
    return (tokens.masked_fill(~keep, pad_id)[:, :width],
            logprobs.masked_fill(~keep, 0.0)[:, :width])


@torch.no_grad()
def continue_rows(model, tokenizer, prefixes: list[list[int]], max_new_tokens: list[int], *,
                  temperature: float = 1.0, top_p: float = 1.0) -> list[list[int]]:
    """T-PPO's windowed generation: each row of token ids (a prompt and what it has generated so
    far) continued by up to its own `max_new_tokens`, sampled; returns the new tokens of each
    row, ending at its end token where one came."""
    enc = tokenizer.pad({"input_ids": prefixes}, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    ends = end_token_ids(tokenizer)
    new, _ = decode(model, ids, mask, 1, max(max_new_tokens), ends,
                    tokenizer.pad_token_id, temperature=temperature, top_p=top_p,
                    limits=max_new_tokens)
    keep, _ = mask_after_eos(new, ends)
    return [row[:int(k.sum())][:limit].tolist() for row, k, limit in zip(new, keep, max_new_tokens)]
