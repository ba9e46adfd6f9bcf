"""scripts/credit_bias.py's read-out of the positional bias: the advantage at each step's last
token, averaged per step position from the first step and from the answer line back."""

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("credit_bias", ROOT / "scripts" / "credit_bias.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_position_means_by_hand():
    # Sample 0: 3 steps ending at tokens 1, 3, 4 (advantages there 1, 2, 3); sample 1: 2 steps
    # ending at 0 and 2 (5, 7); sample 2 is left out by `rows`.
    advantages = torch.tensor([[1., 1., 2., 2., 3., 0.], [5., 6., 7., 0., 0., 0.],
                               [9., 9., 9., 9., 9., 9.]])
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    ends = torch.tensor([[1, 3, 4], [0, 2, 0], [5, 0, 0]])
    rows = torch.tensor([True, True, False])
    means = _script().step_position_means
    assert means(advantages, mask, ends, rows) == [(1 + 5) / 2, (2 + 7) / 2, 3.0]
    # From the answer line back: (3 + 7) / 2, (2 + 5) / 2, 1.
    assert means(advantages, mask, ends, rows, from_end=True) == [5.0, 3.5, 1.0]
