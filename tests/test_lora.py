"""LoRA through peft (runtime/lora.py): the adapter's size counted by hand, the merged weights
equal to peft's own merge without touching the model, the reference as the base with the adapter
off, and an export that plain transformers loads with the adapted model's outputs."""

import copy
import inspect
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs import load_config
from configs.schema import LoraConfig
from policy.generation.logprobs import completion_logprobs
from runtime.checkpoint import save_pretrained
from runtime.lora import AdapterOff, LoraSettings, iter_weights, merged_weights, with_adapter
from runtime.models import load_causal_lm, load_tokenizer
from runtime.tiny_model import build_tiny

from launch import ENV, ROOT
from small_config import SMALL


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = load_config("configs/tiny.yaml", SMALL)
    return build_tiny(tmp_path_factory.mktemp("base") / "tiny", cfg.model.tiny, 0,
                      extra_tokens=(cfg.rm.step_tag,))


def _adapted(base, rank=4, targets="all-linear", seed=1):
    """The base under a LoRA adapter whose B is random (a trained adapter's stand-in: a fresh
    one is 0, and merges to the base)."""
    model = with_adapter(load_causal_lm(base), LoraSettings.of(
        LoraConfig(rank=rank, alpha=8.0, target_modules=targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
    return model


def _batch(base):
    tokenizer = load_tokenizer(base)
    ids = tokenizer(["1+2=3\n", "4*5=20\n"], return_tensors="pt", padding=True)
    return ids["input_ids"], ids["attention_mask"]


def test_the_adapter_trains_what_rank_times_in_plus_out_counts_and_says_so(base, capsys):
    """Every linear layer of every decoder layer gets A [r, in] and B [out, r], the output head
    none: r * (in + out) parameters a layer, printed with their share."""
    plain = load_causal_lm(base)
    c = plain.config
    h, f, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * c.head_dim
    per_layer = sum(4 * (i + o) for i, o in (
        (h, h), (h, kv), (h, kv), (h, h),  # q, k, v, o
        (h, f), (h, f), (f, h)))           # gate, up, down
    total = sum(p.numel() for p in plain.parameters())
    model = with_adapter(plain, LoraSettings.of(LoraConfig(rank=4)))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    expected = c.num_hidden_layers * per_layer
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected
    printed = capsys.readouterr().out
    assert f"{expected:,} of {total + expected:,} parameters train" in printed
    assert f"({100 * expected / (total + expected):.2f}%)" in printed


def test_rank_zero_is_no_adapter_and_unknown_targets_are_named():
    assert LoraSettings.of(LoraConfig()) is None
    assert LoraSettings.of(LoraConfig(rank=2, target_modules="q_proj, v_proj")).targets() == \
        ["q_proj", "v_proj"]


def test_unknown_target_modules_are_refused_naming_the_key(base):
    with pytest.raises(ValueError, match="lora.target_modules='nope_proj'"):
        with_adapter(load_causal_lm(base), LoraSettings.of(
            LoraConfig(rank=2, target_modules="nope_proj")))


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_merged_weights_are_peft_merge_and_leave_the_model_untouched(base, targets):
    model = _adapted(base, targets=targets)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_weights(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for key in merged:
        torch.testing.assert_close(merged[key], reference[key], rtol=0, atol=1e-7, msg=key)
    after = model.state_dict()  # nothing merged into the module and out again
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The push's stream: the same tensors, made one at a time as they are taken.
    stream = iter_weights(model)
    assert inspect.isgenerator(stream)
    streamed = dict(stream)
    assert list(streamed) == list(reference)  # the checkpoint's order
    assert all(torch.equal(streamed[k], merged[k]) for k in merged)
    # A plain model's weights are its state dict.
    plain = load_causal_lm(base)
    assert merged_weights(plain).keys() == plain.state_dict().keys()


def test_the_stream_gathers_one_module_at_a_time_and_draws_each_tensor_inside_it(base):
    """`iter_weights(model, gather)` (a push from a ZeRO-3 policy): each module is gathered
    alone (a LoRA layer with its base weight and its A and B, any other module its own
    parameters), each tensor is drawn while its module is gathered, every parameter is
    gathered, and the stream is the merged weights."""
    model = _adapted(base)
    names = {id(p): n for n, p in model.named_parameters()}
    open_, gathers, drawn = [], [], {}

    @contextmanager
    def gather(params):
        assert not open_, "two modules gathered at once"
        open_.append([names[id(p)] for p in params])
        gathers.append(open_[-1])
        yield
        open_.pop()

    for key, tensor in iter_weights(model, gather):
        assert open_, f"{key} drawn outside a gather"
        drawn[key] = (tensor, open_[-1])
    assert {n for g in gathers for n in g} == set(names.values())
    q = "base_model.model.model.layers.0.self_attn.q_proj."
    assert sorted(drawn["model.layers.0.self_attn.q_proj.weight"][1]) == [
        f"{q}base_layer.weight", f"{q}lora_A.default.weight", f"{q}lora_B.default.weight"]
    assert drawn["model.norm.weight"][1] == ["base_model.model.model.norm.weight"]
    merged = merged_weights(model)
    assert list(drawn) == list(merged)
    assert all(torch.equal(drawn[k][0], merged[k]) for k in merged)


def test_the_reference_under_lora_is_the_base_with_the_adapter_off(base):
    """`AdapterOff` (a LoRA stage's reference) computes the base model's log-probs exactly, the
    adapted policy others; and it leaves the adapter on afterwards."""
    ids, mask = _batch(base)
    model, plain = _adapted(base), load_causal_lm(base)
    with torch.no_grad():
        policy = completion_logprobs(model, ids, mask, 3)
        off = completion_logprobs(AdapterOff(model), ids, mask, 3)
        truth = completion_logprobs(plain, ids, mask, 3)
        again = completion_logprobs(model, ids, mask, 3)
    assert torch.equal(off, truth)
    assert (policy - truth).abs().max() > 1e-3
    assert torch.equal(again, policy)
    assert AdapterOff(model).config is model.config


def test_an_adapted_export_loads_in_plain_transformers_in_a_clean_process(base, tmp_path):
    """The stage's export of a LoRA policy is a plain checkpoint: no adapter files, and a clean
    process's `AutoModelForCausalLM` gives the adapted model's logits (to 1e-5)."""
    model = _adapted(base)
    out = save_pretrained(model, load_tokenizer(base), tmp_path / "export")
    assert (out / "model.safetensors").exists()
    assert not (out / "adapter_config.json").exists()
    ids, mask = _batch(base)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    save_file({"ids": ids, "mask": mask}, tmp_path / "batch.safetensors")
    code = ("import sys; from safetensors.torch import load_file, save_file;"
            "from transformers import AutoModelForCausalLM;"
            "b = load_file(sys.argv[2]); m = AutoModelForCausalLM.from_pretrained(sys.argv[1]);"
            "save_file({'logits': m(input_ids=b['ids'], attention_mask=b['mask'])"
            ".logits.detach().contiguous()}, sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, str(out), str(tmp_path / "batch.safetensors"),
                    str(tmp_path / "logits.safetensors")], check=True, cwd=ROOT, env=ENV,
                   timeout=300)
    got = load_file(tmp_path / "logits.safetensors")["logits"]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert (got - load_causal_lm(base)(input_ids=ids, attention_mask=mask).logits).abs().max() \
        > 1e-3  # (the adapter is in it)


@pytest.mark.parametrize("override, message", [
    ("model.lora.rank=-1", "model.lora.rank = -1"),
    ("model.lora.alpha=0", "model.lora.alpha = 0"),
    ("model.lora.dropout=1.0", "model.lora.dropout = 1.0"),
    ("policy.tis_cap=0.5", "policy.tis_cap = 0.5"),
    ("rollout.lora_push=adapter", "rollout.backend=vllm (got hf)"),
    ("rollout.lora_push=adapter model.lora.rank=0 rollout.backend=vllm",
     "model.lora.rank > 0 (got 0)"),
    ("rollout.lora_push=adapter model.lora.rank=600 rollout.backend=vllm",
     "vLLM serves adapters up to rank 512"),
])
def test_bad_lora_and_tis_settings_are_refused_naming_the_key(override, message):
    from configs.loader import ConfigError

    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_config("configs/tiny.yaml", ["model.lora.rank=4", *override.split()])


def test_a_stage_from_a_merged_export_starts_a_fresh_adapter_whose_reference_is_that_export(
        base, tmp_path):
    """Algorithm 1's reset under LoRA: the stage after a LoRA stage starts from its merged export
    (here a trained adapter's), under a fresh adapter (every B is 0, so the policy computes the
    export's log-probs), and its reference, the policy's module with the adapter off, computes
    exactly what the export loaded alone computes; no second model is loaded for it."""
    from iteration.resolve import resolve
    from policy.engines import policy_engines

    export = save_pretrained(_adapted(base), load_tokenizer(base), tmp_path / "iteration-1")
    cfg = load_config("configs/tiny.yaml", [*SMALL, "model.lora.rank=4", "model.lora.alpha=8"])
    _, _, engine, reference = policy_engines(resolve(cfg).stage, export, export)
    assert isinstance(reference, AdapterOff) and reference.policy is engine.module
    assert all(not p.any() for n, p in engine.module.named_parameters() if "lora_B" in n)
    ids, mask = _batch(base)
    with torch.no_grad():
        truth = completion_logprobs(load_causal_lm(export), ids, mask, 3)
        off = completion_logprobs(reference, ids, mask, 3)
        policy = completion_logprobs(engine.module, ids, mask, 3)
        started = completion_logprobs(load_causal_lm(base), ids, mask, 3)
    assert torch.equal(off, truth)
    torch.testing.assert_close(policy, truth, rtol=0, atol=1e-6)
    assert (truth - started).abs().max() > 1e-3  # (the export is not the base)
