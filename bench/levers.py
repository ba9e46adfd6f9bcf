"""Each speed lever of the GRPO step alone, against what it replaced, side by side in one run.

    python bench/levers.py [--repeats 3]

On the shipped tiny warm start (2.6M), 2 threads, medians of `--repeats`:
- rollout: 8 questions x G = 8 and 64 questions x k = 4 (the evaluation's batch), sampled, up to
  112 tokens: transformers `generate` with the prompt prefilled once (what rollout used),
  `generate` with a static cache, and `policy.generation.rollout.decode` (preallocated cache read up to its
  filled length, shared prefill, ended rows leaving the batch, a prompt's keys and values read
  once per group), also against itself with the prompt's cache copied to every row;
- update: forward + backward and a no-gradient forward of a 64-row rollout: the plain padded
  forward, the prompt-shared one (`completion_logprobs(share_prompts=True, pack=False)`), the
  prompt-shared one on real tokens only (`pack=True`: the rows' completions one sequence,
  attention alone laid out in rows, in blocks of rows of similar lengths), that one with its
  attention in a single block padded to the longest row, and transformers' own packing (each
  row's real tokens concatenated, 1 or 2 sequences a row, position ids restarting, attention
  masked block-diagonally by transformers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def generate_shared(model, ids, mask, repeat, max_new):
    """The rollout before `decode`: prompt prefilled once into a DynamicCache, then generate."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
          past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(repeat)
    return model.generate(input_ids=ids.repeat_interleave(repeat, 0),
                          attention_mask=mask.repeat_interleave(repeat, 0),
                          past_key_values=cache, max_new_tokens=max_new, do_sample=True,
                          top_k=0, pad_token_id=0, eos_token_id=1)


def packed_forward(model, ids, mask, per_row: int):
    import torch

    seqs = [row[m.bool()] for row, m in zip(ids, mask)]
    rows = [seqs[i:i + per_row] for i in range(0, len(seqs), per_row)]
    width = max(sum(len(s) for s in r) for r in rows)
    inp = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        at = 0
        for s in r:
            inp[i, at:at + len(s)], pos[i, at:at + len(s)] = s, torch.arange(len(s))
            at += len(s)
        pos[i, at:] = torch.arange(width - at)  # the tail is a sequence of its own
    return model(input_ids=inp, position_ids=pos).logits


def rollout_rows(model, tok, fmt, splits, repeats: int) -> list[str]:
    """The rollout levers' table rows: GRPO's 8 x G = 8 and the evaluation's 64 x k = 4."""
    import torch

    from policy.generation.rollout import decode
    from tasks.prompts import encode_prompts

    rows = []
    for label, records, repeat in (("8 questions x G = 8", splits.rl[:8], 8),
                                   ("64 questions x k = 4", splits.eval[:64], 4)):
        enc = tok.pad({"input_ids": encode_prompts(tok, fmt.prompts(tok, records))},
                      padding=True, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        with torch.no_grad():
            before = median_time(lambda: generate_shared(model, ids, mask, repeat, 112),
                                 repeats)
            static = median_time(lambda: model.generate(
                input_ids=ids.repeat_interleave(repeat, 0),
                attention_mask=mask.repeat_interleave(repeat, 0), max_new_tokens=112,
                do_sample=True, top_k=0, pad_token_id=0, eos_token_id=1,
                cache_implementation="static"), repeats)
            ours = median_time(lambda: decode(model, ids, mask, repeat, 112, tok.eos_token_id,
                                              tok.pad_token_id), repeats)
            copied = median_time(lambda: decode(model, ids, mask, repeat, 112, tok.eos_token_id,
                                                tok.pad_token_id, share_prompts=False),
                                 repeats)
        rows.append(f"| rollout: generate, static cache | {label} | {before:.2f} | {static:.2f} "
                    f"| {static / before:.2f}x |")
        rows.append(f"| rollout: `decode` | {label} | {before:.2f} | {ours:.2f} | "
                    f"{ours / before:.2f}x |")
        rows.append(f"| rollout: `decode`'s prompt read once a group, against copied to each "
                    f"row | {label} | {copied:.2f} | {ours:.2f} | {ours / copied:.2f}x |")
    return rows


def update_rows(model, tok, fmt, splits, repeats: int) -> list[str]:
    """The update's levers on one 64-row rollout: the prompt-shared forward, real tokens only,
    attention in blocks of rows by length, packing."""
    import torch

    from policy.generation.logprobs import completion_logprobs
    from policy.generation.rollout import generate_groups

    torch.manual_seed(0)
    r = generate_groups(model, tok, fmt.prompts(tok, splits.rl[:8]), 8, max_new_tokens=112)
    start = r.prompt_ids.shape[1]

    def backward(share: bool, pack: bool = False, blocks: int | None = None):
        model.zero_grad()
        lp = completion_logprobs(model, r.input_ids, r.attention_mask, start,
                                 share_prompts=share, pack=pack, blocks=blocks)
        (lp * r.completion_mask).sum().backward()

    def packed(per_row: int):
        model.zero_grad()
        packed_forward(model, r.input_ids, r.attention_mask, per_row).logsumexp(-1).sum() \
            .backward()

    model.train()
    plain = median_time(lambda: backward(False), repeats)
    shared = median_time(lambda: backward(True), repeats)
    shared_packed = median_time(lambda: backward(True, True), repeats)
    one_block = median_time(lambda: backward(True, True, blocks=1), repeats)
    pack1 = median_time(lambda: packed(1), repeats)
    pack2 = median_time(lambda: packed(2), repeats)
    with torch.no_grad():
        plain_ng = median_time(lambda: completion_logprobs(
            model, r.input_ids, r.attention_mask, start, share_prompts=False), repeats)
        shared_ng = median_time(lambda: completion_logprobs(
            model, r.input_ids, r.attention_mask, start, pack=False), repeats)
        packed_ng = median_time(lambda: completion_logprobs(
            model, r.input_ids, r.attention_mask, start), repeats)
    real = float(r.attention_mask.float().mean())
    completion = float(r.completion_mask.float().mean())
    setting = f"64 rows, {real:.0%} of the padded tokens real ({completion:.0%} of completions')"
    return [
        f"| update: prompt-shared forward + backward | {setting} | {plain:.2f} | {shared:.2f} | "
        f"{shared / plain:.2f}x |",
        f"| update: prompt-shared forward, no gradient (reference) | {setting} | {plain_ng:.2f} "
        f"| {shared_ng:.2f} | {shared_ng / plain_ng:.2f}x |",
        f"| update: prompt-shared, real tokens only, forward + backward (vs prompt-shared) | "
        f"{setting} | {shared:.2f} | {shared_packed:.2f} | {shared_packed / shared:.2f}x |",
        f"| update: real tokens only, attention in blocks of rows by length (vs one block), "
        f"forward + backward | {setting} | {one_block:.2f} | {shared_packed:.2f} | "
        f"{shared_packed / one_block:.2f}x |",
        f"| update: prompt-shared, real tokens only, no gradient (vs prompt-shared) | "
        f"{setting} | {shared_ng:.2f} | {packed_ng:.2f} | {packed_ng / shared_ng:.2f}x |",
        f"| update: padding trimmed (1 sequence a row) | {setting} | {plain:.2f} | {pack1:.2f} | "
        f"{pack1 / plain:.2f}x |",
        f"| update: packed, 2 sequences a row | {setting} | {plain:.2f} | {pack2:.2f} | "
        f"{pack2 / plain:.2f}x |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch

    from configs import load_config
    from runtime.data import load_splits
    from runtime.models import load_causal_lm, load_tokenizer
    from tasks.prompts import prompt_format

    torch.set_num_threads(2)
    policy = ROOT / "runtime/bundled/tiny_warm_start"
    cfg = load_config(str(ROOT / "configs/tiny.yaml"), ["data.eval_questions=64"])
    splits = load_splits(cfg.data, cfg.run.seed)
    model, tok = load_causal_lm(policy).eval(), load_tokenizer(policy)
    fmt = prompt_format(cfg.data)
    rows = ["| lever | setting | before s | after s | after / before |", "| --- | --- | --- | --- | --- |"]

    rows += rollout_rows(model, tok, fmt, splits, args.repeats)
    rows += update_rows(model, tok, fmt, splits, args.repeats)
    print(f"tiny warm start, 2 threads, medians of {args.repeats}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
