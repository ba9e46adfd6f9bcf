"""The reward model's likelihood feature: which tokens it reads, the running minimum, the fitted
weights, and a scorer that applies them after a save and reload."""

import math

import pytest
import torch

from process_supervision.formats import StepExample
from reward_model.likelihood_feature import (MIN_CLASS_STEPS, calibration_of, fit_calibration,
                                             refit_or_keep, set_calibration, step_logits)
from reward_model.encoding import encode, tag_tokens
from reward_model.losses import running_min, token_logprobs
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


def _draws(n: int, seed: int, surprise_weight: float):
    """(margins, surprises, labels): labels drawn from logit 0.5 m + w s + 1."""
    gen = torch.Generator().manual_seed(seed)
    margin = torch.randn(n, generator=gen)
    surprise = -torch.empty(n).exponential_(1.0, generator=gen)
    p = torch.sigmoid(0.5 * margin + surprise_weight * surprise + 1.0)
    return margin.tolist(), surprise.tolist(), torch.bernoulli(p, generator=gen).tolist()


def test_refit_keeps_the_previous_weights_on_one_class():
    previous = {"margin": 0.3, "surprise": 1.5, "bias": 0.2}
    margins, surprises, _ = _draws(200, 1, 2.0)
    # A random model's samples are all wrong: an unguarded fit saturates (every score ~0).
    saturated = fit_calibration(margins, surprises, [0.0] * 200)
    assert max(torch.sigmoid(torch.tensor(step_logits(saturated, margins, surprises)))) < 0.01
    chosen, report = refit_or_keep(previous, (margins, surprises, [0.0] * 200), _draws(100, 2, 2.0))
    assert chosen == previous and report["kept"] == 1.0 and report["fit_right"] == 0
    # Exactly MIN_CLASS_STEPS of the rare class is enough to refit (no validation steps here).
    labels = [1.0] * MIN_CLASS_STEPS + [0.0] * (200 - MIN_CLASS_STEPS)
    chosen, report = refit_or_keep(previous, (margins, surprises, labels), ([], [], []))
    assert report["kept"] == 0.0 and chosen != previous
    # No previous weights and one class: the plain tag score (None).
    assert refit_or_keep(None, (margins, surprises, [1.0] * 200), ([], [], []))[0] is None


def test_refit_is_kept_only_when_it_scores_validation_at_least_as_well():
    truth = {"margin": 0.5, "surprise": 2.0, "bias": 1.0}
    validation = _draws(4000, 3, 2.0)
    # The refit's data say the likelihood does not matter (w = 0): on validation data where it
    # does, the refit scores (and ranks) worse than the previous weights, which stay.
    chosen, report = refit_or_keep(truth, _draws(4000, 4, 0.0), validation)
    assert chosen == truth and report["kept"] == 1.0
    assert report["val_loss_refit"] > report["val_loss_previous"]
    assert report["val_auroc_refit"] < report["val_auroc_previous"] - 0.05
    # Previous weights that ignore the likelihood lose to a refit on data like validation's.
    blind = {"margin": 1.0, "surprise": 0.0, "bias": 0.0}
    chosen, report = refit_or_keep(blind, _draws(4000, 5, 2.0), validation)
    assert report["kept"] == 0.0 and chosen["surprise"] == pytest.approx(2.0, abs=0.3)
    assert report["val_auroc_refit"] > report["val_auroc_previous"]
    # Previous weights that rank exactly as well (the same weights, bias off by 4: AUROC is
    # unchanged by a shift) but put the threshold in the wrong place lose to the refit.
    shifted = {**truth, "bias": truth["bias"] - 4.0}
    chosen, report = refit_or_keep(shifted, _draws(4000, 6, 2.0), validation)
    assert report["kept"] == 0.0 and chosen["bias"] == pytest.approx(1.0, abs=0.3)
    assert report["val_loss_refit"] < report["val_loss_previous"] - 0.3
    assert abs(report["val_auroc_refit"] - report["val_auroc_previous"]) < 0.01


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
