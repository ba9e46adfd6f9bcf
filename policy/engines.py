"""The policy's engines: the trained policy and its frozen reference (`policy_engines`), their
log-probs of a rollout, and the sampler that rolls the policy out (the training module, or a
colocated vLLM engine given the current weights).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from policy.generation.logprobs import completion_logprobs
from policy.generation.rollout import Rollout
from policy.math.losses import truncated_importance_weights
from policy.stage import PolicyStage, VLLMSettings
from runtime.batching import plan_grpo_batch
from runtime.dist import world
from runtime.engine import (build_engine, build_inference_engine, gathered_for_generation,
                            module_gather)
from runtime.lora import AdapterOff, LoraSettings, is_adapted, with_adapter
from runtime.memory import memory_phase
from runtime.models import load_causal_lm, load_tokenizer
from runtime.training import StageLoop


def starts_at(reference_path, policy_path) -> bool:
    """Whether a stage's reference is its starting policy (the default, and the outer loop's
    reset): until its first optimizer step the policy's log-probs are the reference's."""
    return reference_path is None or Path(reference_path) == Path(policy_path)


def trainable_policy(policy_path, model):
    """The policy a stage trains, loaded from `policy_path`: the whole model, or, with
    `model.lora` (a rank above 0), the model under a fresh LoRA adapter (runtime/lora.py)."""
    lm = load_causal_lm(policy_path, model, train=True)
    lora = LoraSettings.of(model.lora)
    return lm if lora is None else with_adapter(lm, lora)


def policy_engines(stage: PolicyStage, policy_path, reference_path=None):
    """(tokenizer, batch plan, the policy's training engine, the frozen reference or None) of a
    policy stage; the reference (default: the starting policy) is loaded only when beta > 0,
    and ZeRO-3 partitions it like the policy. Under LoRA a reference that is the starting
    policy is no second copy: it is the policy's module with the adapter off (`AdapterOff`)."""
    p, model = stage.policy, stage.model
    tokenizer = load_tokenizer(policy_path, model)
    plan = plan_grpo_batch(p.questions_per_step, p.group_size, stage.deepspeed.micro_batch_size,
                           world()[1], p.mini_batches)
    engine = build_engine(trainable_policy(policy_path, model), stage.deepspeed,
                          lr=p.lr, micro_batch_size=plan.micro_batch_size,
                          grad_accum=plan.grad_accum)
    reference = None
    if p.beta > 0 and is_adapted(engine) and starts_at(reference_path, policy_path):
        reference = AdapterOff(engine)
    elif p.beta > 0:
        reference = build_inference_engine(
            load_causal_lm(reference_path or policy_path, model, device=engine.device),
            stage.deepspeed)
    return tokenizer, plan, engine, reference


@torch.no_grad()
def forward_logprobs(model, rollout: Rollout, micro: int,
                     entropy_out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, T] completion log-probs without gradient, a micro-batch at a time (and the per-token
    entropy into `entropy_out` [N, T], where given)."""
    parts = []
    for start in range(0, rollout.prompt_ids.shape[0], micro):
        rows = slice(start, start + micro)
        parts.append(completion_logprobs(
            model, rollout.input_ids[rows], rollout.attention_mask[rows],
            rollout.prompt_ids.shape[1],
            entropy_out=None if entropy_out is None else entropy_out[rows]))
    return torch.cat(parts)


def sampler_drift(logprobs: torch.Tensor, rollout: Rollout, all_tokens: float,
                  rows: slice = slice(None)) -> float:
    """The rollout's `rows`' share of the step's mean |log-prob - the sampler's| over its
    `all_tokens` completion tokens (`rollout/logprob_diff`: how far vLLM's numbers are from the
    training model's); 0 where the sampler gave none."""
    sampled = rollout.sampler_logprobs
    if sampled is None:
        return 0.0
    drift = (logprobs - sampled[rows].to(logprobs)).abs() * rollout.completion_mask[rows]
    return float(drift.sum()) / max(all_tokens, 1.0)


def tis_weights(old_logprobs: torch.Tensor, rollout: Rollout, rows: slice, cap: float):
    """(weights, capped) of `truncated_importance_weights` for the rollout's `rows`, against
    the sampler's log-probs; None where off (`policy.tis_cap` 0, or no sampler log-probs: the
    `hf` backend samples with the trained module itself)."""
    if not cap or rollout.sampler_logprobs is None:
        return None
    return truncated_importance_weights(old_logprobs, rollout.sampler_logprobs[rows],
                                        rollout.completion_mask[rows], cap)


def reference_logprobs(reference, rollout: Rollout, micro: int, is_reference: bool):
    """The reference's log-probs of the rollout, or None: without a reference, and while the
    policy still is the reference (`is_reference`), where the caller uses the policy's own."""
    if reference is None or is_reference:
        return None
    return forward_logprobs(reference, rollout, micro)


class Sampler:
    """Who generates for the training engine: its own module (`rollout.backend=hf`), or a
    colocated vLLM engine that is handed the current weights once per optimizer step
    (`rollout.backend=vllm`, policy/generation/vllm.py)."""

    def __init__(self, engine, trainer: StageLoop, vllm: VLLMSettings | None, policy_path):
        self.engine, self.trainer = engine, trainer
        self.vllm, self.start = None, ("checkpoint", str(policy_path))
        self.settings, self.adapter = vllm, bool(vllm and vllm.lora_rank)
        if vllm is not None:
            from policy.generation.vllm import engine_for

            self.vllm = engine_for(vllm, policy_path)

    def push_due(self) -> bool:
        """Whether vLLM lacks the current weights: it holds neither this step's pushed ones nor,
        before the first optimizer step, the starting checkpoint (no push is needed then). With
        `rollout.lora_push=adapter`: whether it lacks this step's adapter (before the first
        step the fresh adapter is 0: the checkpoint alone is the policy)."""
        step = self.trainer.step
        if self.adapter:
            return step > 0 and self.vllm.adapter_version != step
        held = self.vllm.version
        return held != step and not (step == 0 and held == self.start)

    @contextmanager
    def generating(self):
        """The model to generate with, inside the block (every rank enters it together): the
        training module with its weights gathered for the whole generation (hf), or the vLLM
        engine. A push, where due, runs with vLLM's KV pool freed (it sleeps first) and walks
        the policy module by module: under ZeRO-3 one module is gathered at a time beside
        vLLM's weights (`module_gather`), never the whole policy, and the last is released
        before the KV cache wakes to generate. With `rollout.lora_push=adapter` the engine
        keeps the stage's starting checkpoint and the push hands it the adapter alone."""
        if self.vllm is None:
            with gathered_for_generation(self.engine) as module:
                yield module
            return
        if self.adapter and not self.vllm.holds_checkpoint(self.start[1]):
            from policy.generation.vllm import engine_for

            engine_for(self.settings, self.start[1])  # the adapter's base: the stage's start
        if self.push_due():
            self.vllm.sleep()
            with memory_phase("push"):
                self.vllm.sync(self.engine.module, self.trainer.step,
                               gather=module_gather(self.engine), adapter=self.adapter)
        yield self.vllm

    def rest(self) -> None:
        """The end of a generation phase, before scoring, an update or an export: a vLLM
        engine frees its GPU memory (`rollout.sleep`); the next `generating()` wakes it (with the
        updated weights)."""
        if self.vllm is not None:
            self.vllm.sleep()

    def stats(self) -> dict:
        """`time/weight_push`: seconds this rank spent pushing weights into vLLM since the last
        call ({} with the hf backend)."""
        if self.vllm is None:
            return {}
        seconds, self.vllm.push_seconds = self.vllm.push_seconds, 0.0
        return {"time/weight_push": seconds}
