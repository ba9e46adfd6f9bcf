"""Reward-model units: formats, label alignment, the soft-label loss, aggregators, metrics."""

import json
import math

import pytest
import torch

from process_supervision.formats import (StepExample, example_from_row, read_step_rows,
                                         parse_math_shepherd, to_math_shepherd,
                                         write_math_shepherd_jsonl)
from reward_model.encoding import encode, fit_labels, orm_example, tag_tokens
from reward_model.evaluate import (auroc, best_of_n, best_of_n_curve, first_error_metrics,
                                   step_metrics)
from reward_model.losses import STEP_AGGREGATORS, lm_loss_sum, tag_logit_margin, tag_loss
from runtime.data import DataError
from runtime.tiny_model import STEP_TAG, build_tokenizer

from by_hand import trl_to_math_shepherd


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_math_shepherd_round_trip():
    text, label = to_math_shepherd("What is 2+3*4?", ["3*4=12", "2+12=14", "The answer is 14"],
                                   [1.0, 0.0, 0.25])
    assert text == ("What is 2+3*4? Step 1: 3*4=12 ки\nStep 2: 2+12=14 ки\n"
                    "Step 3: The answer is 14 ки")
    assert label == ("What is 2+3*4? Step 1: 3*4=12 +\nStep 2: 2+12=14 -\n"
                     "Step 3: The answer is 14 -")
    question, steps, labels = parse_math_shepherd(text, label)
    assert question == "What is 2+3*4?"
    assert steps == ("3*4=12", "2+12=14", "The answer is 14")
    assert labels == (1.0, 0.0, 0.0)


def test_trl_converter():
    row = {"prompt": "Q?", "completions": ["a=1", "b=2"], "labels": [True, False]}
    converted = trl_to_math_shepherd(row)
    assert converted == {"input": "Q? Step 1: a=1 ки\nStep 2: b=2 ки",
                         "label": "Q? Step 1: a=1 +\nStep 2: b=2 -"}
    assert example_from_row(converted, "x").labels == (1.0, 0.0)


SOFT = StepExample("What is 2+3*4?", ("3*4=12", "2+12=14", "The answer is 14"),
                   (1.0, 0.25, 0.0))
"""One solution whose second step carries a soft label (a Monte Carlo estimate)."""
LAYOUTS = {
    "trl": {"prompt": SOFT.question, "completions": list(SOFT.steps), "labels": [True, 0.25, 0]},
    "openrlhf": {"input": to_math_shepherd(SOFT.question, SOFT.steps)[0],
                 "value": ["+", 0.25, "-"]},
}
"""It in TRL's and OpenRLHF's layouts (RLHFlow's chat layout holds "+"/"-" only: `_chat`)."""


def _chat(question, steps, marks):
    turns = [f"{question} Step 1: {steps[0]}", *steps[1:]]
    return {"conversations": [t for text, mark in zip(turns, marks) for t in (
        {"role": "user", "content": text}, {"role": "assistant", "content": mark})]}


def test_trl_openrlhf_and_rlhflow_layouts_read_alike_and_keep_soft_labels(tmp_path, tok):
    """TRL's float labels and OpenRLHF's `value` numbers are kept as soft targets (not cast to
    0/1), bools and "+"/"-" are 1/0; RLHFlow's chat turns read as the same steps; each layout's
    file reads (as `train-rm` and `eval-rm` read) into the same example, and a soft label lands
    on its step's tag as the target of the loss."""
    for layout in ("trl", "openrlhf"):
        path = tmp_path / f"{layout}.jsonl"
        path.write_text(json.dumps(LAYOUTS[layout]) + "\n")
        (example,), skipped = read_step_rows(str(path))
        assert (example.question, example.steps, example.labels, skipped) == \
            (SOFT.question, SOFT.steps, (1.0, 0.25, 0.0), 0), layout
    path = tmp_path / "rlhflow.jsonl"
    path.write_text(json.dumps(_chat(SOFT.question, SOFT.steps, ["+", "-", "-"])) + "\n")
    (chat,), _ = read_step_rows(str(path))
    assert (chat.question, chat.steps, chat.labels) == (SOFT.question, SOFT.steps, (1, 0, 0))
    prompted = example_from_row({"prompt": SOFT.question, **_chat(SOFT.question, SOFT.steps,
                                                                  ["+", "-", "-"])}, "x")
    assert (prompted.question, prompted.steps) == (SOFT.question, SOFT.steps)  # (no "Step 1:")
    tags = tag_tokens(tok, STEP_TAG)
    batch = encode(tok, [SOFT], tags, STEP_TAG, max_length=256)
    assert batch.targets[0][batch.label_mask[0]].tolist() == [1.0, 0.25, 0.0]
    converted = trl_to_math_shepherd(LAYOUTS["trl"])  # the soft label kept beside +/- text
    assert converted["soft_labels"] == [1.0, 0.25, 0.0]


@pytest.mark.parametrize("row, field", [
    ({"prompt": "Q", "completions": ["a", "b"], "labels": [True, 1.5]}, "'labels', step 2"),
    ({"prompt": "Q", "completions": ["a", 3], "labels": [True, False]}, "'completions'"),
    ({"input": "Q Step 1: a ки\nStep 2: b ки", "value": ["+"]}, "'value'"),
    ({"input": "Q Step 1: a ки", "value": ["yes"]}, "'value', step 1"),
    ({"conversations": [{"role": "user", "content": "Q a"},
                        {"role": "assistant", "content": "+"}]}, "'conversations\\[0\\]'"),
    ({"conversations": [{"role": "user", "content": "Q Step 1: a"},
                        {"role": "user", "content": "+"}]}, "'conversations\\[1\\]'"),
    ({"conversations": [{"role": "user", "content": "Q Step 1: a"}]}, "'conversations'"),
])
def test_a_bad_row_of_each_new_layout_names_file_row_and_field(tmp_path, row, field):
    path = tmp_path / "prm.jsonl"
    good = LAYOUTS["openrlhf"] if "value" in row else LAYOUTS["trl"] if "labels" in row else \
        _chat(SOFT.question, SOFT.steps, ["+", "-", "-"])
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"prm.jsonl: row 2: field {field}"):
        read_step_rows(str(path))


def test_tag_count_mismatch_names_file_and_row(tmp_path):
    good_text, good_label = to_math_shepherd("Q", ["a", "b"], [1, 1])
    bad_label = good_label.replace(" +\nStep 2: b +", " +\nStep 2: b")  # one label missing
    path = tmp_path / "prm.jsonl"
    path.write_text(json.dumps({"input": good_text, "label": good_label}) + "\n"
                    + json.dumps({"input": good_text, "label": bad_label}) + "\n")
    with pytest.raises(DataError, match=r"prm.jsonl: row 2: field 'label'"):
        read_step_rows(str(path))
    examples, skipped = read_step_rows(str(path), skip_bad_rows=True)
    assert len(examples) == 1 and skipped == 1
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": "Q", "completions": ["a", "b"], "labels": [True]}) + "\n")
    with pytest.raises(DataError, match=r"trl.jsonl: row 1: field 'labels'"):
        read_step_rows(str(trl))


def test_soft_labels_written_and_read(tmp_path):
    path = tmp_path / "soft.jsonl"
    write_math_shepherd_jsonl(path, [StepExample("Q", ("a", "b"), (1.0, 0.0), "s:0")],
                              soft_labels=[(0.75, 0.125)])
    (example,), _ = read_step_rows(str(path), use_soft=True)
    assert example.labels == (0.75, 0.125) and example.steps == ("a", "b")
    (hard,), _ = read_step_rows(str(path))
    assert hard.labels == (1.0, 0.0)


def test_labels_land_on_tag_tokens(tok):
    tags = tag_tokens(tok, STEP_TAG)
    ex = StepExample("Q", ("1+1=2", "2*3=6"), (1.0, 0.0))
    batch = encode(tok, [ex], tags, STEP_TAG, max_length=128)
    ids = batch.input_ids[0]
    positions = batch.label_mask[0].nonzero().squeeze(-1).tolist()
    assert [ids[p].item() for p in positions] == [tags.tag_id, tags.tag_id]
    assert batch.targets[0, positions].tolist() == [1.0, 0.0]
    text, _ = to_math_shepherd(ex.question, ex.steps)
    assert positions == _tag_token_positions(text)


def _tag_token_positions(text):
    """One token per character, except the 2-character tag: the k-th tag at character c sits at
    token c - k."""
    chars = [i for i in range(len(text)) if text.startswith(STEP_TAG, i)]
    return [c - k for k, c in enumerate(chars)]


def test_truncation_drops_trailing_labels(tok):
    tags = tag_tokens(tok, STEP_TAG)
    ex = StepExample("Q", ("1+1=2", "2*3=6", "6-1=5"), (1.0, 0.0, 1.0))
    text, _ = to_math_shepherd(ex.question, ex.steps)
    second_tag = _tag_token_positions(text)[1]
    batch = encode(tok, [ex], tags, STEP_TAG, max_length=second_tag + 1)
    assert batch.steps_kept == [2]
    assert batch.targets[0][batch.label_mask[0]].tolist() == [1.0, 0.0]  # not shifted
    short = encode(tok, [ex], tags, STEP_TAG, max_length=second_tag)
    assert short.targets[0][short.label_mask[0]].tolist() == [1.0]


@pytest.mark.parametrize("truncation, last_only, wanted, dropped", [
    ("end", False, [[1.0, 0.0, 1.0], [1.0, 0.0]], 1),   # the long row keeps its first 2 labels
    ("drop", False, [[1.0, 0.0, 1.0], []], 3),          # ... or none
    ("end", True, [[1.0], []], 1),                      # the last step only: cut, so none
    ("drop", True, [[1.0], []], 3),
])
def test_truncation_and_last_step_only_choose_the_labels_training_reads(tok, truncation,
                                                                        last_only, wanted,
                                                                        dropped):
    """Two rows, the second cut by `max_length` after its second tag (of 3): `rm.truncation`
    end keeps the labels before the cut, drop none of the row's; `train_on_last_step_only`
    keeps each row's last step alone, none where the cut took it; the tags dropped counted."""
    tags = tag_tokens(tok, STEP_TAG)
    short = StepExample("Q", ("1+1=2", "2*3=6", "6-1=5"), (1.0, 0.0, 1.0))
    long = StepExample("Q" * 40, ("1+1=2", "2*3=6", "6-1=5"), (1.0, 0.0, 1.0))
    text, _ = to_math_shepherd(long.question, long.steps)
    cut = _tag_token_positions(text)[1] + 1
    batch = encode(tok, [short, long], tags, STEP_TAG, max_length=cut)
    assert batch.steps_kept == [3, 2]
    fitted, lost, seen = fit_labels(batch, [short, long], truncation, last_only)
    assert [fitted.targets[r][fitted.label_mask[r]].tolist() for r in (0, 1)] == wanted
    assert (lost, seen) == (dropped, 6)
    assert torch.equal(batch.label_mask.sum(), torch.tensor(5))  # the batch itself untouched


@pytest.mark.parametrize("truncation, budget, max_length, length, wanted, lost", [
    ("end", 0, 75, 75, [1.0, 0.0], 1),      # cut mid-way through step 3: tokens up to the cut
    ("steps", 0, 75, 72, [1.0, 0.0], 1),    # ... or the row ends at step 2's tag
    ("drop", 0, 75, 75, [], 3),
    ("end", 20, 512, 60, [1.0], 2),         # 20 tokens after the question's 40: step 1 fits
    ("steps", 20, 512, 56, [1.0], 2),
    ("drop", 20, 512, 88, [], 3),
    ("steps", 10, 512, 40, [], 3),          # no step fits: the question alone
])
def test_a_cut_row_ends_where_the_truncation_policy_says(tok, truncation, budget, max_length,
                                                         length, wanted, lost):
    """A 40-token question and 3 steps, 88 tokens, the tags at tokens 55, 71 and 87 (one token
    a character, the tag one token): cut by `max_length` or by a completion budget of
    `max_completion` tokens after the question, the row keeps the tokens and labels before the
    cut (end), ends after its last whole step (steps) or trains on nothing (drop); what it no
    longer holds is masked out, the LM targets with it."""
    tags = tag_tokens(tok, STEP_TAG)
    ex = StepExample("Q" * 40, ("1+1=2", "2*3=6", "6-1=5"), (1.0, 0.0, 1.0))
    text, _ = to_math_shepherd(ex.question, ex.steps)
    assert _tag_token_positions(text) == [55, 71, 87] and len(text) - 3 == 88
    batch = encode(tok, [ex], tags, STEP_TAG, max_length=max_length, lm_targets=True,
                   prompt_tokens=True)
    assert batch.prompt_tokens == [40]
    fitted, dropped, seen = fit_labels(batch, [ex], truncation, False, budget)
    assert int(fitted.attention_mask[0].sum()) == length
    assert fitted.targets[0][fitted.label_mask[0]].tolist() == wanted
    assert (dropped, seen) == (lost, 3)
    assert not fitted.lm_mask[0, length:].any() and not fitted.label_mask[0, length:].any()
    assert fitted.lm_mask[0].any() == bool(wanted)  # step 1 is right: its tokens are LM targets


def test_train_rm_counts_the_tags_its_max_length_cut_and_warns(tmp_path):
    """`igrpo train-rm` (the shipped warm start, 32 synthetic solutions) with a `rm.max_length`
    that cuts some rows: every step logs the tags its rows lost (`rm/tags_dropped`), the run's
    count and share land in done.json; `rm.truncation=drop` loses every tag of a cut row, so
    more, and above 5% of the tags seen a warning names the share. A completion budget
    (`rm.max_completion_length`, the rows ending at their last whole step) cuts more again."""
    import warnings

    import igrpo
    from runtime.tracking import read_metrics

    done = {}
    for policy, budget in (("end", 0), ("drop", 0), ("steps", 60)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml",
                               f"run.root={tmp_path}", f"run.name={policy}", "rm.kind=prm",
                               "rm.synthetic_solutions=32", "rm.epochs=1", "rm.batch_size=16",
                               "deepspeed.micro_batch_size=16", "rm.val_fraction=0",
                               "rm.likelihood_feature=false", "rm.max_length=200",
                               f"rm.truncation={policy}", f"rm.max_completion_length={budget}",
                               "run.wandb_mode=disabled"]) == 0
        out = tmp_path / policy / "rm-prm"
        steps = [r["rm/tags_dropped"] for r in read_metrics(out / "metrics.jsonl")
                 if "rm/loss" in r]
        done[policy] = json.loads((out / "done.json").read_text())
        assert len(steps) == 2 and sum(steps) == done[policy]["tags_dropped"] > 0
        assert done[policy]["tags_dropped_share"] == done[policy]["tags_dropped"] / 128
        warned = [str(w.message) for w in caught if "were cut off by rm.max_length" in
                  str(w.message)]
        assert bool(warned) == (done[policy]["tags_dropped_share"] > 0.05), policy
    assert done["drop"]["tags_dropped"] > done["end"]["tags_dropped"]
    assert done["drop"]["tags_dropped_share"] > 0.05  # (the warning was checked)
    assert done["steps"]["tags_dropped"] > done["end"]["tags_dropped"]


def test_lm_mask_covers_right_steps_only(tok):
    # The auxiliary LM loss reads the tokens of steps labelled right: never the question, a tag,
    # or a wrong step (that would teach the error).
    tags = tag_tokens(tok, STEP_TAG)
    ex = StepExample("Q?", ("1+1=2", "2*3=7", "The answer is 7"), (1.0, 0.0, 0.0))
    batch = encode(tok, [ex], tags, STEP_TAG, max_length=128, lm_targets=True)
    ids = batch.input_ids[0][batch.lm_mask[0]].tolist()
    assert tok.decode(ids) == " Step 1: 1+1=2 "
    soft = encode(tok, [StepExample("Q?", ex.steps, (0.5, 0.75, 0.25))], tags, STEP_TAG, 128,
                  lm_targets=True)
    assert tok.decode(soft.input_ids[0][soft.lm_mask[0]].tolist()) == \
        " Step 1: 1+1=2 \nStep 2: 2*3=7 "
    assert not encode(tok, [ex], tags, STEP_TAG, 128).lm_mask.any()  # scoring: nothing to mark


def test_lm_loss_by_hand():
    # Vocabulary of 3; position 0 predicts token 2 (logits 0, 0, ln 3 -> p = 3/5); position 1
    # predicts token 0 but is masked out.
    logits = torch.tensor([[[0.0, 0.0, math.log(3)], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[1, 2, 0]])
    mask = torch.tensor([[False, True, False]])
    assert lm_loss_sum(logits, ids, mask).item() == pytest.approx(-math.log(3 / 5), rel=1e-6)
    assert lm_loss_sum(logits, ids, torch.zeros_like(mask)).item() == 0.0


def test_prm_loss_by_hand_with_soft_labels():
    # Two tags; logit margins 2 and -1; soft labels 0.75 and 0.25.
    margin = torch.tensor([[0.0, 2.0, 0.0, -1.0]])
    targets = torch.tensor([[0.0, 0.75, 0.0, 0.25]])
    mask = torch.tensor([[False, True, False, True]])
    p1, p2 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(1))
    want = (-(0.75 * math.log(p1) + 0.25 * math.log(1 - p1))
            - (0.25 * math.log(p2) + 0.75 * math.log(1 - p2))) / 2
    assert tag_loss(margin, targets, mask).item() == pytest.approx(want, rel=1e-6)


def test_margin_is_log_odds_of_plus():
    logits = torch.zeros(1, 1, 5)
    logits[0, 0, 1], logits[0, 0, 3] = 1.5, -0.5
    margin = tag_logit_margin(logits, plus_id=1, minus_id=3)
    p_plus = torch.softmax(torch.tensor([1.5, -0.5]), 0)[0]
    assert torch.sigmoid(margin).item() == pytest.approx(p_plus.item())


def test_aggregators_by_hand():
    scores = torch.tensor([[0.9, 0.5, 0.8], [0.6, 0.2, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    want = {"min": [0.5, 0.2], "prod": [0.36, 0.12], "last": [0.8, 0.2],
            "mean": [2.2 / 3, 0.4]}
    for name, expected in want.items():
        got = STEP_AGGREGATORS[name](scores, mask).tolist()
        assert got == pytest.approx(expected), name


def test_orm_example_reads_at_last_token(tok):
    tags = tag_tokens(tok, STEP_TAG)
    batch = encode(tok, [orm_example("Q", "1+1=2\nThe answer is 2", 1.0)], tags, STEP_TAG, 256)
    last_real = int(batch.attention_mask[0].sum()) - 1
    assert batch.label_mask[0].nonzero().squeeze(-1).tolist() == [last_real]


def test_best_of_n_curve_by_hand():
    """rm@N, the reward-weighted vote and maj@N on two hand-built questions, each N's value a
    question's expectation over every subset of N of its samples (ties: the first)."""
    q1 = [(True, 0.9, "1"), (False, 0.8, "2"), (False, 0.7, "2")]
    q2 = [(True, 0.2, "5"), (True, 0.3, "5"), (False, 0.95, "6")]
    curve = best_of_n_curve([q1, q2], [1, 2, 3])
    mean = {n: {m: v[0] for m, v in row.items()} for n, row in curve.items()}
    assert mean[1] == pytest.approx({"rm": 0.5, "weighted_vote": 0.5, "majority": 0.5})
    # q1: {0,1} and {0,2} pick right by every method, {1,2} by none; q2: rm and the vote pick
    # right only in {0,1}, the vote of {0,2} and {1,2} ties 1-1 and takes the first, right
    assert mean[2] == pytest.approx({"rm": (2 / 3 + 1 / 3) / 2,
                                     "weighted_vote": (2 / 3 + 1 / 3) / 2,
                                     "majority": (2 / 3 + 1) / 2})
    # all three: q1's top score is right, "2" outvotes "1" both ways; q2's top score is wrong,
    # "6" (0.95) outweighs "5" (0.5), "5" outnumbers "6"
    assert mean[3] == pytest.approx({"rm": 0.5, "weighted_vote": 0.0, "majority": 0.5})
    assert curve[3]["weighted_vote"][1:] == [0.0, 0.0]
    sampled = best_of_n_curve([q1 * 4, q2 * 4], [6], draws=50, seed=1)  # C(12, 6) > 50: drawn
    assert sampled == best_of_n_curve([q1 * 4, q2 * 4], [6], draws=50, seed=1)
    assert all(0 <= v[0] <= 1 for v in sampled[6].values())


def test_metrics_by_hand():
    assert auroc([0.9, 0.8, 0.3, 0.1], [True, False, True, False]) == pytest.approx(0.75)
    m = step_metrics([[0.9, 0.2], [0.7, 0.6]], [[1, 0], [1, 0]])
    assert m["step_accuracy"] == pytest.approx(0.75)
    assert m["error_f1"] == pytest.approx(2 / 3)  # tp 1, fn 1, fp 0
    fe = first_error_metrics([[0.9, 0.2], [0.9, 0.9], [0.1, 0.9]], [[1, 0], [1, 1], [1, 0]])
    assert fe["first_error_accuracy"] == 0.5 and fe["no_error_accuracy"] == 1.0
    bon = best_of_n([[True, False, False], [False, False, True]],
                    [[0.9, 0.1, 0.2], [0.8, 0.1, 0.3]],
                    [["1", "2", "2"], ["3", "4", "5"]])
    assert bon["rm_pick"] == 0.5 and bon["majority"] == 0.0
    assert bon["random"] == pytest.approx(1 / 3)
    assert bon["group_auroc"] == pytest.approx((1.0 + 0.5) / 2)  # 0.3 beats 0.1, not 0.8
    assert bon["per_question"] == [(1.0, 1.0), (0.0, 0.5)]
    # Pooled over questions these scores rank well; within each question they rank nothing.
    right = [[True, True, False], [True, False, False]]  # an easy and a hard question
    easy_hard = [[0.9, 0.9, 0.9], [0.2, 0.2, 0.2]]
    assert auroc(easy_hard[0] + easy_hard[1], right[0] + right[1]) == pytest.approx(6 / 9)
    assert best_of_n(right, easy_hard, [["1", "1", "2"], ["3", "4", "5"]])["group_auroc"] == 0.5
    assert math.isnan(best_of_n([[True, True]], [[0.1, 0.2]], [["1", "1"]])["group_auroc"])


def test_deepened_backbone_starts_as_the_same_function(tok, tmp_path):
    from reward_model.backbone import ADDED_LAYERS_KEY, deepen
    from runtime.tiny_model import build_model
    from runtime.models import load_causal_lm

    model = build_model(tok, 32, 2, 2, 64, 64, seed=0).eval()
    ids = tok("Start with 7. Add 3.\nAdd 3: 7+3=10", return_tensors="pt")["input_ids"]
    before = model(ids).logits
    assert deepen(model, [0, 1]) == 2
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    # The copies are real layers with their own weights: zero outputs, the same attention inputs.
    assert model.model.layers[2].self_attn.o_proj.weight.abs().sum() == 0
    torch.testing.assert_close(model.model.layers[2].self_attn.q_proj.weight,
                               model.model.layers[0].self_attn.q_proj.weight)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again = load_causal_lm(tmp_path).eval()
    assert getattr(again.config, ADDED_LAYERS_KEY) == 2 and len(again.model.layers) == 4
    torch.testing.assert_close(again(ids).logits, before)
    assert deepen(again, [0, 1]) == 0  # a refresh keeps the depth it has
    with pytest.raises(ValueError, match="layer 5 does not exist"):
        deepen(build_model(tok, 32, 2, 2, 64, 64, seed=0), [5])


def test_minimal_pairs_and_question_grouped_batches():
    from reward_model.examples import synthetic_step_examples
    from reward_model.train import question_groups, split_validation
    from runtime.training import seeded_order
    from runtime.data import synthetic_records

    records = synthetic_records(seed=5, count=40, min_ops=2, max_ops=4)
    pairs = synthetic_step_examples(records, seed=1, paired=True)
    assert len(pairs) == 80
    for right, wrong in zip(pairs[::2], pairs[1::2]):
        assert right.question == wrong.question and set(right.labels) == {1.0}
        assert 0.0 in wrong.labels and wrong.labels[-1] == 0.0  # a slip makes the answer wrong
    order = seeded_order(len(pairs), 3, question_groups(pairs))
    assert sorted(order) == list(range(80))
    assert all(pairs[order[i]].question == pairs[order[i + 1]].question for i in range(0, 80, 2))
    assert order != seeded_order(len(pairs), 4, question_groups(pairs))
    train, val = split_validation(pairs, 0.1, seed=0)
    assert len(val) == 8 and len(train) == 72
    assert not {ex.question for ex in train} & {ex.question for ex in val}


@pytest.mark.parametrize("warmup", [0, 3])
def test_added_layers_train_at_their_own_rate(tok, warmup):
    from configs.schema import DeepSpeedConfig
    from reward_model.backbone import added_layer_parameters, deepen
    from runtime.engine import build_engine

    model = build_model_small(tok)
    deepen(model, [0])
    fresh = added_layer_parameters(model)
    assert len(fresh) == len(list(model.model.layers[0].parameters()))
    engine = build_engine(model, DeepSpeedConfig(warmup_steps=warmup), lr=1e-4,
                          micro_batch_size=1, grad_accum=1,
                          lr_by_param={id(p): 1e-3 for p in fresh})
    for _ in range(4):  # past the warm-up, each group is at its own rate
        loss = engine(input_ids=torch.tensor([[5, 6, 7]])).logits.mean()
        engine.backward(loss)
        engine.step()
    groups = engine.optimizer.param_groups
    assert [g["lr"] for g in groups] == pytest.approx([1e-4, 1e-3])
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in fresh}
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(model.parameters()))


def build_model_small(tok):
    from runtime.tiny_model import build_model

    return build_model(tok, 32, 2, 2, 64, 64, seed=0)


@pytest.mark.parametrize("architecture", ["tiny", "qwen2", "llama"])
def test_two_row_read_out_equals_the_full_logits(architecture):
    """The tag margin read through the output layer's `+` and `-` rows (`tag_margins`) equals
    the one read from [B, L, V] logits, 1e-5, and so do its gradients: on the tiny model and on
    random Qwen2 (tied head) and Llama (untied head) models over GPT-2's byte-level BPE."""
    from reward_model.encoding import ensure_tag_token
    from reward_model.score import tag_margins
    from runtime.models import load_tokenizer
    from runtime.tiny_model import GPT2_TOKENIZER, build_model

    if architecture == "tiny":
        tokenizer = build_tokenizer((STEP_TAG,))
        model = build_model(tokenizer, 32, 2, 2, 64, 256, seed=0)
    else:
        tokenizer = load_tokenizer(GPT2_TOKENIZER)
        model = build_model(tokenizer, 32, 2, 2, 64, 512, seed=0, architecture=architecture)
        ensure_tag_token(tokenizer, model, STEP_TAG, add=True)
        if architecture == "llama":  # an untied output layer, as DeepSeek's 7B has
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone()
                                                      + 0.01)
            model.config.tie_word_embeddings = False
    tags = tag_tokens(tokenizer, STEP_TAG)
    examples = [StepExample("3+4*2?", ("4*2=8", "3+8=11", "The answer is 11"), (1.0, 1.0, 1.0)),
                StepExample("9-5?", ("9-5=3", "The answer is 3"), (0.0, 0.0))]
    batch = encode(tokenizer, examples, tags, STEP_TAG, 128)
    full = tag_logit_margin(model(input_ids=batch.input_ids,
                                  attention_mask=batch.attention_mask).logits,
                            tags.plus_id, tags.minus_id)
    full.sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    read = tag_margins(model, batch.input_ids, batch.attention_mask, tags)
    read.sum().backward()
    torch.testing.assert_close(read, full, rtol=1e-5, atol=1e-5)
    for name, grad in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5,
                                   atol=1e-5, msg=name)
    assert model(input_ids=batch.input_ids).logits.shape[-1] == len(tokenizer)  # head restored


def test_step_rows_are_read_once_and_parsed_when_used(tmp_path, monkeypatch):
    """A stepwise file's rows: checked and their questions kept at reading, each row parsed again
    only when training reads it; a view keeps its rows' questions; the ORM form is applied as a
    row is read."""
    import process_supervision.formats as formats
    from reward_model.train import question_groups, split_validation

    path = tmp_path / "prm.jsonl"
    rows = [to_math_shepherd(f"Q{i % 3}", [f"a{i}", f"b{i}"], [1, i % 2]) for i in range(7)]
    path.write_text("".join(json.dumps({"input": t, "label": lab}) + "\n" for t, lab in rows))
    examples, skipped = read_step_rows(str(path), chunk_rows=3)
    assert skipped == 0 and len(examples) == 7 and not isinstance(examples, list)
    assert examples.questions == [f"Q{i % 3}" for i in range(7)]
    parsed = []
    real = formats.example_from_row
    monkeypatch.setattr(formats, "example_from_row",
                        lambda row, where, *a: parsed.append(where) or real(row, where, *a))
    fifth = examples[5]
    assert fifth.steps == ("a5", "b5") and fifth.labels == (1.0, 1.0)
    assert parsed == [f"{path}: row 6"]  # one row parsed, named by its place in the file
    assert question_groups(examples) == [[0, 3, 6], [1, 4], [2, 5]]
    train, val = split_validation(examples, 0.3, seed=0)
    assert len(train) + len(val) == 7 and isinstance(val, list)
    assert {ex.question for ex in val}.isdisjoint(train.questions)
    assert [ex.steps for ex in train] == [examples[i].steps for i in range(7)
                                          if examples[i].question not in
                                          {ex.question for ex in val}]
    orm = examples.map(lambda ex: StepExample(ex.question, ("\n".join(ex.steps),),
                                              ex.labels[-1:]))
    assert orm[0].steps == ("a0\nb0",) and orm[0].labels == (0.0,)


def test_length_grouped_batches_pad_less_and_keep_the_epoch_a_permutation():
    """`rm.group_by_length`: each epoch is still a permutation; every batch holds rows of similar
    lengths (its padding, longest minus each row, is a fraction of a random batch's); the order
    is seeded (the same each resume) and differs between epochs; without lengths nothing moves."""
    import random

    from runtime.training import epoch_slice, length_grouped, seeded_order

    rng = random.Random(0)
    n, per_step = 1000, 10
    lengths = [rng.randrange(20, 400) for _ in range(n)]
    order = seeded_order(n, 5)
    grouped = length_grouped(order, lengths, per_step, 5, window=8)
    assert sorted(grouped) == list(range(n)) and grouped != order

    def padding(ids):
        batches = [ids[k:k + per_step] for k in range(0, len(ids), per_step)]
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b)
                   for b in batches)

    assert padding(grouped) < 0.2 * padding(order)
    # which rows share a window stays random: the first window holds the order's first 80
    assert set(grouped[:80]) == set(order[:80])
    steps = n // per_step
    first = [i for s in range(steps) for i in epoch_slice(n, s, per_step, 5, None, lengths)[1]]
    again = [i for s in range(steps) for i in epoch_slice(n, s, per_step, 5, None, lengths)[1]]
    second = [i for s in range(steps, 2 * steps)
              for i in epoch_slice(n, s, per_step, 5, None, lengths)[1]]
    assert first == again and sorted(first) == list(range(n)) and second != first
    assert epoch_slice(n, 3, per_step, 5)[1] == seeded_order(n, 5)[30:40]
    # a short last batch stays last, so every step's slice is one batch
    odd = length_grouped(list(range(25)), list(range(25)), 10, 0, window=8)
    assert sorted(odd[20:]) == list(range(5))
    from configs import ConfigError, load_config

    with pytest.raises(ConfigError, match="rm.group_by_question and rm.group_by_length"):
        load_config("configs/tiny.yaml", ["rm.group_by_question=true", "rm.group_by_length=true"])


def test_pairwise_loss_ranks_a_questions_right_solutions_above_its_wrong_ones():
    """Hand-computed: solution scores are the lowest labelled tag logit; only (right, wrong) pairs
    of one question count, each adding softplus(s_wrong - s_right)."""
    import math

    from reward_model.losses import pairwise_loss_sum

    margin = torch.tensor([[2.0, 1.0, 9.0], [0.5, -1.0, 9.0], [3.0, 9.0, 9.0], [-2.0, 9.0, 9.0]],
                          requires_grad=True)
    label_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    targets = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    group = torch.tensor([0, 0, 1, 0])  # rows 0, 1, 3 share a question; row 2 is alone
    total, pairs = pairwise_loss_sum(margin, targets, label_mask, group)
    # right: row 0 (score 1.0); wrong: row 1 (score -1.0), row 3 (score -2.0)
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731
    assert pairs == 2
    assert math.isclose(total.item(), softplus(-1.0 - 1.0) + softplus(-2.0 - 1.0), rel_tol=1e-6)
    total.backward()  # the gradient reaches only the tags that set each score
    assert margin.grad[0, 0] == 0 and margin.grad[0, 1] < 0 and margin.grad[1, 1] > 0
    assert margin.grad[2].abs().sum() == 0 and margin.grad[:, 2].abs().sum() == 0


def test_train_rm_adds_the_pairwise_loss_to_the_pointwise_one(tmp_path):
    """`rm.pairwise_weight` adds the within-question pairwise term to the loss of the same batch:
    at the first step (same weights, same rows) the loss is the plain run's plus the logged term."""
    import igrpo
    from runtime.tracking import read_metrics
    from small_config import SMALL

    rows = {}
    for name, weight in (("plain", 0.0), ("pairwise", 1.0)):
        assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                           f"run.name={name}", *SMALL, "rm.kind=prm", "rm.synthetic_solutions=64",
                           "rm.epochs=1", "rm.batch_size=16", "deepspeed.micro_batch_size=16",
                           "rm.val_fraction=0", "rm.likelihood_feature=false",
                           "rm.group_by_question=true", f"rm.pairwise_weight={weight}",
                           "run.wandb_mode=disabled"]) == 0
        rows[name] = [r for r in read_metrics(tmp_path / name / "rm-prm" / "metrics.jsonl")
                      if "rm/loss" in r]
    pair = [r["rm/pairwise_loss"] for r in rows["pairwise"]]
    assert "rm/pairwise_loss" not in rows["plain"][0] and all(p > 0 for p in pair)
    assert rows["pairwise"][0]["rm/loss"] == pytest.approx(rows["plain"][0]["rm/loss"] + pair[0],
                                                           rel=1e-5)


def test_a_worked_solution_whose_slips_cancel_is_right_for_the_orm_and_wrong_for_the_prm():
    """The ORM reads worked solutions as it reads the policy's samples, by the final answer;
    the PRM by the question, step by step. 27+5 forgotten carry (-10), 22-8 forgotten borrow
    (+10): the answer 48 is the gold one through two wrong steps."""
    from reward_model.examples import worked_examples, worked_orm_examples
    from runtime.data import MathRecord

    question = "Start with 27. Add 5. Subtract 8. Multiply by 2."
    slipped = MathRecord(question, "48", ("Add 5: 27+5=22", "Subtract 8: 22-8=24",
                                          "Multiply by 2: 24*2=48", "The answer is 48"),
                         "synthetic:0:0")
    wrong = MathRecord(question, "48", ("Add 5: 27+5=22", "Subtract 8: 22-8=14",
                                        "Multiply by 2: 14*2=28", "The answer is 28"),
                       "synthetic:0:1")
    orm = worked_orm_examples([slipped, wrong])
    assert [ex.labels for ex in orm] == [(1.0,), (0.0,)]
    assert orm[0].steps == ("\n".join(slipped.solution_steps),)
    assert [ex.labels for ex in worked_examples([slipped])] == [(0.0, 0.0, 0.0, 0.0)]
