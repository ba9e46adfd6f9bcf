"""Policy evaluation on held-out questions: greedy pass@1, maj@K and pass@K.

Launch alone: `igrpo eval --config configs/tiny.yaml eval.checkpoint=runs/tiny/grpo/final`.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import torch
from tqdm import tqdm

from policy.rollout import generate_groups
from runtime.data import MathRecord
from runtime.grading import answers_match, extract_final_answer
from runtime.prompts import PromptFormat


def _vote_key(answer: str | None) -> str | None:
    """Answers that are the same number vote together; others by their normalised text."""
    if answer is None:
        return None
    text = answer.replace(",", "").strip().rstrip(".")
    try:
        return str(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return " ".join(text.split())


def majority_answer(texts: list[str]) -> str | None:
    """The most common final answer among `texts` (ties: the first seen); None if none has one."""
    keys = [(_vote_key(extract_final_answer(t)), extract_final_answer(t)) for t in texts]
    counts = Counter(k for k, _ in keys if k is not None)
    if not counts:
        return None
    best = counts.most_common(1)[0][0]
    return next(a for k, a in keys if k == best)


def _is_right(answer: str | None, gold: str, timeout_s: int) -> bool:
    return answer is not None and answers_match(answer, gold, timeout_s)


@torch.no_grad()
def evaluate_policy(model, tokenizer, records: list[MathRecord], fmt: PromptFormat, *, k: int,
                    temperature: float, max_new_tokens: int, batch_size: int, timeout_s: int = 2,
                    sampled: bool = True, progress: bool = False) -> dict[str, float]:
    """Greedy accuracy (pass@1), and with `sampled`: maj@K, pass@K, mean sampled accuracy."""
    greedy_right, lengths = 0, []
    maj_right = pass_right = sample_right = 0
    per_batch = max(1, batch_size // max(k, 1))
    bar = tqdm(total=len(records), desc="eval", disable=not progress, leave=False)
    for start in range(0, len(records), batch_size):
        chunk = records[start:start + batch_size]
        prompts = fmt.prompts(tokenizer, chunk)
        greedy = generate_groups(model, tokenizer, prompts, 1, max_new_tokens=max_new_tokens,
                                 greedy=True)
        lengths += greedy.lengths.tolist()
        greedy_right += sum(_is_right(extract_final_answer(t), r.answer, timeout_s)
                            for t, r in zip(greedy.texts, chunk))
        bar.update(len(chunk))
    bar.close()
    metrics = {"eval/greedy_accuracy": greedy_right / len(records),
               "eval/greedy_length": sum(lengths) / len(lengths),
               "eval/questions": len(records)}
    if not sampled:
        return metrics
    for start in range(0, len(records), per_batch):
        chunk = records[start:start + per_batch]
        prompts = fmt.prompts(tokenizer, chunk)
        rollout = generate_groups(model, tokenizer, prompts, k, max_new_tokens=max_new_tokens,
                                  temperature=temperature)
        for q, rec in enumerate(chunk):
            texts = rollout.texts[q * k:(q + 1) * k]
            right = [_is_right(extract_final_answer(t), rec.answer, timeout_s) for t in texts]
            sample_right += sum(right)
            pass_right += any(right)
            maj_right += _is_right(majority_answer(texts), rec.answer, timeout_s)
    n = len(records)
    metrics.update({"eval/maj_accuracy": maj_right / n, "eval/pass_at_k": pass_right / n,
                    "eval/sample_accuracy": sample_right / (n * k)})
    return metrics
