"""The field's PRM benchmarks and human labels (process_supervision/benchmarks.py, formats.py):
ProcessBench's F1 and PRMBench's PRMScore equal hand-computed values on small files in the
public layouts, PRM800K rows read as their labellers rated them, and bad rows are named."""

import json

import pytest

import igrpo
from process_supervision.benchmarks import read_benchmark
from process_supervision.formats import example_from_row, read_step_rows
from reward_model.report import benchmark_report
from runtime.data import DataError
from runtime.tiny_model import build_stand_in


class FixedScorer:
    """Scores chosen per question: what a reward model would say, without one."""

    batch_size = 2

    def __init__(self, by_question):
        self.by_question = by_question

    def score(self, examples):
        return [self.by_question[ex.question][:len(ex.steps)] for ex in examples]


PROCESSBENCH = {
    "gsm8k": [  # (row, the PRM's step scores)
        ({"id": "g0", "generator": "m", "problem": "A", "steps": ["a1", "a2", "a3"],
          "final_answer_correct": False, "label": 1}, [0.9, 0.2, 0.8]),  # first error found
        ({"id": "g1", "generator": "m", "problem": "B", "steps": ["b1", "b2"],
          "final_answer_correct": True, "label": -1}, [0.9, 0.4]),  # an error where none is
        ({"id": "g2", "generator": "m", "problem": "C", "steps": ["c1"],
          "final_answer_correct": False, "label": 0}, [0.3]),  # one step, wrong, found
        ({"id": "g3", "generator": "m", "problem": "D", "steps": ["d1"],
          "final_answer_correct": True, "label": -1}, [0.7]),  # all right, none predicted
    ],
    "math": [
        ({"id": "m0", "generator": "m", "problem": "E", "steps": ["e1", "e2", "e3"],
          "final_answer_correct": False, "label": 2}, [0.9, 0.1, 0.1]),  # found too early
        ({"id": "m1", "generator": "m", "problem": "F", "steps": ["f1", "f2"],
          "final_answer_correct": True, "label": -1}, [0.6, 0.9]),
    ],
}


def _write_processbench(folder):
    folder.mkdir()
    # gsm8k as the hub ships it (a JSON list), math as JSON Lines
    (folder / "gsm8k.json").write_text(json.dumps([row for row, _ in PROCESSBENCH["gsm8k"]]))
    (folder / "math.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row, _ in PROCESSBENCH["math"]))
    return FixedScorer({row["problem"]: s for rows in PROCESSBENCH.values() for row, s in rows})


def test_processbench_f1_per_split_average_and_tuned_threshold_by_hand(tmp_path):
    scorer = _write_processbench(tmp_path / "pb")
    bench = read_benchmark(tmp_path / "pb")
    assert bench.name == "processbench" and sorted(bench.splits) == ["gsm8k", "math"]
    assert bench.splits["gsm8k"][0].labels == (1.0, 0.0, 0.0)
    assert bench.splits["gsm8k"][1].labels == (1.0, 1.0)
    report = benchmark_report(scorer, bench)
    # gsm8k: erroneous rows g0, g2 both found (1.0); all-right rows g1 missed, g3 kept (0.5)
    assert report["processbench/gsm8k/error_accuracy"] == 1.0
    assert report["processbench/gsm8k/correct_accuracy"] == 0.5
    assert report["processbench/gsm8k/f1"] == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    # math: m0's error predicted at step 1, not 2 (0.0); m1 kept (1.0): F1 0
    assert report["processbench/math/f1"] == 0.0
    assert report["processbench/average_f1"] == pytest.approx((2 / 3 + 0.0) / 2)
    # The threshold by F1 on gsm8k (ProcessBench's recipe for a scalar PRM): "wrong below 0.4"
    # keeps g1 (its 0.4) and still finds g0 and g2 (0.2, 0.3): F1 1; below 0.3 g2 is missed.
    # Applied to math: m0's first error still found at step 1, F1 0.
    assert report["processbench/threshold"] == 0.4
    assert report["processbench/gsm8k/f1_tuned"] == 1.0
    assert report["processbench/math/f1_tuned"] == 0.0
    assert report["processbench/average_f1_tuned"] == 0.5


def test_prmbench_prm_score_by_hand(tmp_path):
    rows = [{"idx": 0, "question": "Q0", "original_process": ["s1", "s2", "s3"],
             "modified_process": ["s1", "t2", "t3"], "modified_steps": [2, 3],
             "error_steps": [2], "classification": "confidence"},
            {"idx": 1, "question": "Q1", "original_process": ["u1", "u2"],
             "modified_process": ["u1", "v2"], "modified_steps": [2], "error_steps": [2],
             "classification": "redundancy"}]
    path = tmp_path / "prmbench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = read_benchmark(path)
    assert bench.name == "prmbench"
    assert bench.splits["prmbench"][0].labels == (1.0, 0.0, 1.0)
    scorer = FixedScorer({"Q0": [0.8, 0.3, 0.4], "Q1": [0.9, 0.6]})
    report = benchmark_report(scorer, bench)
    # steps (truth, predicted right): (R,R) (W,W) (R,W) (R,R) (W,R)
    # right steps: tp 2, fp 1 (a wrong step called right), fn 1 -> F1 4/6
    # wrong steps: tp 1, fp 1, fn 1 -> F1 2/4
    assert report["prmbench/correct_f1"] == pytest.approx(4 / 6)
    assert report["prmbench/error_f1"] == pytest.approx(0.5)
    assert report["prmbench/prm_score"] == pytest.approx(0.5 * 4 / 6 + 0.5 * 0.5)
    # confidence alone: (R,R) (W,W) (R,W): right F1 2/3, wrong F1 2/3
    assert report["prmbench/confidence/prm_score"] == pytest.approx(2 / 3)


def test_prm800k_rows_read_as_their_labellers_rated_them(tmp_path):
    row = {"question": {"problem": "What is 2 + 3?", "ground_truth_answer": "5"},
           "label": {"steps": [
               {"completions": [{"text": "2 + 3 = 5", "rating": 1}], "chosen_completion": 0},
               {"completions": [{"text": "Let me check", "rating": 0},
                                {"text": "Hmm", "rating": -1}], "chosen_completion": 0},
               {"completions": [{"text": "So it is 6", "rating": -1},
                                {"text": "So it is 5", "rating": 1}],
                "chosen_completion": None},
               {"completions": [{"text": "The answer is 6", "rating": -1}],
                "chosen_completion": 0}],
               "finish_reason": "found_error"}}
    example = example_from_row(row, "prm800k.jsonl: row 1")
    # the chosen completions; none chosen at step 3: its wrong one, and the solution ends there
    assert example.steps == ("2 + 3 = 5", "Let me check", "So it is 6")
    assert example.labels == (1.0, 1.0, 0.0)  # neutral counts as right
    path = tmp_path / "prm800k.jsonl"
    path.write_text(json.dumps(row) + "\n")
    examples, skipped = read_step_rows(str(path))
    assert examples[0].steps == example.steps and skipped == 0


def test_bad_rows_are_named_by_file_row_and_field(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    good = {"id": "a", "generator": "m", "problem": "P", "steps": ["x", "y"],
            "final_answer_correct": True, "label": -1}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "label": 2}) + "\n")
    with pytest.raises(DataError, match=r"gsm8k.jsonl: row 2: field 'label'"):
        read_benchmark(path)
    path.write_text(json.dumps({**good, "steps": []}) + "\n")
    with pytest.raises(DataError, match=r"row 1: field 'steps'"):
        read_benchmark(path)
    bad = {"question": {"problem": "P"}, "label": {"steps": [
        {"completions": [{"text": "x", "rating": 2}], "chosen_completion": 0}]}}
    with pytest.raises(DataError, match=r"row 3: field 'label.steps\[0\]'.completions\[0\]"):
        example_from_row(bad, "prm800k.jsonl: row 3")
    with pytest.raises(DataError, match="no such file"):
        read_benchmark(tmp_path / "missing.json")


@pytest.mark.slow
def test_eval_rm_reports_processbench_for_a_reward_model_of_any_family(tmp_path):
    """`igrpo eval-rm rm.path=... eval.prm_benchmark=...`: a token-classification PRM's
    ProcessBench F1 per split and average land in the run's eval/reward_models.json."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    lm = build_stand_in(tmp_path / "lm", "llama")
    prm = tmp_path / "prm"
    AutoModelForTokenClassification.from_pretrained(lm, num_labels=2).save_pretrained(prm)
    AutoTokenizer.from_pretrained(lm).save_pretrained(prm)
    _write_processbench(tmp_path / "pb")
    report = igrpo.main(["eval-rm", "--config", "configs/tiny.yaml", f"run.root={tmp_path}",
                         "run.name=ev", f"rm.path={prm}", f"eval.prm_benchmark={tmp_path / 'pb'}",
                         "rm.bon_questions=0", "rm.lm_weight=0", "rm.likelihood_feature=false",
                         "rm.eval_solutions=20", "run.wandb_mode=disabled"])
    assert report == 0
    written = json.loads((tmp_path / "ev" / "eval" / "reward_models.json").read_text())
    for key in ("processbench/gsm8k/f1", "processbench/math/f1", "processbench/average_f1"):
        assert 0.0 <= written[key] <= 1.0
    assert written["prm/steps"] > 0  # and the held-out synthetic steps, read by the same PRM
