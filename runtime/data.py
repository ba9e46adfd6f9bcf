"""Math question sets mapped to one internal record: GSM8K, MATH / MATH-500, and the synthetic task.

Files and hub ids are read with `datasets`; every row is checked, and a malformed one stops loading
with an error naming the file, the row (1-based, as an editor shows JSONL lines) and the field, or is
skipped and counted when the caller asks for that.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from tasks import synthetic
from tasks.grading import extract_boxed
from runtime.seeds import derive_seed

BUNDLED = Path(__file__).resolve().parent / "bundled"
GSM8K_TRAIN = BUNDLED / "gsm8k" / "train.jsonl"
GSM8K_TEST = BUNDLED / "gsm8k" / "test.jsonl"
MATH500_TEST = BUNDLED / "math500" / "test.jsonl"
_CALCULATOR_NOTE = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class MathRecord:
    question: str
    answer: str
    """Gold final answer, as text."""
    solution_steps: tuple[str, ...]
    """Reference solution split into steps; the last one states the final answer."""
    source_id: str
    """Where the record came from: `<file or hub id>:<row>` or `synthetic:<seed>:<index>`."""


class DataError(ValueError):
    """A data row that does not fit the expected schema; the message names file, row and field."""


@dataclass
class LoadReport:
    rows: int = 0
    skipped: int = 0
    first_error: str = ""


def _str_field(row: dict, name: str, where: str) -> str:
    if name not in row or row[name] is None:
        raise DataError(f"{where}: field {name!r}: missing")
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {name!r}: empty")
    return value


@dataclass(frozen=True)
class Fields:
    """Which row fields hold the question, the gold answer and the worked solution; empty = the
    layout's own names (`data.question_field`, `answer_field`, `solution_field`)."""

    question: str = ""
    answer: str = ""
    solution: str = ""


def _answer_field(row: dict, name: str, where: str) -> str:
    """A plain gold answer: text, or a number written as text."""
    value = row.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return _str_field(row, name, where).strip()


def gsm8k_record(row: dict, where: str, fields: Fields = Fields()) -> MathRecord:
    """GSM8K layout: a worked solution, one step a line, ending `#### N`."""
    question = _str_field(row, fields.question or "question", where)
    solution_name = fields.solution or "answer"
    if fields.answer:  # the answer stands alone; a solution is optional
        answer = _answer_field(row, fields.answer, where).replace(",", "")
        solution = row.get(solution_name) if isinstance(row.get(solution_name), str) else ""
        body = solution.rpartition("####")[0] if "####" in solution else solution
    else:
        solution = _str_field(row, solution_name, where)
        body, sep, final = solution.rpartition("####")
        answer = final.strip().replace(",", "")
        if not sep or not answer:
            raise DataError(f"{where}: field {solution_name!r}: no final '#### N' answer")
    steps = [_CALCULATOR_NOTE.sub("", line).strip() for line in body.strip().splitlines()]
    steps = [s for s in steps if s]
    steps = steps + [f"{synthetic.ANSWER_PREFIX}{answer}"] if steps else []
    return MathRecord(question, answer, tuple(steps), where)


def split_latex_steps(solution: str) -> list[str]:
    """MATH solutions are paragraphs: split on blank lines and sentence ends outside `$...$`."""
    steps: list[str] = []
    for para in re.split(r"\n\s*\n", solution.strip()):
        start, in_math = 0, False
        for i, ch in enumerate(para):
            if ch == "$":
                in_math = not in_math
            elif ch == "." and not in_math and para[i + 1:i + 3].startswith((" ", "\n")) \
                    and para[i + 1:].strip()[:1].isupper():
                steps.append(para[start:i + 1].strip())
                start = i + 1
        if para[start:].strip():
            steps.append(para[start:].strip())
    return steps


def math_record(row: dict, where: str, fields: Fields = Fields()) -> MathRecord:
    """MATH layout: a LaTeX solution with the final answer in `\\boxed{}` (or an answer field)."""
    question = _str_field(row, fields.question or "problem", where)
    solution_name, answer_name = fields.solution or "solution", fields.answer or "answer"
    if fields.answer:  # the answer stands alone; a solution is optional
        solution = row.get(solution_name) if isinstance(row.get(solution_name), str) else ""
    else:
        solution = _str_field(row, solution_name, where)
    if row.get(answer_name) is not None:
        answer = _answer_field(row, answer_name, where)
    else:
        answer = extract_boxed(solution) or ""
        if not answer:
            raise DataError(f"{where}: field {solution_name!r}: no \\boxed{{}} answer and no "
                            f"{answer_name!r} field")
    source = str(row.get("unique_id") or where)
    steps = split_latex_steps(solution) if solution.strip() else []
    return MathRecord(question, answer.strip(), tuple(steps), source)


RECORD_BUILDERS = {"gsm8k": gsm8k_record, "math": math_record}


def _datasets_rows(path: str, hub_config: str, split: str):
    """Rows of a local JSONL/JSON/parquet file or a hub dataset, read by `datasets`."""
    import datasets

    local = Path(path)
    if local.exists():
        builder = "parquet" if local.suffix == ".parquet" else "json"
        return datasets.load_dataset(builder, data_files=str(local), split="train")
    return datasets.load_dataset(path, hub_config or None, split=split)


def _locate_bad_jsonl_row(path: Path, err: Exception | None) -> DataError | None:
    """The first line of a JSON Lines file that is not a JSON object of the first row's types
    (None if every line is fine and `err` is None)."""
    first_keys: set[str] | None = None
    first_types: dict[str, type] = {}
    with open(path, "rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            where = f"{path}: row {lineno}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as bad:
                return DataError(f"{where}: not valid UTF-8 ({bad.reason} at byte {bad.start})")
            except json.JSONDecodeError as bad:
                return DataError(f"{where}: not valid JSON ({bad.msg})")
            if not isinstance(row, dict):
                return DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            if first_keys is None:
                first_keys = set(row)
                first_types = {k: type(v) for k, v in row.items()}
                continue
            for key, value in row.items():
                expected = first_types.get(key)
                if expected is not None and value is not None and not isinstance(value, expected):
                    return DataError(f"{where}: field {key!r}: expected {expected.__name__}, "
                                     f"got {type(value).__name__}")
    return None if err is None else DataError(f"{path}: could not be read: {err}")


def read_rows(path: str, hub_config: str = "", split: str = "train"):
    """Rows of a file or hub id via `datasets`.

    A local JSON Lines file is first scanned line by line, so a truncated row, bad UTF-8 or a value
    whose type differs from the first row's is named (file, row, field) instead of failing deep in
    pyarrow or being silently cast (`datasets` turns "3" into 3 when a later row holds an int)."""
    local_jsonl = Path(path).suffix == ".jsonl" and Path(path).exists()
    if local_jsonl:
        problem = _locate_bad_jsonl_row(Path(path), None)
        if problem is not None:
            raise problem
    try:
        return _datasets_rows(path, hub_config, split)
    except Exception as err:  # datasets raises many types for a malformed file
        if Path(path).suffix == ".json" and Path(path).exists():
            raise _locate_bad_jsonl_row(Path(path), err) or \
                DataError(f"{path}: could not be read: {err}") from err
        raise DataError(f"{path}: could not be read: {err}") from err


def load_records(path: str, schema: str, *, split: str = "test", hub_config: str = "",
                 skip_bad_rows: bool = False, limit: int | None = None,
                 report: LoadReport | None = None, fields: Fields = Fields()) -> list[MathRecord]:
    """Load GSM8K-layout (`schema='gsm8k'`) or MATH-layout (`schema='math'`) records from a file
    or hub id, reading the question, answer and solution from `fields`."""
    build = RECORD_BUILDERS[schema]
    report = report if report is not None else LoadReport()
    rows = read_rows(path, hub_config, split)
    records: list[MathRecord] = []
    for index, row in enumerate(rows):
        where = f"{path}: row {index + 1}"
        try:
            records.append(build(row, where, fields))
        except DataError as err:
            if not skip_bad_rows:
                raise
            report.skipped += 1
            report.first_error = report.first_error or str(err)
        if limit is not None and len(records) >= limit:
            break
    report.rows = len(records)
    return records


def synthetic_records(seed: int, count: int, min_ops: int, max_ops: int, offset: int = 0,
                      slip_share: float = 0.0,
                      operations: str = synthetic.OPERATIONS) -> list[MathRecord]:
    """`count` synthetic problems; with `slip_share`, that share of them (a seeded draw) carry the
    worked solution of a student who forgets to carry and borrow, under the gold answer."""
    problems = synthetic.make_problems(seed, count + offset, min_ops, max_ops,
                                       operations)[offset:]
    slips = random.Random(derive_seed(seed, "slips"))
    records = []
    for i, p in enumerate(problems):
        steps = synthetic.carry_slip_solution(p) if slips.random() < slip_share else p.steps
        records.append(MathRecord(p.question, str(p.answer), steps, f"synthetic:{seed}:{offset + i}"))
    return records


@dataclass(frozen=True)
class Splits:
    sft: list[MathRecord]
    """Fixed, limited set of worked solutions for the SFT warm start."""
    rl: list[MathRecord]
    """Questions with gold answers for RL (their solutions are not used for training)."""
    eval: list[MathRecord]
    """Held-out questions."""
    val: list[MathRecord]
    """Questions for choosing the SFT checkpoint (`data.val_questions`; the held-out ones if 0)."""


def step_oracle(data):
    """The step oracle of a `DataConfig`'s questions, (question, steps) -> is each step still
    on the true path: the synthetic task's `synthetic.step_correctness`; None for data without
    one (GSM8K, MATH: their reference solutions are one way among many)."""
    return synthetic.step_correctness if data.source == "synthetic" else None


def load_splits(data, seed: int, worked_questions: int | None = None) -> Splits:
    """The three disjoint splits a run uses, from a `DataConfig`. Real data: the first
    `worked_questions` (default `data.sft_questions`) training questions form the SFT split and
    stay out of the RL pool (`iteration.resolve.Resolved.splits` sets it from the run's config)."""
    if data.source == "synthetic":
        # Distinct seeds per split; held-out questions that also occur in training are dropped.
        ops = data.operations
        sft = synthetic_records(derive_seed(seed, "sft-questions"), data.sft_questions,
                                data.min_ops, data.sft_max_ops or data.max_ops,
                                slip_share=data.sft_slip_share, operations=ops)
        rl = synthetic_records(derive_seed(seed, "rl-questions"), data.rl_questions,
                               data.min_ops, data.max_ops, operations=ops)
        seen = {r.question for r in sft} | {r.question for r in rl}
        wanted = data.eval_questions + data.val_questions
        pool = synthetic_records(derive_seed(seed, "held-out-questions"), wanted * 2,
                                 data.min_ops, data.max_ops, operations=ops)
        unseen = [r for r in pool if r.question not in seen]
        held_out = unseen[:data.eval_questions]
        held_questions = {r.question for r in held_out}
        val = [r for r in unseen[data.eval_questions:] if r.question not in held_questions]
        return Splits(sft, rl, held_out, val[:data.val_questions] or held_out)
    # Shipped copies: GSM8K trains on its train split and is scored on test; MATH-500 is a test
    # set only, so without data.path it serves both (its held-out questions are removed below).
    default_train = GSM8K_TRAIN if data.source == "gsm8k" else MATH500_TEST
    default_eval = GSM8K_TEST if data.source == "gsm8k" else MATH500_TEST
    fields = Fields(data.question_field, data.answer_field, data.solution_field)
    train = load_records(data.path or str(default_train), data.source, split="train",
                         hub_config=data.hub_config, skip_bad_rows=data.skip_bad_rows,
                         fields=fields)
    held_out = load_records(data.eval_path or str(default_eval), data.source, split="test",
                            hub_config=data.hub_config, skip_bad_rows=data.skip_bad_rows,
                            limit=data.eval_questions, fields=fields)
    held_questions = {r.question for r in held_out}
    train = [r for r in train if r.question not in held_questions]
    worked = data.sft_questions if worked_questions is None else worked_questions
    n_val = min(data.val_questions, max(0, len(train) - worked - 1))
    val, train = (train[len(train) - n_val:], train[:len(train) - n_val]) if n_val else ([], train)
    return Splits(train[:worked], train[worked:] or train, held_out, val or held_out)

