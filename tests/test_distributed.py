"""Data parallelism on CPU with gloo: 2 processes compute what 1 process computes on the same global
batch (a GRPO step under ZeRO-3, a PPO step under ZeRO-2), and a 2-"node" run on localhost
completes a GRPO step. Algorithm 1 end to end on 2 processes, under every ZeRO stage and with
kills: tests/test_zero_stages.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from configs import load_config
from policy.trace import read_trace
from runtime.tiny_model import build_tiny
from runtime.tracking import read_metrics

from fault_injection import Zygote
from launch import ENV, ROOT, free_port, torchrun
from small_config import SMALL

TOL = dict(rtol=1e-4, atol=1e-6)
"""fp32 on CPU: sums split across ranks and micro-batches round differently, nothing more."""


@pytest.fixture(scope="module")
def ranks():
    """Launches `tests/helpers/dist_check.py` as torchrun would, its ranks forked from one
    process that imported the project once (a cold torchrun launch costs its agent's and every
    rank's imports, about 5 s a process on 2 cores); torchrun itself is tested below."""
    zygote = Zygote(env={"DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled",
                         "OMP_NUM_THREADS": "1"})
    yield zygote
    zygote.close()


def _launch(ranks: Zygote, nproc: int, case: str, out: Path, *args, env: dict | None = None):
    """`torchrun --nproc_per_node NPROC tests/helpers/dist_check.py CASE OUT ARGS`."""
    ranks.launch(nproc, "dist_check", case, out, *args, log=Path(f"{out}.log"), env=env)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = load_config("configs/tiny.yaml", SMALL)
    return build_tiny(tmp_path_factory.mktemp("base") / "tiny", cfg.model.tiny, 0,
                      extra_tokens=(cfg.rm.step_tag,))


def _weights(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], **TOL, msg=key)


def test_a_launched_rank_that_nobody_initialised_sees_its_world(tmp_path):
    """A stage called directly under torchrun (not through the CLI, which initialises the
    process group first) still learns it is one of two ranks, instead of running the whole
    batch as if alone while DeepSpeed averages the two."""
    torchrun(2, "tests/helpers/dist_check.py", "world", tmp_path)
    assert [(tmp_path / f"world-rank{r}.txt").read_text() for r in (0, 1)] == \
        ["(0, 2)", "(1, 2)"]


def test_step_metrics_of_two_ranks_describe_the_whole_batch(tmp_path, ranks):
    """Two ranks holding different halves of a batch log what one process holding all of it
    logs: rewards, lengths, truncation, entropy and the group counts are gathered, not rank 0's
    share (tests/helpers/dist_check.py builds the batch)."""
    metrics = {}
    for nproc in (1, 2):
        _launch(ranks, nproc, "metrics", tmp_path / f"p{nproc}")
        metrics[nproc] = json.loads((tmp_path / f"p{nproc}" / "metrics.json").read_text())
    one, two = metrics[1], metrics[2]
    assert one.keys() == two.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    # Hand-computed from the batch: 12 samples, rewards summing to 5.5 (5 of them 1), 3
    # truncated, 42 completion tokens.
    assert one["reward/mean"] == pytest.approx(5.5 / 12)
    assert one["reward/accuracy"] == pytest.approx(5 / 12)
    assert one["rollout/length_mean"] == pytest.approx(42 / 12)
    assert one["rollout/truncation_rate"] == pytest.approx(3 / 12)
    assert one["reward/nonfinite_groups"] == 1
    assert one["rollout/tokens_per_s"] == pytest.approx(42 / 2.0)


def _grpo_step(ranks: Zygote, nproc: int, out: Path, base, stage: int, *overrides) -> tuple:
    """dist_check.py's GRPO step on `nproc` processes: (its metrics row, the advantages the loss
    received, every rank's rows in order, the run folder)."""
    _launch(ranks, nproc, "grpo", out, base, stage, *overrides)
    row = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r][0]
    advantages = [torch.load(out / f"advantages-rank{r}.pt", weights_only=True)
                  for r in range(nproc)]
    width = max(a.shape[1] for a in advantages)
    return row, torch.cat([torch.nn.functional.pad(a, (0, width - a.shape[1]))
                           for a in advantages]), out


def _same_step(one: tuple, two: tuple) -> None:
    """The advantages the loss received, the step's metrics and the updated weights of two
    `_grpo_step` runs agree."""
    (one, adv1, out1), (two, adv2, out2) = one, two
    assert adv1.abs().sum() > 0 and adv1.shape[0] == 16
    width = max(adv1.shape[1], adv2.shape[1])
    torch.testing.assert_close(torch.nn.functional.pad(adv1, (0, width - adv1.shape[1])),
                               torch.nn.functional.pad(adv2, (0, width - adv2.shape[1])), **TOL)
    # The step's metrics describe the whole batch on both: each rank gathers the others' rows.
    for key in ("train/loss", "train/kl", "train/grad_norm", "reward/mean", "reward/std",
                "reward/group_std", "rollout/length_mean", "rollout/length_max",
                "rollout/truncation_rate", "train/entropy", "train/kept_groups"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert one["train/grad_norm"] > 0 and one["train/kl"] > 0  # mu=2: the 2nd update sees KL
    # The watch reads every rank's rows: its measures and the step's questions agree too.
    for key in ("watch/group_auroc", "watch/adv_auroc", "watch/trace_auroc", "watch/wrong_push",
                "watch/gold",
                "watch/proxy", "watch/kl_init", "watch/steps_per_solution",
                "watch/tokens_per_step", "watch/mixed_groups"):
        if isinstance(one[key], str):  # "nan": no group held both right and wrong samples
            assert two[key] == one[key], key
        else:
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert two["watch/question_ids"] == one["watch/question_ids"]
    # ... and so does the trace the main rank wrote of every rank's samples.
    rows1, rows2 = (read_trace(out / "grpo" / "trace") for out in (out1, out2))
    assert len(rows1) == 16 and [r["question_id"] for r in rows2] == \
        [r["question_id"] for r in rows1]
    for a, b in zip(rows1, rows2):
        assert (a["completion"], a["reward"], a["step_ends"]) == \
            (b["completion"], b["reward"], b["step_ends"])
        assert b["token_advantages"] == pytest.approx(a["token_advantages"], rel=1e-4, abs=1e-6)
    _same_weights(out1 / "grpo" / "final", out2 / "grpo" / "final")


def _prm_steps(ranks: Zygote, nproc: int, out: Path, base: Path, stage: int, data: Path,
               *overrides) -> list:
    _launch(ranks, nproc, "rm", out, base, stage, data, *overrides)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("family,stage", [("token_classification", 3), ("tag_lm", 2)])
def test_packed_prm_steps_on_two_processes_equal_the_padded_ones_on_one(tmp_path, ranks, base, family,
                                                                        stage):
    """Reward-model training packed (`rm.pack`, the default: no padding, a question's tokens
    run once for its solutions, batches holding a question's solutions side by side) on 2
    processes under ZeRO-2 / ZeRO-3 equals the padded forward on one: every step's loss and
    gradient norm, and the exported weights."""
    from process_supervision.formats import to_math_shepherd

    cfg = load_config("configs/tiny.yaml", SMALL)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(dict(zip(("input", "label"), to_math_shepherd(
        f"What is {i % 4} + {i % 4}?", [f"{i % 4} + {i % 4} = {2 * (i % 4) + i % 3}",
                                        f"The answer is {i}" * (1 + i % 2)],
        [i % 3 == 0, i % 3 == 0], cfg.rm.step_tag)))) + "\n" for i in range(16)))
    settings = [f"rm.family={family}", "rm.lm_weight=0", "rm.likelihood_feature=false",
                "rm.group_by_question=true", "rm.lr=1e-3"]
    if family == "token_classification":  # (deepening is the tag LM's)
        settings.append("rm.extra_layers_from=[]")
    padded = _prm_steps(ranks, 1, tmp_path / "p1", base, 0, data, *settings, "rm.pack=false")
    packed = _prm_steps(ranks, 2, tmp_path / "p2", base, stage, data, *settings)
    assert len(packed) == len(padded) == 2  # 16 rows, 8 a step
    for one, two in zip(padded, packed):
        for key in ("rm/loss", "rm/grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert padded[-1]["rm/loss"] != padded[0]["rm/loss"]
    _same_weights(tmp_path / "p1" / "rm" / "final", tmp_path / "p2" / "rm" / "final")


@pytest.mark.slow
def test_grpo_step_two_processes_equal_one(tmp_path, ranks, base, stage=3):
    """One GRPO step under ZeRO-3 on 2 processes: the advantages the loss received, the step's
    metrics and the updated weights equal one process's (ZeRO-2, and the reward model's steps,
    are compared over whole `iterate` runs in tests/test_zero_stages.py)."""
    _same_step(_grpo_step(ranks, 1, tmp_path / "p1", base, stage),
               _grpo_step(ranks, 2, tmp_path / "p2", base, stage))


@pytest.mark.slow
def test_grpo_step_under_gradient_checkpointing_on_two_processes_equals_one(tmp_path, ranks, base):
    """Gradient checkpointing on (both GPU configs): the packed update, its layers checkpointed
    by us and replayed in the packed attention, under ZeRO-3 (parameters gathered again in the
    replay) on 2 processes equals one process's step, which equals the step without
    checkpointing (the packed path, replayed, gives the same gradients)."""
    ck = ("model.gradient_checkpointing=true",)
    one = _grpo_step(ranks, 1, tmp_path / "p1", base, 3, *ck)
    _same_step(one, _grpo_step(ranks, 2, tmp_path / "p2", base, 3, *ck))
    _same_step(one, _grpo_step(ranks, 1, tmp_path / "plain", base, 3))


@pytest.mark.slow
def test_lora_grpo_step_two_processes_equal_one(tmp_path, ranks, base):
    """A GRPO step of a LoRA policy (`model.lora`, rank 4 on every linear layer) on 2 processes
    under ZeRO-2 and under ZeRO-3 equals one process's: advantages, metrics (its KL against the
    reference that is the policy's own module with the adapter off), the watch, the trace and
    the merged export. Only the adapter moved: the export differs from the base in every
    adapted layer and equals it in the embedding and the norms."""
    extra = ("model.lora.rank=4", "model.lora.alpha=8", "policy.lr=1e-3",
             "policy.temperature=1.0", "policy.rollout_questions=1")
    one = _grpo_step(ranks, 1, tmp_path / "p1", base, 0, *extra)
    for stage in (2, 3):
        _same_step(one, _grpo_step(ranks, 2, tmp_path / f"z{stage}", base, stage, *extra))
    start, end = load_file(base / "model.safetensors"), _weights(tmp_path / "p1" / "grpo" / "final")
    assert end.keys() == start.keys()  # a plain checkpoint: no adapter tensors
    for key in end:
        moved = not torch.equal(end[key], start[key])
        assert moved == key.endswith("proj.weight"), key


def test_a_zero3_push_streams_the_merged_weights_gathering_one_module_at_a_time(tmp_path, ranks):
    """What a vLLM push draws from a ZeRO-3 policy on 2 processes (`iter_weights` through
    `module_gather`), whole and under LoRA: every rank gets the merged weights one process
    computes from the whole model, bit for bit and in the checkpoint's order, while no more
    than the largest module (a LoRA layer with its adapter) is gathered beyond what ZeRO-3
    keeps whole anyway; gathering the policy whole first, as a push did before, makes all of
    the partitioned values whole at once. The adapter alone (`rollout.lora_push=adapter`), as
    peft saves it with its tensors gathered, holds the adapter's own values on every rank."""
    _launch(ranks, 2, "push", tmp_path)
    by_rank = json.loads((tmp_path / "push.json").read_text())
    for got in by_rank:
        for kind in ("full", "lora"):
            stream = got[kind]
            assert stream["partitioned"], kind  # (the check below would be vacuous)
            assert stream["keys"] == stream["reference_keys"] and stream["differ"] == [], kind
            assert 0 < stream["most_whole"] <= stream["largest_module"], kind
            assert stream["largest_module"] < stream["total"] / 10, kind
    assert by_rank[0] == by_rank[1]


@pytest.mark.slow
@pytest.mark.parametrize("credit", ["min", "anchored", "anchored-gold-budget", "prime-ensemble"])
def test_grpo_credit_form_two_processes_equal_one(tmp_path, ranks, base, credit):
    """`grpo.process_credit` min, anchored and prime (the sum form is the test above), anchored
    under a gold budget of half the questions, and prime rewarded by an ensemble of two
    step rewards (`rm.ensemble`, worst case): one GRPO step on 2 processes under ZeRO-2 and
    under ZeRO-3 equals one process's, the ensemble's per-member AUROCs and shared error too.
    Sampled at temperature 1 (a group's samples differ, so the min-form values and the
    final-answer checks spread), one question per generate call so that sampling does not
    depend on the ranks."""
    extra = (f"grpo.process_credit={credit.split('-')[0]}", "policy.temperature=1.0",
             "policy.rollout_questions=1",
             *(["grpo.gold_share=0.5"] if credit.endswith("budget") else []),
             *(["rm.ensemble=2", "rm.ensemble_aggregate=worst"] if credit.endswith("ensemble")
               else []))
    one = _grpo_step(ranks, 1, tmp_path / "p1", base, 2, *extra)
    for stage in (2, 3):
        two = _grpo_step(ranks, 2, tmp_path / f"z{stage}", base, stage, *extra)
        _same_step(one, two)
        if credit.endswith("budget"):  # every rank reads the same questions' checks
            assert two[0]["reward/gold_revealed"] == one[0]["reward/gold_revealed"]
        if credit.endswith("ensemble"):  # every rank's members' scores, gathered
            for key in ("watch/member_auroc/0", "watch/member_auroc/1", "watch/shared_error"):
                assert two[0][key] == pytest.approx(one[0][key], rel=1e-6), key
    # Groups hold right and wrong samples, so the watch's AUROCs are measured; the anchored form
    # puts the exact check into the advantage: it ranks right above wrong in every group.
    assert one[0]["watch/mixed_groups"] > 0
    if credit == "anchored":
        assert one[0]["watch/adv_auroc"] == 1.0 and one[0]["watch/wrong_push"] == 0.0
        assert "reward/gold_revealed" not in one[0]
    if credit.endswith("budget"):
        assert 0.0 <= one[0]["reward/gold_revealed"] <= 1.0
    if credit.endswith("ensemble"):  # the members disagree: the worst case is neither
        assert one[0]["watch/member_auroc/0"] != one[0]["watch/member_auroc/1"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo-online", "grpo-online-lora", "grpo-implicit",
                                  "grpo-prime"])
def test_online_reward_model_steps_on_two_processes_equal_one(tmp_path, ranks, base, kind):
    """GRPO rewarded by a reward model that learns from the step's samples (`rm.online`: the
    ORM, whole or under a LoRA adapter (`rm.lora`); PRIME's implicit PRM, two steps, the second rewarded by what it learned in the first;
    PRIME's own order, the PRM stepping inside the scoring, and its gold term):
    on 2 processes under ZeRO-2 and under ZeRO-3 the last step equals one process's, the
    policy's update and the reward model's (its loss, gradient norm and exported weights), the
    2-process gradients perturbed by an ulp as in the recipes' test below. Both models moved far
    past the tolerance."""
    runs = {}
    for name, nproc, stage in (("p1", 1, 0), ("z2", 2, 2), ("z3", 2, 3)):
        out = tmp_path / name
        _launch(ranks, nproc, kind, out, base, stage,
                env={"DIST_CHECK_GRAD_ULPS": "1"} if nproc == 2 else None)
        runs[name] = ([r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r][-1],
                      out)
    one, out1 = runs["p1"]
    assert one["online_rm/grad_norm"] > 0 and one["train/grad_norm"] > 0
    assert one["reward/group_std"] > 0  # the ORM's scores spread within groups
    assert one["reward/gold_read"] == 1.0  # every check trained the ORM, after scoring
    for name in ("z2", "z3"):
        two, out2 = runs[name]
        for key in ("train/loss", "train/grad_norm", "reward/mean", "reward/group_std",
                    "online_rm/loss", "online_rm/grad_norm", "online_rm/right_share"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (name, key)
        for folder in ("final", "online-rm"):
            _same_weights(out1 / "grpo" / folder, out2 / "grpo" / folder)
    start = _weights(Path(base))
    for folder in ("final", "online-rm"):
        end = _weights(out1 / "grpo" / folder)
        adapted = kind.endswith("lora") and folder == "online-rm"  # (its adapter alone moved)
        assert end.keys() == start.keys()  # a plain checkpoint, the adapter merged
        moved = torch.cat([(end[k] - start[k]).abs().flatten() for k in end
                           if not adapted or k.endswith("proj.weight")])
        assert moved.median() > 100 * TOL["atol"], folder
        if adapted:
            assert torch.equal(end["model.embed_tokens.weight"],
                               start["model.embed_tokens.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe, stage", [("gspo", 3), ("dpo", 3), ("online_dpo", 2)])
def test_gspo_and_dpo_steps_on_two_processes_equal_one(tmp_path, ranks, base, recipe, stage):
    """A GSPO step (GSPO-token on process rewards, 4 mini-batches: 4 optimizer steps), two DPO
    steps on pairs of the starting policy's samples and two online DPO steps on 2 processes
    equal one process's: the losses, the pairs and the weights (a mini-batch and a pair hold
    the same samples however many ranks share the step; DPO's second step against a reference
    that is no longer the policy). The 2-process gradients are perturbed by one float32 ulp of
    their RMS before each optimizer step, more than another reduction order changes, so the
    comparison holds on any CPU; AdamW's eps (1e-3 here) bounds what that can move a weight
    (test_engine.py shows the default 1e-8 turning it into differences of the rate's order)."""
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"p{nproc}"
        _launch(ranks, nproc, recipe, out, base, stage,
                env={"DIST_CHECK_GRAD_ULPS": "1"} if nproc == 2 else None)
        runs[nproc] = ([r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r][-1],
                       out)
    (one, out1), (two, out2) = runs[1], runs[2]
    keys = ("dpo/pairs", "dpo/margin", "dpo/accuracy") if "dpo" in recipe else \
        ("train/clip_fraction", "train/entropy", "reward/group_std")
    for key in ("train/loss", "train/grad_norm", "reward/mean", *keys):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert one["train/grad_norm"] > 0 and one.get("dpo/pairs", 1) > 0
    assert one.get("dpo/margin", 1) != 0  # the reference forward ran
    folder = "dpo" if "dpo" in recipe else "grpo"  # train_dpo's own folder (gspo is GRPO's)
    _same_weights(out1 / folder / "final", out2 / folder / "final")
    # ... and the steps moved the weights far past the comparison's tolerance
    start, end = _weights(Path(base)), _weights(out1 / folder / "final")
    moved = torch.cat([(end[k] - start[k]).abs().flatten() for k in end])
    assert moved.median() > 100 * TOL["atol"]


@pytest.mark.slow
def test_ppo_step_two_processes_equal_one(tmp_path, ranks, base):
    """PPO's step over 2 processes (ZeRO-2): the advantages are whitened and both losses
    normalised over the global batch, so the losses, the policy and the critic equal one
    process's."""
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"p{nproc}"
        _launch(ranks, nproc, "ppo", out, base, 2)
        runs[nproc] = ([r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r][0],
                       out)
    (one, out1), (two, out2) = runs[1], runs[2]
    for key in ("train/loss", "critic/value_loss", "train/grad_norm", "critic/grad_norm",
                "critic/value_mean", "critic/explained_variance", "train/kl", "reward/mean",
                "rollout/length_mean"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert one["critic/grad_norm"] > 0 and one["train/grad_norm"] > 0
    _same_weights(out1 / "ppo" / "final", out2 / "ppo" / "final")
    _same_weights(out1 / "ppo" / "critic", out2 / "ppo" / "critic")


@pytest.mark.slow
def test_two_nodes_on_localhost_complete_a_grpo_step(tmp_path, base):
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
         "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
         "tests/helpers/dist_check.py", "grpo", str(tmp_path / "run"), str(base), "2"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    row = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r][0]
    assert row["train/grad_norm"] > 0
    assert (tmp_path / "run" / "grpo" / "final" / "model.safetensors").exists()
    assert (tmp_path / "run" / "advantages-rank1.pt").exists()  # the second node took part
