"""GRPO's loop (policy/algorithms/grpo.py): the shuffled-reward control, DAPO's refill and
overlong rules, the empty step, clip-higher over two updates, the wall-clock budget, resume after
a crash, and the first step's reference."""

import math

import pytest
import torch

from configs import load_config
from iteration.resolve import resolve
from policy.algorithms.grpo import advantage_step, refill_step
from policy.generation.rollout import Rollout
from policy.scoring import Sampled, score_step
from policy.rewards import RuleReward, Scores
from runtime.data import load_splits
from runtime.models import load_causal_lm
from runtime.tiny_model import build_tiny
from runtime.tracking import MetricsLogger, read_metrics

from by_hand import process_advantages
from recipe_batch import batch_rollout, recipe_config
from small_config import SMALL as BASE
from small_runs import RandomReward, weights_differ


def test_shuffled_reward_control_moves_step_rewards_off_their_steps():
    from policy.scoring import shuffled_rewards
    from policy.rewards import Scores

    torch.manual_seed(0)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False],
                         [True, True, True, True]])
    steps = torch.arange(12, dtype=torch.float32).reshape(3, 4) * mask
    scores = Scores(rewards=torch.tensor([0.1, 0.2, 0.3]),
                    correct=torch.tensor([True, False, False]), step_rewards=steps,
                    step_mask=mask, step_end_index=torch.zeros(3, 4, dtype=torch.long))
    moved, rewards = shuffled_rewards(scores, scores.rewards)
    # the final-answer checks move with the rewards (the anchored credit form trains on them)
    assert moved.correct.tolist() == (rewards == 0.1).tolist()
    # The same values on the same layout (padding untouched) ...
    assert sorted(moved.step_rewards[mask].tolist()) == sorted(steps[mask].tolist())
    assert (moved.step_rewards[~mask] == 0).all()
    assert sorted(rewards.tolist()) == pytest.approx([0.1, 0.2, 0.3])
    # ... but not on their own steps (a no-op for process supervision before this control
    # permuted the step rewards too).
    assert not torch.equal(moved.step_rewards, steps)
    assert torch.equal(scores.step_rewards, steps)  # the input is left as it was


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
    g = resolve(recipe_config("dapo", "policy.questions_per_step=4", "policy.group_size=4")).method
    flat, mixed = [1.0] * 4, [1.0, 0.0, 0.0, 0.0]
    first = _sampled(flat + flat + mixed + flat, [0, 1, 2, 3])
    rounds = []

    def more(round_):
        rounds.append(round_)
        base = 10 * round_
        return _sampled(mixed + flat + mixed + [0.0] * 4, [base, base + 1, base + 2, base + 3])

    batch = refill_step(first, more, g, 4, pad_id=0)
    assert rounds == [1, 2]
    assert batch.records == [2, 10, 12, 20]  # the informative groups, in draw order
    assert batch.rollout.texts == [str(q) for q in batch.records for _ in range(4)]
    assert batch.stats == {"rollout/refill_rounds": 2.0, "rollout/extra_samples": 32.0,
                           "train/informative_groups": 4.0}
    # the cap: with one round allowed the batch holds 3 informative groups and one flat one
    capped = refill_step(first, more, resolve(recipe_config(
        "dapo", "policy.questions_per_step=4", "policy.group_size=4",
        "grpo.dynamic_sampling_max_rounds=1")).method, 4, 0)
    assert capped.records == [0, 2, 10, 12] and capped.stats["train/informative_groups"] == 3.0


def test_dynamic_sampling_without_extra_rounds_still_filters_the_groups():
    """grpo.dynamic_sampling with no extra round allowed (`dynamic_sampling_max_rounds=0`)
    samples nothing more but still keeps the groups without signal out of the loss, and
    reports the (empty) refill."""
    cfg = recipe_config("dapo", "policy.questions_per_step=2", "policy.group_size=4",
                        "grpo.dynamic_sampling_max_rounds=0")
    spec = resolve(cfg).method
    assert spec.filter_groups and spec.dynamic_rounds == 0
    first = _sampled([1.0, 0.0, 0.0, 0.0] + [1.0] * 4, [0, 1])
    batch = refill_step(first, lambda round_: pytest.fail("no extra round"), spec, 4, 0)
    assert batch.stats == {"rollout/refill_rounds": 0.0, "rollout/extra_samples": 0.0,
                           "train/informative_groups": 1.0}
    rows = advantage_step(batch.scores, batch.rewards, batch.broken,
                          batch_rollout(lengths=[3] * 8, width=3), spec, 4)
    assert rows.keep.tolist() == [True] * 4 + [False] * 4


def test_overlong_penalty_reaches_process_advantages():
    """G = 2, max 10 tokens, DAPO's buffer share 0.2 = 2 tokens: a 10-token sample loses the
    whole penalty 1 (on its last step), a 5-token one nothing. Step rewards 0.5, 0.5 | 0.5, 0.5
    (no spread: no signal without the penalty) become 0.5, -0.5 | 0.5, 0.5; normalised over the
    group's 4 steps (mean 0.25, std sqrt(3)/4): 0.5774, -1.7321 | 0.5774, 0.5774. Token t sums
    its step and the later ones."""
    cfg = load_config("configs/tiny.yaml", ["policy.supervision=process", "policy.group_size=2",
                                            "policy.max_new_tokens=10"], recipe="dapo")
    rollout = batch_rollout(lengths=[10, 5], width=10, truncated=[True, False])
    step_mask = torch.ones(2, 2, dtype=torch.bool)
    ends = torch.tensor([[4, 9], [1, 4]])

    def reward(records, rollout_):
        return Scores(rewards=torch.tensor([0.5, 0.5]), step_rewards=torch.full((2, 2), 0.5),
                      step_mask=step_mask, step_end_index=ends)

    scores, rewards, broken = score_step(reward, [None], rollout, cfg.policy,
                                         resolve(cfg).stage.shaping)
    assert scores.step_rewards.tolist() == [[0.5, -0.5], [0.5, 0.5]]
    assert rewards.tolist() == [-0.5, 0.5]
    hi, lo = 0.25 / (math.sqrt(3) / 4), -0.75 / (math.sqrt(3) / 4)
    adv = process_advantages(scores.step_rewards, step_mask, ends, 10, 2)
    assert adv[0].tolist() == pytest.approx([hi + lo] * 5 + [lo] * 5, abs=1e-5)
    assert adv[1].tolist() == pytest.approx([2 * hi] * 2 + [hi] * 3 + [0.0] * 5, abs=1e-5)
    # DAPO's overlong filter keeps the truncated sample out of the loss
    batch = advantage_step(scores, rewards, broken, rollout, resolve(load_config(
        "configs/tiny.yaml", ["policy.supervision=process", "policy.group_size=2",
                              "policy.max_new_tokens=10", "grpo.dynamic_sampling=false"],
        recipe="dapo")).method, 2)
    assert batch.keep.tolist() == [False, True] and batch.loss_mask[0].sum() == 0


def test_empty_step_leaves_weights_and_optimizer_state_unchanged(tmp_path):
    """A step whose every group was dropped (dynamic sampling found no signal) must not call
    AdamW: after one real step its momentum is non-zero and would move the weights again."""
    from runtime.batching import plan_grpo_batch
    from policy.algorithms.grpo import StepBatch, update_step
    from runtime.engine import build_engine
    from runtime.models import load_causal_lm
    from runtime.tiny_model import build_tiny
    from runtime.tracking import MetricsLogger
    from runtime.training import StageLoop
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [*SMALL, "policy.group_size=3", "policy.beta=0",
                                            "policy.supervision=outcome",
                                            "policy.lr=1e-2"], recipe="dapo")
    g, spec = cfg.policy, resolve(cfg).method
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    plan = plan_grpo_batch(2, 3, 8, 1)
    engine = build_engine(load_causal_lm(base, cfg.model, train=True), cfg.deepspeed, lr=g.lr,
                          micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    trainer = StageLoop(tmp_path / "grpo", engine, logger, 2, desc="test")
    gen = torch.Generator().manual_seed(0)
    rollout = Rollout(torch.randint(3, 20, (6, 4), generator=gen), torch.ones(6, 4, dtype=torch.long),
                      torch.randint(3, 20, (6, 5), generator=gen), torch.ones(6, 5, dtype=torch.long),
                      [""] * 6, torch.zeros(6, dtype=torch.bool), 3)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    live = advantage_step(Scores(rewards=rewards), rewards, torch.zeros(2, dtype=torch.bool),
                          rollout, spec, 3)
    stats = update_step(trainer, None, rollout, live, g, spec, plan, "real step")
    assert stats.skipped == 0.0 and stats.grad_norm > 0

    def snapshot():
        weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        state = {id_: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                 for id_, s in engine.optimizer.state_dict()["state"].items()}
        return weights, state

    before = snapshot()
    assert any(v["exp_avg"].abs().sum() > 0 for v in before[1].values())  # momentum to lose
    flat = torch.ones(6)
    empty = advantage_step(Scores(rewards=flat), flat, torch.zeros(2, dtype=torch.bool), rollout,
                           spec, 3)
    assert isinstance(empty, StepBatch) and empty.num_sequences == 0
    stats = update_step(trainer, None, rollout, empty, g, spec, plan, "empty step")
    assert stats.skipped == 1.0
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
    from iteration.resolve import resolve
    from runtime.data import load_splits
    from runtime.tiny_model import build_tiny
    from runtime.tracking import MetricsLogger, read_metrics
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=2",
                                            "policy.eval_every=0", "policy.mu=2", "policy.lr=2e-2",
                                            "run.wandb_mode=disabled", "policy.supervision=outcome",
                                            "inspect.every=0"], recipe=name)
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    gen = torch.Generator().manual_seed(0)
    resolve(cfg).train_policy(tmp_path, base, lambda records, rollout: Scores(
        rewards=torch.rand(len(records), generator=gen)), splits.rl, splits.eval[:2], logger, "",
        evaluate_ends=False)
    rows = [r for r in read_metrics(tmp_path / "m.jsonl") if "train/clip_high" in r]
    assert max(r["train/clip_high"] for r in rows) > 0
    if name == "cispo":
        assert all(r["train/clip_fraction"] == r["train/clip_high"] for r in rows)


def test_a_mini_batch_holds_the_same_samples_on_one_rank_or_two():
    """Two questions of G = 4 in 2 mini-batches: on one rank [0, 1, 4, 5 | 2, 3, 6, 7] (each
    question's first half, then its second); on two ranks (a question each) mini-batch m is
    rank 0's m-th half plus rank 1's: the same samples."""
    from policy.batch import mini_batch_order

    assert mini_batch_order(8, 4, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    one = mini_batch_order(8, 4, 2).view(2, -1)
    per_rank = mini_batch_order(4, 4, 2).view(2, -1)
    for m in range(2):
        assert sorted(one[m].tolist()) == sorted([*per_rank[m].tolist(),
                                                  *(per_rank[m] + 4).tolist()])


def test_each_mini_batch_step_sees_its_rows_and_its_own_normalisers(tmp_path, monkeypatch):
    """Two questions of G = 4 in 2 mini-batches, micro-batches of 2, row 5 dropped from the
    loss: the loss is called on rows (0, 1), (4, 5) for the first optimizer step and (2, 3),
    (6, 7) for the second, each with its mini-batch's kept sequences (3, then 4) and tokens."""
    import dataclasses

    from runtime.batching import plan_grpo_batch
    from policy.algorithms.grpo import StepBatch, update_step
    from policy.math.losses import POLICY_LOSSES
    from runtime.engine import build_engine
    from runtime.training import StageLoop
    from small_config import SMALL

    cfg = load_config("configs/tiny.yaml", [*SMALL, "policy.group_size=4", "policy.mini_batches=2",
                                            "policy.supervision=outcome"], recipe="gspo")
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    plan = plan_grpo_batch(2, 4, 2, 1, 2)
    engine = build_engine(load_causal_lm(base, cfg.model, train=True), cfg.deepspeed, lr=1e-3,
                          micro_batch_size=plan.micro_batch_size, grad_accum=plan.grad_accum)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    trainer = StageLoop(tmp_path / "grpo", engine, logger, 2, desc="test")
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 4, 3, 5, 2, 5, 4, 1])
    completion_mask = (torch.arange(5)[None, :] < lengths[:, None]).long()
    rollout = Rollout(torch.randint(3, 20, (8, 4), generator=gen), torch.ones(8, 4, dtype=torch.long),
                      torch.randint(3, 20, (8, 5), generator=gen), completion_mask,
                      [""] * 8, torch.zeros(8, dtype=torch.bool), 4)
    keep = torch.tensor([True] * 5 + [False] + [True] * 2)
    loss_mask = completion_mask.float() * keep[:, None]
    rows = torch.arange(8, dtype=torch.float)[:, None].expand(8, 5) + 1.0  # advantage = row + 1
    batch = StepBatch(rows.clone(), rows[:, :1], keep, torch.zeros(2, dtype=torch.bool),
                      loss_mask, 7.0, float(loss_mask.sum()))
    seen = []
    spec = POLICY_LOSSES["gspo"]

    def recording(logprobs, old, ref, advantages, mask, **kw):
        seen.append(([int(a) - 1 for a in advantages[:, 0].tolist()], kw["num_sequences"],
                     kw["num_tokens"]))
        return spec.fn(logprobs, old, ref, advantages, mask, **kw)

    monkeypatch.setitem(POLICY_LOSSES, "gspo", dataclasses.replace(spec, fn=recording))
    stats = update_step(trainer, None, rollout, batch, cfg.policy, resolve(cfg).method, plan,
                        "mini-batches")
    assert stats.skipped == 0.0
    first, second = 5 + 4 + 2 + 0, 3 + 5 + 4 + 1  # kept tokens of rows 0, 1, 4, (5) / 2, 3, 6, 7
    assert seen == [([0, 1], 3.0, first), ([4, 5], 3.0, first),
                    ([2, 3], 4.0, second), ([6, 7], 4.0, second)]


@pytest.mark.parametrize("supervision", ["outcome", "process"])
def test_gspo_mini_batches_make_the_sequence_clip_act(tmp_path, supervision):
    """The gspo recipe at mu = 1: its 4 mini-batches are 4 optimizer steps, so the last three
    see a ratio other than 1 and the paper's tight ranges clip sequences (GSPO-token under
    process supervision); with one mini-batch nothing is off-policy and nothing clips."""
    from iteration.resolve import resolve
    from runtime.data import load_splits
    from runtime.tiny_model import build_tiny
    from runtime.tracking import MetricsLogger, read_metrics
    from small_config import SMALL

    clipped = {}
    for mini_batches in (4, 1):
        out = tmp_path / str(mini_batches)
        cfg = load_config("configs/tiny.yaml", [
            f"run.root={out}", *SMALL, "policy.steps=2", "policy.eval_every=0", "policy.lr=1e-2",
            f"policy.mini_batches={mini_batches}", "run.wandb_mode=disabled",
            f"policy.supervision={supervision}", "policy.reward=step_oracle",
            "inspect.every=0"], recipe="gspo")
        splits = load_splits(cfg.data, 0)
        base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
        logger = MetricsLogger(out / "m.jsonl", config={}, mode="disabled", project="",
                               name="")
        gen = torch.Generator().manual_seed(0)

        def reward(records, rollout):
            n = len(rollout.texts)
            steps = torch.rand(n, 2, generator=gen)
            return Scores(rewards=steps.sum(-1), step_rewards=steps,
                          step_mask=torch.ones(n, 2, dtype=torch.bool),
                          step_end_index=torch.tensor([[0, 1]] * n))

        resolve(cfg).train_policy(out, base, reward, splits.rl, splits.eval[:2], logger, "",
                     evaluate_ends=False)
        rows = [r for r in read_metrics(out / "m.jsonl") if "train/clip_fraction" in r]
        assert len(rows) == 2
        clipped[mini_batches] = max(r["train/clip_fraction"] for r in rows)
    assert clipped[4] > 0 and clipped[1] == 0, clipped


def test_wall_clock_budget_stops_after_the_step_that_spends_it(tmp_path, monkeypatch):
    """policy.max_minutes: with 10 s per step and a 25 s budget, three steps run (10, 20, 30 s),
    and the seconds spent are part of the state a checkpoint saves."""
    import runtime.training as training
    from runtime.tracking import MetricsLogger

    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(training.time, "perf_counter", lambda: float(next(clock)))
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    trainer = training.StageLoop(tmp_path / "stage", None, logger, 100, desc="t", max_seconds=25)
    while trainer.running():
        trainer.advance()
    assert trainer.step == 3 and trainer.state["seconds"] == 30.0
    unlimited = training.StageLoop(tmp_path / "other", None, logger, 4, desc="t")
    while unlimited.running():
        unlimited.advance()
    assert unlimited.step == 4


def test_the_starting_policys_evaluation_is_not_spent_from_the_budget(tmp_path, monkeypatch):
    """A stage that evaluates its starting policy (`igrpo grpo`: evaluate_ends) gets the steps
    of one that does not: with 10 s a step, a 25 s budget and a 40 s first evaluation, three
    steps still run (the study's `igrpo grpo` arms train as long as the old runner's, which
    skipped that evaluation)."""
    import contextlib

    import policy.evaluate as evaluate
    import runtime.training as training

    now = [0.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: now[0])

    def slow_evaluation(*args, **kwargs):
        now[0] += 40.0
        return {"eval/greedy_accuracy": 0.5}

    monkeypatch.setattr(evaluate, "evaluate_policy", slow_evaluation)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    sampler = type("Sampler", (), {"generating": lambda self: contextlib.nullcontext(None)})()
    steps = {}
    for ends in (True, False):
        trainer = training.StageLoop(tmp_path / f"stage-{ends}", None, logger, 100, desc="t",
                                     max_seconds=25)
        evaluate.make_evaluator(resolve(load_config("configs/tiny.yaml")).stage.evaluation,
                                sampler, None, [], None, trainer, ends)
        while trainer.running():
            now[0] += 10.0
            trainer.advance()
        steps[ends] = trainer.step
    assert steps == {True: 3, False: 3}


SMALL = [*BASE, "policy.eval_every=1"]


class _CrashAt:
    """The rule reward, but raising on its `n`-th call (a crash in the middle of a run)."""

    def __init__(self, n):
        self.n, self.calls, self.inner = n, 0, RuleReward()

    def __call__(self, records, rollout):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("simulated crash")
        return self.inner(records, rollout)


def test_grpo_resumes_after_crash_and_its_trace_neither_loses_nor_repeats_rows(tmp_path):
    """Saved every 2 steps and crashed in step 4: steps 1-3 were traced, step 3 after the last
    save. The resumed stage redoes steps 3 and 4 only (its metrics hold each step once); its
    trace holds each step once, equal to an uninterrupted stage's (the rollouts of a step are
    seeded by the step)."""
    from policy.trace import read_trace

    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=4",
                                            "policy.save_every=2", "policy.eval_every=0",
                                            "run.wandb_mode=disabled", "policy.supervision=outcome"])
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / "m.jsonl", config={}, mode="disabled", project="", name="")
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve(cfg).train_policy(tmp_path, base, _CrashAt(4), splits.rl, splits.eval, logger,
                                  "", out_name="crashed")
    assert len(list((tmp_path / "crashed" / "trace").glob("*.parquet"))) == 3
    reward = _CrashAt(0)
    resolve(cfg).train_policy(tmp_path, base, reward, splits.rl, splits.eval, logger, "",
                              out_name="crashed")
    assert reward.calls == 2  # steps 3 and 4 were left to do
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [0, 1, 2, 3, 4]
    assert (tmp_path / "crashed" / "final" / "config.json").exists()
    logger = MetricsLogger(tmp_path / "s.jsonl", config={}, mode="disabled", project="", name="")
    torch.manual_seed(0)
    resolve(cfg).train_policy(tmp_path, base, RuleReward(), splits.rl, splits.eval, logger, "",
                              out_name="straight")
    resumed, straight = (read_trace(tmp_path / name / "trace") for name in ("crashed", "straight"))
    assert [r["step"] for r in resumed] == [s for s in (1, 2, 3, 4) for _ in range(8)]
    assert resumed == straight


@pytest.mark.parametrize("extra", [["policy.mu=1"], ["policy.mu=2"], ["policy.algorithm=ppo"]],
                         ids=["grpo", "grpo-mu2", "ppo"])
def test_first_step_uses_the_policy_as_its_reference(tmp_path, monkeypatch, extra):
    """A stage's first step, from its reference, runs no reference forward (the policy's own
    log-probs are the reference's) and ends where the run with the reference forward ends: the
    same losses and KL, weights within 1e-6. Later steps do run it."""
    import shutil

    import policy.algorithms.grpo
    import policy.actor_critic
    import policy.engines

    calls = {"reference": 0}
    forward = policy.engines.forward_logprobs

    def counting(model, rollout, micro, *args):  # the reference's (and pi_old's: mu = 2)
        calls["reference"] += 1
        return forward(model, rollout, micro, *args)

    for module in (policy.engines, policy.algorithms.grpo, policy.actor_critic):  # where it is called
        monkeypatch.setattr(module, "forward_logprobs", counting)
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=2",
                                            "policy.eval_every=0", "run.wandb_mode=disabled",
                                            "policy.supervision=outcome", *extra])
    splits = load_splits(cfg.data, 0)
    base = build_tiny(tmp_path / "base", cfg.model.tiny, 0)
    copy = shutil.copytree(base, tmp_path / "copy")
    rows, finals, counts = [], [], []
    for name, reference in (("same", base), ("copy", copy)):
        calls["reference"] = 0
        logger = MetricsLogger(tmp_path / f"{name}.jsonl", config={}, mode="disabled",
                               project="", name="")
        torch.manual_seed(0)
        finals.append(resolve(cfg).train_policy(tmp_path, base, RandomReward(), splits.rl, splits.eval[:2],
                                 logger, "", out_name=name, reference_path=reference,
                                 evaluate_ends=False))
        rows.append([r for r in read_metrics(tmp_path / f"{name}.jsonl") if "train/loss" in r])
        counts.append(calls["reference"])
    assert counts[1] - counts[0] == 1  # the first step's reference forward, skipped
    assert len(rows[0]) == len(rows[1]) == 2
    for a, b in zip(*rows):
        for key in ("train/loss", "train/kl"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    wa, wb = load_causal_lm(finals[0]).state_dict(), load_causal_lm(finals[1]).state_dict()
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)
    assert weights_differ(base, finals[0])
