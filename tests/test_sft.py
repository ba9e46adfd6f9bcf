"""SFT (policy/algorithms/sft.py): the warm start's learning rate decays linearly to zero."""

import pytest

import igrpo
from runtime.tracking import read_metrics

from small_config import SMALL as BASE


SMALL = [*BASE, "grpo.eval_every=1"]


def _args(tmp_path, *extra):
    return ["--config", "configs/tiny.yaml", f"run.root={tmp_path}", *SMALL, *extra]


def test_sft_lr_decays_linearly_to_zero(tmp_path):
    assert igrpo.main(["sft", *_args(tmp_path, "sft.lr_decay=true", "sft.lr=1e-3",
                                     "sft.epochs=2", "sft.eval_every=0")]) == 0
    lrs = [r["train/lr"] for r in read_metrics(tmp_path / "tiny" / "sft" / "metrics.jsonl")
           if "train/lr" in r]
    total = len(lrs)
    assert total == 8  # 64 questions / 16 a step, 2 epochs
    # The rate each step ran at: DeepSpeed's 2-step warm-up (0, half), then 1e-3 falling
    # linearly to 0 at the last step.
    expected = [1e-3 * (k / 2 if k < 2 else (total - k) / (total - 2)) for k in range(total)]
    assert lrs == pytest.approx(expected)
