"""The built-in offline model: a small randomly initialised decoder, saved with `save_pretrained`.

By default a Llama over a character tokenizer; `model.tiny.architecture` picks another
transformers family (qwen2, mistral, gpt_neox) and `model.tiny.tokenizer` a real tokenizer (gpt2:
the shipped GPT-2 byte-level BPE). Every stage then loads it through `from_pretrained`, exactly as
it would load a hub model, so the tiny setup exercises the real loading code with nothing
downloaded.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
STEP_TAG = "ки"
"""Math-Shepherd's step tag; kept one token in the tiny vocabulary."""
CHARSET = string.ascii_letters + string.digits + string.punctuation + " \n"


def build_tokenizer(extra_tokens: tuple[str, ...] = ()):
    """Character-level fast tokenizer over printable ASCII, with pad/eos/unk, the step tag and
    `extra_tokens` (e.g. a configured step tag), each kept one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARSET])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS,
                                        unk_token=UNK, padding_side="left")
    tokenizer.add_tokens(list(dict.fromkeys([STEP_TAG, *extra_tokens])))
    return tokenizer


def build_model(tokenizer, hidden_size: int, num_layers: int, num_heads: int,
                intermediate_size: int, max_positions: int, seed: int,
                architecture: str = "llama"):
    """A small decoder of the transformers family `architecture` with tied embeddings,
    initialised from `seed`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    config = AutoConfig.for_model(
        architecture, vocab_size=len(tokenizer), hidden_size=hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=bos)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


GPT2_TOKENIZER = Path(__file__).resolve().parent / "bundled" / "gpt2_tokenizer"
"""GPT-2's byte-level BPE (50,257 tokens), converted from its published ranks
(scripts/build_gpt2_tokenizer.py; MIT, LICENSE beside it)."""


def tiny_tokenizer(name: str, extra_tokens: tuple[str, ...] = ()):
    """`model.tiny.tokenizer`: empty = the character tokenizer (with `extra_tokens` one token
    each), gpt2 = the shipped GPT-2 BPE, else a local tokenizer folder (both as they are: a step
    tag that is not one token is `rm.add_tag_token`'s business)."""
    if not name:
        return build_tokenizer(extra_tokens)
    from runtime.models import load_tokenizer

    return load_tokenizer(GPT2_TOKENIZER if name == "gpt2" else name)


def build_tiny(out_dir: str | Path, tiny, seed: int, extra_tokens: tuple[str, ...] = ()) -> Path:
    """Build and save the tokenizer and model (from a `TinyModelConfig`) into `out_dir`."""
    out = Path(out_dir)
    tokenizer = tiny_tokenizer(tiny.tokenizer, extra_tokens)
    model = build_model(tokenizer, tiny.hidden_size, tiny.num_layers, tiny.num_heads,
                        tiny.intermediate_size, tiny.max_positions, seed,
                        tiny.architecture)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


STAND_IN_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}User: "
                 "{{ m['content'] }}\n\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}Assistant:{% endif %}")
"""A DeepSeek-style chat template (BOS, "User: ...", "Assistant:") for the GPT-2 tokenizer."""

STAND_INS = {"deepseekmath_7b.yaml": "llama", "qwen25_math_1p5b.yaml": "qwen2"}
"""Each shipped GPU config, and the transformers family of its model."""


def build_stand_in(out: str | Path, architecture: str, chat: bool = False, hidden: int = 32,
                   heads: int = 2, layers: int = 2, intermediate: int | None = None) -> Path:
    """A random model of `architecture` (2 layers, an MLP twice the width unless told) over the
    shipped GPT-2 tokenizer (with a chat template when `chat`), saved in `out`: what a GPU
    config's model looks like to the code, in seconds (the tests, scripts/gpu_check.py). vLLM's
    attention kernels need a head size of 32 or more (64: `hidden=128`)."""
    tokenizer = tiny_tokenizer("gpt2")
    if chat:
        tokenizer.chat_template = STAND_IN_CHAT
    model = build_model(tokenizer, hidden, layers, heads, intermediate or 2 * hidden, 2048, seed=0,
                        architecture=architecture)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
