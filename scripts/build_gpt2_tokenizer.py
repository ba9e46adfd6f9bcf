"""Rebuild the shipped GPT-2 byte-level BPE tokenizer (runtime/bundled/gpt2_tokenizer/).

GPT-2's BPE ranks ship in the openai-whisper source distribution on the package index
(`whisper/assets/gpt2.tiktoken`, MIT); transformers' `TikTokenConverter` turns them into a
`tokenizer.json` with GPT-2's split pattern and `<|endoftext|>` = 50256. Nothing here is downloaded
at run or test time: the converted folder is in the repository.

    pip download --no-deps --no-binary :all: openai-whisper -d /tmp/wh && tar xzf /tmp/wh/*.tar.gz -C /tmp/wh
    pip install tiktoken
    python scripts/build_gpt2_tokenizer.py /tmp/wh/openai_whisper-*/whisper/assets/gpt2.tiktoken
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# GPT-2's pre-tokenizer pattern (tiktoken's "gpt2" encoding).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
OUT = Path(__file__).resolve().parent.parent / "runtime" / "bundled" / "gpt2_tokenizer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ranks", help="path to whisper/assets/gpt2.tiktoken")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    eot = "<|endoftext|>"
    core = TikTokenConverter(vocab_file=args.ranks, pattern=GPT2_PATTERN,
                             extra_special_tokens={eot: 50256}).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=eot, eos_token=eot,
                                        unk_token=eot, model_max_length=1024)
    assert len(tokenizer) == 50257, len(tokenizer)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    tokenizer.save_pretrained(out)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"), pretty=False)  # a third the size
    licence = Path(args.ranks).resolve().parents[2] / "LICENSE"
    if licence.exists():
        shutil.copy(licence, out / "LICENSE")
    print(f"{out}: {len(tokenizer)} tokens; ' ки' -> {tokenizer(' ки')['input_ids']}")


if __name__ == "__main__":
    main()
