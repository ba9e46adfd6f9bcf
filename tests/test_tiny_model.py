"""The tiny offline model and tokenizer round-trip through save/from_pretrained and generate."""

import torch

from configs.schema import TinyModelConfig
from runtime.steps import step_end_token_indices
from runtime.tiny_model import STEP_TAG, build_tiny
from runtime.models import load_causal_lm, load_tokenizer


def test_roundtrip_and_generate(tmp_path):
    path = build_tiny(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                          intermediate_size=64), seed=0)
    tok = load_tokenizer(path)
    model = load_causal_lm(path).eval()
    assert tok.padding_side == "left" and tok.pad_token_id != tok.eos_token_id
    text = "Start with 7. Add 3.\n7+3=10\nThe answer is 10"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert len(tok(f"a {STEP_TAG}\n", add_special_tokens=False)["input_ids"]) == 4  # tag: 1 token
    enc = tok(["7+3=", "Start with 12. Add 3.\n"], return_tensors="pt", padding=True)
    assert enc["attention_mask"][0, 0] == 0  # left padding survived save/load
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (2, enc["input_ids"].shape[1] + 5)
    again = load_causal_lm(path).eval()
    with torch.no_grad():
        a = model(**enc).logits
        b = again(**enc).logits
    assert torch.equal(a, b)


def test_step_end_indices_char_tokenizer(tmp_path):
    tok = load_tokenizer(build_tiny(tmp_path / "b", TinyModelConfig(hidden_size=32, num_layers=1,
                                                                     num_heads=2), seed=0))
    text = "7+3=10\n10*2=20\nThe answer is 20"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # Step 1 ends at its newline (char 6), step 2 at char 14; the last step takes the EOS too.
    assert step_end_token_indices(tok, ids, text) == [6, 14, len(ids) - 1]
