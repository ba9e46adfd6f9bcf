"""The GPU path, shown on the CPU: every tensor of a step on the training engine's device
whichever backend sampled it, collectives on the process group's device, and the per-rank GPU
set before any collective. What only a GPU can show is in scripts/gpu_check.sh."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from configs import load_config
from policy.engines import Sampler
from policy.sampling import rollout_step
from policy.scoring import score_step
from policy.rewards import Scores
from policy.generation.rollout import generate_groups
from runtime import dist as dist_module
from runtime.data import load_splits
from runtime.models import load_causal_lm, load_tokenizer
from tasks.prompts import prompt_format

META = torch.device("meta")


class _VLLMLike:
    """A sampler with its own `generate_groups` that returns CPU tensors, as the vLLM engine
    does (its rows from the hf loop: what matters is where they land)."""

    def __init__(self, model):
        self.model = model

    version = None

    def sync(self, module, version):
        return self

    def sleep(self):
        pass

    def generate_groups(self, tokenizer, prompts, group_size, logprobs=False, **kwargs):
        rollout = generate_groups(self.model, tokenizer, prompts, group_size, **kwargs)
        return replace(rollout, sampler_logprobs=torch.zeros(rollout.completion_ids.shape))


def _sampler(engine, vllm) -> Sampler:
    sampler = Sampler.__new__(Sampler)
    sampler.engine, sampler.trainer, sampler.vllm = engine, SimpleNamespace(step=0), vllm
    sampler.start, sampler.settings, sampler.adapter = None, None, False
    return sampler


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_a_rollout_and_what_the_step_builds_from_it_are_on_the_engines_device(warm_start,
                                                                               backend):
    """The training engine reports the meta device here (on a GPU: cuda:LOCAL_RANK): the rollout
    of either backend comes out on it (vLLM's is built on the CPU)."""
    cfg = load_config("configs/tiny.yaml", ["policy.group_size=2", "policy.max_new_tokens=8",
                                            "policy.supervision=outcome"])
    model = load_causal_lm(warm_start).eval()
    tokenizer = load_tokenizer(warm_start)
    engine = SimpleNamespace(device=META, module=model, zero_optimization_stage=lambda: 0)
    sampler = _sampler(engine, None if backend == "hf" else _VLLMLike(model))
    records = load_splits(cfg.data, 0).eval[:2]
    rollout = rollout_step(sampler, tokenizer, prompt_format(cfg.data).prompts(tokenizer, records),
                           cfg.policy, (0, 0))
    tensors = [rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
               rollout.completion_mask, rollout.truncated]
    if backend == "vllm":
        tensors.append(rollout.sampler_logprobs)
    assert all(t.device == META for t in tensors)


def test_a_grpo_step_uses_no_tensor_of_a_default_device(tmp_path, warm_start):
    """Every tensor a GRPO step makes (scoring, advantages, the update through a DeepSpeed
    engine, the metrics) is made on the device of the tensors it came from: with the default
    device set to `meta`, a tensor made without a device would be meta, and mixing it with the
    CPU rollout, or reading its value, fails. (Only the reward callable, which builds its
    scores from Python numbers, runs outside: `score_step` moves them.)"""
    from policy.algorithms.grpo import advantage_step, log_step, update_step
    from iteration.resolve import resolve
    from policy.engines import policy_engines
    from runtime.training import StageLoop
    from runtime.tracking import MetricsLogger

    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", "policy.group_size=4",
                                            "policy.max_new_tokens=12", "policy.supervision=outcome",
                                            "deepspeed.micro_batch_size=4", "policy.mu=2"])
    g, stage, spec = cfg.policy, resolve(cfg).stage, resolve(cfg).method
    tokenizer, plan, engine, reference = policy_engines(stage, warm_start)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="",
                           name="")
    trainer = StageLoop(tmp_path / "grpo", engine, logger, 1, desc="grpo")
    sampler = _sampler(engine, None)
    records = load_splits(cfg.data, 0).eval[:g.questions_per_step]
    rollout = rollout_step(sampler, tokenizer, prompt_format(cfg.data).prompts(tokenizer,
                                                                               records), g, (0, 0))
    cpu_scores = Scores(rewards=torch.arange(len(rollout.texts)).float() % 3,
                        correct=torch.arange(len(rollout.texts)) % 2 == 0)
    with torch.device("meta"):
        scores, rewards, broken = score_step(lambda r, o: cpu_scores, records, rollout, g,
                                             stage.shaping)
        batch = advantage_step(scores, rewards, broken, rollout, spec, g.group_size)
        stats = update_step(trainer, reference, rollout, batch, g, spec, plan, "test", False)
        metrics = log_step(rollout, scores, rewards, batch, stats, g,
                           {"rollout": 1.0, "scoring": 1.0, "update": 1.0})
    assert stats.grad_norm > 0 and metrics["train/kl"] >= 0
    assert metrics["reward/mean"] == pytest.approx(float(cpu_scores.rewards.mean()))


def test_collectives_allocate_on_the_process_groups_device(monkeypatch):
    """Under NCCL (no CPU backend) a collective's tensor is on this rank's GPU, under gloo on
    the CPU; `global_sum` allocates where `collective_device` says."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert dist_module.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert dist_module.collective_device() == torch.device("cpu")

    seen = []

    class Reduced(Exception):
        pass

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Reduced

    monkeypatch.setattr(dist_module, "world", lambda: (0, 2))
    monkeypatch.setattr(dist_module, "collective_device", lambda: META)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Reduced):
        dist_module.global_sum(1.0)
    assert seen == [META]


def test_the_shipped_real_configuration_is_the_plans_qwen_architecture():
    """configs/models/qwen25_math_1p5b/config.json (what `gpu_check.py real` builds its random
    1.5B from) is the architecture the plan knows for Qwen2.5-Math-1.5B: 1,543,656,960
    parameters, and the plan reads it from the folder as from any local model."""
    from configs.memory import KNOWN, architecture

    found = architecture(SimpleNamespace(policy_path="configs/models/qwen25_math_1p5b"))
    assert found == KNOWN["Qwen/Qwen2.5-Math-1.5B-Instruct"]
    assert found.params == 1_543_656_960


def test_the_real_architecture_check_runs_an_iteration_and_plans_every_phase(capsys):
    """`scripts/gpu_check.py real --cpu`: a random model of the shipped Qwen2.5-Math-1.5B
    configuration (shrunk to 2 layers of 64, the real 151,936-token vocabulary) runs one GRPO
    iteration of the 1.5B recipe (hf backend) to the end, and the report pairs every phase of
    the plan with a measurement (none on the CPU: PyTorch's CUDA counters are what it reads)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", "scripts/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    found = gpu_check.real_check(SimpleNamespace(cpu=True, peak_tflops=989.0))
    assert found["exit_code"] == 0 and found["grpo_steps"] == 2
    assert found["params"] > 151_936 * 64  # the real vocabulary's embedding at least
    assert list(found["phases_gib"]) == ["start-up", "rollout", "scoring", "update",
                                         "reward models", "labelling", "evaluation: sampling",
                                         "evaluation: scoring"]
    assert all(v["plan"] > 0 and v["measured"] is None for v in found["phases_gib"].values())
    assert all(t > 0 for t in found["rollout_tokens_per_s"] + found["update_tokens_per_s"])
