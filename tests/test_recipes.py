"""The recipes (configs/recipes/) and the formulas they switch on, against numbers computed by
hand in each test: every recipe's advantages and objective on one batch, DAPO's refill and
overlong rules, GPG's alpha, C3PO's budget, the float-equal group, and the empty step."""

import math

import pytest
import torch

from configs import load_config
from configs.loader import ConfigError, RECIPE_KEYS, recipes
from policy.math.advantages import (outcome_advantages, process_advantages, token_budget_mask,
                                    zero_group_correction)
from policy.kit import Sampled, score_step
from policy.algorithms.grpo import advantage_step, refill_step
from policy.math.losses import POLICY_LOSSES
from policy.rewards import Scores
from policy.generation.rollout import Rollout


# One batch for every recipe: 2 questions x G = 3 samples, completion lengths 3, 1, 2 | 2, 2, 1.
# Group 1 has rewards 1, 0, 0 (signal); group 2 rewards 1, 1, 1 (no signal).
LENGTHS = [3, 1, 2, 2, 2, 1]
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
WIDTH = 4


def _rollout(lengths=LENGTHS, width=WIDTH, truncated=None):
    n = len(lengths)
    mask = torch.tensor([[1] * n_ + [0] * (width - n_) for n_ in lengths])
    return Rollout(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                   torch.ones(n, width, dtype=torch.long), mask, [""] * n,
                   torch.tensor(truncated or [False] * n), 3)


def _recipe(name, *extra):
    return load_config("configs/tiny.yaml", ["grpo.supervision=outcome", "grpo.group_size=3",
                                             "grpo.questions_per_step=2",
                                             "grpo.max_new_tokens=4", *extra], recipe=name)


# Group 1 by hand: mean 1/3, population std sqrt(2)/3; r - mean = 2/3, -1/3, -1/3.
STD = math.sqrt(2) / 3
NORMALISED = [(2 / 3) / STD, (-1 / 3) / STD, (-1 / 3) / STD, 0.0, 0.0, 0.0]
CENTRED = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
# Per-token log-ratios log(pi/pi_old): every token of sample i has ratio RATIO[i].
RATIO = [1.5, 0.7, 1.1, 1.0, 1.0, 1.0]


def _objective_terms(adv, eps_low, eps_high):
    """min(r A, clip(r) A) of one token of each sample, by hand."""
    return [min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a) for r, a in zip(RATIO, adv)]


def _by_hand(name):
    """(advantages [6], objective) of each recipe on the batch above, written out."""
    if name in ("grpo", "r1", "c3po"):
        adv = NORMALISED
    elif name in ("dr_grpo", "gpg"):
        adv = CENTRED
    elif name == "dapo":
        adv = NORMALISED
    elif name == "cispo":
        adv = NORMALISED
    else:
        raise KeyError(name)
    if name == "gpg":
        adv = [a * 6 / (6 - 3) for a in adv]  # alpha = B / (B - M) = 6 / 3
    terms = _objective_terms(adv, 0.2, 0.28 if name == "dapo" else 0.2)
    n = LENGTHS
    if name == "grpo":  # 1/G sum_i 1/|o_i| sum_t: each sample's token mean is its term
        return adv, sum(terms) / 6
    if name == "r1":  # 1/G sum_i sum_t
        return adv, sum(t * k for t, k in zip(terms, n)) / 6
    if name == "dr_grpo":  # 1/(G * max_tokens) sum_i sum_t
        return adv, sum(t * k for t, k in zip(terms, n)) / (6 * WIDTH)
    if name == "dapo":  # only group 1 is kept (dynamic sampling): 1/sum |o_i| over its tokens
        return adv, sum(t * k for t, k in zip(terms[:3], n[:3])) / sum(n[:3])
    if name == "gpg":  # sum A log pi / sum |o_i|, log pi = log(ratio) with pi_old = 1
        return adv, sum(a * math.log(r) * k for a, r, k in zip(adv, RATIO, n)) / sum(n)
    if name == "cispo":  # sg(min(r, 1.28)) A log pi / sum |o_i|
        return adv, sum(min(r, 1.28) * a * math.log(r) * k
                        for a, r, k in zip(adv, RATIO, n)) / sum(n)
    # c3po: Phi = 0.5 * 2 * 3 * 4 = 12 >= all 11 tokens, so every token is in Psi; / Phi
    return adv, sum(t * k for t, k in zip(terms, n)) / 12


@pytest.mark.parametrize("name", ["grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po"])
def test_each_recipe_objective_and_advantages_by_hand(name):
    cfg = _recipe(name)
    g = cfg.grpo
    rollout = _rollout()
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    batch = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                           rollout, g)
    adv, objective = _by_hand(name)
    assert batch.advantages[:, 0].tolist() == pytest.approx(adv, abs=1e-5)
    # Token advantages: the sample's advantage on its tokens, 0 on padding.
    assert (batch.advantages[rollout.completion_mask == 0] == 0).all()
    old = torch.zeros(6, WIDTH, dtype=torch.float64)  # pi_old = 1, so log pi = log(ratio)
    new = torch.tensor(RATIO, dtype=torch.float64).log()[:, None].expand(6, WIDTH)
    out = POLICY_LOSSES[g.loss].fn(new, old, None, batch.advantages.double(),
                                   batch.loss_mask.double(), clip_eps_low=g.clip_eps,
                                   clip_eps_high=g.clip_eps_high, beta=g.beta,
                                   num_sequences=batch.num_sequences,
                                   num_tokens=batch.num_tokens, max_tokens=WIDTH)
    assert -out.loss.item() == pytest.approx(objective, rel=1e-5)


def test_recipe_settings_are_the_papers():
    dapo = _recipe("dapo").grpo
    assert (dapo.beta, dapo.clip_eps, dapo.clip_eps_high, dapo.loss) == (0.0, 0.2, 0.28, "dapo")
    assert dapo.dynamic_sampling and dapo.overlong_filter and dapo.overlong_buffer_share == 0.2
    gpg = _recipe("gpg").grpo
    assert (gpg.loss, gpg.scale_by_std, gpg.zero_group_correction, gpg.beta) == \
        ("gpg", False, True, 0.0)
    grpo = _recipe("grpo").grpo
    assert (grpo.beta, grpo.clip_eps, grpo.mu, grpo.loss) == (0.04, 0.2, 1, "grpo")
    rft = load_config("configs/tiny.yaml", [], recipe="online_rft")
    assert (rft.grpo.supervision, rft.grpo.beta, rft.iterate.reward) == ("rft", 0.0, "rule")
    assert _recipe("offline_rft").grpo.algorithm == "offline_rft"


def test_recipe_composes_with_any_base_and_owns_its_keys(tmp_path):
    """Over the tiny and the 7B config, a recipe sets the same algorithm keys and leaves the
    base's scale alone; a base file that chose another loss is reset to the recipe's."""
    base = tmp_path / "base.yaml"
    base.write_text(open("configs/tiny.yaml").read().replace(
        "  beta: 0.04\n", "  beta: 0.5\n  loss: cispo\n  overlong_penalty: 3.0\n"))
    tiny = load_config(base, [], recipe="dapo")
    big = load_config("configs/deepseekmath_7b.yaml", [], recipe="dapo")
    for key in RECIPE_KEYS:
        section, name = key.split(".")
        assert tiny[section][name] == big[section][name], key
    assert tiny.grpo.group_size == 64 and tiny.grpo.lr == 2.0e-5
    assert big.grpo.lr != tiny.grpo.lr and tiny.run.recipe == "dapo"
    assert load_config(base, []).grpo.loss == "cispo"  # the file's own without a recipe
    # the command line still wins over the recipe, and the file may name the recipe
    assert load_config("configs/tiny.yaml", ["grpo.beta=0.1"], recipe="dapo").grpo.beta == 0.1
    assert load_config("configs/tiny.yaml", ["run.recipe=gpg"]).grpo.loss == "gpg"
    with pytest.raises(ConfigError, match="recipe 'dapoo'.*the recipes are c3po"):
        load_config("configs/tiny.yaml", [], recipe="dapoo")
    assert set(recipes()) == {"grpo", "r1", "dr_grpo", "dapo", "gpg", "cispo", "c3po",
                              "online_rft", "offline_rft", "ppo", "vc_ppo", "vapo", "t_ppo"}


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
    cfg = _recipe("c3po", "grpo.token_budget_share=0.25")
    rewards = torch.tensor(REWARDS)
    batch = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                           _rollout(), cfg.grpo, seed=3)
    assert batch.loss_mask.sum() == 6 and batch.num_tokens == 6
    order = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    expected = token_budget_mask(torch.tensor(LENGTHS), 6, order)
    assert batch.loss_mask.sum(-1).long().tolist() == expected.tolist()
    assert batch.stats["train/budget_tokens"] == 6


def _sampled(rewards, questions, g=4):
    n = len(rewards)
    rollout = Rollout(torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.long),
                      torch.ones(n, 2, dtype=torch.long), torch.ones(n, 2, dtype=torch.long),
                      [str(q) for q in questions for _ in range(g)],
                      torch.zeros(n, dtype=torch.bool), g)
    rewards = torch.tensor(rewards)
    return Sampled(list(questions), rollout, Scores(rewards=rewards), rewards,
                   torch.zeros(len(questions), dtype=torch.bool))


def test_dapo_refill_fills_the_batch_and_counts_the_extra_generations():
    """4 questions per step, G = 4; the first draw has one informative group (question 2);
    each extra round draws 4 new questions, of which two are informative. One round would give
    3, so two rounds are needed: 4 informative groups, 8 extra groups = 32 extra samples."""
    g = _recipe("dapo", "grpo.questions_per_step=4", "grpo.group_size=4").grpo
    flat, mixed = [1.0] * 4, [1.0, 0.0, 0.0, 0.0]
    first = _sampled(flat + flat + mixed + flat, [0, 1, 2, 3])
    rounds = []

    def more(round_):
        rounds.append(round_)
        base = 10 * round_
        return _sampled(mixed + flat + mixed + [0.0] * 4, [base, base + 1, base + 2, base + 3])

    batch = refill_step(first, more, g, pad_id=0)
    assert rounds == [1, 2]
    assert batch.records == [2, 10, 12, 20]  # the informative groups, in draw order
    assert batch.rollout.texts == [str(q) for q in batch.records for _ in range(4)]
    assert batch.stats == {"rollout/refill_rounds": 2.0, "rollout/extra_samples": 32.0,
                           "train/informative_groups": 4.0}
    # the cap: with one round allowed the batch holds 3 informative groups and one flat one
    capped = refill_step(first, more, _recipe("dapo", "grpo.questions_per_step=4",
                                              "grpo.group_size=4",
                                              "grpo.dynamic_sampling_max_rounds=1").grpo, 0)
    assert capped.records == [0, 2, 10, 12] and capped.stats["train/informative_groups"] == 3.0


def test_overlong_penalty_reaches_process_advantages():
    """G = 2, max 10 tokens, DAPO's buffer share 0.2 = 2 tokens: a 10-token sample loses the
    whole penalty 1 (on its last step), a 5-token one nothing. Step rewards 0.5, 0.5 | 0.5, 0.5
    (no spread: no signal without the penalty) become 0.5, -0.5 | 0.5, 0.5; normalised over the
    group's 4 steps (mean 0.25, std sqrt(3)/4): 0.5774, -1.7321 | 0.5774, 0.5774. Token t sums
    its step and the later ones."""
    g = load_config("configs/tiny.yaml", ["grpo.supervision=process", "grpo.group_size=2",
                                          "grpo.max_new_tokens=10"], recipe="dapo").grpo
    rollout = _rollout(lengths=[10, 5], width=10, truncated=[True, False])
    step_mask = torch.ones(2, 2, dtype=torch.bool)
    ends = torch.tensor([[4, 9], [1, 4]])

    def reward(records, rollout_):
        return Scores(rewards=torch.tensor([0.5, 0.5]), step_rewards=torch.full((2, 2), 0.5),
                      step_mask=step_mask, step_end_index=ends)

    scores, rewards, broken = score_step(reward, [None], rollout, g)
    assert scores.step_rewards.tolist() == [[0.5, -0.5], [0.5, 0.5]]
    assert rewards.tolist() == [-0.5, 0.5]
    hi, lo = 0.25 / (math.sqrt(3) / 4), -0.75 / (math.sqrt(3) / 4)
    adv = process_advantages(scores.step_rewards, step_mask, ends, 10, 2)
    assert adv[0].tolist() == pytest.approx([hi + lo] * 5 + [lo] * 5, abs=1e-5)
    assert adv[1].tolist() == pytest.approx([2 * hi] * 2 + [hi] * 3 + [0.0] * 5, abs=1e-5)
    # DAPO's overlong filter keeps the truncated sample out of the loss
    batch = advantage_step(scores, rewards, broken, rollout,
                           load_config("configs/tiny.yaml", ["grpo.supervision=process",
                                                             "grpo.group_size=2",
                                                             "grpo.max_new_tokens=10",
                                                             "grpo.dynamic_sampling=false"],
                                       recipe="dapo").grpo)
    assert batch.keep.tolist() == [False, True] and batch.loss_mask[0].sum() == 0


def test_clip_higher_and_cispo_clip_on_the_upper_side_only():
    """Ratios 1.25 and 1.3 on A > 0, 0.75 on A < 0. GRPO's symmetric 0.2 clips all three;
    DAPO's eps_high 0.28 lets 1.25 through (1 upper, 1 lower); CISPO bounds the weight above
    only: 1 upper clip, never a lower one."""
    new = torch.tensor([[1.25, 1.3, 0.75]]).log()
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    kw = dict(beta=0.0, num_sequences=1, num_tokens=3, max_tokens=3)
    grpo = POLICY_LOSSES["grpo"].fn(new, old, None, adv, mask, clip_eps_low=0.2,
                                    clip_eps_high=0.2, **kw)
    dapo = POLICY_LOSSES["dapo"].fn(new, old, None, adv, mask, clip_eps_low=0.2,
                                    clip_eps_high=0.28, **kw)
    cispo = POLICY_LOSSES["cispo"].fn(new, old, None, adv, mask, clip_eps_low=0.2,
                                      clip_eps_high=0.28, **kw)
    assert (grpo.clip_fraction.item(), grpo.clip_high.item()) == pytest.approx((1.0, 2 / 3))
    assert (dapo.clip_fraction.item(), dapo.clip_high.item()) == pytest.approx((2 / 3, 1 / 3))
    assert (cispo.clip_fraction.item(), cispo.clip_high.item()) == pytest.approx((1 / 3, 1 / 3))


def test_empty_step_leaves_weights_and_optimizer_state_unchanged(tmp_path):
    """A step whose every group was dropped (dynamic sampling found no signal) must not call
    AdamW: after one real step its momentum is non-zero and would move the weights again."""
    from configs.batching import plan_grpo_batch
    from policy.algorithms.grpo import StepBatch, update_step
    from runtime.engine import build_engine
    from runtime.models import load_causal_lm
    from runtime.tiny_model import build_tiny
    from runtime.tracking import MetricsLogger
    from runtime.training import Trainer
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [*SMALL, "grpo.group_size=3", "grpo.beta=0",
                                            "grpo.supervision=outcome",
                                            "grpo.lr=1e-2"], recipe="dapo")
    g = cfg.grpo
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    plan = plan_grpo_batch(2, 3, 8, 1)
    engine = build_engine(load_causal_lm(base, cfg.model, train=True), cfg.deepspeed, lr=g.lr,
                          micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    trainer = Trainer(tmp_path / "grpo", engine, logger, 2, desc="test")
    gen = torch.Generator().manual_seed(0)
    rollout = Rollout(torch.randint(3, 20, (6, 4), generator=gen), torch.ones(6, 4, dtype=torch.long),
                      torch.randint(3, 20, (6, 5), generator=gen), torch.ones(6, 5, dtype=torch.long),
                      [""] * 6, torch.zeros(6, dtype=torch.bool), 3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    live = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                          rollout, g)
    stats = update_step(trainer, None, rollout, live, g, plan, "real step")
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0

    def snapshot():
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        state = {id_: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                 for id_, s in engine.optimizer.state_dict()["state"].items()}
        return weights, state

    before = snapshot()
    assert any(v["exp_avg"].abs().sum() > 0 for v in before[1].values())  # momentum to lose
    flat = torch.ones(6)
    empty = advantage_step(Scores(rewards=flat), flat, torch.zeros(2, dtype=torch.bool), rollout, g)
    assert isinstance(empty, StepBatch) and empty.num_sequences == 0
    stats = update_step(trainer, None, rollout, empty, g, plan, "empty step")
    assert stats["skipped"] == 1.0
    after = snapshot()
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(before[1][i][k], after[1][i][k]) for i in before[1] for k in before[1][i])
    # the control: the same batch without the skip moves the weights by momentum alone
    engine.backward(sum(0.0 * p.sum() for p in engine.module.parameters()))
    engine.step()
    moved = snapshot()
    assert any(not torch.equal(before[0][k], moved[0][k]) for k in before[0])


@pytest.mark.parametrize("name", ["dapo", "cispo"])
def test_with_two_updates_the_upper_clip_acts(tmp_path, name):
    """mu = 2: the second update's ratio is no longer 1, and a large step size pushes ratios
    past 1 + eps_high: the upper clip fraction is > 0 (CISPO: all of its clipping)."""
    from policy.algorithms import train_policy
    from runtime.data import load_splits
    from runtime.tiny_model import build_tiny
    from runtime.tracking import MetricsLogger, read_metrics
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.steps=2",
                                            "grpo.eval_every=0", "grpo.mu=2", "grpo.lr=2e-2",
                                            "run.wandb_mode=disabled", "grpo.supervision=outcome",
                                            "grpo.inspect_every=0"], recipe=name)
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    gen = torch.Generator().manual_seed(0)
    train_policy(cfg, tmp_path, base, lambda records, rollout: Scores(
        rewards=torch.rand(len(records), generator=gen)), splits.rl, splits.eval[:2], logger, "",
        evaluate_ends=False)
    rows = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/clip_high" in r]
    assert max(r["train/clip_high"] for r in rows) > 0
    if name == "cispo":
        assert all(r["train/clip_fraction"] == r["train/clip_high"] for r in rows)


def test_offline_rft_keeps_the_right_samples_and_resumes(tmp_path):
    """The starting policy is sampled once (grpo.steps x questions x G samples, graded by the
    rule), only the right ones are fine-tuned on, and a rerun samples nothing again."""
    import json

    from policy.algorithms import train_policy
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from runtime.models import load_causal_lm
    from runtime.tracking import MetricsLogger, read_metrics
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.steps=2",
                                            "model.policy_path=bundled:tiny_warm_start",
                                            "grpo.max_new_tokens=112",
                                            "run.wandb_mode=disabled"], recipe="offline_rft")
    splits = load_splits(cfg.data, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    calls = []

    def reward(records, rollout):
        calls.append(len(records))
        return RuleReward()(records, rollout)

    start = cfg.model.policy_path
    final = train_policy(cfg, tmp_path, start, reward, splits.rl, splits.eval, logger, "")
    rows = [json.loads(line) for line in open(tmp_path / "grpo" / "samples.jsonl")]
    assert len(rows) == 2 * 2 * 4 and calls == [8, 8]
    right = [r for r in rows if r["right"]]
    assert 0 < len(right) < len(rows)  # the warm start is right on some samples, not all
    from runtime.grading import grade
    assert all(grade(r["text"], r["answer"]) == r["right"] for r in rows)
    done = json.loads((tmp_path / "grpo" / "done.json").read_text())
    assert (done["samples"], done["kept"]) == (16, len(right))
    metrics = read_metrics(tmp_path / "m.jsonl")
    assert metrics[-1]["rft/kept"] == len(right)
    assert not torch.equal(load_causal_lm(start).lm_head.weight,
                           load_causal_lm(final).lm_head.weight)
    # a crash after sampling: the samples are reused, nothing is drawn again
    (tmp_path / "grpo" / "done.json").unlink()
    train_policy(cfg, tmp_path, start, reward, splits.rl, splits.eval, logger, "")
    assert calls == [8, 8]


def test_wall_clock_budget_stops_after_the_step_that_spends_it(tmp_path, monkeypatch):
    """grpo.max_minutes: with 10 s per step and a 25 s budget, three steps run (10, 20, 30 s),
    and the seconds spent are part of the state a checkpoint saves."""
    import runtime.training as training
    from runtime.tracking import MetricsLogger

    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(training.time, "perf_counter", lambda: float(next(clock)))
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    trainer = training.Trainer(tmp_path / "stage", None, logger, 100, desc="t", max_seconds=25)
    while trainer.running():
        trainer.advance()
    assert trainer.step == 3 and trainer.state["seconds"] == 30.0
    unlimited = training.Trainer(tmp_path / "other", None, logger, 4, desc="t")
    while unlimited.running():
        unlimited.advance()
    assert unlimited.step == 4


def test_offline_rft_shares_its_budget_between_sampling_and_fine_tuning(tmp_path, monkeypatch):
    """A 4-minute budget, half of it for sampling: at 50 s a sampled step, sampling stops after
    the step that reaches 120 s (3 steps, 150 s) and the fine-tuning gets the 90 s left."""
    import json

    import policy.algorithms.offline_rft as offline_rft
    from policy.rewards import RuleReward
    from runtime.data import load_splits
    from small_config import SMALL

    assert offline_rft.budget_split(4, 0.5, 150.0) == (120.0, 90.0)
    assert offline_rft.budget_split(4, 0.5, 300.0)[1] == 1e-3  # overspent: one step still runs
    assert offline_rft.budget_split(0, 0.5, 999.0) == (float("inf"), 0.0)  # no budget
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "grpo.steps=6",
                                            "model.policy_path=bundled:tiny_warm_start",
                                            "grpo.max_minutes=4", "run.wandb_mode=disabled"],
                      recipe="offline_rft")
    clock = iter(range(0, 100_000, 50))  # a step reads the clock twice: 50 s each
    monkeypatch.setattr(offline_rft, "perf_counter", lambda: float(next(clock)))
    rows = offline_rft.sample_once(cfg, tmp_path, cfg.model.policy_path, RuleReward(),
                                   load_splits(cfg.data, 0).rl)
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    assert offline_rft.sampled_seconds(rows) == 150.0
    # resumed: the seconds already spent count, so nothing more is drawn
    again = offline_rft.sample_once(cfg, tmp_path, cfg.model.policy_path, RuleReward(),
                                    load_splits(cfg.data, 0).rl)
    assert again == rows
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(rows)
    assert json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])["seconds"] == 50.0
