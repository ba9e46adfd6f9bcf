"""The real-model path on CPU: GPT-2's byte-level BPE, three transformers families, the shipped GPU
configs with their models swapped for tiny random ones of the same architecture, real data."""

import json

import pytest
import torch

import igrpo
from eval_checks import check_against_outcomes, check_intervals
from configs import load_config
from process_supervision.formats import StepExample
from reward_model.encoding import (TagTokenError, check_tag_tokens, encode, ensure_tag_token,
                                   tag_tokens)
from runtime.models import load_causal_lm, load_tokenizer
from tasks.prompts import PromptFormat, encode_prompts
from runtime.tiny_model import (GPT2_TOKENIZER, STAND_IN_CHAT, STAND_INS, build_model,
                                build_stand_in, build_tokenizer)
from small_config import ITERATE, SMALL

TAG = "ки"
def gpt2():
    return load_tokenizer(GPT2_TOKENIZER)


def tiny_random(out, architecture: str, chat: bool = False):
    """A 2-layer random model of `architecture` over the GPT-2 tokenizer, saved in `out`."""
    return build_stand_in(out, architecture, chat)


def test_shipped_gpt2_tokenizer_is_gpt2s_bpe():
    tok = gpt2()
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    # The ids measured with GPT-2's published ranks: the tag is 3 tokens after a space, 2 alone.
    assert tok(" ки", add_special_tokens=False)["input_ids"] == [12466, 118, 18849]
    assert tok("ки", add_special_tokens=False)["input_ids"] == [31583, 18849]
    assert tok(" +", add_special_tokens=False)["input_ids"] == [1343]
    assert tok.decode(tok("12+3=15\n", add_special_tokens=False)["input_ids"]) == "12+3=15\n"


def test_tag_that_is_not_one_token_is_named_or_added(tmp_path):
    tok = gpt2()
    with pytest.raises(TagTokenError, match=r"\[12466, 118, 18849\]") as err:
        check_tag_tokens(tok, TAG)
    assert "rm.add_tag_token" in str(err.value) and repr(TAG) in str(err.value)
    model = build_model(tok, 32, 1, 2, 64, 512, seed=0, architecture="qwen2")
    char = build_tokenizer((TAG,))  # the character tokenizer holds the tag as one token
    assert ensure_tag_token(char, None, TAG, add=False) is False and len(char) == 100
    assert ensure_tag_token(tok, model, TAG, add=True)
    assert len(tok) == 50258 and model.get_input_embeddings().weight.shape[0] == 50258
    assert not ensure_tag_token(tok, model, TAG, add=True)  # one token now: nothing added again
    # At every labelled position the token is the tag's, for steps of any text.
    tags = tag_tokens(tok, TAG)
    examples = [StepExample("Natalia sold 48 clips. How many?", ("48 / 2 = 24", "48 + 24 = 72",
                                                                 "The answer is 72"),
                            (1.0, 1.0, 0.0)),
                StepExample("Q ки?", ("a ки b", "c\nd"), (1.0, 0.0))]  # tags in the text dropped
    batch = encode(tok, examples, tags, TAG, max_length=512)
    for row, ex in enumerate(examples):
        positions = batch.label_mask[row].nonzero().squeeze(-1).tolist()
        assert len(positions) == len(ex.steps)
        assert [tok.decode([int(batch.input_ids[row, p])]) for p in positions] == [TAG] * len(
            ex.steps)
        assert batch.targets[row, positions].tolist() == list(ex.labels)


def test_prompts_get_one_bos_as_the_tokenizer_adds_it():
    from tokenizers.processors import TemplateProcessing

    tok = gpt2()
    bos = tok.eos_token_id  # GPT-2's only special token serves as BOS here
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tok.chat_template = STAND_IN_CHAT
    plain, chat = PromptFormat("{question}\n"), PromptFormat("boxed {question}", chat=True)
    ids = encode_prompts(tok, [plain.prompt(tok, "1+1?"), chat.prompt(tok, "1+1?")])
    assert [row.count(bos) for row in ids] == [1, 1] and all(row[0] == bos for row in ids)
    assert tok.decode(ids[1][1:]) == "User: boxed 1+1?\n\nAssistant:"
    with pytest.raises(ValueError, match="no chat template"):
        PromptFormat(chat=True).prompt(gpt2(), "q")


# One unit of every stage (SFT where the config has it, label, ORM and PRM training, evaluation,
# GRPO) for each shipped config with its model swapped for a tiny random one of the same
# architecture over the GPT-2 tokenizer; tiny.yaml runs a third family on GSM8K.
SHIPPED_ARCHITECTURES = STAND_INS
FEW = ["policy.steps=1", "policy.questions_per_step=2", "policy.group_size=4", "policy.max_new_tokens=16",
       "policy.rollout_questions=1", "deepspeed.micro_batch_size=4", "eval.max_new_tokens=16",
       "eval.k=2", "eval.batch_size=8", "data.eval_questions=4", "label.questions=3",
       "label.samples_per_question=2", "label.num_completions=2", "label.max_new_tokens=16",
       "rm.batch_size=4", "rm.bon_questions=2", "rm.bon_samples=2", "iterate.iterations=1",
       "run.wandb_mode=disabled", "run.threads=2",
       # the GPU configs sample with vLLM; the stand-ins here run on transformers (the vllm
       # backend has its own tests, tests/test_vllm.py)
       "rollout.backend=hf"]


def test_every_shipped_model_config_has_a_tiny_stand_in():
    from configs import CONFIG_DIR

    from configs.loader import BUNDLED

    # Configs that name an outside model (tiny.yaml starts from the shipped warm start).
    with_models = {p.name for p in CONFIG_DIR.glob("*.yaml")
                   if load_config(p).model.policy_path
                   and not load_config(p).model.policy_path.startswith(str(BUNDLED))}
    assert with_models == set(SHIPPED_ARCHITECTURES)


def _check_run(run, stand_in=None):
    summary = json.loads((run / "summary.json").read_text())["iterations"]
    assert [it["iteration"] for it in summary] == [0, 1]
    for it in summary:
        assert it["eval"]["questions"] == 4
        check_against_outcomes(it["eval"], run / "eval" / f"iteration-{it['iteration']}.json")
        assert {"prm_pick", "orm_pick", "majority", "random"} <= set(it["bon"])
    assert torch.isfinite(torch.tensor(summary[1]["grpo"]["train/kl"]))
    units = json.loads((run / "manifest.json").read_text())["units"]
    assert all(u["state"] == "done" for u in units.values()), units
    if stand_in is not None:  # no SFT stage: Algorithm 1 starts from the given policy
        assert units["sft"]["outputs"]["policy"] == str(stand_in)
        assert not (run / "sft").exists()
    # The reward models hold the step tag as one added token (the GPT-2 BPE splits it).
    for kind in ("orm", "prm"):
        rm_tok = load_tokenizer(run / f"rm-{kind}" / "iteration-0" / "final")
        assert len(rm_tok) == 50258 and check_tag_tokens(rm_tok, TAG).tag_id == 50257
    start = load_causal_lm(stand_in or run / "sft" / "best", device="cpu")
    final = load_causal_lm(run / "grpo" / "iteration-1" / "final", device="cpu")
    assert type(final).__name__ == type(start).__name__
    assert any(not torch.equal(a.float(), b.float()) for a, b in
               zip(start.state_dict().values(), final.state_dict().values()))


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(SHIPPED_ARCHITECTURES))
def test_shipped_gpu_config_runs_every_stage_on_a_tiny_stand_in(tmp_path, config):
    stand_in = tiny_random(tmp_path / "model", SHIPPED_ARCHITECTURES[config], chat=True)
    cfg = load_config(f"configs/{config}")
    assert not cfg.sft.enabled and cfg.data.chat_template and cfg.model.dtype == "bfloat16"
    # Everything as the config sets it (bf16, ZeRO stage, chat template, boxed prompt, lengths,
    # gradient checkpointing, tag added to the RM) except the model and the counts.
    assert igrpo.main(["iterate", "--config", f"configs/{config}", f"run.root={tmp_path}",
                       f"model.policy_path={stand_in}", *FEW]) == 0
    _check_run(tmp_path / cfg.run.name, stand_in)


@pytest.mark.slow
def test_gpt_neox_with_gpt2_tokenizer_on_gsm8k_every_stage(tmp_path):
    assert igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       *SMALL, *ITERATE, *FEW, "data.source=gsm8k", "data.prompt_template=boxed",
                       "model.tiny.architecture=gpt_neox", "model.tiny.tokenizer=gpt2",
                       "model.tiny.max_positions=1024", "rm.add_tag_token=true",
                       "rm.extra_layers_from=[]", "rm.worked_solutions=8"]) == 0
    _check_run(tmp_path / "tiny")


def test_tag_not_one_token_stops_before_any_work(tmp_path, capsys):
    code = igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={tmp_path}", *SMALL,
                       "model.tiny.architecture=qwen2", "model.tiny.tokenizer=gpt2",
                       "run.wandb_mode=disabled"])
    err = capsys.readouterr().err
    assert code == 2 and "[12466, 118, 18849]" in err and "rm.add_tag_token" in err
    assert not {"sft", "labels", "manifest.json"} & {p.name for p in (tmp_path / "tiny").iterdir()}


def test_gsm8k_trains_on_train_and_is_scored_on_test():
    from runtime.data import GSM8K_TEST, GSM8K_TRAIN, load_splits

    data = load_config("configs/tiny.yaml", ["data.source=gsm8k", "data.sft_questions=1000",
                                             "data.eval_questions=1319"]).data
    splits = load_splits(data, 0)
    assert all(r.source_id.startswith(str(GSM8K_TRAIN)) for r in splits.sft + splits.rl + splits.val)
    assert all(r.source_id.startswith(str(GSM8K_TEST)) for r in splits.eval)
    assert len(splits.eval) == 1319
    assert len(splits.sft) + len(splits.rl) + len(splits.val) == 7473  # no test question in train
    assert splits.sft[0].solution_steps[-1] == f"The answer is {splits.sft[0].answer}"


@pytest.mark.parametrize("data", [
    ["data.source=gsm8k"],  # the shipped GSM8K test split
    ["data.source=math"],  # the shipped MATH-500
    ["data.source=math", "data.eval_path={user}", "data.path={user}", "data.question_field=q",
     "data.answer_field=final"],  # a user's JSONL with its own field names, MATH-style answers
], ids=["gsm8k", "math500", "user-jsonl"])
def test_eval_on_real_data(tmp_path, data):
    user = tmp_path / "mine.jsonl"
    rows = [{"q": "What is 6 times 7?", "final": "42"}, {"q": "Simplify $\\frac{2}{4}$.",
                                                           "final": "\\frac{1}{2}"},
            {"q": "What is 1 + 1?", "final": "2"}, {"q": "Name 3.", "final": "3"}]
    user.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = [d.format(user=user) for d in data]
    model = tiny_random(tmp_path / "model", "qwen2")
    assert igrpo.main(["eval", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       f"eval.checkpoint={model}", "data.eval_questions=4", "eval.k=2",
                       "eval.max_new_tokens=8", "run.wandb_mode=disabled", *data]) == 0
    report = json.loads((tmp_path / "tiny" / "eval" / f"{tmp_path.name}.json").read_text())
    assert report["eval/questions"] == 4 and report["eval/k"] == 2
    check_intervals(report, prefix="eval/")


def test_user_fields_and_errors_name_the_field(tmp_path):
    from runtime.data import DataError, Fields, load_records

    user = tmp_path / "mine.jsonl"
    user.write_text(json.dumps({"q": "What is 6 times 7?", "final": 42, "work": "6*7=42\n#### 42"})
                    + "\n" + json.dumps({"q": "2+2?", "work": "#### 4"}) + "\n")
    records = load_records(str(user), "gsm8k", fields=Fields("q", "final", "work"),
                           limit=1)
    assert (records[0].question, records[0].answer) == ("What is 6 times 7?", "42")
    assert records[0].solution_steps == ("6*7=42", "The answer is 42")
    with pytest.raises(DataError, match=r"mine.jsonl: row 2: field 'final': missing"):
        load_records(str(user), "gsm8k", fields=Fields("q", "final", "work"))
