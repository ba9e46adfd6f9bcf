"""SFT (policy/algorithms/sft.py): the warm start's learning rate decays linearly to zero; the
last weights exported on request."""

import pytest
import torch

import igrpo
from runtime.models import load_causal_lm
from runtime.tracking import read_metrics

from small_config import SMALL as BASE


SMALL = [*BASE, "policy.eval_every=1"]


def _weights_differ(a, b) -> bool:
    wa, wb = load_causal_lm(a).state_dict(), load_causal_lm(b).state_dict()
    return any(not torch.equal(wa[k], wb[k]) for k in wa)


def _args(tmp_path, *extra):
    return ["--config", "configs/tiny.yaml", f"run.root={tmp_path}", *SMALL, *extra]


def test_sft_lr_decays_linearly_to_zero(tmp_path):
    assert igrpo.main(["sft", *_args(tmp_path, "sft.lr_decay=true", "sft.lr=1e-3",
                                     "sft.epochs=2", "sft.eval_every=0",
                                     "sft.export_final=true")]) == 0
    lrs = [r["train/lr"] for r in read_metrics(tmp_path / "tiny" / "sft" / "metrics.jsonl")
           if "train/lr" in r]
    total = len(lrs)
    assert total == 8  # 64 questions / 16 a step, 2 epochs
    # The rate each step ran at: DeepSpeed's 2-step warm-up (0, half), then 1e-3 falling
    # linearly to 0 at the last step.
    expected = [1e-3 * (k / 2 if k < 2 else (total - k) / (total - 2)) for k in range(total)]
    assert lrs == pytest.approx(expected)
    # `sft.export_final`: the last weights beside the best (here step 0's: validation only at
    # the end, on a model too small to answer), and they are the trained ones.
    run = tmp_path / "tiny"
    assert _weights_differ(run / "base", run / "sft" / "final")
