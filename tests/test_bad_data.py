"""Corrupted files, for every loader of user data: the error names file, row and field; row-level
problems can be skipped with a count instead."""

import json

import pytest

from process_supervision.formats import read_step_rows
from runtime.data import DataError, LoadReport, load_records

GOOD = {
    "gsm8k": {"question": "q", "answer": "x\n#### 3"},
    "math": {"problem": "p", "solution": "s \\boxed{3}", "answer": "3"},
    "math_shepherd": {"input": "q Step 1: a ки\nStep 2: b ки",
                      "label": "q Step 1: a +\nStep 2: b -"},
}
FIELD = {"gsm8k": "answer", "math": "answer", "math_shepherd": "label"}
MISSING = {"gsm8k": "answer", "math": "problem", "math_shepherd": "label"}
"""(MATH rows may omit `answer`: it is then read from the solution's \\boxed{}.)"""


def _load(kind, path, **kw):
    if kind == "math_shepherd":
        examples, skipped = read_step_rows(str(path), **kw)
        return examples, skipped
    report = LoadReport()
    return load_records(str(path), kind, report=report, **kw), report.skipped


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_truncated_file_names_the_row(tmp_path, kind):
    f = tmp_path / f"{kind}.jsonl"
    _write(f, [GOOD[kind]] * 3)
    f.write_bytes(f.read_bytes()[:-12])  # the download stopped mid-row
    with pytest.raises(DataError, match=rf"{kind}.jsonl: row 3: not valid JSON"):
        _load(kind, f)


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_wrong_encoding_names_the_row(tmp_path, kind):
    f = tmp_path / f"{kind}.jsonl"
    _write(f, [GOOD[kind]])
    bad = dict(GOOD[kind])
    key = next(iter(bad))
    line = json.dumps({**bad, key: "caf\u00e9"}, ensure_ascii=False).encode("latin-1")
    f.write_bytes(f.read_bytes() + line + b"\n")
    with pytest.raises(DataError, match=rf"{kind}.jsonl: row 2: not valid UTF-8"):
        _load(kind, f)


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_wrong_type_names_row_and_field(tmp_path, kind):
    f = tmp_path / f"{kind}.jsonl"
    field = FIELD[kind]
    _write(f, [GOOD[kind], {**GOOD[kind], field: 12}])
    with pytest.raises(DataError, match=rf"{kind}.jsonl: row 2: field '{field}'"):
        _load(kind, f)


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_missing_field_is_named_or_skipped_with_a_count(tmp_path, kind):
    f = tmp_path / f"{kind}.jsonl"
    field = MISSING[kind]
    missing = {k: v for k, v in GOOD[kind].items() if k != field}
    _write(f, [GOOD[kind], missing, GOOD[kind]])
    with pytest.raises(DataError, match=rf"{kind}.jsonl: row 2: .*'{field}'"):
        _load(kind, f)
    loaded, skipped = _load(kind, f, skip_bad_rows=True)
    assert len(loaded) == 2 and skipped == 1
