"""Shared fixtures. Expensive ones (the tiny warm-start checkpoint) are built once per session.
Test helpers (configs, launchers, fault injection, checks) live in tests/helpers/."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers on CI's two cores. Each keeps one intra-op
    # thread, whatever `run.threads` a test's config asks for: two workers at two threads each
    # would oversubscribe the cores, and the tiny model's ops gain little from a second thread
    # (the learning tests take about as long on one as on two; bench/README.md, "The test suite").
    torch.set_num_threads(1)
    _set_num_threads = torch.set_num_threads
    torch.set_num_threads = lambda n: _set_num_threads(1)

if not torch.cuda.is_available():  # on a GPU machine DeepSpeed finds CUDA itself
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# The slow tests start from the shipped tiny warm start (runtime/bundled/tiny_warm_start), the
# policy `make demo` starts from: a converged SFT policy on worked solutions of which 40% forget to
# carry and borrow, so it is right under sampling less often than greedy (its recipe.json).


@pytest.fixture(scope="session")
def warm_start() -> Path:
    from configs.loader import BUNDLED

    return BUNDLED / "tiny_warm_start"


# The slowest files first (about their minutes of one worker, longest first): `make test`'s two
# workers take whole files (--dist loadfile) in collection order (--no-loadscope-reorder: by
# default xdist orders files by their number of tests instead), so a long file collected last
# would run alone at the end while the other worker idles.
SLOWEST_FILES = ("test_learning.py", "test_zero_stages.py", "test_reward_model_learning.py",
                 "test_real_models.py", "test_distributed.py", "test_dpo.py",
                 "test_reward_families.py", "test_iteration.py", "test_hostile.py",
                 "test_fault_injection.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
