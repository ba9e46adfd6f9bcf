"""Reward-model ensembles (`rm.ensemble`, reward_model/ensemble.py): the aggregates and the shared
error by hand on toy groups, the ensemble reward's step-by-step aggregate from its members' scores
(one grading), and `igrpo iterate` training the members, rewarding GRPO with them and logging
each member's AUROC and the shared error."""

import json
from types import SimpleNamespace

import pytest
import torch

from configs import ConfigError, load_config
from policy.rewards import Scores, grade_samples
from policy.watch import shared_error
from reward_model.ensemble import EnsembleReward, aggregate_members
from reward_model.losses import STEP_AGGREGATORS
from runtime.data import MathRecord

from small_config import ITERATE, SMALL


def test_the_aggregates_by_hand():
    # Three members, two samples. Means .4 and .7; minima .2 and .5; population variances
    # (.04 + 0 + .04) / 3 each, so mean - 1.5 var = .4 - .04 and .7 - .04.
    values = torch.tensor([[0.2, 0.9], [0.4, 0.5], [0.6, 0.7]])
    assert aggregate_members(values, "mean").tolist() == pytest.approx([0.4, 0.7])
    assert aggregate_members(values, "worst").tolist() == pytest.approx([0.2, 0.5])
    assert aggregate_members(values, "uncertainty", 1.5).tolist() == pytest.approx([0.36, 0.66])
    assert aggregate_members(values, "uncertainty", 0.0).tolist() == pytest.approx([0.4, 0.7])
    with pytest.raises(ValueError, match="rm.ensemble_aggregate=vote"):
        aggregate_members(values, "vote")


def test_shared_error_by_hand():
    # Groups of 4, two members. Group 0: right 0.9/0.5 (member 0, lower median 0.5) and 0.8/0.6
    # (member 1, 0.6); wrong sample 2 (0.7, 0.9) is above both medians: shared; sample 3 is not.
    # Group 1: all right, not counted. Group 2: one right (0.5, 0.5); wrong 1 (0.6, 0.4) fools
    # member 0 only, wrong 2 (0.4, 0.6) member 1 only, wrong 3 (0.9, 0.9) both. 2 of 5 wrong.
    members = torch.tensor([[0.9, 0.8], [0.5, 0.6], [0.7, 0.9], [0.2, 0.3],
                            [0.1, 0.1], [0.2, 0.2], [0.3, 0.3], [0.4, 0.4],
                            [0.5, 0.5], [0.6, 0.4], [0.4, 0.6], [0.9, 0.9]])
    correct = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert shared_error(members, correct, 4) == (pytest.approx(0.4), 5)
    share, counted = shared_error(members[4:8], correct[4:8], 4)
    assert counted == 0 and share != share  # NaN: no group holds both


def _close(got, rows):
    torch.testing.assert_close(got, torch.tensor(rows, dtype=got.dtype), rtol=0, atol=1e-6)


class Member:
    """A member reward returning fixed step scores (and the checks it was handed)."""

    def __init__(self, steps, mask):
        self.steps, self.mask, self.calls = torch.tensor(steps), torch.tensor(mask), []

    def __call__(self, records, rollout, correct=None):
        self.calls.append(correct)
        if correct is None:
            correct = grade_samples(records, rollout.texts)
        return Scores(rewards=STEP_AGGREGATORS["min"](self.steps, self.mask), correct=correct,
                      step_rewards=self.steps, step_mask=self.mask,
                      step_end_index=torch.tensor([[1, 3], [2, 0]]))


def test_the_ensemble_reward_aggregates_each_step_then_the_solution():
    """Two PRM members: the worst case takes each step's minimum over the members, then the
    PRM's own aggregate (min) over the steps; the members' own solution scores ride along; the
    samples are graded once (by the first member) and the others handed that grading; a step
    one member's max_length cut is left out of the ensemble's."""
    records = [MathRecord("What is 2 + 3?", "5", (), "q0")] * 2
    rollout = SimpleNamespace(texts=["2 + 3 = 5\nThe answer is 5", "The answer is 6"])
    a = Member([[0.9, 0.2], [0.6, 0.0]], [[True, True], [True, False]])
    b = Member([[0.5, 0.4], [0.8, 0.0]], [[True, True], [True, False]])
    worst = EnsembleReward([a, b], "worst", step_aggregate=STEP_AGGREGATORS["min"])(records,
                                                                                   rollout)
    _close(worst.step_rewards, [[0.5, 0.2], [0.6, 0.0]])
    assert worst.rewards.tolist() == pytest.approx([0.2, 0.6])
    _close(worst.members, [[0.2, 0.4], [0.6, 0.8]])
    assert worst.correct.tolist() == [True, False]
    assert a.calls == [None] and torch.equal(b.calls[0], worst.correct)
    mean = EnsembleReward([a, b], "mean", step_aggregate=STEP_AGGREGATORS["min"])(records,
                                                                                 rollout)
    assert mean.rewards.tolist() == pytest.approx([0.3, 0.7])
    cut = Member([[0.5, 0.0], [0.8, 0.0]], [[True, False], [True, False]])
    shared = EnsembleReward([a, cut], "mean", step_aggregate=STEP_AGGREGATORS["min"])(records,
                                                                                     rollout)
    assert shared.step_mask.tolist() == [[True, False], [True, False]]
    assert shared.rewards.tolist() == pytest.approx([0.7, 0.7])


def test_the_ensemble_reward_of_orms_aggregates_the_solution_scores():
    class Orm:
        def __init__(self, scores):
            self.scores = torch.tensor(scores)

        def __call__(self, records, rollout, correct=None):
            return Scores(rewards=self.scores,
                          correct=grade_samples(records, rollout.texts) if correct is None
                          else correct)

    records = [MathRecord("What is 2 + 3?", "5", (), "q0")] * 2
    rollout = SimpleNamespace(texts=["The answer is 5", "The answer is 6"])
    got = EnsembleReward([Orm([0.9, 0.3]), Orm([0.5, 0.5])], "uncertainty", 2.0)(records, rollout)
    # means .7, .4; variances .04, .01
    assert got.rewards.tolist() == pytest.approx([0.62, 0.38])
    assert got.step_rewards is None and got.members.shape == (2, 2)


def test_bad_ensembles_are_refused():
    for overrides, match in ((["rm.ensemble=0"], "rm.ensemble = 0"),
                             (["rm.ensemble_aggregate=vote"], "rm.ensemble_aggregate"),
                             (["rm.ensemble_lambda=-1"], "rm.ensemble_lambda = -1"),
                             (["rm.ensemble=3", "rm.online=true", "policy.supervision=outcome"],
                              "rm.ensemble=3 with rm.online")):
        with pytest.raises(ConfigError, match=match):
            load_config("configs/tiny.yaml", overrides)
    with pytest.raises(ValueError, match="at least 2 members"):
        EnsembleReward([Member([[0.5]], [[True]])], "mean")
    from iteration.resolve import grpo_reward_problem, loop_reward_problem, resolve

    outcome = ["rm.ensemble=2", "policy.supervision=outcome"]
    assert "its members would be trained for nothing" in loop_reward_problem(resolve(load_config(
        "configs/tiny.yaml", [*outcome, "iterate.reward=rule"])))
    assert "trained by `igrpo iterate`" in grpo_reward_problem(resolve(load_config(
        "configs/tiny.yaml", [*outcome, "policy.reward=rm", "rm.path=somewhere"])))


@pytest.mark.slow
def test_iterate_trains_the_members_and_is_rewarded_by_them(tmp_path, monkeypatch):
    """`igrpo iterate rm.ensemble=2 rm.ensemble_aggregate=worst` with a refresh: each iteration
    trains the PRM and its second member on the same rows with another seed (its weights
    differ), the refresh continues each member from its own; the ORM stays one; every GRPO step
    logs each member's in-group AUROC and the shared error."""
    import igrpo
    import iteration.loop

    trained = []
    train = iteration.loop.train_reward_model

    def recording(spec, out, init, examples, *args, **kwargs):
        trained.append((out.relative_to(tmp_path / "tiny").as_posix(), str(init), spec.seed,
                        len(examples)))
        return train(spec, out, init, examples, *args, **kwargs)

    monkeypatch.setattr(iteration.loop, "train_reward_model", recording)
    assert igrpo.main(["iterate", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       *SMALL, *ITERATE, "rm.ensemble=2", "rm.ensemble_aggregate=worst",
                       "iterate.refresh=true"]) == 0
    run = tmp_path / "tiny"
    names = [t[0] for t in trained]
    assert names == ["rm-orm/iteration-0", "rm-prm/iteration-0", "rm-prm/iteration-0-member-1",
                     "rm-orm/iteration-1", "rm-prm/iteration-1", "rm-prm/iteration-1-member-1"]
    by_name = {t[0]: t for t in trained}
    first, second = by_name["rm-prm/iteration-0"], by_name["rm-prm/iteration-0-member-1"]
    assert first[1] == second[1] and first[3] == second[3] and first[2] != second[2]
    assert by_name["rm-prm/iteration-1-member-1"][1] == str(
        run / "rm-prm/iteration-0-member-1/final")
    manifest = json.loads((run / "manifest.json").read_text())
    outputs = {name: unit["outputs"] for name, unit in manifest["units"].items()}
    assert outputs["rm-prm/0"]["members"] == ["rm-prm/iteration-0/final",
                                              "rm-prm/iteration-0-member-1/final"]
    assert "members" not in outputs["rm-orm/0"]
    from safetensors.torch import load_file

    a = load_file(run / "rm-prm/iteration-0/final/model.safetensors")
    b = load_file(run / "rm-prm/iteration-0-member-1/final/model.safetensors")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in
            (run / "grpo/iteration-1/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert steps and all({"watch/member_auroc/0", "watch/member_auroc/1",
                          "watch/shared_error"} <= r.keys() for r in steps)


def test_the_watch_reads_an_orm_ensembles_members_by_hand():
    """`watch_step` on an ORM ensemble's step (outcome supervision: no step rows): each member's
    in-group AUROC and the shared error from `Scores.members`, and no step measures."""
    from policy.stage_watch import watch_step

    # One group of 4: samples 0, 1 right. Member 0 ranks 0 > 2 > 1 > 3 (AUROC 3/4), member 1
    # ranks 2 > 0 > 1 > 3 (1/2); wrong sample 2 beats both members' median right: shared 1/2.
    members = torch.tensor([[0.9, 0.8], [0.5, 0.6], [0.7, 0.9], [0.2, 0.3]])
    correct = torch.tensor([True, True, False, False])
    scores = Scores(rewards=members.min(-1).values, correct=correct, members=members)
    sampled = SimpleNamespace(scores=scores, rewards=scores.rewards,
                              rollout=SimpleNamespace(group_size=4),
                              records=[MathRecord("q", "1", (), "q0")])
    batch = SimpleNamespace(loss_mask=torch.ones(4, 3), advantages=torch.ones(4, 3))
    metrics = watch_step(sampled, batch, SimpleNamespace(per_step=False), None)
    assert metrics["watch/member_auroc/0"] == 0.75 and metrics["watch/member_auroc/1"] == 0.5
    assert metrics["watch/shared_error"] == 0.5
    assert "watch/steps_per_solution" not in metrics


def test_a_fork_drops_a_reward_models_ensemble_members_with_it(tmp_path):
    """`Manifest.fork(drop=["rm-prm/iteration-0"])`: the members beside it go too (else a
    finished member would be reused by the redone unit); another iteration's stay."""
    from iteration.manifest import fork

    src = tmp_path / "src"
    for rel in ("rm-prm/iteration-0", "rm-prm/iteration-0-member-1",
                "rm-prm/iteration-0-member-2", "rm-prm/iteration-1-member-1"):
        (src / rel).mkdir(parents=True)
    (src / "manifest.json").write_text(json.dumps({"units": {}}))
    fork(src, tmp_path / "dst", drop=["rm-prm/iteration-0"])
    assert sorted(p.name for p in (tmp_path / "dst" / "rm-prm").iterdir()) == \
        ["iteration-1-member-1"]
