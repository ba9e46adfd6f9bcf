"""Steps: split solutions into steps and map each step to the token index where it ends.

Token positions come from the tokenizer's own decoding of token prefixes (never from guessing
string lengths), so they are right for character, BPE and SentencePiece tokenizers alike, including
tokens that straddle a step boundary (such a token ends the step whose last character it holds).
"""

from __future__ import annotations

import bisect

import torch


def split_steps(text: str, separator: str = "\n") -> list[str]:
    """Non-empty steps of a solution, one per `separator`-delimited piece."""
    return [s for s in text.split(separator) if s.strip()]


def step_char_ends(text: str, separator: str = "\n") -> list[int]:
    """Index of the last character of each non-empty step in `text`, counting the separator that
    closes it (writing the separator is the step's own decision to end)."""
    ends, start = [], 0
    pieces = text.split(separator)
    for k, piece in enumerate(pieces):
        stop = start + len(piece)
        if piece.strip():
            closed = k < len(pieces) - 1
            ends.append(stop + len(separator) - 1 if closed else stop - 1)
        start = stop + len(separator)
    return ends


def step_end_token_indices(tokenizer, token_ids: list[int], text: str,
                           separator: str = "\n") -> list[int]:
    """For each step of `text` (the decoding of `token_ids`), the index of the token holding the
    step's last character: the smallest k whose prefix `token_ids[:k + 1]` decodes past that
    character. The last step is extended to the last token (so EOS belongs to it).

    A fast tokenizer's streaming decoder gives every prefix's length in one pass, and each step's
    candidate is then checked with two decodes of the prefixes around it; where a check fails (a
    tokenizer whose stream and prefix decodes disagree there), or without a fast tokenizer, a
    binary search over prefix decodes finds it. The same indices either way, in O(steps) decodes
    instead of O(steps x log tokens).
    """
    if not token_ids:
        return []
    prefix_cache: dict[int, int] = {}

    def decoded_len(k: int) -> int:  # characters produced by the first k tokens
        if k not in prefix_cache:
            prefix_cache[k] = len(tokenizer.decode(token_ids[:k], skip_special_tokens=True))
        return prefix_cache[k]

    streamed = streamed_lengths(tokenizer, token_ids)
    out = []
    for char_index in step_char_ends(text, separator):
        if streamed is not None:
            k = min(bisect.bisect_right(streamed, char_index, lo=1) - 1, len(token_ids) - 1)
            if decoded_len(k + 1) > char_index and (k == 0 or decoded_len(k) <= char_index):
                out.append(k)
                continue
        lo, hi = 0, len(token_ids) - 1
        while lo < hi:  # smallest k with decoded_len(k + 1) > char_index
            mid = (lo + hi) // 2
            if decoded_len(mid + 1) > char_index:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    if out:
        out[-1] = len(token_ids) - 1
    return out


def streamed_lengths(tokenizer, token_ids: list[int]) -> list[int] | None:
    """Characters decoded after each prefix of `token_ids` (from 0 tokens), by the tokenizers
    library's streaming decoder (one pass); None without a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if backend is None:
        return None
    stream, lengths = DecodeStream(skip_special_tokens=True), [0]
    for token in token_ids:
        lengths.append(lengths[-1] + len(stream.step(backend, token) or ""))
    return lengths


def pad_steps(per_sample: list[list[float]], ends: list[list[int]]):
    """Ragged step values and end indices -> (values [N, S], mask [N, S], ends [N, S])."""
    width = max([len(v) for v in per_sample] + [1])
    values = torch.zeros(len(per_sample), width)
    mask = torch.zeros(len(per_sample), width, dtype=torch.bool)
    end_index = torch.zeros(len(per_sample), width, dtype=torch.long)
    for i, (vals, idx) in enumerate(zip(per_sample, ends)):
        values[i, :len(vals)] = torch.tensor(vals, dtype=torch.float32)
        mask[i, :len(vals)] = True
        end_index[i, :len(idx)] = torch.tensor(idx, dtype=torch.long)
    return values, mask, end_index
