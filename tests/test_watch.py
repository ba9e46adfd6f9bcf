"""The reward-hacking watch (policy/watch.py), the rollout traces (policy/trace.py) and the guard:
the measures on toy groups against values worked by hand, a GRPO stage that logs the watch and
writes traces ending exactly where one without them ends, the guard's actions, and the trace
page of a hand-built step."""

import math

import pytest
import torch

import igrpo
from configs import load_config
from iteration.resolve import resolve
from policy.algorithms.grpo import advantage_step
from policy.generation.rollout import Rollout
from policy.rewards import RuleReward, Scores
from policy.trace import read_trace, render_trace_page, trace_rows, write_trace
from policy.watch import (Guard, group_auroc, k3_kl, mean_token_advantage, positive_mass,
                          watch_metrics, wrong_push)
from runtime.data import MathRecord, load_splits
from runtime.models import load_causal_lm, load_tokenizer
from runtime.tiny_model import build_tiny
from runtime.tracking import MetricsLogger, read_metrics

from small_config import SMALL


def test_group_auroc_pools_the_right_wrong_pairs_of_mixed_groups():
    # Group 1 (right: 0.9, 0.5; wrong: 0.2, 0.5): 0.9>0.2, 0.9>0.5, 0.5>0.2, 0.5=0.5 -> 3.5 of 4.
    # Group 2 all right: no pair. Group 3 (right: 0.1; wrong: 0.3, 0.0, 0.1): 0 + 1 + 0.5 -> 1.5
    # of 3. Pooled: 5 of 7 pairs.
    values = torch.tensor([0.9, 0.2, 0.5, 0.5, 1, 2, 3, 4, 0.1, 0.3, 0.0, 0.1])
    correct = torch.tensor([1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert group_auroc(values, correct, 4) == (pytest.approx(5 / 7), 2)
    assert group_auroc(-values, correct, 4)[0] == pytest.approx(2 / 7)  # the ranking inverted
    auroc, groups = group_auroc(values[4:8], correct[4:8], 4)
    assert math.isnan(auroc) and groups == 0


def test_advantage_measures_on_a_toy_step():
    # Two groups of 2; token advantages over 3 tokens, the last token of sample 1 padding.
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 5.0], [0.5, -0.5, 0.0],
                               [2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    correct = torch.tensor([False, True, True, False])
    rewards = torch.tensor([0.9, 0.1, 0.3, 0.8])
    mean = mean_token_advantage(advantages, mask)
    assert mean.tolist() == pytest.approx([1.0, -1.0, 0.0, 2.0])
    mass = positive_mass(advantages, mask)
    assert mass.tolist() == pytest.approx([3.0, 0.0, 0.5, 2.0])
    # Positive mass 5.5, of which the wrong samples 0 and 3 hold 3 + 2.
    assert wrong_push(mass, correct) == pytest.approx(5 / 5.5)
    assert math.isnan(wrong_push(torch.zeros(4), correct))
    steps, tokens = torch.tensor([3, 2, 1, 2]), torch.tensor([3, 2, 3, 1])
    m = watch_metrics(rewards, correct, mean, mass, 2, steps, tokens)
    # Both groups mixed, each ranking its wrong sample first: AUROC 0 for reward and advantage.
    assert m["watch/group_auroc"] == 0.0 and m["watch/adv_auroc"] == 0.0
    assert m["watch/mixed_groups"] == 2
    assert m["watch/gold"] == 0.5 and m["watch/proxy"] == pytest.approx(0.525)
    assert m["watch/steps_per_solution"] == 2.0 and m["watch/tokens_per_step"] == 9 / 8


def test_k3_kl_by_hand():
    # r = other - policy = (-0.5, 0, padding): k3 = e^-0.5 - 1 + 0.5 = 0.10653066, and 0.
    policy = torch.tensor([[-1.0, -2.0, 0.0]])
    other = torch.tensor([[-1.5, -2.0, 9.0]])
    assert k3_kl(policy, other, torch.tensor([[1, 1, 0]])) == pytest.approx(0.10653066 / 2)


def test_guard_judges_full_windows_of_its_measures():
    guard = Guard("stop", 3, min_auroc=0.6, max_wrong_push=0.5)
    assert guard.check([[0.1, 0.9]] * 2) is None  # not yet a full window
    assert "group_auroc 0.500" in guard.check([[0.9, 0.1], [0.3, 0.1], [0.3, 0.1]])
    assert guard.check([[0.9, 0.1], [0.3, 0.1], [0.6, 0.1]]) is None  # 0.6 is not under 0.6
    # An undefined AUROC (no mixed group) leaves the mean; the wrong push still counts.
    assert "wrong_push 0.700" in guard.check([[math.nan, 0.7]] * 3)
    assert Guard("off", 3, 0.6, 0.5).check([[0.0, 1.0]] * 3) is None


def _trace_step():
    """One question, G = 2: sample 0 answers wrong yet the reward model gives it 1, sample 1
    answers right and gets 0. Outcome GRPO normalises (r - 0.5) / 0.5: +1 and -1 on every token."""
    cfg = load_config("configs/tiny.yaml", [*SMALL, "policy.supervision=outcome",
                                            "policy.group_size=2"])
    tokenizer = load_tokenizer(build_tiny_tokenizer_dir())
    texts = ["1+1=3", "1+1=2"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rollout = Rollout(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                      torch.tensor(ids), torch.ones(2, len(ids[0]), dtype=torch.long), texts,
                      torch.zeros(2, dtype=torch.bool), 2)
    rewards = torch.tensor([1.0, 0.0])
    scores = Scores(rewards=rewards, correct=torch.tensor([False, True]))
    batch = advantage_step(scores, rewards, torch.zeros(1, dtype=torch.bool), rollout,
                           resolve(cfg).method, 2)
    record = MathRecord("What is 1+1?", "2", ("1+1=2",), "toy:0")
    return rollout, scores, rewards, batch, record, tokenizer


def build_tiny_tokenizer_dir():
    from configs.loader import BUNDLED

    return BUNDLED / "tiny_warm_start"


def test_trace_rows_and_page_of_a_hand_built_step(tmp_path):
    rollout, scores, rewards, batch, record, tokenizer = _trace_step()
    rows = trace_rows(7, [record], rollout, scores, rewards, batch.advantages, batch.normalised,
                      batch.keep, tokenizer)
    # (the group's std carries GRPO's 1e-6 guard: 0.5 / (0.5 + 1e-6))
    assert rows[0]["token_advantages"] == pytest.approx([1.0] * 5, abs=1e-5)
    assert rows[1]["token_advantages"] == pytest.approx([-1.0] * 5, abs=1e-5)
    assert [r["correct"] for r in rows] == [False, True] and rows[0]["question_id"] == "toy:0"
    assert "".join(rows[0]["tokens"]) == "1+1=3"
    assert rows[0]["step_values"] == pytest.approx([1.0], abs=1e-5)
    write_trace(tmp_path / "trace", 7, rows)
    read = read_trace(tmp_path / "trace")  # (float columns stored as float32)
    assert [{k: v for k, v in r.items() if "advantages" not in k and "values" not in k}
            for r in read] == [{k: v for k, v in r.items() if "advantages" not in k
                                and "values" not in k} for r in rows]
    assert read[0]["token_advantages"] == pytest.approx(rows[0]["token_advantages"], rel=1e-6)
    page = render_trace_page(rows, "toy")
    # Each token carries its advantage; the wrong answer pushed up is marked for the filter.
    assert page.count("A=1.0000") == 5 and page.count("A=-1.0000") == 5
    assert page.count("class='s pushed-wrong'") == 1
    assert "only wrong answers pushed up" in page
    # `igrpo inspect` writes the page beside the trace.
    assert igrpo.main(["inspect", str(tmp_path / "trace")]) == 0
    assert (tmp_path / "trace.html").read_text() == render_trace_page(
        rows, f"GRPO trace: {tmp_path / 'trace'}")


def _stage_run(tmp_path, name, reward, *extra, init=None):
    cfg = load_config("configs/tiny.yaml", [f"run.root={tmp_path}", *SMALL, "policy.steps=4",
                                            "policy.eval_every=0", "run.wandb_mode=disabled",
                                            "policy.supervision=outcome", *extra])
    splits = load_splits(cfg.data, 0)
    base = tmp_path / "base"
    if not (base / "config.json").exists():
        build_tiny(base, cfg.model.tiny, 0)
    logger = MetricsLogger(tmp_path / f"{name}.jsonl", config={}, mode="disabled", project="",
                           name="")
    torch.manual_seed(0)  # (a stage draws its sampling seed from the state it starts in)
    final = resolve(cfg).policy_trainer(0, init)(tmp_path, base, reward, splits.rl,
                                                 splits.eval[:2], logger, "", out_name=name,
                                                 evaluate_ends=False)
    return [r for r in read_metrics(tmp_path / f"{name}.jsonl") if "train/loss" in r], final


@pytest.mark.slow
def test_the_watch_and_the_traces_change_nothing_they_watch(tmp_path, warm_start):
    """From the shipped warm start (right and wrong answers in a group): GRPO with the watch on
    (its KL from a run's starting policy every step, a model of its own as from the outer
    loop's second iteration) and every rollout traced, and without either, log the same proxy,
    gold and loss bit for bit and end in the same weights."""
    import shutil

    shutil.copytree(warm_start, tmp_path / "base")
    shutil.copytree(warm_start, tmp_path / "init")
    common = ("policy.group_size=8", "policy.questions_per_step=4", "policy.max_new_tokens=80",
              "policy.steps=3")
    on, final_on = _stage_run(tmp_path, "on", RuleReward(), *common, "watch.kl_init_every=1",
                                  init=str(tmp_path / "init"))
    off, final_off = _stage_run(tmp_path, "off", RuleReward(), *common, "watch.enabled=false",
                                "inspect.trace=false")
    assert [r["reward/mean"] for r in on] == [r["reward/mean"] for r in off]
    assert [r["reward/accuracy"] for r in on] == [r["reward/accuracy"] for r in off]
    assert [r["train/loss"] for r in on] == [r["train/loss"] for r in off]
    assert all(isinstance(r["watch/group_auroc"], float) for r in on)  # mixed groups measured
    assert abs(on[0]["watch/kl_init"]) < 1e-7 < on[2]["watch/kl_init"]
    assert not any("watch/gold" in r for r in off)
    assert len(list((tmp_path / "on" / "trace").glob("*.parquet"))) == 3
    assert not (tmp_path / "off" / "trace").exists()
    a, b = load_causal_lm(final_on).state_dict(), load_causal_lm(final_off).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Inverted:
    """Seeded random rewards whose verdict is their opposite (right = reward < 0.5): the reward
    ranks every mixed group backwards, in-group AUROC 0, as a hacked reward model does."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, records, rollout):
        rewards = torch.rand(len(rollout.texts), generator=self.gen)
        return Scores(rewards=rewards, correct=rewards < 0.5)


@pytest.mark.parametrize("action", ["warn", "stop"])
def test_the_guard_warns_or_ends_the_stage(tmp_path, action, capsys):
    rows, final = _stage_run(tmp_path, action, _Inverted(), f"watch.guard={action}",
                             "watch.window=2")
    assert rows[0]["watch/group_auroc"] == 0.0
    fired = [r["step"] for r in rows if r.get("guard/fired")]
    assert fired[0] == 2 and f"guard ({action}) at step 2" in capsys.readouterr().out
    done = (tmp_path / action / "done.json").read_text()
    if action == "warn":
        assert len(rows) == 4 and fired == [2, 3, 4] and "guard" not in done
    else:
        assert len(rows) == 2 and '"fired_at": 2' in done and "group_auroc 0.000" in done
        assert (final / "model.safetensors").exists()
