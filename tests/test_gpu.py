"""GPU checks (skipped without CUDA): one iterate unit of tiny random models on the accelerator,
with every model the loop loads (labeller, evaluator, reference, reward-model scorers) on it.
Run them with `bash scripts/gpu_check.sh` on a GPU machine."""

import importlib
import json
import sys

import pytest
import torch

import igrpo
import runtime.models
from test_real_models import FEW, tiny_random

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("config", ["qwen25_math_1p5b.yaml", "deepseekmath_7b.yaml"])
def test_iterate_unit_on_cuda(tmp_path, monkeypatch, config):
    devices = []
    load = runtime.models.load_causal_lm

    def recording(*args, **kwargs):
        model = load(*args, **kwargs)
        devices.append(next(model.parameters()).device.type)
        return model

    importlib.import_module("iteration.loop")  # every module the loop uses, loaded
    for module in list(sys.modules.values()):  # each module that imported the loader
        if getattr(module, "load_causal_lm", None) is load:
            monkeypatch.setattr(module, "load_causal_lm", recording)
    arch = {"qwen25_math_1p5b.yaml": "qwen2", "deepseekmath_7b.yaml": "llama"}[config]
    stand_in = tiny_random(tmp_path / "model", arch, chat=True)
    assert igrpo.main(["iterate", "--config", f"configs/{config}", f"run.root={tmp_path}",
                       f"model.policy_path={stand_in}", *FEW]) == 0
    assert devices and set(devices) == {"cuda"}, devices
    run = next(p for p in tmp_path.iterdir() if (p / "summary.json").exists())
    assert len(json.loads((run / "summary.json").read_text())["iterations"]) == 2
