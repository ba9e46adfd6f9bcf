"""Shared fixtures. Expensive ones (the tiny warm-start checkpoint) are built once per session."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The one tiny warm start shared by every slow test of a session: the tiny default's SFT stage on
# a fixed budget, so that later stages start from a policy that solves part of the task.
WARM_START = [
    "data.sft_questions=12800", "sft.epochs=1", "sft.eval_every=100", "sft.patience=0",
    "data.eval_questions=200", "run.wandb_mode=disabled", "run.threads=2",
]


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory) -> Path:
    import igrpo

    root = tmp_path_factory.mktemp("warm")
    assert igrpo.main(["sft", "--config", "configs/tiny.yaml", f"run.root={root}",
                       *WARM_START]) == 0
    return root / "tiny" / "sft" / "best"
