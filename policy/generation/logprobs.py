"""Per-token log-probabilities of the sampled tokens, without a full-batch float32 log-softmax."""

from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig


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


def _checkpointed_layers(module) -> list | None:
    """The decoder layers transformers checkpoints (None before its GradientCheckpointingLayer,
    where the packed path does not run under checkpointing)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return [m for m in module.modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


@contextmanager
def _kept_activations(layers: list):
    """The shared prompt pass under gradient checkpointing runs with its layers' checkpointing
    off: a checkpointed layer drops the cache the per-row pass reads. It is a question's prompt
    once, a small share of a micro-batch's tokens, so keeping its activations costs little."""
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


@contextmanager
def _replayed_in_packed_attention(layers: list, hf_config: PretrainedConfig):
    """The packed per-row pass under gradient checkpointing, each layer checkpointed by us
    (transformers' own checkpointing off): the replay in backward runs outside the forward's
    `custom_attention` block, so each layer's replay enters it again itself (a layer replayed
    with the model's own attention would compute something else)."""
    from policy.generation.rollout import custom_attention

    def replayable(layer):
        forward = inspect.unwrap(type(layer).forward).__get__(layer)  # transformers' wrapper off

        def run(*args, **kwargs):
            with custom_attention(hf_config, PACKED, _packed_attention):
                return forward(*args, **kwargs)

        return lambda *args, **kwargs: torch.utils.checkpoint.checkpoint(
            run, *args, use_reentrant=False, **kwargs)

    with _kept_activations(layers):
        for layer in layers:
            layer.forward = replayable(layer)
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward

class _Block:
    """Rows of similar completion lengths whose attention runs as one padded `[rows, width]`
    block: their tokens are a slice of the packed sequence, row by row."""

    def __init__(self, rows: torch.Tensor, lengths: torch.Tensor, group: torch.Tensor,
                 prompt_mask: torch.Tensor):
        self.rows, self.width = len(rows), max(int(lengths.max()), 1)
        self.group = group[rows]
        column = torch.arange(self.width, device=rows.device)
        local, self.column = (column[None, :] < lengths[:, None]).nonzero(as_tuple=True)
        self.row = rows[local]
        self.tokens = len(local)
        self.slots = local * self.width + self.column
        causal = column[None, :] <= column[:, None]  # a padded query sees at least itself
        self.mask = torch.cat([prompt_mask.bool()[self.group][:, None, :].expand(
            -1, self.width, -1), causal.expand(self.rows, -1, -1)], -1)[:, None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, tokens, dim] -> [rows, heads, width, dim], zeros where no token is."""
        x = x[0].transpose(0, 1)
        out = x.new_zeros(self.rows * self.width, *x.shape[1:]).index_copy(0, self.slots, x)
        return out.view(self.rows, self.width, *x.shape[1:]).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, heads, width, dim] -> [tokens, heads, dim]: the real tokens, row by row."""
        return x.transpose(1, 2).reshape(self.rows * self.width, *x.shape[1:2], -1).index_select(
            0, self.slots)


# The packed pass's attention runs in up to LENGTH_BLOCKS blocks of rows of similar lengths,
# each of at least BLOCK_ROWS rows: fewer FLOPs on padding, more attention calls (the balance
# measured in bench/README.md, each speed lever).
LENGTH_BLOCKS, BLOCK_ROWS = 4, 16


class _Packed:
    """The packed completion pass's view of its batch: the prompts' keys and values (one entry a
    layer, from the prompt pass, once per question) and where each packed token sits in the
    padded layouts its attention runs in. Rows are sorted by completion length into blocks
    (`_Block`), each padded only to its own longest row, so the attention's FLOPs on padding
    shrink with the spread of lengths; the packed sequence runs block by block."""

    def __init__(self, cache, group: torch.Tensor, prompt_mask: torch.Tensor,
                 lengths: torch.Tensor, blocks: int | None = None):
        """`blocks`: how many length blocks (default: up to LENGTH_BLOCKS of BLOCK_ROWS rows)."""
        self.keys = [layer.keys for layer in cache.layers]
        self.values = [layer.values for layer in cache.layers]
        if blocks is None:
            blocks = max(1, min(LENGTH_BLOCKS, len(lengths) // BLOCK_ROWS))
        order = torch.argsort(lengths, stable=True)
        self.blocks = [block for block in (_Block(rows, lengths[rows], group, prompt_mask)
                                           for rows in order.tensor_split(blocks))
                       if block.tokens]
        self.row = torch.cat([b.row for b in self.blocks])
        self.column = torch.cat([b.column for b in self.blocks])


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      packed: _Packed | None = None, **kwargs):
    """Attention of the packed completion tokens (`[1, packed]`, no padding) over [their prompt |
    their own row's earlier tokens]: padded to `[rows, width]` a block at a time for SDPA here
    only, so the projections and MLPs around it run on real tokens alone."""
    layer, dtype = module.layer_idx, query.dtype
    outs, start = [], 0
    for block in packed.blocks:
        part = slice(start, start + block.tokens)
        start += block.tokens
        keys = torch.cat([packed.keys[layer].index_select(0, block.group),
                          block.pad(key[:, :, part])], 2)
        values = torch.cat([packed.values[layer].index_select(0, block.group),
                            block.pad(value[:, :, part])], 2)
        queries = block.pad(query[:, :, part])
        if query.device.type == "cpu" and dtype != torch.float32 and torch.is_grad_enabled():
            # The CPU's flash attention runs its backward in bf16 slower than in fp32 (its
            # forward is fast in bf16: a no-gradient pass stays in bf16).
            queries, keys, values = queries.float(), keys.float(), values.float()
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=block.mask, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1]).to(dtype)
        outs.append(block.unpad(out))
    return torch.cat(outs)[None], None


PACKED = "igrpo_packed"


def _packable(hf_config: PretrainedConfig, completion_mask: torch.Tensor) -> bool:
    """The packed pass serves models whose attention runs through a function of ours
    (`policy.generation.rollout.serves_custom_attention`), and completions whose real tokens
    come first in their row (right padding only), at least one of them."""
    from policy.generation.rollout import serves_custom_attention

    return (serves_custom_attention(hf_config) and bool(completion_mask.any())
            and bool((completion_mask.cummin(-1).values == completion_mask).all()))


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_start: int, chunk_tokens: int = 4096,
                        entropy_out: torch.Tensor | None = None,
                        share_prompts: bool = True, pack: bool = True,
                        blocks: int | None = None) -> torch.Tensor:
    """Log-probs of the completion tokens of left-padded `[prompt | completion]` rows.

    input_ids, attention_mask: [N, P + T], the completion starting at column `completion_start`
    (= P). Returns [N, T]: the log-prob of token `P + t` given everything before it (0 where
    the completion is padding, on the packed path).

    With `share_prompts`, rows that repeat the row above's prompt (a question's G samples) share
    one forward of it: the prompt runs once per question into a KV cache, and only `[last prompt
    token | completion]` runs per row, its attention reading its question's prompt keys (the
    gradient of every row flows back into the one prompt pass). With `pack` as well (on the
    architectures `_packable` names), that per-row pass carries no padding: the rows' real
    tokens run as one sequence, and only attention lays them out in rows. Same values and
    gradients as the plain forward (to float rounding), with the prompt's FLOPs paid once per
    group instead of G times and none paid on padding. Under gradient checkpointing the packed
    path keeps the prompt pass's activations (`_kept_activations`) and checkpoints the per-row
    pass's layers (`_replayed_in_packed_attention`); where it cannot pack there, and when no row
    repeats, the plain forward runs. `blocks`: the packed pass's attention
    in that many blocks of rows of similar lengths (default: `_Packed`'s rule).
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    start = completion_start
    first, run = prompt_runs(input_ids[:, :start])
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    layers = _checkpointed_layers(module) if _checkpointing(model) and torch.is_grad_enabled() \
        else []
    packable = pack and layers is not None and _packable(module.config, attention_mask[:, start:])
    if not share_prompts or start < 2 or len(first) == len(run) or (layers != []
                                                                   and not packable):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids,
                       logits_to_keep=input_ids.shape[1] - start + 1).logits
        return selective_log_softmax(logits[:, :-1], input_ids[:, start:], chunk_tokens,
                                     entropy_out)
    from transformers import DynamicCache

    cache = DynamicCache(config=module.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `past_key_values` renamed `cache` in transformers 5
        with _kept_activations(layers):
            model(input_ids=input_ids[first, :start - 1],
                  attention_mask=attention_mask[first, :start - 1],
                  position_ids=position_ids[first, :start - 1], past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
        if packable:
            return _packed_logprobs(model, module, cache, input_ids, attention_mask,
                                    position_ids, start, first, run, chunk_tokens,
                                    entropy_out, blocks, layers)
        cache.batch_select_indices(run)
        logits = model(input_ids=input_ids[:, start - 1:], attention_mask=attention_mask,
                       position_ids=position_ids[:, start - 1:], past_key_values=cache,
                       use_cache=True).logits
    # logits[:, j] predicts token j + 1; keep the positions that predict completion tokens.
    return selective_log_softmax(logits[:, :-1], input_ids[:, start:], chunk_tokens, entropy_out)


def _packed_logprobs(model, module, cache, input_ids, attention_mask, position_ids, start: int,
                     first: torch.Tensor, run: torch.Tensor, chunk_tokens: int, entropy_out,
                     blocks: int | None = None, checkpointed: list | None = None):
    """The per-row pass of `completion_logprobs` on real tokens only: row i's inputs are its last
    prompt token and its completion but the last token, one packed sequence for all rows."""
    lengths = attention_mask[:, start:].sum(-1)
    packed = _Packed(cache, run, attention_mask[first, :start - 1], lengths, blocks)
    column = start - 1 + packed.column
    logits = _packed_pass(model, module, packed, input_ids[packed.row, column],
                          position_ids[packed.row, column], checkpointed)
    entropy = None if entropy_out is None else logits.new_zeros(len(column), dtype=torch.float32)
    picked = selective_log_softmax(logits, input_ids[packed.row, column + 1], chunk_tokens, entropy)
    if entropy_out is not None:
        entropy_out.zero_()
        entropy_out[packed.row, packed.column] = entropy
    out = picked.new_zeros(input_ids.shape[0], input_ids.shape[1] - start)
    return out.index_put((packed.row, packed.column), picked)


def _packed_pass(model, module, packed: _Packed, ids: torch.Tensor, positions: torch.Tensor,
                 checkpointed: list | None, embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The model's output ([tokens, C]) over the packed tokens `ids` (or their `embeds`) at
    `positions`, attention laid out by `packed`; each layer checkpointed by us where
    `checkpointed` names layers."""
    from policy.generation.rollout import custom_attention

    replayed = _replayed_in_packed_attention(checkpointed, module.config) if checkpointed \
        else nullcontext()
    inputs = {"input_ids": ids[None]} if embeds is None else {"inputs_embeds": embeds[None]}
    with custom_attention(module.config, PACKED, _packed_attention), replayed:
        return model(**inputs, position_ids=positions[None], use_cache=False,
                     packed=packed).logits[0]


def packs(model) -> bool:
    """Whether `packed_row_logits` serves this model (a DeepSpeed engine or the model): its
    attention runs through a function of ours, and under gradient checkpointing transformers
    checkpoints its layers one by one (`GradientCheckpointingLayer`)."""
    from policy.generation.rollout import serves_custom_attention

    module = getattr(model, "module", model)
    return serves_custom_attention(module.config) and not (
        _checkpointing(model) and _checkpointed_layers(module) is None)


def packed_row_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      group: torch.Tensor, shared: torch.Tensor,
                      blocks: int | None = None) -> torch.Tensor:
    """The model's output ([B, L, C]) over right-padded rows, with no FLOP on padding and each
    group's common prefix run once: rows of group g (`group`: [B], groups numbered from 0) all
    begin with the same `shared[g]` tokens (at least 1, each row keeping at least one token
    past them). The prefixes run once a group into a KV cache (left-padded, as
    `completion_logprobs`'s prompts); the rows' remaining real tokens run as one packed
    sequence whose attention reads their group's prefix and their own row's earlier tokens.
    Output past each row's prefix equals the plain forward's (values and gradients, to float
    rounding); zeros on the prefixes and on padding, which the caller does not read. For
    models `packs` serves."""
    from transformers import DynamicCache

    module = getattr(model, "module", model)
    layers = _checkpointed_layers(module) if _checkpointing(model) and torch.is_grad_enabled() \
        else []
    rows, width = input_ids.shape
    first = torch.full((len(shared),), rows, device=group.device).scatter_reduce(
        0, group, torch.arange(rows, device=group.device), "amin")
    source = torch.arange(int(shared.max()), device=shared.device)[None] \
        - (int(shared.max()) - shared[:, None])  # the prefix column each left-padded slot holds
    prompt_mask = (source >= 0).long()
    # Every token embedded in one lookup, whose backward then builds the embedding's (dense,
    # vocabulary-sized) gradient once, not once a pass.
    embeds = module.get_input_embeddings()(input_ids)
    cache = DynamicCache(config=module.config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `past_key_values` renamed `cache` in transformers 5
        with _kept_activations(layers):
            model(inputs_embeds=embeds[first[:, None], source.clamp(min=0)],
                  attention_mask=prompt_mask,
                  position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
                  past_key_values=cache, use_cache=True)
    offset = shared[group]
    packed = _Packed(cache, group, prompt_mask, attention_mask.sum(-1) - offset, blocks)
    column = offset[packed.row] + packed.column
    logits = _packed_pass(model, module, packed, input_ids[packed.row, column], column, layers,
                          embeds[packed.row, column])
    return logits.new_zeros(rows, width, logits.shape[-1]).index_put((packed.row, column), logits)
