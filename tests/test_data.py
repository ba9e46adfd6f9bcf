"""Loaders on the shipped real data, the synthetic task, and malformed-row errors."""

import json
import random

import pytest

from tasks import synthetic
from runtime.data import (GSM8K_TEST, MATH500_TEST, DataError, LoadReport, load_records,
                          load_splits)
from configs import ConfigError, load_config


def test_gsm8k_reads_all_shipped_test_rows():
    records = load_records(str(GSM8K_TEST), "gsm8k")
    assert len(records) == 1319
    first = records[0]
    assert first.answer == "18"
    assert first.solution_steps[-1] == "The answer is 18"
    assert "<<" not in "".join(first.solution_steps)


def test_math500_reads_all_rows():
    records = load_records(str(MATH500_TEST), "math")
    assert len(records) == 500
    assert records[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert all(r.solution_steps for r in records)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_missing_field_names_file_row_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    _write_jsonl(f, [{"question": "q1", "answer": "x\n#### 3"}, {"question": "q2"},
                     {"question": "q3", "answer": "#### 4"}])
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: field 'answer'"):
        load_records(str(f), "gsm8k")


def test_unparseable_gold_answer(tmp_path):
    f = tmp_path / "bad.jsonl"
    _write_jsonl(f, [{"question": "q1", "answer": "no final answer here"}])
    with pytest.raises(DataError, match=r"row 1: field 'answer': no final"):
        load_records(str(f), "gsm8k")


def test_wrong_type_names_row_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    _write_jsonl(f, [{"question": "q1", "answer": "#### 3"}, {"question": 7, "answer": "#### 4"}])
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: field 'question'"):
        load_records(str(f), "gsm8k")


def test_broken_json_line_is_named(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "q1", "answer": "#### 3"}\n{"question": "q2", "ans\n')
    with pytest.raises(DataError, match=r"bad.jsonl: row 2: not valid JSON"):
        load_records(str(f), "gsm8k")


def test_skip_bad_rows_counts_them(tmp_path):
    f = tmp_path / "bad.jsonl"
    _write_jsonl(f, [{"question": "q1", "answer": "#### 3"}, {"question": "q2", "answer": "none"},
                     {"question": "q3", "answer": "#### 5"}])
    report = LoadReport()
    records = load_records(str(f), "gsm8k", skip_bad_rows=True, report=report)
    assert [r.answer for r in records] == ["3", "5"]
    assert report.skipped == 1 and "row 2" in report.first_error


def test_synthetic_is_seeded_and_solutions_are_right():
    a = synthetic.make_problems(3, 50)
    assert a == synthetic.make_problems(3, 50)
    assert a != synthetic.make_problems(4, 50)
    for p in a:
        assert p.steps[-1] == f"The answer is {p.answer}"
        assert all(synthetic.step_correctness(p.question, p.steps))


def test_corrupted_solution_has_known_first_wrong_step():
    rng = random.Random(0)
    for p in synthetic.make_problems(5, 200):
        steps, first_wrong = synthetic.corrupt_solution(p, rng)
        truth = synthetic.step_correctness(p.question, steps)
        assert truth == [k < first_wrong for k in range(len(steps))]
        assert steps[-1] != f"The answer is {p.answer}"


def test_synthetic_splits_are_disjoint():
    cfg = load_config(None, ["data.sft_questions=300", "data.rl_questions=2000",
                             "data.eval_questions=100"])
    splits = load_splits(cfg.data, seed=0)
    assert (len(splits.sft), len(splits.rl), len(splits.eval), len(splits.val)) == \
        (300, 2000, 100, 200)
    train = {r.question for r in splits.sft} | {r.question for r in splits.rl}
    held_out, val = {r.question for r in splits.eval}, {r.question for r in splits.val}
    assert not train & held_out and not train & val and not held_out & val
    # The validation draw comes after the held-out one: adding it leaves the held-out set as is.
    without = load_splits(load_config(None, [*cfg_overrides(cfg), "data.val_questions=0"]).data, 0)
    assert [r.question for r in without.eval] == [r.question for r in splits.eval]
    assert without.val is without.eval  # 0: SFT picks on the held-out set, as before


def test_sft_max_ops_keeps_the_longest_problems_out_of_sft_only():
    overrides = ["data.sft_questions=300", "data.rl_questions=600", "data.eval_questions=100",
                 "data.min_ops=2", "data.max_ops=5"]
    full = load_splits(load_config(None, overrides).data, seed=0)
    short = load_splits(load_config(None, [*overrides, "data.sft_max_ops=3"]).data, seed=0)
    ops = lambda records: {len(r.solution_steps) - 1 for r in records}  # the last step is the answer line
    assert ops(full.sft) == ops(short.rl) == ops(short.eval) == ops(short.val) == {2, 3, 4, 5}
    assert ops(short.sft) == {2, 3}
    assert [r.question for r in short.rl] == [r.question for r in full.rl]
    with pytest.raises(ConfigError, match="sft_max_ops"):
        load_config(None, [*overrides, "data.sft_max_ops=6"])


def cfg_overrides(cfg) -> list[str]:
    return [f"data.{key}={cfg.data[key]}" for key in ("sft_questions", "rl_questions",
                                                      "eval_questions")]


def test_real_data_validation_is_the_end_of_the_training_file(tmp_path):
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(
        json.dumps({"question": f"What is {i} plus 1?", "answer": f"So it is {i + 1}.\n#### {i + 1}"})
        + "\n" for i in range(30)))
    cfg = load_config(None, ["data.source=gsm8k", f"data.path={train_file}", "data.sft_questions=10",
                             "data.val_questions=5", "data.eval_questions=20"])
    splits = load_splits(cfg.data, seed=0)
    assert [r.answer for r in splits.val] == [str(i + 1) for i in range(25, 30)]
    assert [r.answer for r in splits.sft] == [str(i + 1) for i in range(10)]
    assert [r.answer for r in splits.rl] == [str(i + 1) for i in range(10, 25)]
    assert len(splits.eval) == 20  # the shipped GSM8K test set


def test_parquet_and_json_files_load(tmp_path):
    import datasets

    rows = [{"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2"},
            {"problem": "Half of 1?", "solution": "So $\\boxed{\\frac{1}{2}}$."}]
    parquet = tmp_path / "math.parquet"
    datasets.Dataset.from_list([{**r, "answer": r.get("answer")} for r in rows]).to_parquet(
        str(parquet))
    records = load_records(str(parquet), "math")
    assert [r.answer for r in records] == ["2", "\\frac{1}{2}"]  # boxed when no answer field
    as_json = tmp_path / "gsm.json"
    as_json.write_text(json.dumps([{"question": "q", "answer": "x\n#### 7"}]))
    assert load_records(str(as_json), "gsm8k")[0].answer == "7"


def test_without_sft_no_question_leaves_the_rl_pool():
    """GSM8K train's first `data.sft_questions` (2,000 by default) are the SFT split only when an
    SFT stage trains on them; a run from an instruct model keeps all 7,473 for RL (and the first
    reward models' worked solutions where it asks for some)."""
    from iteration.resolve import resolve

    base = ["data.source=gsm8k", "data.val_questions=0", "data.eval_questions=10"]
    without = resolve(load_config(None, [*base, "sft.enabled=false"])).splits()
    with_sft = resolve(load_config(None, [*base, "sft.enabled=true"])).splits()
    worked = resolve(load_config(None, [*base, "sft.enabled=false",
                                        "rm.worked_solutions=100"])).splits()
    assert (len(without.sft), len(without.rl)) == (0, 7473)
    assert (len(with_sft.sft), len(with_sft.rl)) == (2000, 5473)
    assert (len(worked.sft), len(worked.rl)) == (100, 7373)
    assert {r.question for r in worked.sft}.isdisjoint(r.question for r in worked.rl)


def test_derive_seed_keeps_each_named_stream_and_hashes_new_ones():
    """The named purposes keep the seeds the shipped figures were drawn with; a purpose not in
    the table gets a stable hash of (run seed, purpose, key), distinct per purpose and key."""
    from runtime.seeds import PURPOSES, derive_seed

    assert derive_seed(3, "questions") == 3 * 7_919 and derive_seed(3, "label", 2) == 305
    assert derive_seed(0, "replay", 4) == 4 and derive_seed(1, "rl-questions") == 5
    assert len(PURPOSES) == 18
    new = derive_seed(3, "a new stream", 1)
    assert new == derive_seed(3, "a new stream", 1) and 0 <= new < 2 ** 31
    assert len({new, derive_seed(3, "a new stream", 2), derive_seed(3, "another", 1),
                derive_seed(4, "a new stream", 1)}) == 4
