"""The likelihood feature of a reward model: fit how much its own token log-likelihoods count.

Why: the tiny policy forms each result digit only in its last layer (logit lens: 23/25/32/97% of
next result digits right after layers 1/2/3/4), so at a step's tag no layer is left to compare the
written result with the one the model would compute, and a few CPU minutes of tag training do not
teach it (docs/reward_models.md). The comparison is already in the language model's output:
the log-likelihood of each written token. Its running minimum over the solution so far
(`losses.running_min`) ranks the policy's own samples within a question at AUROC 0.90, where the
trained tag alone scored 0.5.

With `rm.likelihood_feature`, a step's logit is `margin * tag margin + surprise * running min +
bias`; this file fits the three numbers by logistic regression on training examples (after the
backbone's training, not through it) and stores them in the model config under
`igrpo_step_calibration`, so the checkpoint stays a plain `from_pretrained` one and every scorer
that loads it (`TagScorer`) applies them. Without that key a reward model scores the Math-Shepherd
way, P(+) at the tag, exactly as a released PRM does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reward_model.evaluate import auroc

CALIBRATION_KEY = "igrpo_step_calibration"
MIN_CLASS_STEPS = 5
"""A refit needs at least this many right and this many wrong steps (hard, >= 0.5) to fit on."""


def fit_calibration(margins: list[float], surprises: list[float], targets: list[float],
                    l2: float = 1e-4, iterations: int = 100) -> dict[str, float]:
    """Logistic regression of the (soft) step labels on (tag margin, running min log-lik).

    Starts from the plain tag score (margin weight 1, the rest 0); `l2` keeps the weights finite
    on separable data. Returns {"margin", "surprise", "bias"} and the fitted mean loss ("loss")
    beside the plain tag score's ("plain_loss")."""
    if not targets:
        raise ValueError("fit_calibration: no labelled steps to fit on")
    x = torch.tensor([margins, surprises], dtype=torch.float64).T
    y = torch.tensor(targets, dtype=torch.float64)
    w = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)

    def loss_of(params: torch.Tensor) -> torch.Tensor:
        logit = x @ params[:2] + params[2]
        return F.binary_cross_entropy_with_logits(logit, y)

    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_of(w) + l2 * (w[:2] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        plain = loss_of(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
        fitted = loss_of(w)
    margin, surprise, bias = w.detach().tolist()
    return {"margin": margin, "surprise": surprise, "bias": bias, "loss": float(fitted),
            "plain_loss": float(plain)}


def step_logits(calibration: dict[str, float] | None, margins: list[float],
                surprises: list[float]) -> list[float]:
    """Step logits under `calibration` (None: the plain tag margin)."""
    if calibration is None:
        return list(margins)
    return [calibration["margin"] * m + calibration["surprise"] * s + calibration["bias"]
            for m, s in zip(margins, surprises)]


def validation_loss(calibration: dict[str, float] | None, margins: list[float],
                    surprises: list[float], targets: list[float]) -> float:
    """Mean binary cross-entropy of the (soft) step labels under `calibration`."""
    logits = torch.tensor(step_logits(calibration, margins, surprises), dtype=torch.float64)
    return float(F.binary_cross_entropy_with_logits(
        logits, torch.tensor(targets, dtype=torch.float64)))


def refit_or_keep(previous: dict[str, float] | None, fit_on: tuple[list, list, list],
                  validate_on: tuple[list, list, list]) -> tuple[dict[str, float] | None, dict]:
    """The guard around a refit (a refresh trains on a few hundred of the policy's own samples).

    `fit_on` and `validate_on` are (margins, surprises, soft labels) of training and validation
    steps. Keeps `previous` (the weights the model carries; None = plain tag score) when
    - the training steps hold fewer than `MIN_CLASS_STEPS` right or wrong steps: a fit on one
      class drives the bias to -inf or +inf and ranks nothing (a random model's samples are all
      wrong: every score became ~2e-8 and GRPO had no signal), or
    - the new weights score the validation steps worse (mean log loss) than `previous` on the
      same backbone. Log loss, not AUROC: the refreshed backbone can keep its ranking and move
      its scores, and only a refit puts the threshold back (the tiny demo, seed 1: carried
      weights ranked validation at AUROC 0.844 against the refit's 0.842, were kept, and
      called 99% of right solutions wrong).
    Returns (weights to use, report: `kept` 0/1, `fit_right`/`fit_wrong` counts, the two
    validation losses, and the two validation AUROCs where both classes are present)."""
    margins, surprises, targets = fit_on
    right = sum(1 for t in targets if t >= 0.5)
    report = {"fit_right": float(right), "fit_wrong": float(len(targets) - right)}
    if min(right, len(targets) - right) < MIN_CLASS_STEPS:
        return previous, {**report, "kept": 1.0}
    fitted = fit_calibration(margins, surprises, targets)
    report.update({"loss": fitted["loss"], "plain_loss": fitted["plain_loss"]})
    v_margins, v_surprises, v_targets = validate_on
    if previous is not None and v_targets:
        new = validation_loss(fitted, v_margins, v_surprises, v_targets)
        old = validation_loss(previous, v_margins, v_surprises, v_targets)
        report.update({"val_loss_refit": new, "val_loss_previous": old})
        truth = [t >= 0.5 for t in v_targets]
        if any(truth) and not all(truth):
            report.update({
                "val_auroc_refit": auroc(step_logits(fitted, v_margins, v_surprises), truth),
                "val_auroc_previous": auroc(step_logits(previous, v_margins, v_surprises), truth)})
        if new > old:
            return previous, {**report, "kept": 1.0}
    return fitted, {**report, "kept": 0.0}


def calibration_of(model) -> dict[str, float] | None:
    """The fitted numbers a reward model carries in its config, or None (plain tag score)."""
    value = getattr(model.config, CALIBRATION_KEY, None)
    return dict(value) if value else None


def set_calibration(model, calibration: dict[str, float] | None) -> None:
    """Record the fitted numbers in the model config (saved with `save_pretrained`)."""
    setattr(model.config, CALIBRATION_KEY,
            None if calibration is None else
            {k: float(calibration[k]) for k in ("margin", "surprise", "bias")})
