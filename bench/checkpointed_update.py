"""An update micro-batch under gradient checkpointing, as both GPU configs run it: the padded
forward (what ran before: checkpointing turned the packed path off) against the packed one (the
prompt once per question, the rows' real tokens one sequence, each layer checkpointed and
replayed in backward), side by side in one run.

    python bench/checkpointed_update.py [--repeats 5 --rows 8 --prompt 96 --longest 512]

A random Qwen2 (4 layers of 256, GQA, a 32K vocabulary), fp32, 2 threads; a micro-batch of the
GPU configs' 8 rows, one question's samples, their completion lengths GSM8K-like (drawn from 80
to 300 tokens, seeded) with one row at the longest (as with G = 64 at temperature 1, some sample
usually is), so the padded batch is as wide as that row. Forward + backward of the log-probs' sum;
medians of `--repeats`; tokens/s counts the real (prompt + completion) tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def batch(rows: int, prompt: int, longest: int, vocab: int):
    """[prompt | completion] rows of one question: the prompt shared, completions of GSM8K-like
    lengths (one at `longest`), right-padded."""
    import torch

    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(80, 300, (rows,), generator=generator)
    lengths[rows // 2] = longest
    ids = torch.zeros(rows, prompt + longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, :prompt] = torch.randint(2, vocab, (prompt,), generator=generator)
    mask[:, :prompt] = 1
    for row, n in enumerate(lengths.tolist()):
        ids[row, prompt:prompt + n] = torch.randint(2, vocab, (n,), generator=generator)
        mask[row, prompt:prompt + n] = 1
    return ids, mask


def timed(fn, repeats: int) -> float:
    """`levers.median_time` after one warm-up call."""
    from levers import median_time  # bench/levers.py, beside this script

    fn()
    return median_time(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--longest", type=int, default=512)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import transformers

    from policy.generation.logprobs import completion_logprobs

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=32_000, hidden_size=256, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=768, max_position_embeddings=2048)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids, mask = batch(args.rows, args.prompt, args.longest, config.vocab_size)
    real = int(mask.sum())

    def update(packed: bool):
        model.zero_grad()
        logprobs = completion_logprobs(model, ids, mask, args.prompt, share_prompts=packed)
        (logprobs * mask[:, args.prompt:]).sum().backward()

    rows = ["| update micro-batch | s | real tokens/s | vs padded, checkpointed |",
            "| --- | --- | --- | --- |"]
    model.gradient_checkpointing_enable({"use_reentrant": False})
    padded = timed(lambda: update(False), args.repeats)
    packed = timed(lambda: update(True), args.repeats)
    model.gradient_checkpointing_disable()
    free = timed(lambda: update(True), args.repeats)
    for name, seconds in (("padded, checkpointing (before)", padded),
                          ("packed, checkpointing (now)", packed),
                          ("packed, no checkpointing", free)):
        rows.append(f"| {name} | {seconds:.2f} | {real / seconds:,.0f} | "
                    f"{padded / seconds:.2f}x |")
    print(f"{args.rows} rows, prompt {args.prompt}, completions up to {args.longest}: {real} real "
          f"of {ids.numel()} padded tokens ({real / ids.numel():.0%}); 2 threads, medians of "
          f"{args.repeats}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
