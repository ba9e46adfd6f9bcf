"""The reward model's likelihood feature: which tokens it reads, the running minimum, the fitted
weights, and a scorer that applies them after a save and reload."""

import math

import pytest
import torch

from process_supervision.formats import StepExample
from reward_model.calibration import calibration_of, fit_calibration, set_calibration
from reward_model.encoding import encode, tag_tokens
from reward_model.heads import running_min, token_logprobs
from reward_model.score import TagScorer
from runtime.tiny_model import STEP_TAG, build_model, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_solution_mask_covers_the_steps_only(tok):
    ex = StepExample("Q", ("1+1=2", "2*3=6"), (1.0, 0.0))
    batch = encode(tok, [ex], tag_tokens(tok, STEP_TAG), STEP_TAG, 128, solution_tokens=True)
    ids = batch.input_ids[0][batch.solution_mask[0]].tolist()
    # From after the question to each tag; the tags and the newline after a tag are left out.
    assert tok.decode(ids) == " Step 1: 1+1=2 Step 2: 2*3=6 "
    plain = encode(tok, [ex], tag_tokens(tok, STEP_TAG), STEP_TAG, 128)
    assert not plain.solution_mask.any()


def test_token_logprobs_and_running_min_by_hand():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 0.0]]])
    ids = torch.tensor([[1, 0, 1]])
    # Token 1 given position 0: log 1/2; token 2 (=1) given position 1: log 1/4.
    assert token_logprobs(logits, ids).tolist()[0] == pytest.approx(
        [0.0, math.log(0.5), math.log(0.25)])
    values = torch.tensor([[-1.0, -3.0, -5.0, -0.5, -4.0, -2.0]])
    mask = torch.tensor([[False, True, False, True, True, True]])
    # -1 and -5 are outside the mask; before the first masked position the minimum is 0.
    assert running_min(values, mask).tolist()[0] == [0.0, -3.0, -3.0, -3.0, -4.0, -4.0]


def test_calibration_recovers_known_weights():
    gen = torch.Generator().manual_seed(0)
    margin = torch.randn(20000, generator=gen)
    surprise = -torch.empty(20000).exponential_(1.0, generator=gen)
    p = torch.sigmoid(0.5 * margin + 2.0 * surprise + 1.0)
    labels = torch.bernoulli(p, generator=gen)
    fitted = fit_calibration(margin.tolist(), surprise.tolist(), labels.tolist())
    assert fitted["margin"] == pytest.approx(0.5, abs=0.08)
    assert fitted["surprise"] == pytest.approx(2.0, abs=0.15)
    assert fitted["bias"] == pytest.approx(1.0, abs=0.12)
    assert fitted["loss"] < fitted["plain_loss"]
    with pytest.raises(ValueError, match="no labelled steps"):
        fit_calibration([], [], [])


def test_scorer_applies_the_fitted_weights_after_reload(tok, tmp_path):
    model = build_model(tok, 32, 1, 2, 64, 256, seed=0)
    examples = [StepExample("Start with 3. Add 4.", ("Add 4: 3+4=7", "The answer is 7"), (1, 1)),
                StepExample("Start with 9. Subtract 2.", ("Subtract 2: 9-2=8",), (0,))]
    plain = TagScorer(model, tok, STEP_TAG, 256)
    values = plain.tag_values(examples, with_surprise=True)
    assert [len(m) for m, _ in values] == [2, 1] and [len(s) for _, s in values] == [2, 1]
    first, second = values[0][1]
    assert second <= first < 0  # a running minimum over more tokens
    assert plain.score(examples)[0] == pytest.approx(
        [1 / (1 + math.exp(-m)) for m in values[0][0]])
    weights = {"margin": 0.5, "surprise": 2.0, "bias": 3.0}
    set_calibration(model, weights)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded = TagScorer.from_pretrained(tmp_path, STEP_TAG, 256)
    assert calibration_of(reloaded.model) == weights
    expected = [[1 / (1 + math.exp(-(0.5 * m + 2.0 * s + 3.0))) for m, s in zip(*v)]
                for v in values]
    scored = reloaded.score(examples)
    assert [len(s) for s in scored] == [2, 1]
    for got, want in zip(scored, expected):
        assert got == pytest.approx(want, rel=1e-5)
