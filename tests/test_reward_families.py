"""Reward models by family (reward_model/families.py): each adapter's scores equal the ones read
by hand from the model's own logits at the right positions, on random Llama and Qwen2 models of
each class over the shipped GPT-2 BPE, saved with `save_pretrained` and loaded back as each family
loads them; a token-classification PRM trained here reloads in plain transformers with the same
scores; GRPO runs rewarded by each family."""

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import (AutoConfig, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, AutoTokenizer)

import igrpo
from configs import ConfigError, load_config
from process_supervision.formats import StepExample
from reward_model.families import (FamilyError, SequenceScorer, TokenClassScorer, infer_family,
                                   load_reward_model)
from reward_model.score import TagScorer
from runtime.tiny_model import build_stand_in
from runtime.tracking import read_metrics

EXAMPLES = [StepExample("What is 3 + 4?", ("3 + 4 = 7", "The answer is 7"), (1.0, 1.0)),
            StepExample("Tom has 5 apples and eats 2. How many are left?",
                        ("5 - 2 = 4", "So 4 are left", "The answer is 4"), (0.0, 0.0, 0.0)),
            StepExample("Double 6.", ("6 * 2 = 12",), (1.0,))]


def _classifier(tmp_path, architecture, auto_class, num_labels, chat=False, extra_tokens=()):
    """A random `auto_class` model of `architecture` over the GPT-2 BPE, saved and loaded back."""
    lm = build_stand_in(tmp_path / f"{architecture}-lm", architecture, chat=chat)
    torch.manual_seed(0)
    model = auto_class.from_pretrained(lm, num_labels=num_labels)
    tokenizer = AutoTokenizer.from_pretrained(lm)
    if extra_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.eos_token_id
    with torch.no_grad():  # a head that is not near zero, so that positions tell apart
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = tmp_path / f"{architecture}-{auto_class.__name__}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _rm(**settings):
    """The tiny config's `rm` section (a plain dataclass) with `settings`."""
    cfg = load_config("configs/tiny.yaml", ["rm.lm_weight=0", "rm.likelihood_feature=false"])
    return dataclasses.replace(OmegaConf.to_object(cfg.rm), **settings)


def _by_hand_token_classification(path, example, separator, label_index, softmax, chat=False,
                                  system=""):
    """Each step's probability read by hand: the row built piece by piece as TRL lays it (BOS,
    question, then each step and the separator; or the chat template's turns), one unpadded
    forward, the class's probability at each separator's last token."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    if chat:
        turns = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": example.question}]
        ids = tokenizer(tokenizer.apply_chat_template(turns, tokenize=False,
                                                      add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
    else:
        ids = [tokenizer.bos_token_id] + tokenizer(example.question,
                                                   add_special_tokens=False)["input_ids"]
    sep = tokenizer(separator, add_special_tokens=False)["input_ids"]
    ends = []
    for step in example.steps:
        ids = ids + tokenizer(step, add_special_tokens=False)["input_ids"] + sep
        ends.append(len(ids) - 1)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    if softmax:
        probs = torch.softmax(logits, -1)[:, label_index]
    else:
        probs = torch.sigmoid(logits[:, label_index])
    return [probs[e].item() for e in ends]


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_trl_layout_token_classification_prm_reads_each_steps_separator(tmp_path, architecture):
    path = _classifier(tmp_path, architecture, AutoModelForTokenClassification, 2)
    assert infer_family(path) == "token_classification"
    scorer = load_reward_model(path, _rm())
    assert isinstance(scorer, TokenClassScorer)
    scores = scorer.score(EXAMPLES)  # one batch: rows of different lengths, right-padded
    for example, got in zip(EXAMPLES, scores):
        want = _by_hand_token_classification(path, example, "\n", 1, softmax=True)
        assert got == pytest.approx(want, abs=1e-5)
    # the positions matter: a step's score is not the one read a token earlier
    assert len({round(s, 4) for row in scores for s in row}) > 3


def test_qwen_style_prm_reads_class_one_at_extra_0_in_the_chat_template(tmp_path):
    path = _classifier(tmp_path, "qwen2", AutoModelForTokenClassification, 2, chat=True,
                       extra_tokens=("<extra_0>",))
    system = "Please reason step by step."
    rm = _rm(separator="<extra_0>", chat_template=True, system_prompt=system)
    scorer = load_reward_model(path, rm)
    for example, got in zip(EXAMPLES, scorer.score(EXAMPLES)):
        want = _by_hand_token_classification(path, example, "<extra_0>", 1, softmax=True,
                                             chat=True, system=system)
        assert got == pytest.approx(want, abs=1e-5)
    # one token per separator: the label sits on <extra_0> itself
    batch = scorer.encode(EXAMPLES[:1])
    sep_id = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<extra_0>")
    assert batch.input_ids[0][batch.label_mask[0]].tolist() == [sep_id, sep_id]


def test_sigmoid_reading_and_label_index_are_config(tmp_path):
    path = _classifier(tmp_path, "llama", AutoModelForTokenClassification, 3)
    scorer = load_reward_model(path, _rm(activation="sigmoid", label_index=2))
    for example, got in zip(EXAMPLES, scorer.score(EXAMPLES)):
        want = _by_hand_token_classification(path, example, "\n", 2, softmax=False)
        assert got == pytest.approx(want, abs=1e-5)
    softmax3 = load_reward_model(path, _rm(label_index=2)).score(EXAMPLES[:1])[0]
    assert softmax3 == pytest.approx(
        _by_hand_token_classification(path, EXAMPLES[0], "\n", 2, softmax=True), abs=1e-5)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_classification_orm_reads_the_last_real_token(tmp_path, architecture, side):
    path = _classifier(tmp_path, architecture, AutoModelForSequenceClassification, 1)
    assert infer_family(path) == "sequence_classification"
    scorer = load_reward_model(path, _rm())
    assert isinstance(scorer, SequenceScorer)
    scorer.tokenizer.padding_side = side  # the scorer pads as it reads, whatever the tokenizer
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    solutions = [StepExample(ex.question, ("\n".join(ex.steps),), (1.0,)) for ex in EXAMPLES]
    got = scorer.score(solutions)
    for ex, row in zip(solutions, got):
        ids = [tokenizer.bos_token_id] + tokenizer(ex.question, add_special_tokens=False)[
            "input_ids"] + tokenizer("\n" + ex.steps[0], add_special_tokens=False)["input_ids"]
        with torch.no_grad():  # unpadded: the model pools its own last token
            want = torch.sigmoid(model(input_ids=torch.tensor([ids])).logits[0, 0]).item()
        assert row == pytest.approx([want], abs=1e-5)
    # as a process reward: one score per step prefix, the last equal to the whole solution's
    per_step = scorer.score(EXAMPLES[1:2])[0]
    assert len(per_step) == 3 and per_step[-1] == pytest.approx(got[1][0], abs=1e-5)


def test_family_is_told_from_the_architecture_or_refused(tmp_path):
    lm = build_stand_in(tmp_path / "lm", "llama")
    assert infer_family(lm) == "tag_lm"
    strange = tmp_path / "strange"
    strange.mkdir()
    (strange / "config.json").write_text(json.dumps({"architectures": ["LlamaModel"]}))
    with pytest.raises(FamilyError, match=r"strange/config.json.*LlamaModel.*rm.family"):
        infer_family(strange)
    with pytest.raises(FamilyError, match="cannot read"):
        infer_family(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="rm.family=token_classification with "
                                          "rm.likelihood_feature=True"):
        load_config("configs/tiny.yaml", ["rm.family=token_classification"])
    assert isinstance(load_reward_model(lm, _rm()), TagScorer)


def _stepwise_rows(n: int, seed: int = 0) -> list[dict]:
    """TRL stepwise rows whose wrong steps say so ("?" before the separator): a label a PRM
    of any size learns from the step's own tokens, about 30% of the steps."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randrange(10, 99), rng.randrange(10, 99), rng.randrange(10, 99)
        steps, labels = [f"{a} + {b} = {a + b}", f"{a + b} + {c} = {a + b + c}",
                         f"The answer is {a + b + c}"], []
        for k in range(3):
            right = rng.random() > 0.3
            steps[k] += "" if right else " ?"
            labels.append(right)
        rows.append({"prompt": f"Row {i}: what is {a} + {b} + {c}?", "completions": steps,
                     "labels": labels})
    return rows


@pytest.mark.slow
def test_token_classification_prm_trained_here_reloads_in_plain_transformers(tmp_path):
    """`igrpo train-rm rm.family=token_classification` on TRL stepwise rows and a GPT-2-BPE Qwen2:
    it learns the labels (held-out step accuracy far above the share of right steps), the export
    is TRL's layout (a 2-label *ForTokenClassification), and plain transformers reading it the
    TRL way gives the scorer's scores."""
    base = build_stand_in(tmp_path / "base", "qwen2", hidden=64)
    data = tmp_path / "stepwise.jsonl"
    rows = _stepwise_rows(320)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       "run.name=run", f"rm.init_path={base}", "rm.family=token_classification",
                       "rm.lm_weight=0", "rm.likelihood_feature=false", f"rm.data_path={data}",
                       "rm.batch_size=16", "deepspeed.micro_batch_size=16", "rm.epochs=2",
                       "rm.lr=1e-3", "rm.eval_every=0", "run.wandb_mode=disabled",
                       "run.threads=2", "rm.val_fraction=0.2"]) == 0
    final = run / "rm-prm" / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    assert AutoConfig.from_pretrained(final).num_labels == 2  # (the default: not written out)
    right_share = sum(sum(r["labels"]) for r in rows) / (3 * len(rows))
    done = json.loads((run / "rm-prm" / "done.json").read_text())
    assert right_share < 0.75 and done["step_accuracy"] >= 0.95
    scorer = load_reward_model(final, _rm())
    assert isinstance(scorer, TokenClassScorer)
    for example, got in zip(EXAMPLES, scorer.score(EXAMPLES)):
        assert got == pytest.approx(
            _by_hand_token_classification(final, example, "\n", 1, softmax=True), abs=1e-5)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """A reward model of each family: TRL's token-classification PRM, a Qwen-style one, and a
    sequence-classification ORM (random, over the GPT-2 BPE), and a tag LM (the shipped tiny
    warm start, its own tokenizer: the step tag is one token there)."""
    from configs.loader import BUNDLED

    root = tmp_path_factory.mktemp("families")
    return {"trl_prm": (_classifier(root, "llama", AutoModelForTokenClassification, 2), []),
            "qwen_prm": (_classifier(root, "qwen2", AutoModelForTokenClassification, 2,
                                     chat=True, extra_tokens=("<extra_0>",)),
                         ["rm.separator=<extra_0>", "rm.chat_template=true"]),
            "tag_lm_prm": (BUNDLED / "tiny_warm_start", []),
            "orm": (_classifier(root, "qwen2", AutoModelForSequenceClassification, 1), [])}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trl_prm", "qwen_prm", "tag_lm_prm", "orm"])
def test_grpo_runs_rewarded_by_each_family(tmp_path, families, name):
    """`igrpo grpo policy.reward=rm rm.path=...`: process supervision by each PRM family (step
    rewards at the policy's step ends), outcome supervision by the ORM; the logged rewards are
    the reward model's probabilities, not the rule's 0/1."""
    path, extra = families[name]
    supervision = "outcome" if name == "orm" else "process"
    assert igrpo.main(["grpo", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       "run.name=g", "policy.reward=rm", f"rm.path={path}",
                       f"policy.supervision={supervision}", "policy.steps=2",
                       "policy.questions_per_step=2", "policy.group_size=4", "policy.eval_every=0",
                       "data.eval_questions=4", "eval.k=2", "run.threads=2",
                       "run.wandb_mode=disabled", "inspect.every=0", *extra]) == 0
    rows = [r for r in read_metrics(tmp_path / "g" / "grpo" / "metrics.jsonl")
            if "reward/mean" in r]
    assert len(rows) == 2
    for row in rows:
        assert 0.0 < row["reward/mean"] < 1.0 and row["reward/std"] > 0
    assert (tmp_path / "g" / "grpo" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_token_classification_prm_trains_on_two_processes_under_zero3_as_on_one(tmp_path):
    """`torchrun -m igrpo train-rm rm.family=token_classification deepspeed.zero_stage=3` on 2
    gloo processes: every step's loss, the validation (spread over the ranks, each scoring with
    the gathered weights) and the export equal 1 process's."""
    from safetensors.torch import load_file

    from launch import torchrun

    base = build_stand_in(tmp_path / "base", "qwen2")
    data = tmp_path / "stepwise.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _stepwise_rows(80)))
    runs = {}
    for nproc in (1, 2):
        done = torchrun(nproc, "-m", "igrpo", "train-rm", "--config", "configs/tiny.yaml",
                 f"run.root={tmp_path}", f"run.name=p{nproc}", f"rm.init_path={base}",
                 "rm.family=token_classification", "rm.lm_weight=0",
                 "rm.likelihood_feature=false", f"rm.data_path={data}", "rm.batch_size=16",
                 "deepspeed.micro_batch_size=8", "deepspeed.zero_stage=3", "rm.epochs=1",
                 "rm.lr=1e-3", "rm.eval_every=2", "rm.val_fraction=0.2", "run.threads=1",
                 "run.wandb_mode=disabled")
        out = tmp_path / f"p{nproc}" / "rm-prm"
        # what each rank printed last, flushed before a finished rank exits without teardown
        assert done.stdout.splitlines().count(str(out / "final")) == nproc, done.stdout[-2000:]
        runs[nproc] = ([r for r in read_metrics(out / "metrics.jsonl") if "rm/loss" in r],
                       json.loads((out / "done.json").read_text()),
                       load_file(out / "final" / "model.safetensors"))
    (rows1, done1, w1), (rows2, done2, w2) = runs[1], runs[2]
    assert len(rows1) == len(rows2) >= 3 and "rm/val_step_accuracy" in rows2[1]
    for a, b in zip(rows1, rows2):
        assert b["rm/loss"] == pytest.approx(a["rm/loss"], rel=1e-4)
    assert done2["step_accuracy"] == done1["step_accuracy"] and done2["steps"] == done1["steps"]
    assert w1.keys() == w2.keys()
    for key in w1:
        assert torch.allclose(w1[key], w2[key], atol=1e-5), key


def test_a_sequence_classifier_is_read_by_every_command_and_trained_by_none(tmp_path):
    """rm.family=sequence_classification (an ORM read as it is) resolves for every command
    (eval-rm, grpo with policy.reward=rm, iterate); only training one is refused, naming the
    family, before any model loads."""
    from iteration.resolve import resolve
    from reward_model.train import train_reward_model

    w = resolve(load_config(None, ["rm.family=sequence_classification"]))
    assert not w.rm.trainable
    with pytest.raises(ValueError, match="rm.family=sequence_classification"):
        train_reward_model(w.rm, tmp_path / "rm", "no-model-here", [], None, "")
