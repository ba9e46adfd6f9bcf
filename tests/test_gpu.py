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


def test_a_zero3_push_never_holds_the_whole_policy_on_the_gpu():
    """A vLLM push's weight stream from a ZeRO-3 LoRA policy on the GPU (`iter_weights` through
    `module_gather`): the most CUDA memory it holds above the partitioned engine is within
    three of its largest modules (the module gathered, a merged copy, the tensor handed on),
    while gathering the policy whole first, as the push did before, holds all of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from configs import load_config
    from configs.schema import LoraConfig
    from iteration.resolve import resolve
    from runtime.engine import build_engine, gathered_for_generation, module_gather
    from runtime.lora import LoraSettings, iter_weights, with_adapter

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=32_000)
    model = with_adapter(LlamaForCausalLM(config), LoraSettings.of(LoraConfig(rank=16)))
    whole = 4 * sum(p.numel() for p in model.parameters())
    largest = 4 * 32_000 * 1024  # the embedding (and the untied output layer), float32
    ds = resolve(load_config("configs/tiny.yaml", ["deepspeed.zero_stage=3"])).stage.deepspeed
    engine = build_engine(model, ds, lr=1e-4, micro_batch_size=1, grad_accum=1)

    def held_by(stream) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in stream():
            pass
        return torch.cuda.max_memory_allocated() - before

    def at_once():
        with gathered_for_generation(engine) as module:
            yield from iter_weights(module)

    streamed = held_by(lambda: iter_weights(engine.module, module_gather(engine)))
    assert streamed <= 3 * largest < whole / 2
    assert held_by(at_once) >= 0.9 * whole
