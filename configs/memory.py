"""`igrpo plan`: per-GPU memory of a GRPO (or PPO: the critic counted) run at a given scale,
and whether it fits.

    igrpo plan --config configs/deepseekmath_7b.yaml --gpus 8 --nodes 1 --gpu-gb 80 141

Model states (parameters, gradients, optimizer) come from DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`); frozen models
(the reference and the reward model in use) hold bf16/fp32 weights only, partitioned under ZeRO-3;
the rollout's KV cache and the update's activations are computed from the architecture:

- KV cache: sequences per GPU x (prompt + completion tokens) x layers x 2 (K and V) x KV heads x
  head dim x bytes per value;
- activations of one update micro-batch without recomputation, with flash attention (no s x s
  score matrix kept): layers x tokens x hidden x 34 bytes (Korthikanti et al., 2022, "Reducing
  activation recomputation", table 2, bf16), plus the micro-batch's logits.

Rollout and update do not overlap in time, so the peak is the weights plus the larger of the two.

With `rollout.backend=vllm` (both GPU configs) the rollout is the colocated vLLM engine's, not the
decoding loop's: a pool of `rollout.memory_fraction` of the GPU (or the policy's weights plus
`rollout.kv_cache_gb`) holds vLLM's copy of the weights and a paged KV cache that serves a
question's G samples in waves (their prompt's blocks shared), so the plan asks how many full-length
sequences it holds at once, not whether all G fit. Under ZeRO-3 the policy is gathered only to
push the weights (beside vLLM's weights, before its KV cache wakes). With `rollout.sleep` the
engine frees everything before the update (vLLM's sleep level 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GB = 1024 ** 3


@dataclass(frozen=True)
class Architecture:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        """Llama-style decoder: embeddings, attention (q, k, v, o), gated MLP, RMSNorms, head."""
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attention + mlp + 2 * self.hidden
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden + head

    @property
    def largest_layer_params(self) -> int:
        """The largest single module (what ZeRO-3 gathers at once): the embedding here."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)


KNOWN = {
    # DeepSeekMath 7B (base, instruct, RL) share DeepSeek LLM 7B's architecture (config.json).
    name: Architecture(hidden=4096, layers=30, heads=32, kv_heads=32, intermediate=11008,
                       vocab=102400)
    for name in ("deepseek-ai/deepseek-math-7b-base", "deepseek-ai/deepseek-math-7b-instruct",
                 "deepseek-ai/deepseek-math-7b-rl")
} | {
    # Qwen2.5-Math-1.5B(-Instruct), from its config.json: GQA with 2 KV heads, tied embeddings.
    name: Architecture(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960,
                       vocab=151936, tied=True)
    for name in ("Qwen/Qwen2.5-Math-1.5B", "Qwen/Qwen2.5-Math-1.5B-Instruct")
}


def _from_config_dict(cfg: dict) -> Architecture:
    return Architecture(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                        heads=cfg["num_attention_heads"],
                        kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                        intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                        tied=bool(cfg.get("tie_word_embeddings", False)))


def architecture(model_cfg) -> Architecture:
    """The policy's architecture: a local `config.json`, a known hub id, or the tiny default."""
    path = model_cfg.policy_path
    if not path:
        from runtime.tiny_model import tiny_tokenizer

        tiny = model_cfg.tiny
        return Architecture(hidden=tiny.hidden_size, layers=tiny.num_layers, heads=tiny.num_heads,
                            kv_heads=tiny.num_heads, intermediate=tiny.intermediate_size,
                            vocab=len(tiny_tokenizer(tiny.tokenizer, ("ки",))), tied=True)
    config_file = Path(path) / "config.json"
    if config_file.exists():
        return _from_config_dict(json.loads(config_file.read_text()))
    if path in KNOWN:
        return KNOWN[path]
    raise ValueError(f"model.policy_path={path!r}: no local config.json and not a known hub id "
                     f"({', '.join(sorted(KNOWN))}); download the model's config.json and pass "
                     "its folder")


@dataclass(frozen=True)
class PlanRow:
    item: str
    gpu_bytes: float
    note: str


def model_states(params: int, largest: int, ds, gpus: int, nodes: int) -> tuple[int, int, str]:
    """(GPU bytes, CPU bytes, source) of the trained policy's states under its ZeRO stage."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if ds.zero_stage == 3:
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest, gpus, nodes, cpu_offload=ds.offload_optimizer,
            cpu_offload_params=ds.offload_param, zero_init=True)
        return gpu, cpu, "DeepSpeed estimate_zero3_model_states_mem_needs"
    if ds.zero_stage in (1, 2):
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, gpus, nodes,
                                                         cpu_offload=ds.offload_optimizer)
        source = "DeepSpeed estimate_zero2_model_states_mem_needs"
        return gpu, cpu, source + (" (stage 1 keeps full grads: a lower bound)"
                                   if ds.zero_stage == 1 else "")
    if ds.bf16:
        return 20 * params, 0, "no ZeRO: 2 (bf16 weights) + 18 (grads, fp32 master, Adam) B/param"
    return 16 * params, 0, "no ZeRO, fp32: 4 (weights) + 4 (grads) + 8 (Adam) B/param"


def plan(cfg, gpus: int, nodes: int, prompt_tokens: int = 256) -> tuple[list[PlanRow], dict]:
    """Per-GPU memory rows of one GRPO iteration, and the numbers behind them."""
    arch = architecture(cfg.model)
    ds, g = cfg.deepspeed, cfg.grpo
    total_gpus = gpus * nodes
    value_bytes = 2 if ds.bf16 else 4
    params = arch.params
    tokens = prompt_tokens + g.max_new_tokens
    rank_questions = g.questions_per_step / total_gpus
    # One generate call holds grpo.rollout_questions questions' G samples (0: all of a rank's).
    rollout_seqs = min(rank_questions, g.rollout_questions or rank_questions) * g.group_size
    kv_per_seq = tokens * arch.layers * 2 * arch.kv_heads * arch.head_dim * value_bytes
    gathered = value_bytes * params if ds.zero_stage == 3 else 0.0
    weight_rows = _weight_rows(cfg, arch, gpus, nodes)
    rollout_rows = _rollout_rows(cfg, value_bytes * params, gathered, rollout_seqs,
                                 kv_per_seq, tokens)
    update = _update_row(cfg, arch, tokens, value_bytes)
    weights = sum(r.gpu_bytes for r in weight_rows)
    rollout = sum(r.gpu_bytes for r in rollout_rows)
    numbers = {"params": params, "largest_layer_params": arch.largest_layer_params,
               "weights": weights, "gathered": gathered, "update": update.gpu_bytes,
               "peak": weights + max(rollout, update.gpu_bytes),
               "kv_per_sequence": kv_per_seq, "rollout_sequences": rollout_seqs,
               "group_size": g.group_size, "total_gpus": total_gpus, "tokens": tokens,
               "vllm": None}
    if cfg.rollout.backend == "vllm":
        numbers["vllm"] = {"weights": value_bytes * params, "fraction": cfg.rollout.memory_fraction,
                           "kv_fixed": cfg.rollout.kv_cache_gb * GB,
                           "sleeps": cfg.rollout.sleep}
    return [*weight_rows, *rollout_rows, update], numbers


def _weight_rows(cfg, arch: Architecture, gpus: int, nodes: int) -> list[PlanRow]:
    """What stays on the GPU throughout: the policy's model states (the critic's too), the
    frozen reference and the reward model GRPO is rewarded by."""
    ds, g = cfg.deepspeed, cfg.grpo
    value_bytes = 2 if ds.bf16 else 4
    params, largest = arch.params, arch.largest_layer_params
    states_gpu, states_cpu, source = model_states(params, largest, ds, gpus, nodes)
    rows = [PlanRow("policy model states", states_gpu, f"{source}; CPU {states_cpu / GB:.1f} GiB")]
    if g.algorithm in ("ppo", "t_ppo"):
        # The critic: the policy's backbone under a one-output head (no LM head), trained by its
        # own DeepSpeed engine: its model states count like the policy's.
        critic_params = params - (0 if arch.tied else arch.vocab * arch.hidden) + arch.hidden
        critic_gpu, critic_cpu, _ = model_states(critic_params, largest, ds, gpus, nodes)
        rows.append(PlanRow("critic model states", critic_gpu,
                            f"{critic_params / 1e9:.2f}B params (PPO family); CPU "
                            f"{critic_cpu / GB:.1f} GiB"))
    if g.beta > 0:  # without the KL term no reference model is loaded
        if ds.zero_stage == 3:
            rows.append(PlanRow("reference model", value_bytes * params / (gpus * nodes)
                                + value_bytes * largest,
                                "ZeRO-3 partitioned weights + one gathered layer"))
        else:
            rows.append(PlanRow("reference model", value_bytes * params,
                                "replicated weights (inference only)"))
    # The scorer is loaded whole on every GPU (reward_model/score.py), not partitioned.
    reward = "PRM" if g.supervision == "process" else "ORM"
    rows.append(PlanRow(f"{reward} (scoring)", value_bytes * params,
                        "replicated weights (scoring)"))
    return rows


def _rollout_rows(cfg, weights: float, gathered: float, sequences: float, kv_per_seq: float,
                  tokens: int) -> list[PlanRow]:
    """The rollout's: vLLM's copy of the weights (its pool is per GPU size: `vllm_phases`), or
    the decoding loop's KV cache; the gathered policy under ZeRO-3 either way."""
    r = cfg.rollout
    if r.backend == "vllm":
        pool = f"{r.kv_cache_gb:g} GB KV cache + the weights" if r.kv_cache_gb else \
            f"rollout.memory_fraction {r.memory_fraction:g} of the GPU"
        return [PlanRow("rollout: gathered policy", gathered,
                        "ZeRO-3: gathered to push the weights into vLLM, released before it "
                        "generates" if gathered else "not partitioned: nothing to gather"),
                PlanRow("rollout: vLLM weights", weights,
                        f"inside vLLM's pool ({pool}; per GPU size below)")]
    return [PlanRow("rollout: gathered policy", gathered,
                    "ZeRO-3: the full weights, gathered once per rollout" if gathered else
                    "not partitioned: nothing to gather"),
            PlanRow("rollout: KV cache", sequences * kv_per_seq,
                    f"{sequences:g} sequences x {tokens} tokens")]


def _update_row(cfg, arch: Architecture, tokens: int, value_bytes: int) -> PlanRow:
    """One update micro-batch's activations and logits. With gradient checkpointing each layer
    keeps only its input, and one layer's activations are rebuilt at a time in the backward
    pass. (The critic's update, after the policy's, keeps no vocabulary logits.)"""
    ds, recompute = cfg.deepspeed, cfg.model.gradient_checkpointing
    per_layer = tokens * ds.micro_batch_size * arch.hidden
    activations = (arch.layers * per_layer * value_bytes + per_layer * 34) if recompute else \
        arch.layers * per_layer * 34
    logits = ds.micro_batch_size * tokens * arch.vocab * value_bytes
    return PlanRow("update: activations", activations + logits,
                   f"micro-batch {ds.micro_batch_size} x {tokens} tokens, "
                   f"{'gradient checkpointing' if recompute else 'no recompute'}, "
                   "flash attention, + logits")


def vllm_phases(numbers: dict, gpu_gb: float) -> dict:
    """The vLLM path on a GPU of `gpu_gb`: vLLM's pool (weights + KV cache), the KV tokens and
    full-length sequences it holds at once, and the peaks of the rollout (the larger of the
    push, when the gathered policy and vLLM's weights are resident, and generation, when the
    whole pool is) and of the update (the pool gone when the engine sleeps)."""
    v = numbers["vllm"]
    pool = v["weights"] + v["kv_fixed"] if v["kv_fixed"] else v["fraction"] * gpu_gb * GB
    kv = max(pool - v["weights"], 0.0)
    sequences = int(kv // numbers["kv_per_sequence"])
    rollout = numbers["weights"] + max(numbers["gathered"] + v["weights"], pool)
    update = numbers["weights"] + numbers["update"] + (0.0 if v["sleeps"] else pool)
    return {"pool": pool, "kv": kv, "sequences": sequences, "rollout": rollout,
            "update": update, "peak": max(rollout, update)}


def rollout_chunk(numbers: dict, gpu_gb: float, headroom: float = 0.9) -> int:
    """Sequences per generate call whose KV cache fits beside the weights (0: none fits)."""
    free = gpu_gb * GB * headroom - numbers["weights"] - numbers["gathered"]
    return max(0, min(int(free // numbers["kv_per_sequence"]), int(numbers["rollout_sequences"])))


def verdict(numbers: dict, gpu_gb: float, headroom: float = 0.9) -> str:
    usable = gpu_gb * GB * headroom
    if numbers["vllm"] is not None:
        return _vllm_verdict(numbers, gpu_gb, usable)
    if numbers["peak"] <= usable:
        return "fits"
    if numbers["weights"] + numbers["update"] > usable:
        return (f"does NOT fit: weights + update activations need "
                f"{(numbers['weights'] + numbers['update']) / GB:.1f} GiB; lower "
                "deepspeed.micro_batch_size or add GPUs")
    questions = rollout_chunk(numbers, gpu_gb, headroom) // numbers["group_size"]
    if questions < 1:
        return "does NOT fit: not even one question's G samples fit in the rollout's KV cache"
    return (f"fits with the rollout in chunks: grpo.rollout_questions={questions} "
            f"({questions * numbers['group_size']} sequences per generate call)")


def _vllm_verdict(numbers: dict, gpu_gb: float, usable: float) -> str:
    v = vllm_phases(numbers, gpu_gb)
    where = (f"peak {v['peak'] / GB:.1f} GiB (rollout {v['rollout'] / GB:.1f}, update "
             f"{v['update'] / GB:.1f}); vLLM pool {v['pool'] / GB:.1f} GiB")
    if v["sequences"] < 1:
        return (f"does NOT fit: vLLM's KV cache ({v['kv'] / GB:.1f} GiB) holds no "
                f"{numbers['tokens']}-token sequence; raise rollout.memory_fraction ({where})")
    if v["peak"] > usable:
        return (f"does NOT fit: {where}; lower rollout.memory_fraction or "
                "deepspeed.micro_batch_size, or add GPUs")
    waves = -(-numbers["group_size"] // v["sequences"])
    return (f"fits: {where}, its KV cache {v['kv'] / GB:.1f} GiB holds {v['sequences']} "
            f"sequences of {numbers['tokens']} tokens at once (a question's "
            f"{numbers['group_size']} in {waves} wave{'s' if waves > 1 else ''})")


def render(cfg, rows: list[PlanRow], numbers: dict, gpu_sizes: list[float], gpus: int,
           nodes: int) -> str:
    g, ds = cfg.grpo, cfg.deepspeed
    lines = [f"memory plan: {cfg.model.policy_path or 'tiny model'} "
             f"({numbers['params'] / 1e9:.2f}B params), {nodes} node(s) x {gpus} GPU(s), "
             f"ZeRO-{ds.zero_stage}{' bf16' if ds.bf16 else ' fp32'}, "
             f"{g.questions_per_step} questions x G={g.group_size}",
             f"{'item':<24}{'GiB/GPU':>10}  how", "-" * 78]
    for r in rows:
        lines.append(f"{r.item:<24}{r.gpu_bytes / GB:>10.2f}  {r.note}")
    lines.append("-" * 78)
    if numbers["vllm"] is None:
        lines.append(f"{'peak: weights + max(rollout, update)':<24}{numbers['peak'] / GB:>10.2f}")
    for size in gpu_sizes:
        lines.append(f"{size:g} GB GPU (90% usable): {verdict(numbers, size)}")
    return "\n".join(lines)
