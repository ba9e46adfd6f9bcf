"""Rollout: shared-prefill sampling equals plain generate; masks and truncation are right."""

import torch

from configs.schema import TinyModelConfig
from policy.logprobs import completion_logprobs, selective_log_softmax
from policy.rollout import concat_rollouts, generate_groups
from runtime.tiny_model import build_tiny
from runtime.models import load_causal_lm, load_tokenizer

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
    """`grpo.rollout_questions`: generating question by question and re-padding gives the same
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
