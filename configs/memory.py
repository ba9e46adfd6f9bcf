"""`igrpo plan`: per-GPU memory of every phase of a GRPO iteration (or PPO's: the critic
counted) at a given scale, and whether each fits.

    igrpo plan --config configs/deepseekmath_7b.yaml --gpus 8 --nodes 1 --gpu-gb 80 141

The terms. Model states (parameters, gradients, optimizer) come from DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`); frozen models
(the reference, the reward models) hold bf16/fp32 weights only, the reference partitioned under
ZeRO-3 and a reward model loaded whole on every GPU; the rest comes from the architecture:

- KV cache: sequences x (prompt + completion tokens) x layers x 2 (K and V) x KV heads x head dim
  x bytes per value;
- an update micro-batch's activations, with flash attention (no s x s score matrix kept): layers
  x tokens x hidden x 34 bytes without recomputation (Korthikanti et al., 2022, table 2, bf16),
  each layer's input plus one layer's 34 bytes with gradient checkpointing; and its logits: the
  model's [tokens, vocabulary] output plus the loss's float32 copy, which the log-softmax keeps
  for the backward pass (`selective_log_softmax` chunks its computation, not what autograd saves);
- a no-gradient forward of the reward model (scoring): one layer's working set at a time,
  `rm.score_batch_size` x `rm.max_length` tokens x (4 hidden + 3 intermediate) values.

The phases, in the order a GRPO iteration (`igrpo iterate`) runs them. The GRPO stage holds the
policy's states, the reference and the reward model it is rewarded by throughout ("held"):

    start-up        held + a whole bf16 copy (ZeRO-3: each model is loaded whole, then partitioned)
    push            held + one gathered module (ZeRO-3: the push walks the policy module by
                    module) + vLLM's weights (its KV cache asleep)
    rollout         held + vLLM's pool (weights + KV cache), or the decoding loop's KV cache
    scoring         held + the reward model's forward (vLLM asleep); an online reward model
                    (`rm.online`) is held as training states and gathered whole to score
                    (the implicit PRM's frozen reference held too)
    update          held + activations + logits (vLLM asleep)
    RM update       an online reward model's step after the policy's: held + its activations
                    (the implicit PRM's: the policy update's activations and logits); with
                    `rm.online_update=before` it runs inside the scoring, whose measured peak
                    then holds it
    reward models   a reward model's training states + its activations (vLLM asleep)
    labelling       vLLM's pool (the decoding loop: the policy + its KV cache)
    evaluation      sampling beside both reward models (best-of-N), then their scoring

With `rm.backend=vllm` the PRM scores in a vLLM pooling engine of its own: its weights are the
scorer's row, and its KV cache (`rm.vllm_kv_cache_gb`) is in every phase after start-up (the
engine never sleeps).

With `rollout.backend=vllm` (both GPU configs) a pool of `rollout.memory_fraction` of the GPU
(or the weights plus `rollout.kv_cache_gb`) holds vLLM's weights and a paged KV cache that serves
a question's G samples in waves, so the plan asks how many full-length sequences it holds at
once. With `rollout.sleep` (a GPU) the pool is mapped only while vLLM generates
(docs/rollout.md, "Sleep and wake"); without it, every phase after the engine starts carries it.
A GPU's usable memory is 90% of what the card reports (an "80 GB" H100: 79.65 GiB).
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

    def lora_params(self, rank: int, targets: str = "all-linear") -> int:
        """A LoRA adapter's parameters: r * (in + out) for each adapted linear layer of every
        decoder layer (`targets`: all-linear, or comma-separated module names)."""
        h, f, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                  "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
        chosen = set(shapes) if targets == "all-linear" else \
            {name.strip() for name in targets.split(",")}
        return self.layers * rank * sum(i + o for name, (i, o) in shapes.items()
                                        if name in chosen)

    @property
    def largest_layer_params(self) -> int:
        """The largest single module (what ZeRO-3 gathers at once): the embedding here."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    def push_module_params(self, lora: bool) -> int:
        """The most values a push holds at once: the largest module gathered, or a fused
        layer vLLM's reload buffers until its last piece arrives: gate and up (and under LoRA
        the gathered W of the second beside both merged copies), whichever is larger."""
        return max(self.largest_layer_params, (3 if lora else 2) * self.hidden * self.intermediate)


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


def _from_config_dict(hf: dict) -> Architecture:
    return Architecture(hidden=hf["hidden_size"], layers=hf["num_hidden_layers"],
                        heads=hf["num_attention_heads"],
                        kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                        intermediate=hf["intermediate_size"], vocab=hf["vocab_size"],
                        tied=bool(hf.get("tie_word_embeddings", False)))


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


@dataclass(frozen=True)
class Phase:
    name: str
    terms: tuple[tuple[str, float], ...]
    """(item, bytes per GPU) of what the GPU holds at the phase's peak."""

    @property
    def peak(self) -> float:
        return sum(b for _, b in self.terms)


# What a card reports in MiB (nvidia-smi), by the size it is sold as: an "80 GB" H100 or A100
# has 81,559 MiB = 79.65 GiB, a 141 GB H200 143,771 MiB. Other sizes are taken as GiB.
GPU_MIB = {80: 81_559, 141: 143_771, 40: 40_960, 24: 24_564}


def gpu_bytes(gpu_gb: float) -> float:
    """The memory a card sold as `gpu_gb` GB reports."""
    return GPU_MIB.get(gpu_gb, gpu_gb * 1024) * 2**20


def model_states(params: int, largest: int, ds, gpus: int, nodes: int) -> tuple[int, int, str]:
    """(GPU bytes, CPU bytes, source) of a trained model's states under its ZeRO stage; bf16
    under ZeRO-2/3 adds the float32 gradient accumulation's 2 more bytes a partitioned param."""
    gpu, cpu, source = _estimated_states(params, largest, ds, gpus, nodes)
    if ds.bf16 and ds.zero_stage >= 2 and not ds.offload_optimizer:
        gpu += 2 * params / (gpus * nodes)
        source += " + float32 gradient accumulation"
    return gpu, cpu, source


def _estimated_states(params: int, largest: int, ds, gpus: int, nodes: int
                      ) -> tuple[int, int, str]:
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
    """Per-GPU terms of one GRPO iteration (the rows) and the numbers the phases are built from
    (`phases`; vLLM's pool depends on the GPU's size)."""
    arch = architecture(cfg.model)
    ds, g = cfg.deepspeed, cfg.policy
    total_gpus = gpus * nodes
    value_bytes = 2 if ds.bf16 else 4
    params = arch.params
    tokens = prompt_tokens + g.max_new_tokens
    rank_questions = g.questions_per_step / total_gpus
    # One generate call holds policy.rollout_questions questions' G samples (0: all of a rank's).
    rollout_seqs = min(rank_questions, g.rollout_questions or rank_questions) * g.group_size
    kv_per_seq = tokens * arch.layers * 2 * arch.kv_heads * arch.head_dim * value_bytes
    whole = value_bytes * params
    rows = [*_weight_rows(ds, g, arch, gpus, nodes, cfg.rm.online,
                          cfg.rm.online and cfg.rm.family == "implicit", cfg.rm.ensemble,
                          cfg.model.lora),
            PlanRow("whole policy", whole, f"{value_bytes * 8}-bit weights: a model loaded "
                    "before ZeRO-3 partitions it, the policy gathered to generate (hf), "
                    "vLLM's copy")]
    if cfg.rollout.backend != "vllm":
        rows.append(PlanRow("rollout: KV cache", rollout_seqs * kv_per_seq,
                            f"{rollout_seqs:g} sequences x {tokens} tokens"))
    elif ds.zero_stage == 3:  # the push gathers a module at a time (runtime.lora.iter_weights)
        rows.append(PlanRow("push: one gathered module", value_bytes * arch.push_module_params(
            bool(cfg.model.lora.rank)), "ZeRO-3: the largest module gathered for vLLM at a "
            "time (a LoRA layer with its merged copy)"))
    if cfg.rm.backend == "vllm":  # (the weights: the "PRM (scoring)" row, in its engine)
        rows.append(PlanRow(POOLING, cfg.rm.vllm_kv_cache_gb * GB, "rm.backend=vllm: "
                            "rm.vllm_kv_cache_gb; the engine never sleeps"))
    recompute = cfg.model.gradient_checkpointing
    rows += [_scoring_row(cfg.rm, arch, value_bytes),
             *_update_rows(ds, recompute, arch, tokens, value_bytes),
             *_reward_model_rows(ds, cfg.rm, recompute, arch, gpus, nodes, value_bytes)]
    numbers = {"params": params, "largest_layer_params": arch.largest_layer_params,
               "kv_per_sequence": kv_per_seq, "rollout_sequences": rollout_seqs,
               "group_size": g.group_size, "total_gpus": total_gpus, "tokens": tokens,
               "zero3": ds.zero_stage == 3, "terms": {r.item: r.gpu_bytes for r in rows},
               "label_sequences": cfg.label.prefixes_per_batch * cfg.label.num_completions,
               "eval_sequences": cfg.eval.batch_size,
               "vllm": None, "title": (
                   f"{cfg.model.policy_path or 'tiny model'} ({params / 1e9:.2f}B params"
                   f"{_lora_title(cfg.model.lora, arch)}), "
                   f"{nodes} node(s) x {gpus} GPU(s), ZeRO-{ds.zero_stage}"
                   f"{' bf16' if ds.bf16 else ' fp32'}, {g.questions_per_step} questions x "
                   f"G={g.group_size}, rollout {cfg.rollout.backend}")}
    if cfg.rollout.backend == "vllm":
        numbers["vllm"] = {"weights": whole, "fraction": cfg.rollout.memory_fraction,
                           "kv_fixed": cfg.rollout.kv_cache_gb * GB,
                           "sleeps": cfg.rollout.sleep}
    return rows, numbers


POOLING = "PRM pooling engine: KV cache"
"""`rm.backend=vllm`: the pooling engine's KV cache, awake from the GRPO stage's start on."""


def _lora_title(lora, arch: Architecture) -> str:
    if not lora.rank:
        return ""
    return f", LoRA rank {lora.rank}: {arch.lora_params(lora.rank, lora.target_modules) / 1e6:.1f}M " \
        "trained"


def adapted_states(arch: Architecture, lora, ds, gpus: int, nodes: int) -> tuple[float, float, str]:
    """(GPU bytes, CPU bytes, how) of a LoRA model's states: the frozen base's weights alone
    (partitioned under ZeRO-3), and the adapter's full states (weights, gradients, optimizer)
    as DeepSpeed's estimator counts a model of the adapter's size."""
    value_bytes = 2 if ds.bf16 else 4
    adapter = arch.lora_params(lora.rank, lora.target_modules)
    base = value_bytes * arch.params / ((gpus * nodes) if ds.zero_stage == 3 else 1)
    gpu, cpu, source = model_states(adapter, adapter, ds, gpus, nodes)
    return base + gpu, cpu, (f"frozen base {value_bytes * 8}-bit weights"
                             f"{' (partitioned)' if ds.zero_stage == 3 else ''} + the "
                             f"{adapter / 1e6:.1f}M-parameter adapter's states ({source})")


def _weight_rows(ds, g, arch: Architecture, gpus: int, nodes: int,
                 online: bool = False, implicit: bool = False, members: int = 1,
                 lora=None) -> list[PlanRow]:
    """What a GRPO stage holds throughout: the policy's model states (the critic's too), the
    frozen reference and the reward model GRPO is rewarded by (`ds`: the deepspeed section, `g`
    the policy section; `online`: the reward model trains beside the policy, `rm.online`;
    `implicit`: it is PRIME's implicit PRM, with a frozen reference of its own; `members`: the
    reward models of an ensemble, `rm.ensemble`, each held like the first; `lora`: the
    `model.lora` section: the policy is a frozen base under an adapter, and its reference the
    base with the adapter off, no second copy)."""
    value_bytes = 2 if ds.bf16 else 4
    params, largest = arch.params, arch.largest_layer_params
    adapted = lora is not None and lora.rank > 0
    if adapted:
        states_gpu, states_cpu, source = adapted_states(arch, lora, ds, gpus, nodes)
    else:
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
    references = (["reference model"] if g.beta > 0 and not adapted else []) + \
        (["implicit PRM reference"] if implicit else [])  # (without the KL term, no reference)
    for name in references:
        if ds.zero_stage == 3:
            rows.append(PlanRow(name, value_bytes * params / (gpus * nodes)
                                + value_bytes * largest,
                                "ZeRO-3 partitioned weights + one gathered layer"))
        else:
            rows.append(PlanRow(name, value_bytes * params, "replicated weights (inference only)"))
    if online:  # a second training engine: its model states count like the policy's
        rm_gpu, rm_cpu, _ = model_states(params, largest, ds, gpus, nodes)
        rows.append(PlanRow("online RM model states", rm_gpu, f"rm.online: trained every step; "
                            f"CPU {rm_cpu / GB:.1f} GiB"))
    # The scorer is loaded whole on every GPU (reward_model/score.py), not partitioned.
    reward = "PRM" if g.supervision == "process" else "ORM"
    rows.append(PlanRow(f"{reward} (scoring)", value_bytes * params,
                        "the online reward model gathered whole to score" if online
                        else
                        "replicated weights (scoring)"))
    if members > 1:
        rows.append(PlanRow(f"{members - 1} more ensemble members (scoring)",
                            (members - 1) * value_bytes * params,
                            f"rm.ensemble={members}: each member's replicated weights"))
    return rows


def _scoring_row(rm, arch: Architecture, value_bytes: int) -> PlanRow:
    tokens = rm.score_batch_size * rm.max_length
    return PlanRow("scoring: forward", tokens * (4 * arch.hidden + 3 * arch.intermediate)
                   * value_bytes, f"one layer's working set, rm.score_batch_size "
                   f"{rm.score_batch_size} x rm.max_length {rm.max_length} tokens")


def _activations(arch: Architecture, tokens: int, recompute: bool, value_bytes: int) -> float:
    """One micro-batch of `tokens` tokens: every layer's 34 bytes a token and hidden unit, or
    with gradient checkpointing each layer's input and one layer rebuilt at a time."""
    per_layer = tokens * arch.hidden
    return (arch.layers * per_layer * value_bytes + per_layer * 34) if recompute else \
        arch.layers * per_layer * 34


def _update_rows(ds, recompute: bool, arch: Architecture, tokens: int,
                 value_bytes: int) -> list[PlanRow]:
    """One update micro-batch's activations and logits (the model's and the loss's float32
    copy). (The critic's update, after the policy's, keeps no vocabulary logits.)"""
    rows = ds.micro_batch_size * tokens
    return [PlanRow("update: activations", _activations(arch, rows, recompute, value_bytes),
                    f"micro-batch {ds.micro_batch_size} x {tokens} tokens, "
                    f"{'gradient checkpointing' if recompute else 'no recompute'}, "
                    "flash attention"),
            PlanRow("update: logits", rows * arch.vocab * (value_bytes + 4),
                    f"[{rows} x {arch.vocab}] logits + the loss's float32 copy")]


def _reward_model_rows(ds, rm, recompute: bool, arch: Architecture, gpus: int, nodes: int,
                       value_bytes: int) -> list[PlanRow]:
    """Training a reward model of the policy's architecture (trained from the policy): its
    states under the run's ZeRO stage and a micro-batch of `rm.max_length` tokens."""
    if rm.lora.rank:  # `rm.lora`: a frozen backbone and the adapter's states
        states, _, source = adapted_states(arch, rm.lora, ds, gpus, nodes)
    else:
        states, _, source = model_states(arch.params, arch.largest_layer_params, ds, gpus,
                                         nodes)
    rows = ds.micro_batch_size * rm.max_length
    return [PlanRow("reward model states", states, f"{source} (training)"),
            PlanRow("reward model: activations",
                    _activations(arch, rows, recompute, value_bytes),
                    f"micro-batch {ds.micro_batch_size} x rm.max_length {rm.max_length}")]


def pool_bytes(numbers: dict, gpu_gb: float) -> float:
    """vLLM's pool on a GPU sold as `gpu_gb` GB: its weights plus the KV cache."""
    v = numbers["vllm"]
    return v["weights"] + v["kv_fixed"] if v["kv_fixed"] else v["fraction"] * gpu_bytes(gpu_gb)


def phases(numbers: dict, gpu_gb: float) -> list[Phase]:
    """Each phase's terms on a GPU sold as `gpu_gb` GB (module docstring)."""
    t, v = numbers["terms"], numbers["vllm"]
    held = tuple((k, b) for k, b in t.items()
                 if k in ("policy model states", "critic model states", "reference model",
                          "online RM model states", "implicit PRM reference")
                 or (k.endswith("(scoring)") and "online RM model states" not in t))
    scorer = next(b for k, b in t.items() if k.endswith("(scoring)"))
    online = "online RM model states" in t
    # the pooling engine (rm.backend=vllm) stays awake after the GRPO stage starts it
    pooling = ((POOLING, t[POOLING]),) if POOLING in t else ()
    whole = t["whole policy"]
    gathered = (("gathered policy", whole),) if numbers["zero3"] else ()
    both_rms = (("both reward models", 2 * scorer),)
    if v is None:
        kv = numbers["kv_per_sequence"]
        rollout = (*gathered, ("KV cache", t["rollout: KV cache"]))
        label = (("policy", whole), ("KV cache", numbers["label_sequences"] * kv))
        sampling = (("policy", whole), *both_rms, ("KV cache", numbers["eval_sequences"] * kv))
        push, awake = None, ()
    else:
        pool = (("vLLM pool", pool_bytes(numbers, gpu_gb)),)
        rollout, label, sampling = pool, pool, (*pool, *both_rms)
        awake = () if v["sleeps"] else pool  # without sleep the pool stays in every phase
        module = t.get("push: one gathered module")
        push = Phase("push", (*held, *((("one gathered module", module),) if module else ()),
                              ("vLLM weights", v["weights"]), *awake, *pooling))
    awake = (*awake, *pooling)
    rollout, label, sampling = (*rollout, *pooling), (*label, *pooling), (*sampling, *pooling)
    out = [Phase("start-up", (*held, *((("whole model, before partitioning", whole),)
                                       if numbers["zero3"] else ())))]
    out += [push] if push is not None else []
    out += [Phase("rollout", (*held, *rollout)),
            # an online reward model scores gathered whole beside its states
            Phase("scoring", (*held, *((("gathered online RM", scorer),) if online else ()),
                              ("scoring: forward", t["scoring: forward"]), *awake)),
            Phase("update", (*held, ("activations", t["update: activations"]),
                             ("logits", t["update: logits"]), *awake)),
            *([Phase("RM update", (*held, *(
                (("activations", t["update: activations"]), ("logits", t["update: logits"]))
                if "implicit PRM reference" in t else
                (("activations", t["reward model: activations"]),)), *awake))]
              if online else []),
            Phase("reward models", (("states", t["reward model states"]),
                                    ("activations", t["reward model: activations"]), *awake)),
            Phase("labelling", label),
            Phase("evaluation: sampling", sampling),
            Phase("evaluation: scoring", (*both_rms, ("scoring: forward",
                                                      t["scoring: forward"]), *awake))]
    return out


def peak(numbers: dict, gpu_gb: float) -> float:
    return max(p.peak for p in phases(numbers, gpu_gb))


def vllm_sequences(numbers: dict, gpu_gb: float) -> tuple[float, int]:
    """(KV-cache bytes, full-length sequences it holds at once) of vLLM's pool."""
    kv = max(pool_bytes(numbers, gpu_gb) - numbers["vllm"]["weights"], 0.0)
    return kv, int(kv // numbers["kv_per_sequence"])


def verdict(numbers: dict, gpu_gb: float, headroom: float = 0.9) -> str:
    usable = gpu_bytes(gpu_gb) * headroom
    found = phases(numbers, gpu_gb)
    worst = max(found, key=lambda p: p.peak)
    where = f"peak {worst.peak / GB:.1f} GiB ({worst.name}) of {usable / GB:.1f} usable"
    if numbers["vllm"] is not None:
        kv, sequences = vllm_sequences(numbers, gpu_gb)
        if sequences < 1:
            return (f"does NOT fit: vLLM's KV cache ({kv / GB:.1f} GiB) holds no "
                    f"{numbers['tokens']}-token sequence; raise rollout.memory_fraction")
    over = [p.name for p in found if p.peak > usable]
    if over:
        return f"does NOT fit: {where}; over in {', '.join(over)}"
    if numbers["vllm"] is None:
        return f"fits: {where}"
    waves = -(-numbers["group_size"] // sequences)
    return (f"fits: {where}; vLLM's KV cache {kv / GB:.1f} GiB holds {sequences} sequences of "
            f"{numbers['tokens']} tokens at once (a question's {numbers['group_size']} in "
            f"{waves} wave{'s' if waves > 1 else ''})")


def render(rows: list[PlanRow], numbers: dict, gpu_sizes: list[float]) -> str:
    """`igrpo plan`'s table: the terms, then each phase's peak on each GPU size."""
    lines = [f"memory plan: {numbers['title']}", f"{'term':<28}{'GiB/GPU':>9}  how", "-" * 78]
    lines += [f"{r.item:<28}{r.gpu_bytes / GB:>9.2f}  {r.note}" for r in rows]
    for size in gpu_sizes:
        lines += ["", f"{size:g} GB GPU ({gpu_bytes(size) / GB:.2f} GiB, 90% usable "
                  f"{0.9 * gpu_bytes(size) / GB:.1f}):", f"{'phase':<22}{'peak GiB':>9}  of"]
        for p in phases(numbers, size):
            lines.append(f"{p.name:<22}{p.peak / GB:>9.2f}  "
                         + " + ".join(f"{k} {b / GB:.2f}" for k, b in p.terms if b))
        lines.append(f"-> {verdict(numbers, size)}")
    return "\n".join(lines)
