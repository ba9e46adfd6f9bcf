"""`igrpo plan`: the paper-scale memory table, every phase of an iteration, checked against
DeepSpeed's estimator and by hand; both GPU recipes fit their hardware at every phase."""

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

import igrpo
from configs import load_config
from configs.memory import KNOWN, Architecture, gpu_bytes, peak, phases, plan, verdict

GIB = 1024 ** 3


def test_seven_b_plan_by_hand_with_the_decoding_loop(capsys, tmp_path):
    """The 7B recipe sampled by our decoding loop (`rollout.backend=hf`) instead of vLLM, with
    evaluation and labelling calls of the decoding loop's sizes (the recipe's vLLM-sized calls,
    1,024 samples and 512 continuations, would need 600 GiB of KV cache here: refused)."""
    hf = ["rollout.backend=hf", "policy.rollout_questions=1", "eval.batch_size=64",
          "label.prefixes_per_batch=8"]
    assert "over in labelling, evaluation: sampling" in verdict(
        plan(load_config("configs/deepseekmath_7b.yaml", hf[:2]), 8, 1, 256)[1], 141)
    cfg = load_config("configs/deepseekmath_7b.yaml", hf)
    rows, numbers = plan(cfg, gpus=8, nodes=1, prompt_tokens=256)
    arch = KNOWN["deepseek-ai/deepseek-math-7b-instruct"]
    # DeepSeek LLM 7B: 30 layers of 4096 wide, 102,400-token vocabulary, untied head: 6.91B.
    assert numbers["params"] == 6_910_365_696 == arch.params
    by_item = {r.item: r.gpu_bytes for r in rows}
    _, gpu, _ = estimate_zero3_model_states_mem_needs(arch.params, 102_400 * 4096, 8, 1,
                                                      cpu_offload=False, cpu_offload_params=False)
    # DeepSpeed's own number, and bf16 gradients accumulated in float32 under ZeRO-3: 2 more
    # bytes a partitioned param
    assert by_item["policy model states"] == gpu + 2 * arch.params / 8
    # 16 x 64 = 1,024 samples over 8 GPUs = 2 questions per GPU, generated one question
    # (policy.rollout_questions=1) at a time: 64 sequences of 256 + 1,024 tokens, bf16 K and V.
    assert by_item["rollout: KV cache"] == 64 * 1280 * 30 * 2 * 32 * 128 * 2
    assert by_item["whole policy"] == 2 * arch.params
    # Gradient checkpointing: each layer's bf16 input kept, one layer rebuilt at a time; the
    # logits in bf16 and the loss's float32 copy of them.
    tokens = 1280 * 8 * 4096
    assert by_item["update: activations"] == 30 * tokens * 2 + tokens * 34
    assert by_item["update: logits"] == 8 * 1280 * 102_400 * (2 + 4)
    # The reference is partitioned; the PRM scorer is loaded whole on every GPU.
    assert by_item["PRM (scoring)"] == 2 * arch.params
    assert by_item["reference model"] == 2 * arch.params / 8 + 2 * 102_400 * 4096
    assert verdict(numbers, 141).startswith("fits")
    weights = by_item["policy model states"] + by_item["reference model"] + by_item["PRM (scoring)"]
    rollout = {p.name: p for p in phases(numbers, 141)}["rollout"]
    assert rollout.peak == weights + by_item["whole policy"] + by_item["rollout: KV cache"]
    assert peak(numbers, 141) == rollout.peak
    assert igrpo.main(["plan", "--config", "configs/deepseekmath_7b.yaml", *hf,
                       "--gpus", "8", "--nodes", "1",
                       f"run.root={tmp_path}", "--gpu-gb", "80", "141"]) == 0
    out = capsys.readouterr().out
    assert "80 GB GPU (79.65 GiB" in out and "-> fits" in out
    assert not list(tmp_path.iterdir())  # planning runs nothing and writes nothing


def test_seven_b_recipe_fits_eight_80_gb_gpus_at_every_phase_on_vllm(capsys):
    """The recipe as shipped (vLLM, ZeRO-3, rollout.memory_fraction 0.4, vLLM asleep outside its
    generation), phase by phase by hand on an "80 GB" H100 (81,559 MiB = 79.65 GiB, 90% usable =
    71.7 GiB): vLLM's pool is 0.4 of the card; the push holds one gathered module (the
    embedding: it walks the ZeRO-3 policy module by module) beside vLLM's weights but not its KV
    cache; the rollout the pool; scoring and the update the GRPO stage's
    weights and their own working sets; start-up a whole model before ZeRO-3 partitions it."""
    cfg = load_config("configs/deepseekmath_7b.yaml")
    rows, numbers = plan(cfg, gpus=8, nodes=1, prompt_tokens=512)
    t = {r.item: r.gpu_bytes for r in rows}
    params = KNOWN["deepseek-ai/deepseek-math-7b-instruct"].params
    assert "rollout: KV cache" not in t  # the decoding loop's term is not counted
    assert gpu_bytes(80) == 81_559 * 2**20
    held = t["policy model states"] + t["reference model"] + t["PRM (scoring)"]
    pool, whole = 0.4 * 81_559 * 2**20, 2 * params
    module = 2 * 102_400 * 4_096  # the embedding in bf16, the largest module
    assert t["push: one gathered module"] == module
    # rm.score_batch_size 16 x 1,536 tokens x (4 x 4,096 + 3 x 11,008) bf16 values
    assert t["scoring: forward"] == 16 * 1536 * (4 * 4096 + 3 * 11_008) * 2
    assert t["update: logits"] == 8 * 1536 * 102_400 * 6
    by_phase = {p.name: p.peak for p in phases(numbers, 80)}
    assert by_phase == {
        "start-up": held + whole, "push": held + module + whole, "rollout": held + pool,
        "scoring": held + t["scoring: forward"],
        "update": held + t["update: activations"] + t["update: logits"],
        "reward models": t["reward model states"] + t["reward model: activations"],
        "labelling": pool, "evaluation: sampling": pool + 2 * t["PRM (scoring)"],
        "evaluation: scoring": 2 * t["PRM (scoring)"] + t["scoring: forward"]}
    assert max(by_phase.values()) == by_phase["rollout"] <= 0.9 * gpu_bytes(80)
    assert round(by_phase["rollout"] / GIB, 1) == 64.8
    # With the pool awake at the push (the order before) the push alone would need 78.4 GiB.
    assert (by_phase["push"] + pool) / GIB > 71.7
    per_sequence = (512 + 1024) * 30 * 2 * 32 * 128 * 2  # tokens x layers x K,V x heads x dim
    assert int((pool - whole) // per_sequence) == 27
    assert verdict(numbers, 80).startswith("fits") and verdict(numbers, 141).startswith("fits")
    awake = plan(load_config("configs/deepseekmath_7b.yaml", ["rollout.sleep=false"]), 8, 1,
                 512)[1]
    # without sleep the pool sits beside the push and the update: both go over
    assert verdict(awake, 80) == "does NOT fit: peak 78.4 GiB (push) of 71.7 usable; over in " \
        "push, update"
    tight = plan(load_config("configs/deepseekmath_7b.yaml", ["rollout.memory_fraction=0.16"]),
                 8, 1, 512)[1]
    assert verdict(tight, 80).startswith("does NOT fit: vLLM's KV cache")  # 12.7 < 12.87 GiB
    assert igrpo.main(["plan", "--config", "configs/deepseekmath_7b.yaml", "--gpus", "8",
                       "--gpu-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "-> fits: peak 64.8 GiB (rollout) of 71.7 usable" in out
    assert all(name in out for name in by_phase)


def test_two_nodes_halve_the_partitioned_states():
    cfg = load_config("configs/deepseekmath_7b.yaml", ["policy.rollout_questions=0",
                                                       "rollout.backend=hf"])
    one = dict((r.item, r.gpu_bytes) for r in plan(cfg, 8, 1)[0])
    two = dict((r.item, r.gpu_bytes) for r in plan(cfg, 8, 2)[0])
    assert two["rollout: KV cache"] == one["rollout: KV cache"] / 2
    assert two["policy model states"] < one["policy model states"]


def test_one_gpu_plan_for_the_qwen_config(capsys):
    cfg = load_config("configs/qwen25_math_1p5b.yaml")
    rows, numbers = plan(cfg, gpus=1, nodes=1, prompt_tokens=cfg.data.max_prompt_tokens)
    # Qwen2.5-Math-1.5B: 28 layers of 1536, 2 KV heads of 128, tied 151,936-token embeddings.
    assert numbers["params"] == KNOWN["Qwen/Qwen2.5-Math-1.5B-Instruct"].params
    assert 1.5e9 < numbers["params"] < 1.6e9
    by_item = {r.item: r.gpu_bytes for r in rows}
    assert by_item["whole policy"] == 2 * numbers["params"]
    found = {p.name: p for p in phases(numbers, 80)}
    # one GPU: nothing partitioned, so nothing gathered for the push, nothing loaded whole twice
    assert [k for k, _ in found["push"].terms][-1] == "vLLM weights"
    assert "one gathered module" not in dict(found["push"].terms)
    # vLLM's pool 0.3 x 79.65 GiB less its weights; a sequence: 512 + 1,024 tokens of 28 layers
    # of K and V, 2 KV heads of 128 in bf16. A question's 64 samples fit at once.
    from configs.memory import vllm_sequences

    assert vllm_sequences(numbers, 80)[1] == int((0.3 * gpu_bytes(80) - 2 * numbers["params"])
                                                 // (1536 * 28 * 2 * 2 * 128 * 2)) >= 64
    assert all(p.peak <= 0.9 * gpu_bytes(80) for p in found.values())
    assert verdict(numbers, 80).startswith("fits")
    assert igrpo.main(["plan", "--config", "configs/qwen25_math_1p5b.yaml", "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-Math-1.5B-Instruct" in out and "-> fits: peak 61.3 GiB (rollout)" in out


def test_ppo_plan_counts_the_critic():
    """The PPO family's critic: the 7B backbone without its untied LM head (6.91B - 102,400 x
    4,096 + a 4,096-wide value head = 6.49B params), with DeepSpeed's ZeRO-3 states; a recipe
    without the KL term (vc_ppo: beta 0) loads no reference."""
    grpo = load_config("configs/deepseekmath_7b.yaml")
    ppo = load_config("configs/deepseekmath_7b.yaml", recipe="ppo")
    by_grpo = {r.item: r.gpu_bytes for r in plan(grpo, 8, 1)[0]}
    rows, numbers = plan(ppo, 8, 1)
    by_ppo = {r.item: r.gpu_bytes for r in rows}
    critic = 6_910_365_696 - 102_400 * 4096 + 4096
    _, gpu, _ = estimate_zero3_model_states_mem_needs(critic, 102_400 * 4096, 8, 1,
                                                      cpu_offload=False, cpu_offload_params=False)
    assert by_ppo["critic model states"] == gpu + 2 * critic / 8
    assert peak(numbers, 80) == peak(plan(grpo, 8, 1)[1], 80) + gpu + 2 * critic / 8
    assert by_ppo.keys() - by_grpo.keys() == {"critic model states"}
    vc = {r.item for r in plan(load_config("configs/deepseekmath_7b.yaml", recipe="vc_ppo"),
                               8, 1)[0]}
    assert "reference model" not in vc and "critic model states" in vc


def test_an_online_orm_is_held_as_training_states_and_gathered_to_score():
    """`rm.online`: the ORM is a second training engine of the GRPO stage, its model states
    counted like the policy's (same architecture) in every phase the stage holds; it scores
    gathered whole, and its own update (activations of a micro-batch of `rm.max_length`) comes
    after the policy's."""
    args = ["rm.online=true", "policy.supervision=outcome"]
    frozen = dict((r.item, r.gpu_bytes) for r in plan(load_config(
        "configs/deepseekmath_7b.yaml", args[1:]), 8, 1, 256)[0])
    rows, numbers = plan(load_config("configs/deepseekmath_7b.yaml", args), 8, 1, 256)
    t = {r.item: r.gpu_bytes for r in rows}
    assert t["online RM model states"] == t["policy model states"]
    assert "online RM model states" not in frozen
    by_phase = {p.name: dict(p.terms) for p in phases(numbers, 80)}
    held = t["policy model states"] + t["reference model"] + t["online RM model states"]
    assert sum(by_phase["scoring"].values()) == held + t["ORM (scoring)"] + t["scoring: forward"]
    assert by_phase["scoring"]["gathered online RM"] == 2 * numbers["params"]  # bf16, whole
    assert sum(by_phase["RM update"].values()) == held + t["reward model: activations"]
    assert [p.name for p in phases(numbers, 80)].index("RM update") == \
        [p.name for p in phases(numbers, 80)].index("update") + 1
    # PRIME's implicit PRM: its frozen reference held like the policy's, its update an LM's
    rows, numbers = plan(load_config("configs/deepseekmath_7b.yaml",
                                     [*args, "rm.family=implicit"]), 8, 1, 256)
    t = {r.item: r.gpu_bytes for r in rows}
    assert t["implicit PRM reference"] == t["reference model"]
    by_phase = {p.name: dict(p.terms) for p in phases(numbers, 80)}
    assert "implicit PRM reference" in by_phase["rollout"]
    assert by_phase["RM update"]["logits"] == t["update: logits"]


def test_an_ensembles_members_are_each_held_like_the_reward_model():
    """`rm.ensemble=3`: two more reward models' bf16 weights held in every phase of the GRPO
    stage (the rollout's peak rises by exactly that), none outside it (the loop's reports read
    the first)."""
    one = plan(load_config("configs/deepseekmath_7b.yaml"), 8, 1, 256)
    rows, numbers = plan(load_config("configs/deepseekmath_7b.yaml", ["rm.ensemble=3"]), 8, 1,
                         256)
    t = {r.item: r.gpu_bytes for r in rows}
    assert t["2 more ensemble members (scoring)"] == 2 * t["PRM (scoring)"] == \
        2 * 2 * numbers["params"]
    before = {p.name: p.peak for p in phases(one[1], 80)}
    after = {p.name: p.peak for p in phases(numbers, 80)}
    extra = t["2 more ensemble members (scoring)"]
    for name in ("rollout", "scoring", "update"):
        assert after[name] == pytest.approx(before[name] + extra), name
    assert after["reward models"] == pytest.approx(before["reward models"])


def test_a_lora_policy_holds_a_frozen_base_and_the_adapters_states_and_no_reference():
    """`model.lora`: the 7B policy on one GPU as bf16 weights (not partitioned on one GPU) plus
    a rank-16 adapter on all 7 linear layers of its 30 layers, r * (in + out) each: 37.5M
    parameters whose states DeepSpeed's estimator counts; the reference is the base with the
    adapter off (no row). Every GRPO phase then fits one 80 GB card; training a full 7B
    reward model does not (it needs `rm.lora`)."""
    cfg = load_config("configs/deepseekmath_7b.yaml", ["model.lora.rank=16"])
    arch = KNOWN["deepseek-ai/deepseek-math-7b-instruct"]
    adapter = 30 * 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert arch.lora_params(16) == adapter == 37_478_400
    assert arch.lora_params(16, "q_proj,v_proj") == 30 * 16 * 2 * 8192
    rows, numbers = plan(cfg, gpus=1, nodes=1)
    by_item = {r.item: r.gpu_bytes for r in rows}
    _, gpu, _ = estimate_zero3_model_states_mem_needs(adapter, adapter, 1, 1, cpu_offload=False,
                                                      cpu_offload_params=False)
    assert by_item["policy model states"] == 2 * arch.params + gpu + 2 * adapter
    assert "reference model" not in by_item
    full = {r.item: r.gpu_bytes for r in plan(load_config("configs/deepseekmath_7b.yaml"), 1,
                                                1)[0]}
    assert full["policy model states"] > 5 * by_item["policy model states"]
    grpo = [p for p in phases(numbers, 80) if p.name not in ("reward models",)]
    assert all(p.peak <= 0.9 * gpu_bytes(80) for p in grpo)
    assert "over in reward models" in verdict(numbers, 80)
    assert "LoRA rank 16: 37.5M trained" in numbers["title"]
    # `rm.lora` too: the reward model's training holds the same frozen base and adapter states,
    # and the whole 7B iteration fits one 80 GB card (peak at rollout, beside vLLM's pool).
    both = load_config("configs/deepseekmath_7b.yaml", ["model.lora.rank=16", "rm.lora.rank=16"])
    rows, numbers = plan(both, gpus=1, nodes=1)
    by_item = {r.item: r.gpu_bytes for r in rows}
    assert by_item["reward model states"] == by_item["policy model states"]
    assert verdict(numbers, 80).startswith("fits: peak 58.4 GiB (rollout)")
    # The push gathers a module at a time: here the embedding (102,400 x 4,096), larger than
    # the fused gate and up vLLM buffers with, under LoRA, the gathered W beside both merged
    # copies (3 x 4,096 x 11,008); on the tiny shape the buffered MLP pieces are what counts.
    assert by_item["push: one gathered module"] == 2 * 102_400 * 4_096
    tiny = Architecture(hidden=256, layers=4, heads=4, kv_heads=4, intermediate=512, vocab=100)
    assert (tiny.push_module_params(False), tiny.push_module_params(True)) == \
        (2 * 256 * 512, 3 * 256 * 512)


def test_the_qwen_recipe_with_lora_holds_a_tenth_of_its_full_states():
    """The 1.5B recipe on one GPU (ZeRO-2, bf16): 18.5M adapter parameters (rank 16, 28 layers,
    2 KV heads of 128) beside the 3.1 GB frozen base, against full fine-tuning's 31.6 GiB."""
    arch = KNOWN["Qwen/Qwen2.5-Math-1.5B-Instruct"]
    assert arch.lora_params(16) == 28 * 16 * (2 * 3072 + 2 * (1536 + 256) + 3 * (1536 + 8960))
    full = {r.item: r.gpu_bytes for r in plan(load_config("configs/qwen25_math_1p5b.yaml"),
                                                1, 1)[0]}
    cfg = load_config("configs/qwen25_math_1p5b.yaml", ["model.lora.rank=16", "rm.lora.rank=16"])
    rows, numbers = plan(cfg, 1, 1)
    lora = {r.item: r.gpu_bytes for r in rows}
    assert lora["policy model states"] < full["policy model states"] / 9
    assert "reference model" in full and "reference model" not in lora
    assert verdict(numbers, 80).startswith("fits: peak 30.0 GiB (rollout)")


def test_a_prm_scored_through_vllm_holds_its_pooling_engines_kv_cache_after_start_up():
    """`rm.backend=vllm`: the PRM's pooling engine never sleeps, so its KV cache
    (`rm.vllm_kv_cache_gb`) is in every phase of the 7B recipe but start-up, by exactly its
    size; its weights are the scorer's row, counted as before."""
    overrides = ["rm.family=token_classification", "rm.add_tag_token=false"]
    base = load_config("configs/deepseekmath_7b.yaml", overrides)
    pooled = load_config("configs/deepseekmath_7b.yaml",
                         [*overrides, "rm.backend=vllm", "rm.vllm_kv_cache_gb=2"])
    rows, numbers = plan(pooled, gpus=8, nodes=1, prompt_tokens=512)
    t = {r.item: r.gpu_bytes for r in rows}
    assert t["PRM pooling engine: KV cache"] == 2 * GIB
    assert t["PRM (scoring)"] == {r.item: r.gpu_bytes for r in plan(base, 8, 1, 512)[0]}[
        "PRM (scoring)"]
    before = {p.name: p.peak for p in phases(plan(base, 8, 1, 512)[1], 80)}
    after = {p.name: p.peak for p in phases(numbers, 80)}
    assert after.keys() == before.keys()
    assert {k: round((after[k] - before[k]) / GIB, 9) for k in after} == {
        k: 0.0 if k == "start-up" else 2.0 for k in after}
