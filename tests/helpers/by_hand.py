"""Thin entry points the tests read formulas through: the project's own functions called the
way the paper or a file format states them (the project calls the functions underneath)."""

import torch

from policy.evaluate import majority_of
from policy.math.advantages import GroupNorm, sum_credit
from process_supervision.formats import STEP_TAG, example_from_row, to_math_shepherd
from tasks.grading import extract_final_answer


def process_advantages(step_rewards: torch.Tensor, step_mask: torch.Tensor,
                       step_end_index: torch.Tensor, num_tokens: int, group_size: int, *,
                       scale_by_std: bool = True, unbiased: bool = False,
                       eps: float = 1e-6, min_std: float = 0.0) -> torch.Tensor:
    """Process-supervision advantages (the paper's §4.1.3): all step rewards of a group (its
    samples' steps together) normalised by their mean and std; token t of a sample gets the sum
    of the normalised rewards of the steps ending at or after t, 0 after its last step. [Q*G, S]
    step rewards, mask and end indices -> [Q*G, T]: GRPO's `sum` credit form."""
    norm = GroupNorm(group_size, scale_by_std, unbiased, eps, min_std)
    return sum_credit(step_rewards, step_mask, step_end_index, None, num_tokens, norm)[0]


def majority_answer(texts: list[str]) -> str | None:
    """The most common final answer among `texts` (ties: the first seen); None if none has
    one."""
    return majority_of([extract_final_answer(t) for t in texts])


def trl_to_math_shepherd(row: dict, tag: str = STEP_TAG) -> dict:
    """One TRL stepwise row as a Math-Shepherd row (its soft labels, where it has any, as
    `soft_labels`)."""
    example = example_from_row(row, "row", tag)
    text, label = to_math_shepherd(example.question, example.steps, example.labels, tag)
    soft = any(y not in (0.0, 1.0) for y in example.labels)
    return {"input": text, "label": label, **({"soft_labels": list(example.labels)} if soft
                                               else {})}
