"""Rollout: shared-prefill sampling equals plain generate; masks and truncation are right."""

import pytest
import torch

from configs import load_config
from configs.schema import TinyModelConfig
from policy.generation.logprobs import completion_logprobs, selective_log_softmax
from policy.generation.rollout import concat_rollouts, generate_groups
from runtime.tiny_model import build_tiny
from runtime.data import load_splits
from runtime.models import load_causal_lm, load_tokenizer
from tasks.prompts import prompt_format

from end_tokens import expected_stops, two_end_tokens

PROMPTS = ["Start with 7. Add 3.\n", "Start with 12. Multiply by 2. Subtract 4.\n"]


def _tiny(tmp_path):
    path = build_tiny(tmp_path / "m", TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2,
                                                       intermediate_size=128), seed=1)
    return load_causal_lm(path).eval(), load_tokenizer(path)


def test_shared_prefill_equals_plain_generate(tmp_path):
    model, tok = _tiny(tmp_path)
    shared = generate_groups(model, tok, PROMPTS, 3, max_new_tokens=12, greedy=True)
    plain = generate_groups(model, tok, PROMPTS, 3, max_new_tokens=12, greedy=True,
                            share_prefill=False)
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert shared.texts == plain.texts
    torch.manual_seed(0)
    a = generate_groups(model, tok, PROMPTS, 4, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(0)
    b = generate_groups(model, tok, PROMPTS, 4, max_new_tokens=12, temperature=1.0,
                        share_prefill=False)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_rollout_in_chunks_equals_one_call(tmp_path):
    """`policy.rollout_questions`: generating question by question and re-padding gives the same
    samples, masks and log-probs as one call (greedy)."""
    model, tok = _tiny(tmp_path)
    whole = generate_groups(model, tok, PROMPTS, 2, max_new_tokens=12, greedy=True)
    parts = concat_rollouts([generate_groups(model, tok, [p], 2, max_new_tokens=12, greedy=True)
                             for p in PROMPTS], tok.pad_token_id)
    assert parts.texts == whole.texts
    assert torch.equal(parts.completion_mask, whole.completion_mask)
    assert torch.equal(parts.completion_ids, whole.completion_ids)
    assert torch.equal(parts.prompt_mask, whole.prompt_mask)
    a = completion_logprobs(model, whole.input_ids, whole.attention_mask, whole.prompt_ids.shape[1])
    b = completion_logprobs(model, parts.input_ids, parts.attention_mask, parts.prompt_ids.shape[1])
    mask = whole.completion_mask.bool()
    assert torch.allclose(a[mask], b[mask], atol=1e-5)


def test_rollout_layout_and_masks(tmp_path):
    model, tok = _tiny(tmp_path)
    r = generate_groups(model, tok, PROMPTS, 4, max_new_tokens=10, temperature=1.0)
    assert r.prompt_ids.shape[0] == 8 and r.completion_ids.shape[0] == 8
    # Rows are grouped: the G samples of prompt 0 first.
    assert torch.equal(r.prompt_ids[0], r.prompt_ids[3])
    assert not torch.equal(r.prompt_ids[3], r.prompt_ids[4])
    for i in range(8):
        real = r.completion_ids[i][r.completion_mask[i].bool()].tolist()
        if r.truncated[i]:
            assert len(real) == 10 and tok.eos_token_id not in real
        else:
            assert real[-1] == tok.eos_token_id and real.count(tok.eos_token_id) == 1
        pad = r.completion_ids[i][~r.completion_mask[i].bool()]
        assert (pad == tok.pad_token_id).all()


def test_completion_logprobs_match_full_forward(tmp_path):
    model, tok = _tiny(tmp_path)
    r = generate_groups(model, tok, PROMPTS, 2, max_new_tokens=8, temperature=1.0)
    with torch.no_grad():
        got = completion_logprobs(model, r.input_ids, r.attention_mask, r.prompt_ids.shape[1])
        pos = (r.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask,
                       position_ids=pos).logits
        p = r.prompt_ids.shape[1]
        want = torch.log_softmax(logits[:, p - 1:-1].float(), -1).gather(
            -1, r.completion_ids[..., None]).squeeze(-1)
    mask = r.completion_mask.bool()
    assert torch.allclose(got[mask], want[mask], atol=1e-5)
    assert selective_log_softmax(logits[:, p - 1:-1], r.completion_ids).shape == got.shape


def _warm_start_prompts(warm_start, n):
    from configs import load_config
    from runtime.data import load_splits
    from tasks.prompts import prompt_format

    cfg = load_config("configs/tiny.yaml", [f"data.eval_questions={n}"])
    tok = load_tokenizer(warm_start)
    return load_causal_lm(warm_start).eval(), tok, prompt_format(cfg.data).prompts(
        tok, load_splits(cfg.data, cfg.run.seed).eval[:n])


def test_decoding_loop_equals_transformers_generate(warm_start):
    """The lean loop (preallocated cache, shared prefill, ended rows leaving the batch) writes
    the tokens `model.generate` writes: greedy, on questions whose answers end at different
    lengths, so rows leave the batch along the way."""
    model, tok, prompts = _warm_start_prompts(warm_start, 24)
    ours = generate_groups(model, tok, prompts, 2, max_new_tokens=112, greedy=True)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=112, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    theirs = out[:, enc["input_ids"].shape[1]:].repeat_interleave(2, 0)
    lengths = ours.lengths
    assert lengths.min() < lengths.max() - 10  # rows did end at different steps
    for row, n in enumerate(lengths.tolist()):
        assert ours.completion_ids[row, :n].tolist() == theirs[row, :n].tolist()


def test_sampled_tokens_have_the_models_log_probs_after_rows_leave(warm_start):
    """Sampling at temperature 1: each sampled token's log-prob in the loop equals the
    teacher-forced log-prob of the full forward, row by row, so dropping ended rows from the
    cache kept every row with its own keys and values. T-PPO's per-row limits stop rows early."""
    from policy.generation.rollout import continue_rows, decode, mask_after_eos
    from tasks.prompts import encode_prompts

    model, tok, prompts = _warm_start_prompts(warm_start, 16)
    enc = tok.pad({"input_ids": encode_prompts(tok, prompts)}, padding=True, return_tensors="pt")
    torch.manual_seed(3)
    tokens, logprobs = decode(model, enc["input_ids"], enc["attention_mask"], 4, 112,
                              tok.eos_token_id, tok.pad_token_id)
    real, _ = mask_after_eos(tokens, tok.eos_token_id)
    ids = torch.cat([enc["input_ids"].repeat_interleave(4, 0), tokens], 1)
    mask = torch.cat([enc["attention_mask"].repeat_interleave(4, 0), real], 1)
    with torch.no_grad():
        want = completion_logprobs(model, ids, mask, enc["input_ids"].shape[1])
    real = real.bool()
    assert real.sum(-1).min() < real.sum(-1).max() - 10
    assert torch.allclose(logprobs[real], want[real], atol=1e-4)
    limits = [3, 50, 1, 112] * 4
    new = continue_rows(model, tok, encode_prompts(tok, prompts), limits)
    assert all(len(row) <= n for row, n in zip(new, limits)) and len(new[0]) >= 1


def test_decoding_runs_in_inference_mode_and_returns_ordinary_tensors(warm_start):
    """The decoding loop runs the model under inference mode (no autograd bookkeeping), and its
    tokens and log-probs then feed a training forward and backward like any tensor: autograd
    saves them (it refuses to save inference tensors)."""
    from policy.generation.rollout import decode
    from tasks.prompts import encode_prompts

    model, tok, prompts = _warm_start_prompts(warm_start, 2)
    enc = tok.pad({"input_ids": encode_prompts(tok, prompts)}, padding=True, return_tensors="pt")
    modes = []
    hook = model.register_forward_pre_hook(
        lambda module, args: modes.append(torch.is_inference_mode_enabled()))
    try:
        tokens, logprobs = decode(model, enc["input_ids"], enc["attention_mask"], 2, 8,
                                  tok.eos_token_id, tok.pad_token_id)
    finally:
        hook.remove()
    assert len(modes) > 1 and all(modes)
    assert not torch.is_inference(tokens) and not torch.is_inference(logprobs)
    model.zero_grad()
    logits = model(input_ids=tokens).logits
    picked = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)  # saves tokens
    (picked * logprobs).sum().backward()  # saves logprobs
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_filled_cache_layer_keeps_one_count_of_written_positions():
    """The decoding cache's layer counts what is written once: transformers' `cumulative_length`
    reads the same count as attention's `filled`, and crop and reset move both."""
    from policy.generation.rollout import FilledLayer

    layer = FilledLayer(8)
    step = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 1, 3, 4)
    keys, _ = layer.update(step, -step)
    assert keys.shape[2] == 3 and torch.equal(keys, step)
    layer.update(step[:, :, :2], step[:, :, :2])
    assert layer.filled == layer.get_seq_length() == int(layer.cumulative_length) == 5
    layer.crop(-2)
    assert layer.filled == int(layer.cumulative_length) == 3
    keys, values = layer.update(step[:, :, :1] + 100, step[:, :, :1])
    assert keys.shape[2] == 4 and torch.equal(keys[:, :, 3], step[:, :, 0] + 100)
    layer.reset()
    assert layer.filled == int(layer.cumulative_length) == 0 and layer.keys.abs().sum() == 0
    with pytest.raises(RuntimeError):
        layer.crop(1)  # StaticLayer's rule: a static layer crops by a negative count only


def test_prompt_shared_update_equals_the_plain_one(warm_start):
    """The update's forward with each question's prompt run once for its G samples gives the
    plain forward's log-probs, GRPO loss and gradients (1e-5), with and without gradient."""
    from policy.math.losses import grpo_loss

    model, tok, prompts = _warm_start_prompts(warm_start, 4)
    torch.manual_seed(0)
    r = generate_groups(model, tok, prompts, 8, max_new_tokens=112)
    advantages = torch.randn(r.completion_ids.shape[0], 1).expand_as(r.completion_mask)
    results = []
    for share in (True, False):
        model.zero_grad()
        logprobs = completion_logprobs(model, r.input_ids, r.attention_mask,
                                       r.prompt_ids.shape[1], share_prompts=share)
        with torch.no_grad():
            ref = completion_logprobs(model, r.input_ids, r.attention_mask,
                                      r.prompt_ids.shape[1], share_prompts=share) - 0.1
        loss = grpo_loss(logprobs, logprobs.detach(), ref, advantages, r.completion_mask,
                         clip_eps_low=0.2, clip_eps_high=0.2, beta=0.04, num_sequences=32.0,
                         num_tokens=1.0, max_tokens=112).loss
        loss.backward()
        results.append((logprobs.detach(), ref, loss.detach(),
                        [p.grad.clone() for p in model.parameters()]))
    (lp_a, ref_a, loss_a, grads_a), (lp_b, ref_b, loss_b, grads_b) = results
    mask = r.completion_mask.bool()
    assert torch.allclose(lp_a[mask], lp_b[mask], atol=1e-5)
    assert torch.allclose(ref_a[mask], ref_b[mask], atol=1e-5)
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    for a, b in zip(grads_a, grads_b):
        assert (a - b).abs().max() <= 1e-5 * max(b.abs().max(), 1.0)
    assert any(g.abs().sum() > 0 for g in grads_a)


def _count_calls(monkeypatch, module, name: str) -> list:
    """Wrap `module.name` so that each call appends to the returned list."""
    calls, function = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(1), function(*a, **k))[1])
    return calls


ARCHITECTURES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 4, "sliding_window": None}),
    "gpt_neox": ("GPTNeoXConfig", {}),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_prompt_shared_decoding_equals_every_row_reading_its_own_prompt(architecture, dtype,
                                                                        monkeypatch):
    """Decoding with each prompt's keys and values kept once per group (`_PromptKV`, read by
    `_prompt_shared_attention`) samples the tokens, with the log-probs, that decoding with the
    prompt's cache copied to every row samples: random 2-layer models of each architecture the
    shared path serves (grouped-query attention included), left-padded prompts of different
    lengths, groups of 6 that shrink unevenly as rows end, and prompts whose rows all stopped
    (their own limits of 1 and 8 new tokens: the first leave before any row's token is cached)
    leaving the batch. In bf16 on CPU the prompt's and the row's own parts run as two flash
    attentions merged by their log-sum-exps (same tokens; log-probs to bf16's rounding)."""
    import transformers

    from policy.generation import rollout

    name, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, name)(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    lengths = [9, 3, 14, 6, 11]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(2, 64, (n,))
        mask[row, -n:] = 1
    calls = _count_calls(monkeypatch, rollout, "_prompt_shared_attention")
    out = {}
    for share in (True, False):
        torch.manual_seed(1)
        out[share] = rollout.decode(model, ids, mask, 6, 60, 1, 0, limits=[1, 60, 8, 60, 60],
                                    share_prompts=share)
    assert calls  # the shared path ran
    tokens, logprobs = out[True]
    same = (tokens == out[False][0]).all(-1)  # in bf16 a near-tie may sample another token
    assert same.all() if dtype == "float32" else same.float().mean() >= 0.9, same
    torch.testing.assert_close(logprobs[same], out[False][1][same], rtol=0,
                               atol=1e-5 if dtype == "float32" else 0.05)
    ended = (tokens == 1).any(-1).view(len(lengths), 6)[[1, 3, 4]]
    assert ended.any() and not ended.all()  # rows left the batch at different steps
    assert (tokens[:6, 1:] == 0).all() and (tokens[12:18, 8:] == 0).all()  # the limits held
    assert model.config._attn_implementation != rollout.PROMPT_SHARED  # restored


def _update_rows() -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, mask, prompt width) of 3 questions x 4 samples: left-padded prompts of different
    lengths, completions of different lengths (one of a single token), 20 columns wide."""
    prompt_lengths, group, width = [9, 3, 14], 4, 20
    completion_lengths = torch.tensor([20, 7, 1, 13, 5, 20, 9, 2, 16, 3, 11, 20])
    rows, start = len(completion_lengths), max(prompt_lengths)
    ids = torch.zeros(rows, start + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for q, n in enumerate(prompt_lengths):
        prompt = torch.randint(2, 64, (n,))
        for row in range(q * group, (q + 1) * group):
            ids[row, start - n:start], mask[row, start - n:start] = prompt, 1
    for row, n in enumerate(completion_lengths.tolist()):
        ids[row, start:start + n], mask[row, start:start + n] = torch.randint(2, 64, (n,)), 1
    return ids, mask, start


@pytest.mark.parametrize("blocks", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_packed_update_equals_the_padded_one(architecture, dtype, blocks, monkeypatch):
    """The update's forward on real tokens only (`pack`: the rows' completions run as one
    sequence, each question's prompt once, attention alone laid out in rows) gives the padded
    plain forward's log-probs, entropy, GRPO loss and gradients (1e-5): random 2-layer models of
    each architecture it serves (grouped-query attention included), left-padded prompts of
    different lengths, completions of different lengths (one of a single token), the attention
    in one block of rows or in 4 blocks of rows sorted by length. In bf16 (whose CPU attention
    backward runs in fp32 on the packed path) to bf16's rounding."""
    import transformers

    from policy.generation import logprobs as lp_module
    from policy.math.losses import grpo_loss

    name, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, name)(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    ids, mask, start = _update_rows()
    rows, width = ids.shape[0], ids.shape[1] - start
    completion_mask = mask[:, start:].float()
    advantages = torch.randn(rows, 1).expand(rows, width)
    calls = _count_calls(monkeypatch, lp_module, "_packed_attention")
    attention = _count_calls(monkeypatch, torch.nn.functional, "scaled_dot_product_attention")
    out = {}
    for pack in (True, False):
        model.zero_grad()
        attention.clear()
        entropy = torch.zeros(rows, width)
        logprobs = completion_logprobs(model, ids, mask, start, entropy_out=entropy, pack=pack,
                                       share_prompts=pack, blocks=blocks)
        loss = grpo_loss(logprobs, logprobs.detach(), logprobs.detach() - 0.1, advantages,
                         completion_mask, clip_eps_low=0.2, clip_eps_high=0.2, beta=0.04,
                         num_sequences=float(rows), num_tokens=1.0, max_tokens=width).loss
        loss.backward()
        out[pack] = (logprobs.detach() * completion_mask, entropy * completion_mask,
                     loss.detach(), [p.grad.float() for p in model.parameters()])
        if pack:  # a layer's attention ran on the prompts, then on each block on its own
            assert len(attention) == config.num_hidden_layers * (1 + blocks)
    assert len(calls) == config.num_hidden_layers  # the packed path ran, once a layer
    tolerance = 1e-5 if dtype == "float32" else 0.05
    for a, b in zip(out[True][:3], out[False][:3]):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0)
    for a, b in zip(out[True][3], out[False][3]):
        assert (a - b).abs().max() <= tolerance * max(b.abs().max(), 1.0)
    assert sum(float(g.abs().sum()) for g in out[True][3]) > 0
    assert model.config._attn_implementation != lp_module.PACKED  # restored


def test_every_end_token_of_the_generation_config_stops_and_masks(tmp_path):
    """A tokenizer whose model's generation config lists two end tokens: the decoding loop
    stops each row at the first of either (or EOS), masks everything after it, marks the row
    not truncated, and appends nothing it did not sample. Without them, rows run on."""
    from configs.loader import BUNDLED
    from runtime.models import end_token_ids

    folder, ends = two_end_tokens(tmp_path)
    tokenizer = load_tokenizer(folder)
    assert end_token_ids(tokenizer) == ends
    assert end_token_ids(load_tokenizer(BUNDLED / "tiny_warm_start")) == ends[:1]
    cfg = load_config("configs/tiny.yaml", [])
    prompts = prompt_format(cfg.data).prompts(tokenizer, load_splits(cfg.data, 0).eval[:6])
    model = load_causal_lm(folder).eval()
    free = generate_groups(model, load_tokenizer(BUNDLED / "tiny_warm_start"), prompts, 1,
                           max_new_tokens=40, greedy=True)
    stopped = generate_groups(model, tokenizer, prompts, 1, max_new_tokens=40, greedy=True)
    reference = [row[m.bool()].tolist() for row, m in zip(free.completion_ids,
                                                           free.completion_mask)]
    wanted = expected_stops(reference, ends)
    got = [row[m.bool()].tolist() for row, m in zip(stopped.completion_ids,
                                                    stopped.completion_mask)]
    assert got == wanted
    assert sum(len(w) < len(r) for w, r in zip(wanted, reference)) >= 4  # rows really cut
    # a row ends at an end token, or runs out of tokens (truncated)
    assert [row[-1] not in ends for row in got] == stopped.truncated.tolist()
    assert all(len(row) == 40 for row, cut in zip(got, stopped.truncated) if cut)
    assert (stopped.completion_ids[~stopped.completion_mask.bool()]
            == tokenizer.pad_token_id).all()


def test_chunked_logprobs_equal_full_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50)
    labels = torch.randint(0, 50, (3, 7))
    full = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    chunked = selective_log_softmax(logits, labels, chunk_tokens=4)
    assert torch.allclose(chunked, full, atol=1e-5)
    bf16 = selective_log_softmax(logits.bfloat16(), labels, chunk_tokens=5)
    assert bf16.dtype == torch.float32


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_packed_update_under_gradient_checkpointing_equals_the_padded_one(architecture,
                                                                         monkeypatch):
    """With gradient checkpointing on (both GPU configs), the update still runs packed: the
    shared prompt pass keeps its activations (its cache is what the rows read), the per-row pass
    on real tokens is checkpointed and replayed in backward. Its log-probs, GRPO loss and
    gradients equal the padded plain forward's without checkpointing (1e-5, float32), and the
    checkpointed layers really replayed (the packed attention ran twice a layer)."""
    import transformers

    from policy.generation import logprobs as lp_module
    from policy.math.losses import grpo_loss

    name, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, name)(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids, mask, start = _update_rows()
    rows, width = ids.shape[0], ids.shape[1] - start
    completion_mask = mask[:, start:].float()
    advantages = torch.randn(rows, 1).expand(rows, width)
    calls = _count_calls(monkeypatch, lp_module, "_packed_attention")
    out = {}
    for checkpointed in (True, False):
        if checkpointed:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad()
        logprobs = completion_logprobs(model, ids, mask, start, pack=checkpointed,
                                       share_prompts=checkpointed)
        loss = grpo_loss(logprobs, logprobs.detach(), logprobs.detach() - 0.1, advantages,
                         completion_mask, clip_eps_low=0.2, clip_eps_high=0.2, beta=0.04,
                         num_sequences=float(rows), num_tokens=1.0, max_tokens=width).loss
        loss.backward()
        out[checkpointed] = (logprobs.detach() * completion_mask, loss.detach(),
                             [p.grad.clone() for p in model.parameters()])
    # forward, then the replay in backward: twice a layer, on the checkpointed run only
    assert len(calls) == 2 * config.num_hidden_layers
    for a, b in zip(out[True][:2], out[False][:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in zip(out[True][2], out[False][2]):
        assert (a - b).abs().max() <= 1e-5 * max(b.abs().max(), 1.0)
    assert sum(float(g.abs().sum()) for g in out[True][2]) > 0
    assert all(not getattr(m, "gradient_checkpointing", False) for m in model.modules())
