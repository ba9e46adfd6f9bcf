"""`igrpo score` (reward_model/score_file.py): per-step scores and the solution score of every
row of a Math-Shepherd, TRL-stepwise, OpenRLHF, RLHFlow, ProcessBench, PRM800K or plain-solutions
file, written beside the row's own fields, with each question's best-of-N pick; equal to the
scorer's own `score()`; a bad row named before any model loads; a killed run resumed without
scoring a finished shard again; 2 processes write what 1 writes. The reward model: the shipped
tiny warm start read at its step tag (a tag LM), loaded in a few seconds."""

import json
import math
import os

import pytest

import igrpo
from configs import ConfigError, load_config
from configs.loader import BUNDLED
from process_supervision.benchmarks import processbench_example
from process_supervision.formats import (StepExample, example_from_row, prm800k_example,
                                         to_math_shepherd)
from reward_model import families, score_file
from reward_model.examples import as_orm
from reward_model.families import load_reward_model
from reward_model.score import TagScorer
from reward_model.score_file import best_of_n
from runtime.data import DataError
from runtime.steps import split_steps

from launch import torchrun

RM = BUNDLED / "tiny_warm_start"
QUESTIONS = ["What is 3 + 4?", "What is 12 - 5?", "What is 6 * 2?"]
SOLUTIONS = {  # per question: a right solution, a wrong one, a longer one
    QUESTIONS[0]: ["3 + 4 = 7\nThe answer is 7", "3 + 4 = 8\nThe answer is 8",
                   "3 + 4 = 7\n7 + 0 = 7\nThe answer is 7"],
    QUESTIONS[1]: ["12 - 5 = 7\nThe answer is 7", "12 - 5 = 17\nThe answer is 17",
                   "12 - 5 = 7\n7 = 7\nThe answer is 7"],
    QUESTIONS[2]: ["6 * 2 = 12\nThe answer is 12", "6 * 2 = 8\nThe answer is 8",
                   "6 * 2 = 12\n12 = 12\nThe answer is 12"],
}


def _plain_rows() -> list[dict]:
    return [{"question": q, "solution": s, "sample": k}
            for q in QUESTIONS for k, s in enumerate(SOLUTIONS[q])]


def _steps(solution: str) -> list[str]:
    return split_steps(solution, "\n")


def _layout_rows(layout: str) -> list[dict]:
    """The plain rows in `layout`'s own fields (labels: the first step right, the rest wrong)."""
    rows = []
    for i, row in enumerate(_plain_rows()):
        q, steps = row["question"], _steps(row["solution"])
        labels = [1] + [0] * (len(steps) - 1)
        if layout == "math_shepherd":
            text, label = to_math_shepherd(q, steps, labels)
            rows.append({"input": text, "label": label, "source_id": f"s{i}"})
        elif layout == "trl":
            rows.append({"prompt": q, "completions": steps, "labels": [bool(y) for y in labels]})
        elif layout == "openrlhf":
            rows.append({"input": to_math_shepherd(q, steps)[0],
                         "value": ["+" if y else "-" for y in labels]})
        elif layout == "rlhflow":
            turns = [f"{q} Step 1: {steps[0]}", *steps[1:]]
            rows.append({"conversations": [
                turn for text, y in zip(turns, labels) for turn in (
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": "+" if y else "-"})]})
        elif layout == "processbench":
            rows.append({"id": f"gsm8k-{i}", "generator": "tiny", "problem": q, "steps": steps,
                         "final_answer_correct": False, "label": 1})
        elif layout == "prm800k":  # ratings 1 then -1: the solution stops at its first wrong step
            rows.append({"labeler": "x", "question": {"problem": q, "ground_truth_answer": "7"},
                         "label": {"steps": [{"completions": [{"text": s, "rating": 1 if y else -1,
                                                               "flagged": None}],
                                              "human_completion": None, "chosen_completion": 0}
                                             for s, y in zip(steps, labels)],
                                   "finish_reason": "found_error"}})
        else:
            rows.append(row)
    return rows


def _examples(layout: str, rows: list[dict], path) -> list[StepExample]:
    """The solutions each layout's own reader makes of the rows (what the command must score)."""
    where = [f"{path}: row {i + 1}" for i in range(len(rows))]
    if layout in ("math_shepherd", "trl", "openrlhf", "rlhflow"):
        return [example_from_row(r, w) for r, w in zip(rows, where)]
    if layout == "processbench":
        return [processbench_example(r, w) for r, w in zip(rows, where)]
    if layout == "prm800k":
        return [prm800k_example(r, w) for r, w in zip(rows, where)]
    return [StepExample(r["question"], tuple(_steps(r["solution"])),
                        (0.0,) * len(_steps(r["solution"]))) for r in rows]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _score(tmp_path, data, *extra, name="score"):
    return igrpo.main(["score", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       f"run.name={name}", "model.policy_path=", f"rm.path={RM}",
                       f"rm.score_input={data}", "run.wandb_mode=disabled", *extra])


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def scorer():
    rm = load_config("configs/tiny.yaml").rm
    return load_reward_model(RM, rm)


@pytest.mark.parametrize("layout", ["math_shepherd", "trl", "openrlhf", "rlhflow", "processbench",
                                    "prm800k", "plain"])
def test_each_layout_gets_the_scorers_own_step_scores_beside_its_fields(tmp_path, layout,
                                                                         scorer):
    rows = _layout_rows(layout)
    data = _write(tmp_path / f"{layout}.jsonl", rows)
    assert _score(tmp_path, data) == 0
    folder = tmp_path / "score" / "score" / layout
    out = _read(folder / "scored.jsonl")
    examples = _examples(layout, rows, data)
    want = scorer.score(examples)
    assert len(out) == len(rows)
    for row, got, steps, example in zip(rows, out, want, examples):
        assert {k: v for k, v in got.items() if k not in ("step_scores", "score", "best_of_n")} \
            == row  # the row's own fields, as written (PRM800K's nulls included)
        assert got["step_scores"] == steps and len(steps) == len(example.steps)
        assert got["score"] == min(steps)  # rm.aggregate=min
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["layout"], summary["rows"], summary["questions"]) == (layout, 9, 3)
    assert not (tmp_path / "score" / "base").exists()  # nothing built: model.policy_path=''


GOLD = {QUESTIONS[0]: "7", QUESTIONS[1]: "7", QUESTIONS[2]: "12"}
RIGHT = [True, False, True]
"""Each question's known answer, and which of its three solutions (right, wrong, longer) reach
it."""


def test_known_answers_give_best_of_n_curves_by_hand(tmp_path):
    """Rows carrying their question's `answer`: each solution graded against it, and the
    summary's best-of-N curve at N = 1, 2, 3 by hand from the scores the command wrote: at N = 1
    every method's accuracy is the share of right solutions, 2/3; at N = 3, rm@3 is the accuracy
    of the rows marked `best_of_n`, maj@3 is 1 (two of three solutions reach the answer) and the
    weighted vote picks the answer whose solutions' scores sum highest; a table and a plot beside
    the summary. Without answers there is no curve."""
    rows = [dict(row, answer=GOLD[row["question"]]) for row in _plain_rows()]
    data = _write(tmp_path / "known.jsonl", rows)
    assert _score(tmp_path, data) == 0
    folder = tmp_path / "score" / "score" / "known"
    summary = json.loads((folder / "summary.json").read_text())
    curve, out = summary["best_of_n_curve"], _read(folder / "scored.jsonl")
    assert list(curve) == ["1", "2", "3"]
    assert all(curve["1"][m][0] == pytest.approx(2 / 3) for m in ("rm", "weighted_vote",
                                                                 "majority"))
    right = RIGHT * 3
    picked = [r for r, row in zip(right, out) if row["best_of_n"]]
    assert curve["3"]["rm"][0] == pytest.approx(sum(picked) / 3)
    assert curve["3"]["majority"] == [1.0, 1.0, 1.0]
    votes = []
    for q in range(3):
        scores = [row["score"] for row in out[3 * q:3 * q + 3]]
        votes.append(scores[0] + scores[2] >= scores[1])  # the right answer's sum wins
    assert curve["3"]["weighted_vote"][0] == pytest.approx(sum(votes) / 3)
    lo, hi = curve["2"]["rm"][1:]
    assert lo <= curve["2"]["rm"][0] <= hi
    assert (folder / "bon_curve.png").stat().st_size > 0
    assert (folder / "bon_curve.md").read_text().startswith("| N | rm | weighted_vote |")
    plain = _write(tmp_path / "plain.jsonl", _plain_rows())
    assert _score(tmp_path, plain, name="plain") == 0
    assert "best_of_n_curve" not in json.loads(
        (tmp_path / "plain" / "score" / "plain" / "summary.json").read_text())


def test_aggregate_prod_an_orm_and_the_best_of_n_pick_by_hand(tmp_path, scorer):
    rows = _plain_rows() + [{"question": QUESTIONS[0], "solution": "\n", "sample": 3}]
    data = _write(tmp_path / "plain.jsonl", rows)
    assert _score(tmp_path, data, "rm.aggregate=prod", name="prod") == 0
    out = _read(tmp_path / "prod" / "score" / "plain" / "scored.jsonl")
    for got in out[:-1]:
        assert got["score"] == pytest.approx(math.prod(got["step_scores"]), rel=1e-6)
    assert out[-1]["step_scores"] == [] and out[-1]["score"] is None  # no step: no score
    for q in QUESTIONS:  # the pick: the highest score among the question's rows
        mine = [r for r in out if r["question"] == q]
        best = max((r for r in mine if r["score"] is not None), key=lambda r: r["score"])
        assert [r["best_of_n"] for r in mine] == [r is best for r in mine]
    # an ORM reads the whole solution as one step: one score, the scorer's own
    assert _score(tmp_path, data, "rm.kind=orm", name="orm") == 0
    out = _read(tmp_path / "orm" / "score" / "plain" / "scored.jsonl")
    plain = _examples("plain", rows[:-1], data)
    assert [r["step_scores"] for r in out[:-1]] == scorer.score(as_orm(plain))
    assert [r["score"] for r in out[:-1]] == [s[0] for s in scorer.score(as_orm(plain))]


def test_best_of_n_picks_each_questions_highest_score_by_hand():
    questions = ["a", "a", "b", "a", "b", "c", "c", "d"]
    scores = [0.2, 0.9, 0.5, 0.9, None, None, None, 0.1]
    # a: 0.9 twice, the first of them; b: 0.5 (the other has no score); c: nothing scored
    assert best_of_n(questions, scores) == [False, True, True, False, False, False, False, True]


BAD = {  # layout: (rows 1-2 good, row 3 bad in `field`)
    "plain": ({"question": "q", "sample": 0}, "solution"),
    "math_shepherd": ({"input": "q Step 1: a ки", "label": "q Step 1: a ?"}, "label"),
    "trl": ({"prompt": "q", "completions": ["a", "b"], "labels": [True]}, "labels"),
    "openrlhf": ({"input": "q Step 1: a ки", "value": ["+", 1.5]}, "value"),
    "rlhflow": ({"conversations": [{"role": "user", "content": "q Step 1: a"},
                                   {"role": "assistant", "content": "?"}]}, "conversations"),
    "processbench": ({"problem": "q", "steps": ["a"], "label": 3}, "label"),
    "prm800k": ({"question": {"problem": "q"}, "label": {"steps": 2}}, "label.steps"),
}


@pytest.mark.parametrize("layout", sorted(BAD))
def test_a_bad_row_is_named_by_file_row_and_field_before_any_model_loads(tmp_path, layout,
                                                                          monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(families, "load_reward_model", no_model)
    bad, field = BAD[layout]
    rows = _layout_rows(layout)[:2] + [bad]
    data = _write(tmp_path / f"{layout}.jsonl", rows)
    with pytest.raises(DataError, match=rf"{layout}.jsonl: row 3: field '{field}'"):
        _score(tmp_path, data)
    # a plain file that happens to hold a `value` column stays plain (OpenRLHF's needs `input`)
    assert score_file.detect_layout({"question": "q", "solution": "s", "value": [1]}, "x") == \
        "plain"
    data = _write(tmp_path / "unknown.jsonl", [{"text": "no layout"}])
    with pytest.raises(DataError, match=r"unknown.jsonl: row 1: no 'input'/'label'"):
        _score(tmp_path, data, name="unknown")
    assert not (tmp_path / "score" / "base").exists()


class Killed(Exception):
    """What the simulated kill raises in the middle of the second shard."""


def test_a_killed_run_resumes_without_scoring_a_finished_shard_again(tmp_path, monkeypatch):
    data = _write(tmp_path / "plain.jsonl", _plain_rows())
    args = ("rm.score_shard_rows=4", "rm.score_batch_size=2")
    assert _score(tmp_path, data, *args, name="straight") == 0
    straight = (tmp_path / "straight" / "score" / "plain" / "scored.jsonl").read_text()
    own = TagScorer.score
    scored: list[str] = []

    def counting(self, examples, kill_at=None):
        if kill_at is not None and len(scored) >= kill_at:
            raise Killed()
        scored.extend(ex.question + ex.steps[0] for ex in examples)
        return own(self, examples)

    monkeypatch.setattr(TagScorer, "score", lambda self, ex: counting(self, ex, kill_at=6))
    with pytest.raises(Killed):  # shard 1 (rows 1-4) written; killed in shard 2's 2nd batch
        _score(tmp_path, data, *args, name="killed")
    folder = tmp_path / "killed" / "score" / "plain"
    shards = folder / "shards" / score_file.model_fingerprint(RM)
    assert [p.name for p in sorted(shards.glob("*.json"))] == ["rows-000000000-000000004.json"]
    assert not (folder / "scored.jsonl").exists()
    scored.clear()
    monkeypatch.setattr(TagScorer, "score", lambda self, ex: counting(self, ex))
    assert _score(tmp_path, data, *args, name="killed") == 0
    rows = _plain_rows()
    assert scored == [r["question"] + _steps(r["solution"])[0] for r in rows[4:]]
    assert (folder / "scored.jsonl").read_text() == straight
    # the same command again scores nothing; another output path is no change of config
    scored.clear()
    assert _score(tmp_path, data, *args, f"rm.score_output={tmp_path / 'o.jsonl'}",
                  name="killed") == 0
    assert scored == [] and (tmp_path / "o.jsonl").read_text() == straight
    # another reward-model setting is: the finished shards would mix two models
    assert _score(tmp_path, data, *args, "rm.aggregate=prod", name="killed") == 2


def test_a_model_trained_again_in_place_is_scored_again(tmp_path):
    """The shards are kept under the reward model's fingerprint (its config and weight files'
    names, sizes and times), so a model retrained at the same path never reuses the old
    model's scores on a resume."""
    import shutil

    model = tmp_path / "rm"
    shutil.copytree(RM, model)
    before = score_file.model_fingerprint(model)
    assert score_file.model_fingerprint(model) == before  # stable while nothing changes
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10 ** 9))
    assert score_file.model_fingerprint(model) != before
    assert score_file.model_fingerprint("org/hub-model") == \
        score_file.model_fingerprint("org/hub-model")


def test_score_needs_a_model_and_an_input(tmp_path, capsys):
    assert igrpo.main(["score", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       "run.wandb_mode=disabled", f"rm.path={RM}"]) == 2
    assert "rm.score_input=FILE" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="rm.score_shard_rows=0"):
        load_config("configs/tiny.yaml", ["rm.score_shard_rows=0"])


def test_train_rm_from_init_path_builds_nothing_in_base(tmp_path, monkeypatch):
    """With rm.init_path set, `igrpo train-rm` trains from it and builds no tiny policy in
    <run>/base (the training itself is stubbed: only its backbone is in question)."""
    from reward_model import train

    started = []

    def stub(spec, out, init, examples, logger, config_yaml):
        started.append(init)
        return out

    monkeypatch.setattr(train, "train_reward_model", stub)
    assert igrpo.main(["train-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                       "model.policy_path=", "rm.init_path=bundled:tiny_warm_start",
                       "data.rl_questions=64", "rm.synthetic_solutions=8",
                       "run.wandb_mode=disabled"]) == 0
    assert [str(p) for p in started] == [str(RM)]
    assert not (tmp_path / "tiny" / "base").exists()


@pytest.mark.slow
def test_two_processes_write_what_one_writes(tmp_path):
    rows = _plain_rows() + [{"question": QUESTIONS[1], "solution": s, "sample": 9 + k}
                            for k, s in enumerate(SOLUTIONS[QUESTIONS[2]])]
    data = _write(tmp_path / "plain.jsonl", rows)
    out = {}
    for nproc in (1, 2):
        torchrun(nproc, "-m", "igrpo", "score", "--config", "configs/tiny.yaml",
                 f"run.root={tmp_path / f'p{nproc}'}", "model.policy_path=", f"rm.path={RM}",
                 f"rm.score_input={data}", "rm.score_shard_rows=5", "rm.score_batch_size=2",
                 "run.threads=1")
        out[nproc] = (tmp_path / f"p{nproc}" / "tiny" / "score" / "plain" /
                      "scored.jsonl").read_text()
    assert out[2] == out[1] and len(out[1].splitlines()) == len(rows)
