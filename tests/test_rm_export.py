"""Reward models others can load (reward_model/export.py): `igrpo train-rm` exports each family in
its ecosystem's layout with a model card. Plain transformers, in a process that cannot import the
project, runs the card's own snippet on the export and gets the project's step scores; the
token classifier's config names its classes."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

import igrpo
from configs import load_config
from process_supervision.formats import StepExample
from reward_model.export import CardFacts, model_card, name_labels
from reward_model.families import Reading, load_reward_model
from runtime.tiny_model import build_stand_in

EXAMPLES = [StepExample("What is 3 + 4?", ("3 + 4 = 7", "The answer is 7"), (1.0, 1.0)),
            StepExample("  Tom has 5 apples and eats 2. How many are left? ",
                        ("5 - 2 = 4", " So 4 are left ", "The answer is 4"), (0.0, 0.0, 0.0)),
            StepExample("Double 6.", ("6 * 2 = 12",), (1.0,))]

# Run in a fresh `python -I` from the export's folder: the project's packages cannot be imported
# (the editable install's finder is shadowed), the card's python block is run as it is, and its
# `step_scores` read every example.
CARD_RUNNER = r"""
import json, os, re, runpy, sys, tempfile

PROJECT = {"configs", "tasks", "runtime", "policy", "reward_model", "process_supervision",
           "iteration", "igrpo"}


class NoProject:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in PROJECT:
            raise ImportError(f"{name}: the project is not importable here")
        return None


sys.meta_path.insert(0, NoProject())
code = re.search(r"```python\n(.*?)```", open("README.md").read(), re.S).group(1)
script = os.path.join(tempfile.mkdtemp(), "card_snippet.py")  # (not among the export's files)
open(script, "w").write(code)  # the card's own code, run as a user's script would run it
scope = runpy.run_path(script, run_name="card")
assert not PROJECT & set(sys.modules), sorted(PROJECT & set(sys.modules))
rows = json.loads(sys.argv[1])
print("SCORES " + json.dumps([scope["step_scores"](question, steps) for question, steps in rows]))
"""


def _card_scores(folder, examples) -> list[list[float]]:
    """The step scores the model card's snippet gives, run by plain transformers in `folder`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    rows = json.dumps([[ex.question, list(ex.steps)] for ex in examples])
    done = subprocess.run([sys.executable, "-I", "-c", CARD_RUNNER, rows], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [li for li in done.stdout.splitlines() if li.startswith("SCORES ")][-1]
    return json.loads(line.removeprefix("SCORES "))


def _rm(**settings):
    cfg = load_config("configs/tiny.yaml", ["rm.lm_weight=0", "rm.likelihood_feature=false"])
    return dataclasses.replace(OmegaConf.to_object(cfg.rm), **settings)


def _stepwise_rows(n: int) -> list[dict]:
    """TRL stepwise rows whose wrong steps say so (" ?" at the end)."""
    rows = []
    for i in range(n):
        a, b = 10 + i % 80, 11 + (7 * i) % 80
        steps = [f"{a} + {b} = {a + b}", f"The answer is {a + b}"]
        labels = [i % 3 != 0, i % 4 != 1]
        rows.append({"prompt": f"Row {i}: what is {a} + {b}?", "labels": labels,
                     "completions": [s + ("" if ok else " ?") for s, ok in zip(steps, labels)]})
    return rows


def _train(tmp_path, base, *extra):
    """(the export, the data file) of `igrpo train-rm`: 3 optimizer steps on 32 TRL stepwise
    rows (8 held out)."""
    data = tmp_path / "stepwise.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _stepwise_rows(32)))
    assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       "run.name=run", f"rm.init_path={base}", "rm.lm_weight=0",
                       "rm.likelihood_feature=false", f"rm.data_path={data}", "rm.batch_size=8",
                       "deepspeed.micro_batch_size=8", "rm.epochs=1", "rm.lr=1e-3",
                       "rm.eval_every=0", "rm.val_fraction=0.25", "run.threads=1",
                       "run.wandb_mode=disabled", *extra]) == 0
    return tmp_path / "run" / "rm-prm" / "final", data


def _front_matter(card: str) -> dict:
    import yaml

    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_token_classification_export_reloads_in_plain_transformers_with_its_card(tmp_path):
    """TRL's layout: a 2-label *ForTokenClassification whose config names class 1 `right_step`;
    the card's snippet, in a process without the project, gives the scorer's step scores."""
    base = build_stand_in(tmp_path / "base", "qwen2")
    final, data = _train(tmp_path, base, "rm.family=token_classification")
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    assert config["id2label"] == {"0": "wrong_step", "1": "right_step"}
    assert config["label2id"] == {"wrong_step": 0, "right_step": 1}
    assert AutoConfig.from_pretrained(final).id2label[1] == "right_step"
    card = (final / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "token-classification"
    assert "process-reward-model" in meta["tags"]
    done = json.loads((tmp_path / "run" / "rm-prm" / "done.json").read_text())
    for needed in ("`token_classification`", "`Qwen2ForTokenClassification`",
                   "separator '\\n' (token ids [198])", "softmax over the classes, class 1",
                   "BOS (token", f"`{data}`; 32 examples, 24 trained on, 8 held out",
                   f"| step_accuracy | {done['step_accuracy']:.4f} |", "Optimizer steps: 3."):
        assert needed in card, needed
    want = load_reward_model(final, _rm(family="token_classification")).score(EXAMPLES)
    got = _card_scores(final, EXAMPLES)
    assert [len(row) for row in got] == [2, 3, 1]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)
    assert len({round(s, 4) for row in got for s in row}) > 3  # the positions matter


def test_tag_lm_export_reloads_in_plain_transformers_with_its_card(tmp_path):
    """The Math-Shepherd layout: a causal LM (its tokenizer given the tag as a new token) whose
    card's snippet, P(+) over '+'/'-' at each tag, gives the project's `TagScorer` scores."""
    base = build_stand_in(tmp_path / "base", "llama")
    final, _ = _train(tmp_path, base, "rm.family=tag_lm", "rm.add_tag_token=true")
    assert json.loads((final / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    card = (final / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["pipeline_tag"] == "text-generation" and "process-reward-model" in meta["tags"]
    tag_id = AutoTokenizer.from_pretrained(final).convert_tokens_to_ids("ки")
    for needed in ("`tag_lm`", "`LlamaForCausalLM`", f"Step tag 'ки' (token id {tag_id})",
                   "| auroc |"):
        assert needed in card, needed
    want = load_reward_model(final, _rm(family="tag_lm")).score(EXAMPLES)
    got = _card_scores(final, EXAMPLES)
    assert [len(row) for row in got] == [2, 3, 1]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


def test_card_reads_label_zero_under_a_sigmoid_in_the_chat_template(tmp_path):
    """The other readings a card describes: class 0 read as the right step (the labels named so),
    a sigmoid, the chat template's system and user turns, a cut at `max_length`, a model whose
    code comes with it (loaded with `trust_remote_code`); on a random classifier saved as the
    export saves one."""
    lm = build_stand_in(tmp_path / "lm", "qwen2", chat=True)
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(lm, num_labels=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert name_labels(model.config, 0) == {0: "right_step", 1: "wrong_step"}
    tokenizer = AutoTokenizer.from_pretrained(lm)
    reading = Reading(separator="\n\n", label_index=0, activation="sigmoid", chat_template=True,
                      system_prompt="Please reason step by step.")
    final = tmp_path / "final"
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    card = model_card(tokenizer, CardFacts(True, type(model).__name__, reading, "ки", "prm", 40,
                                           remote_code=True))
    (final / "README.md").write_text(card)
    assert card.count("trust_remote_code=True") == 2  # tokenizer and model: the code's own
    assert AutoConfig.from_pretrained(final).label2id == {"right_step": 0, "wrong_step": 1}
    assert "No validation split." in card and "chat template" in card
    rm = _rm(family="token_classification", separator="\n\n", label_index=0,
             activation="sigmoid", chat_template=True, system_prompt="Please reason step by step.",
             max_length=40)
    want = load_reward_model(final, rm).score(EXAMPLES)
    got = _card_scores(final, EXAMPLES)
    assert [len(row) for row in got] == [len(row) for row in want]
    assert sum(map(len, got)) < 6  # the cut at 40 tokens dropped a step
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


@pytest.mark.parametrize("family", ["token_classification", "tag_lm"])
def test_a_lora_reward_models_export_is_the_merged_model_with_its_trained_head(tmp_path,
                                                                                family):
    """`rm.lora`: the adapter trains on the backbone (and a token classifier's fresh head whole,
    peft's `modules_to_save`); the export is the merged plain model, no adapter files, whose
    card's snippet in a process without the project gives the project's scores (to 1e-5). Only
    the adapted layers and the head moved: the embeddings and norms are the base's, and the
    token classifier's head is not the one it was drawn as."""
    from safetensors.torch import load_file

    from configs.schema import ModelConfig
    from reward_model.train import token_classifier

    base = build_stand_in(tmp_path / "base", "qwen2" if family != "tag_lm" else "llama")
    extra = ["rm.add_tag_token=true"] if family == "tag_lm" else []
    final, _ = _train(tmp_path, base, f"rm.family={family}", "rm.lora.rank=4",
                      "rm.lora.alpha=8", *extra)
    assert not (final / "adapter_config.json").exists()
    trained, start = load_file(final / "model.safetensors"), load_file(base / "model.safetensors")
    for key, value in trained.items():
        if key.endswith("proj.weight"):
            assert not torch.equal(value, start[key]), key
        elif key in start and value.shape == start[key].shape:
            assert torch.equal(value, start[key]), key
    if family == "token_classification":
        cfg = load_config("configs/tiny.yaml")
        drawn = token_classifier(base, ModelConfig(), cfg.run.seed).score.weight
        assert trained["score.weight"].shape == drawn.shape
        assert not torch.equal(trained["score.weight"], drawn.detach())
    want = load_reward_model(final, _rm(family=family)).score(EXAMPLES)
    got = _card_scores(final, EXAMPLES)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


def test_igrpo_score_reads_a_peft_adapter_folder_as_its_merged_model(tmp_path):
    """A LoRA token-classification PRM saved as a peft adapter (its `adapter_config.json` naming
    the base, the trained head in `modules_to_save`), as other trainers leave it: `igrpo score`
    on that folder merges it onto its base and gives the step scores `igrpo score` gives on the
    merged export (to 1e-5); the adapter folder is left as it was."""
    from configs.schema import LoraConfig
    from reward_model.train import classifier_head, token_classifier
    from runtime.checkpoint import save_pretrained
    from runtime.lora import LoraSettings, with_adapter
    from configs.schema import ModelConfig

    base = build_stand_in(tmp_path / "base", "qwen2")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = token_classifier(base, ModelConfig(), 0)
    model = with_adapter(model, LoraSettings.of(LoraConfig(rank=4, alpha=8)),
                         task_type="TOKEN_CLS", modules_to_save=[classifier_head(model)])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a trained adapter's and head's stand-in
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    assert (adapter / "adapter_config.json").exists()
    before = sorted(p.name for p in adapter.iterdir())
    merged = save_pretrained(model, tokenizer, tmp_path / "merged")
    data = tmp_path / "stepwise.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _stepwise_rows(6)))
    scores = {}
    for name, path in (("adapter", adapter), ("merged", merged)):
        assert igrpo.main(["score", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                           f"run.name=score-{name}", "model.policy_path=", f"rm.path={path}",
                           "rm.family=token_classification", "rm.likelihood_feature=false",
                           "rm.lm_weight=0", "rm.extra_layers_from=[]",
                           f"rm.score_input={data}", "run.wandb_mode=disabled"]) == 0
        (scored,) = (tmp_path / f"score-{name}").rglob("scored.jsonl")
        scores[name] = [json.loads(line)["step_scores"] for line in
                        scored.read_text().splitlines()]
    assert len(scores["adapter"]) == 6
    for a, m in zip(scores["adapter"], scores["merged"]):
        assert a == pytest.approx(m, abs=1e-5)
    assert len({round(s, 4) for row in scores["adapter"] for s in row}) > 3
    assert sorted(p.name for p in adapter.iterdir()) == before
