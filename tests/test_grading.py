"""The grader on real data: GSM8K gold answers and MATH-500 reference solutions."""

import json

import pytest

from runtime.data import GSM8K_TEST, MATH500_TEST, load_records
from tasks.grading import answers_match, extract_final_answer, grade


def test_gsm8k_gold_against_itself_and_plus_one():
    records = load_records(str(GSM8K_TEST), "gsm8k")
    rows = [json.loads(line) for line in open(GSM8K_TEST)]
    right = sum(grade(row["answer"], rec.answer) for row, rec in zip(rows, records))
    assert right == 1319
    wrong = sum(grade(f"#### {float(rec.answer) + 1:g}", rec.answer) for rec in records)
    assert wrong == 0


def test_math500_reference_boxed_against_answer():
    rows = [json.loads(line) for line in open(MATH500_TEST)]
    misses = [row["unique_id"] for row in rows if not grade(row["solution"], row["answer"])]
    print(f"MATH-500: {500 - len(misses)}/500 correct; misses: {misses}")
    assert len(misses) <= 5


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("a \\boxed{1} then \\boxed{x^{2}}", "x^{2}"),
    ("1+2=3\nThe answer is 3", "3"),
    ("The answer is $42$.", "42"),
    ("work\n#### 1,234", "1,234"),
    ("no answer", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_equivalences():
    assert answers_match("0.5", "\\frac{1}{2}")
    assert answers_match("1,234", "1234")
    assert not answers_match("3", "4")
    assert not answers_match("9" * 500, "9")
    assert grade("The answer is 16", "16") and not grade("The answer is 17", "16")
