"""Steps: split solutions into steps and map each step to the token index where it ends.

Token positions come from the tokenizer's own decoding of token prefixes (never from guessing
string lengths), so they are right for character, BPE and SentencePiece tokenizers alike, including
tokens that straddle a step boundary (such a token ends the step whose last character it holds).
"""

from __future__ import annotations

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
    step's last character. The last step is extended to the last token (so EOS belongs to it).
    """
    if not token_ids:
        return []
    ends = step_char_ends(text, separator)
    prefix_cache: dict[int, int] = {}

    def decoded_len(k: int) -> int:  # characters produced by the first k tokens
        if k not in prefix_cache:
            prefix_cache[k] = len(tokenizer.decode(token_ids[:k], skip_special_tokens=True))
        return prefix_cache[k]

    out = []
    for char_index in ends:
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
