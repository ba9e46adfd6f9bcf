"""The field's process-reward benchmarks, read by their public field names (PRM800K, a
training set as well, is read in `formats.py`).

- **ProcessBench** (Zheng et al. 2024): rows `id`, `generator`, `problem`, `steps` (list),
  `final_answer_correct`, `label` (0-based index of the earliest wrong step, -1 when every step is
  right), one file per split (gsm8k, math, olympiadbench, omnimath). Its metric: a PRM's predicted
  first error is its first step scored below 0.5 (none: -1); accuracy on the erroneous rows (the
  index matches) and on the all-right rows (no error predicted), and their harmonic mean, the F1;
  the average over splits is the mean of the splits' F1.
- **PRMBench** (Song et al. 2025): rows `original_process`, `modified_process` (lists of steps),
  `modified_steps`, `error_steps` (1-based) and `classification`; a PRM is scored on the modified
  process, each step right unless listed in `error_steps`: PRMScore = 0.5 F1 (right steps) + 0.5
  negative F1 (wrong steps).
Errors name the file, the row and the field, as the other readers' do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from process_supervision.formats import StepExample
from runtime.data import DataError, read_rows

PROCESSBENCH_SPLITS = ("gsm8k", "math", "olympiadbench", "omnimath")


@dataclass(frozen=True)
class BenchmarkRows:
    """A benchmark's rows as labelled solutions: `name` (processbench or prmbench), per split
    (ProcessBench: the file's stem) its examples, and per example its category (PRMBench's
    `classification`, else the split)."""

    name: str
    splits: dict[str, list[StepExample]]
    categories: dict[str, list[str]]


def _string_list(row: dict, field: str, where: str) -> list[str]:
    value = row.get(field)
    if not isinstance(value, list) or not value or not all(isinstance(s, str) for s in value):
        raise DataError(f"{where}: field {field!r}: expected a non-empty list of strings")
    return value


def processbench_example(row: dict, where: str) -> StepExample:
    """One ProcessBench row as a solution whose labels are right up to `label` (the first wrong
    step, -1: none) and wrong from it on."""
    if not isinstance(row.get("problem"), str):
        raise DataError(f"{where}: field 'problem': missing or not a string")
    steps = _string_list(row, "steps", where)
    label = row.get("label")
    if isinstance(label, bool) or not isinstance(label, int) or not -1 <= label < len(steps):
        raise DataError(f"{where}: field 'label': expected -1 or a step index below "
                        f"{len(steps)}, found {label!r}")
    first = len(steps) if label == -1 else label
    labels = tuple(1.0 if k < first else 0.0 for k in range(len(steps)))
    return StepExample(row["problem"], tuple(steps), labels, str(row.get("id", where)))


def prmbench_example(row: dict, where: str) -> StepExample:
    """One PRMBench row: its modified process, each step right unless in `error_steps`."""
    question = row.get("question", row.get("original_question"))
    if not isinstance(question, str):
        raise DataError(f"{where}: field 'question': missing or not a string")
    steps = _string_list(row, "modified_process", where)
    errors = row.get("error_steps")
    if not isinstance(errors, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= len(steps)
            for k in errors):
        raise DataError(f"{where}: field 'error_steps': expected 1-based step numbers up to "
                        f"{len(steps)}, found {errors!r}")
    labels = tuple(0.0 if k + 1 in errors else 1.0 for k in range(len(steps)))
    return StepExample(question, tuple(steps), labels, str(row.get("idx", row.get("id", where))))


def _files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl", ".parquet"))
        if not found:
            raise DataError(f"{path}: no .json, .jsonl or .parquet file")
        return found
    if not path.exists():
        raise DataError(f"{path}: no such file")
    return [path]


def read_benchmark(path: str | Path) -> BenchmarkRows:
    """ProcessBench or PRMBench rows from a file or a folder of files (ProcessBench: one per
    split, the split named by the file), told apart by their fields."""
    splits: dict[str, list[StepExample]] = {}
    categories: dict[str, list[str]] = {}
    name = ""
    for file in _files(path):
        rows = read_rows(str(file), "", "train")
        if not len(rows):
            raise DataError(f"{file}: no rows")
        kind = "prmbench" if "modified_process" in rows[0] else "processbench"
        if name and kind != name:
            raise DataError(f"{file}: {kind} rows beside {name} rows in {path}")
        name = kind
        read = prmbench_example if kind == "prmbench" else processbench_example
        examples = [read(row, f"{file}: row {i + 1}") for i, row in enumerate(rows)]
        splits[file.stem] = examples
        categories[file.stem] = [str(row.get("classification", file.stem)) for row in rows] \
            if kind == "prmbench" else [file.stem] * len(rows)
    return BenchmarkRows(name, splits, categories)
