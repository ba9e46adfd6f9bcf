"""Group-relative advantages (policy/math/advantages.py) against hand-computed numbers and the
seed's worked example: outcome, process, RFT, the estimator table, the process credit forms (sum,
min, anchored), GPG's alpha, C3PO's budget."""

import math

import pytest
import torch

from configs import load_config
from configs.loader import ConfigError
from iteration.resolve import resolve
from policy.algorithms.grpo import advantage_step, compute_advantages
from policy.math.advantages import (PROCESS_CREDIT, GroupNorm, min_form_values, outcome_advantages,
                                    token_budget_mask, zero_group_correction)
from policy.rewards import Scores

from by_hand import process_advantages
from recipe_batch import LENGTHS, REWARDS, batch_rollout, recipe_config
from seed_example import seed_inputs


def test_seed_example_advantages():
    *_, adv = seed_inputs()
    assert adv.tolist() == pytest.approx([0.577, 0.577, 0.577, -1.732], abs=1e-3)


def test_all_equal_group_gives_zero_advantage_not_nan():
    adv = outcome_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3)
    assert adv.tolist() == [0.0] * 6
    adv = outcome_advantages(torch.tensor([0.5, 0.5]), 1)  # G = 1: no group to compare against
    assert adv.tolist() == [0.0, 0.0]


def test_unbiased_std_and_no_std():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25; sample std = sqrt(0.75 / 3) = 0.5 -> (1 - 0.25) / 0.5 = 1.5
    assert outcome_advantages(r, 4, unbiased=True, eps=0)[0].item() == pytest.approx(1.5)
    assert outcome_advantages(r, 4, scale_by_std=False).tolist() == [0.75, -0.25, -0.25, -0.25]


def test_process_advantages_by_hand():
    # One group, G = 2. Sample 0: 3 steps ending at tokens 1, 3, 5 with rewards 1, 0, 1.
    # Sample 1: 2 steps ending at tokens 2, 4 with rewards 0, 0; token 5 lies after its last step.
    step_rewards = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    step_mask = torch.tensor([[True, True, True], [True, True, False]])
    step_end = torch.tensor([[1, 3, 5], [2, 4, 0]])
    # All 5 step rewards together: mean 0.4, population std sqrt((2*0.36 + 3*0.16)/5) = sqrt(0.24).
    sd = math.sqrt(0.24)
    hi, lo = 0.6 / sd, -0.4 / sd
    adv = process_advantages(step_rewards, step_mask, step_end, num_tokens=7, group_size=2, eps=0)
    expected0 = [hi + lo + hi] * 2 + [lo + hi] * 2 + [hi] * 2 + [0.0]
    expected1 = [lo + lo] * 3 + [lo] * 2 + [0.0] * 2
    assert adv[0].tolist() == pytest.approx(expected0, abs=1e-6)
    assert adv[1].tolist() == pytest.approx(expected1, abs=1e-6)


def test_process_advantages_equal_plain_loop():
    torch.manual_seed(0)
    n, s, t, g = 8, 4, 20, 4
    rewards = torch.rand(n, s)
    mask = torch.rand(n, s) > 0.3
    ends = torch.sort(torch.randint(0, t, (n, s)), dim=-1).values
    fast = process_advantages(rewards, mask, ends, t, g, eps=0)
    for q in range(n // g):
        vals = torch.cat([rewards[i][mask[i]] for i in range(q * g, (q + 1) * g)])
        mean, std = vals.mean(), vals.std(unbiased=False)
        for i in range(q * g, (q + 1) * g):
            for tok in range(t):
                want = sum(((rewards[i, j] - mean) / std).item()
                           for j in range(s) if mask[i, j] and ends[i, j] >= tok)
                assert fast[i, tok].item() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_equal_group_has_exactly_zero_advantage(dtype):
    rewards = torch.full((64,), 0.7, dtype=dtype)
    assert (outcome_advantages(rewards, 64) == 0).all()
    steps = torch.full((64, 3), 0.7, dtype=dtype)
    adv = process_advantages(steps, torch.ones(64, 3, dtype=torch.bool),
                             torch.tensor([[1, 3, 5]] * 64), 6, 64)
    assert (adv == 0).all()
    # 0.1 + 0.6 is 0.7 up to rounding: one reward, no spread
    near = torch.tensor([0.1 + 0.6, 0.7, 0.7, 0.7], dtype=torch.float64)
    assert (outcome_advantages(near, 4) == 0).all()
    # a real spread of one part in a thousand keeps its signal
    assert (outcome_advantages(torch.tensor([0.7, 0.7007]), 2) != 0).all()


def test_gpg_alpha_by_hand():
    assert zero_group_correction(8, 4) == 2.0   # B = 8 samples, M = 4 without signal
    assert zero_group_correction(64, 16) == pytest.approx(64 / 48)
    assert zero_group_correction(8, 0) == 1.0
    assert zero_group_correction(8, 8) == 1.0   # nothing to correct: the step is skipped


def test_c3po_selection_and_normaliser_by_hand():
    lengths = torch.tensor([5, 3, 4, 2])
    order = torch.tensor([2, 0, 1, 3])
    # budget 9: row 2 (4 tokens, 5 left), row 0 (5 tokens, 0 left): sum_{j<N} 4 < 9 <= 9
    assert token_budget_mask(lengths, 9, order).tolist() == [5, 0, 4, 0]
    # budget 7: row 2 (4), then row 0 cut to 3 tokens so that |Psi| = Phi
    assert token_budget_mask(lengths, 7, order).tolist() == [3, 0, 4, 0]
    # budget above the batch: everything, and the normaliser stays Phi
    assert token_budget_mask(lengths, 100, order).tolist() == [5, 3, 4, 2]
    # Through the step: Phi = 0.25 * 2 * 3 * 4 = 6 tokens of the 11; the loss divides by 6.
    cfg = recipe_config("c3po", "grpo.token_budget_share=0.25")
    rewards = torch.tensor(REWARDS)
    batch = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                           batch_rollout(), resolve(cfg).method, cfg.policy.group_size, seed=3)
    assert batch.loss_mask.sum() == 6 and batch.num_tokens == 6
    order = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    expected = token_budget_mask(torch.tensor(LENGTHS), 6, order)
    assert batch.loss_mask.sum(-1).long().tolist() == expected.tolist()
    assert batch.stats["train/budget_tokens"] == 6


# One group, G = 3, T = 6: steps of different counts and token lengths; padding entries hold 9.0
# (never read) and tokens after a sample's last step end lie outside every step.
#   sample 0: 1 step,  reward 0.9,           ends at token 2     (tokens 3-5 after it)
#   sample 1: 2 steps, rewards 0.8, 0.5,      ends at tokens 1, 5
#   sample 2: 3 steps, rewards 0.6, 0.3, 0.5, ends at tokens 0, 2, 4 (token 5 after it)
STEPS = torch.tensor([[0.9, 9.0, 9.0], [0.8, 0.5, 9.0], [0.6, 0.3, 0.5]])
STEP_MASK = torch.tensor([[True, False, False], [True, True, False], [True, True, True]])
STEP_END = torch.tensor([[2, 0, 0], [1, 5, 0], [0, 2, 4]])
CORRECT = torch.tensor([True, True, False])
NORM = GroupNorm(3, eps=0.0)
ROOT2 = math.sqrt(2)


def _close(got, rows):
    torch.testing.assert_close(got, torch.tensor(rows, dtype=got.dtype), rtol=0, atol=1e-6)


def _credit(name, steps=STEPS, mask=STEP_MASK, ends=STEP_END, correct=CORRECT, tokens=6,
            norm=NORM, weight=0.5):
    return PROCESS_CREDIT[name].estimate(steps, mask, ends, correct, tokens, norm, weight)


def test_sum_credit_by_hand():
    # The 6 rewards: mean 3.6 / 6 = 0.6; deviations .3 | .2 -.1 | 0 -.3 -.1, squares summing to
    # .24: std sqrt(.24 / 6) = 0.2. Normalised: 1.5 | 1.0 -0.5 | 0 -1.5 -0.5. Token t sums its
    # step and the later ones: sample 1's tokens 0-1 get 1.0 - 0.5, sample 2's tokens 0-2 get
    # 0 - 1.5 - 0.5 (tokens 1-2 lie in step 1), its tokens 3-4 get -0.5.
    adv, normalised = _credit("sum")
    _close(adv, [[1.5] * 3 + [0.0] * 3,
                 [0.5] * 2 + [-0.5] * 4,
                 [-2.0] * 3 + [-0.5] * 2 + [0.0]])
    assert normalised[STEP_MASK].tolist() == pytest.approx([1.5, 1.0, -0.5, 0, -1.5, -0.5],
                                                          abs=1e-6)


def test_min_credit_by_hand():
    # Each step's value is the min of its reward and every later one: 0.9 | min(.8, .5) = .5, .5 |
    # min(.6, .3, .5) = .3, min(.3, .5) = .3, .5. Mean 3.0 / 6 = 0.5; deviations .4 | 0 0 |
    # -.2 -.2 0: std sqrt(.24 / 6) = 0.2. Normalised: 2 | 0 0 | -1 -1 0. Token t gets its own
    # step's value: sample 2's tokens 0-2 get -1 (step 0 and step 1, whose 0.3 is the min of
    # its own and the later rewards), tokens 3-4 get 0.
    adv, normalised = _credit("min")
    _close(adv, [[2.0] * 3 + [0.0] * 3,
                 [0.0] * 6,
                 [-1.0] * 3 + [0.0] * 3])
    _close(normalised, [[2, 0, 0], [0, 0, 0], [-1, -1, 0]])


def test_anchored_credit_by_hand_part_by_part():
    # Outcome part: correct 1, 1, 0 normalised within the group: mean 2/3, std sqrt(2) / 3, so
    # (1/3) / (sqrt(2)/3) = 1/sqrt(2) on each right sample, -sqrt(2) on the wrong one, on every
    # token (also after the last step).
    outcome, parts = _credit("anchored", weight=0.0)
    _close(outcome, [[1 / ROOT2] * 6, [1 / ROOT2] * 6, [-ROOT2] * 6])
    # Process part: the min form's token values (2 | 0 | -1, -1, -1, 0, ...) clamped to [-1, 1]
    # (sample 0's 2 becomes 1), times process_weight 0.5.
    adv, parts = _credit("anchored", weight=0.5)
    process = (adv - outcome) / 0.5
    _close(process, [[1.0] * 3 + [0.0] * 3, [0.0] * 6,
                     [-1.0] * 3 + [0.0] * 3])
    _close(adv, [[1 / ROOT2 + 0.5] * 3 + [1 / ROOT2] * 3,
                 [1 / ROOT2] * 6,
                 [-ROOT2 - 0.5] * 3 + [-ROOT2] * 3])
    # What was normalised: the min-form values, then the outcome (each sums to 0 over the group).
    _close(parts, [[2, 0, 0, 1 / ROOT2], [0, 0, 0, 1 / ROOT2],
                   [-1, -1, 0, -ROOT2]])
    assert parts.sum().item() == pytest.approx(0, abs=1e-5)


def test_prime_credit_by_hand_part_by_part():
    """PRIME's advantage: the check's outcome part (as anchored's) plus process_weight times the
    sum form's token values, unbounded (sample 2's -2.0 stays -2.0), and under a gold budget a
    group outside it gets the sum form alone."""
    outcome = [[1 / ROOT2] * 6, [1 / ROOT2] * 6, [-ROOT2] * 6]
    total = [[1.5] * 3 + [0.0] * 3, [0.5] * 2 + [-0.5] * 4, [-2.0] * 3 + [-0.5] * 2 + [0.0]]
    adv, parts = _credit("prime", weight=1.0)
    _close(adv, [[o + t for o, t in zip(orow, trow)] for orow, trow in zip(outcome, total)])
    _close(_credit("prime", weight=0.0)[0], outcome)
    # What was normalised: the sum form's step rewards, then the outcome.
    _close(parts, [[1.5, 0, 0, 1 / ROOT2], [1.0, -0.5, 0, 1 / ROOT2], [0, -1.5, -0.5, -ROOT2]])
    hidden, hidden_parts = PROCESS_CREDIT["prime"].estimate(
        STEPS, STEP_MASK, STEP_END, CORRECT, 6, NORM, 1.0, revealed=torch.zeros(3, dtype=bool))
    _close(hidden, total)
    assert hidden_parts[:, -1].abs().sum() == 0
    # DAPO's filter: a group whose checks agree still carries the sum form's signal; one whose
    # steps and checks are all equal carries none.
    flat = torch.full_like(STEPS, 0.5)
    informative = PROCESS_CREDIT["prime"].informative
    assert informative(STEPS, STEP_MASK, torch.ones(3, dtype=torch.bool), 3).tolist() == [True]
    assert informative(flat, STEP_MASK, torch.ones(3, dtype=torch.bool), 3).tolist() == [False]
    assert informative(flat, STEP_MASK, CORRECT, 3).tolist() == [True]
    with pytest.raises(ValueError, match="prime need the reward's final-answer check"):
        _credit("prime", correct=None)


def test_credit_forms_through_the_step_mask_completion_padding():
    """compute_advantages picks the form from grpo.process_credit and zeroes the completion's
    padding: completions of 4, 6 and 5 tokens (sample 0's tokens 4-5 and sample 2's token 5 are
    padding, sample 0's token 3 lies after its last step)."""
    rollout = batch_rollout(lengths=[4, 6, 5], width=6)
    scores = Scores(rewards=torch.zeros(3), correct=CORRECT, step_rewards=STEPS,
                    step_mask=STEP_MASK, step_end_index=STEP_END)
    for name in ("sum", "min", "prime", "anchored"):
        cfg = load_config("configs/tiny.yaml", ["policy.group_size=3", "grpo.std_eps=0",
                                                f"grpo.process_credit={name}"])
        adv, _ = compute_advantages(scores, scores.rewards, rollout, resolve(cfg).method)
        expected = _credit(name)[0] * rollout.completion_mask
        assert torch.equal(adv, expected), name
        assert (adv[0, 4:] == 0).all() and adv[2, 5] == 0
    a, o = 1 / ROOT2 + 0.5, 1 / ROOT2  # (anchored's)
    assert adv[0].tolist() == pytest.approx([a, a, a, o, 0, 0], abs=1e-6)


def test_the_default_config_takes_the_sum_form_through_the_production_path():
    """configs/tiny.yaml's process supervision is DeepSeekMath's sum form (its values by hand:
    test_sum_credit_by_hand), through `compute_advantages` as GRPO calls it."""
    cfg = load_config("configs/tiny.yaml", ["policy.group_size=3"])
    g = cfg.grpo
    assert g.process_credit == "sum"
    rollout = batch_rollout(lengths=[6, 6, 6], width=6)
    scores = Scores(rewards=torch.zeros(3), step_rewards=STEPS, step_mask=STEP_MASK,
                    step_end_index=STEP_END)
    adv, _ = compute_advantages(scores, scores.rewards, rollout, resolve(cfg).method)
    by_hand = process_advantages(STEPS, STEP_MASK, STEP_END, 6, 3, eps=g.std_eps)
    assert torch.equal(adv, by_hand)


def test_min_credit_equals_plain_loop():
    torch.manual_seed(1)
    n, s, t, g = 12, 4, 14, 4
    steps = torch.rand(n, s)
    mask = torch.rand(n, s) > 0.4
    mask[3] = False  # a sample without a step
    ends = torch.sort(torch.randint(0, t, (n, s)), dim=-1).values
    fast, _ = _credit("min", steps, mask, ends, None, t, GroupNorm(g, eps=0.0))
    for q in range(n // g):
        rows = range(q * g, (q + 1) * g)
        real = [steps[i, j].item() for i in rows for j in range(s) if mask[i, j]]
        floor = min([0.0] + real)
        values = {}
        for i in rows:
            js = [j for j in range(s) if mask[i, j]]
            for j in js:
                values[i, j] = min(steps[i, k].item() for k in js if k >= j)
            if not js:
                values[i, None] = floor
        mean = sum(values.values()) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values.values()) / len(values))
        for i in rows:
            js = [j for j in range(s) if mask[i, j]]
            for tok in range(t):
                own = [j for j in js if ends[i, j] >= tok]
                key = (i, own[0]) if own else (i, None) if not js else None
                want = 0.0 if key is None else (values[key] - mean) / std
                assert fast[i, tok].item() == pytest.approx(want, abs=1e-5)


def test_a_sample_without_a_step_gets_the_floor_not_the_average():
    # G = 3, T = 4: an empty completion beside two right ones (step rewards 1 | 1, 1). The sum
    # form has no spread: all 0, the empty sample "average". Under min it gets the group's floor
    # min(0, lowest step reward) = 0: values 0 | 1 | 1, 1, mean 3/4, std sqrt(3)/4, normalised
    # -sqrt(3) | 1/sqrt(3) | 1/sqrt(3), 1/sqrt(3) (the seed example's numbers).
    steps = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[False, False], [True, False], [True, True]])
    ends = torch.tensor([[0, 0], [3, 0], [1, 3]])
    correct = torch.tensor([False, True, True])
    args = dict(steps=steps, mask=mask, ends=ends, correct=correct, tokens=4)
    assert (_credit("sum", **args)[0] == 0).all()
    lo, hi = -math.sqrt(3), 1 / math.sqrt(3)
    adv, normalised = _credit("min", **args)
    _close(adv, [[lo] * 4, [hi] * 4, [hi] * 4])
    _close(normalised, [[lo, 0], [hi, 0], [hi, hi]])
    # anchored: outcome -sqrt(2) | 1/sqrt(2) | 1/sqrt(2); process 0.5 * clamp(-sqrt(3)) = -0.5
    adv, _ = _credit("anchored", **args)
    _close(adv, [[-ROOT2 - 0.5] * 4, [1 / ROOT2 + 0.5 * hi] * 4,
                 [1 / ROOT2 + 0.5 * hi] * 4])
    # A floor below 0: the group's lowest step reward (an overlong penalty can push one there).
    values, valid = min_form_values(torch.tensor([[0.0, 0.0], [-0.5, 0.25]]),
                                    torch.tensor([[False, False], [True, True]]), 2)
    assert values.tolist() == [[-0.5, 0.0], [-0.5, 0.25]]
    assert valid.tolist() == [[True, False], [True, True]]


def test_each_credit_form_filters_on_what_it_normalises():
    # G = 2: rewards 0.5, 0.2 | 0.2 spread, but their min-form values 0.2, 0.2 | 0.2 do not.
    steps = torch.tensor([[0.5, 0.2], [0.2, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    both, one = torch.tensor([True, True]), torch.tensor([True, False])
    assert PROCESS_CREDIT["sum"].informative(steps, mask, both, 2).tolist() == [True]
    assert PROCESS_CREDIT["min"].informative(steps, mask, both, 2).tolist() == [False]
    assert PROCESS_CREDIT["anchored"].informative(steps, mask, both, 2).tolist() == [False]
    # the outcome alone spreads: anchored has signal, and so has its advantage
    assert PROCESS_CREDIT["anchored"].informative(steps, mask, one, 2).tolist() == [True]
    adv, _ = _credit("anchored", steps, mask, torch.tensor([[0, 1], [1, 0]]), one, 2,
                     GroupNorm(2, eps=0.0), 0.5)
    _close(adv, [[1.0, 1.0], [-1.0, -1.0]])
    with pytest.raises(ValueError, match="Scores.correct"):
        _credit("anchored", correct=None)


def test_credit_form_typos_and_misuse_fail_at_start_up():
    with pytest.raises(ConfigError, match="grpo.process_credit"):
        load_config("configs/tiny.yaml", ["grpo.process_credit=mean"])
    with pytest.raises(ConfigError, match="grpo.process_credit=min with policy.supervision=outcome"):
        load_config("configs/tiny.yaml", ["grpo.process_credit=min", "policy.supervision=outcome"])
    with pytest.raises(ConfigError, match="grpo.process_weight"):
        load_config("configs/tiny.yaml", ["grpo.process_credit=anchored",
                                          "grpo.process_weight=-0.5"])
    assert load_config("configs/tiny.yaml", ["grpo.process_credit=anchored"]).grpo.process_weight \
        == 0.5


def test_a_gold_budget_leaves_the_questions_outside_it_to_the_prm_min_form():
    """Two groups of the hand-built one above, the first inside the gold budget and the second
    outside: the first gets the anchored advantages worked out by hand, the second the min form's
    (2 | 0 | -1, unclamped, no outcome term), and its outcome column is 0."""
    steps, mask, ends = STEPS.repeat(2, 1), STEP_MASK.repeat(2, 1), STEP_END.repeat(2, 1)
    correct = CORRECT.repeat(2)
    revealed = torch.tensor([True] * 3 + [False] * 3)
    adv, parts = PROCESS_CREDIT["anchored"].estimate(steps, mask, ends, correct, 6, NORM, 0.5,
                                                     revealed=revealed)
    _close(adv, [[1 / ROOT2 + 0.5] * 3 + [1 / ROOT2] * 3,
                 [1 / ROOT2] * 6,
                 [-ROOT2 - 0.5] * 3 + [-ROOT2] * 3,
                 [2.0] * 3 + [0.0] * 3,
                 [0.0] * 6,
                 [-1.0] * 3 + [0.0] * 3])
    _close(parts[3:, -1], [0.0, 0.0, 0.0])
    # outside the budget the verdicts' spread is no signal: only the min-form values can be
    two = torch.tensor([[0.5, 0.2], [0.2, 0.0]]).repeat(2, 1)
    two_mask = torch.tensor([[True, True], [True, False]]).repeat(2, 1)
    one = torch.tensor([True, False]).repeat(2)
    assert PROCESS_CREDIT["anchored"].informative(
        two, two_mask, one, 2, revealed=torch.tensor([True, True, False, False])).tolist() == \
        [True, False]


def test_the_gold_budget_is_drawn_per_question_and_keeps_its_share():
    """`gold_budget`: a question is in or out whatever order, step or group it comes in; the
    share of 4,000 questions in a 25% budget is 0.25 within 0.03 (about 4 binomial standard
    errors); 0 and 1 take none and all; score_step marks exactly those samples."""
    from policy.rewards import gold_budget
    from runtime.data import MathRecord

    records = [MathRecord(f"q{i}", "1", ("1",), f"synthetic:0:{i}") for i in range(4000)]
    inside = gold_budget(records, 0.25, seed=3)
    assert abs(float(inside.float().mean()) - 0.25) < 0.03
    assert torch.equal(gold_budget(records[::-1], 0.25, seed=3), inside.flip(0))
    assert not torch.equal(gold_budget(records, 0.25, seed=4), inside)  # the seed draws it
    assert not gold_budget(records, 0.0, seed=3).any() and gold_budget(records, 1.0, seed=3).all()

    from policy.rewards import RuleReward
    from policy.scoring import score_step
    from policy.stage import Shaping

    cfg = load_config("configs/tiny.yaml", ["policy.group_size=2"])
    rollout = batch_rollout(lengths=[3, 3, 3, 3, 3, 3], width=4)
    scores, _, _ = score_step(RuleReward(), records[:3], rollout, cfg.policy,
                              Shaping(gold_share=0.25, gold_seed=3))
    assert torch.equal(scores.revealed, inside[:3].repeat_interleave(2))
    whole, _, _ = score_step(RuleReward(), records[:3], rollout, cfg.policy, Shaping())
    assert whole.revealed is None and torch.equal(whole.correct, scores.correct)


def test_a_gold_budget_needs_the_anchored_form():
    with pytest.raises(ConfigError, match="grpo.gold_share=0.1 with grpo.process_credit=sum"):
        load_config("configs/tiny.yaml", ["policy.supervision=process", "grpo.gold_share=0.1"])
    with pytest.raises(ConfigError, match=r"grpo.gold_share = 1.5; expected a share"):
        load_config("configs/tiny.yaml", ["grpo.gold_share=1.5"])
    cfg = load_config("configs/tiny.yaml", ["policy.supervision=process", "grpo.gold_share=0.1",
                                            "grpo.process_credit=anchored", "run.seed=7"])
    assert (resolve(cfg).stage.shaping.gold_share, resolve(cfg).stage.shaping.gold_seed) == (0.1, 7)
