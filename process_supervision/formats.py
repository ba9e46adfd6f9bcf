"""PRM dataset formats: Math-Shepherd (native) and TRL's stepwise format, read and written, and
PRM800K's human labels, read.

Math-Shepherd rows hold `input` = the question followed by "Step 1: ... ки\\nStep 2: ... ки..." and
`label` = the same text with each tag replaced by `+` (the step can still reach the gold answer) or
`-`. Soft estimates ride along as `soft_labels` (a fraction in [0, 1] per step). TRL rows hold
`prompt`, `completions` (a list of steps) and `labels` (bools, or numbers in [0, 1] kept as soft
targets). OpenRLHF's rows hold the tagged `input` and `value`, one label per tag ("+"/"-" or a
number in [0, 1], kept soft: ER-PRM's data). RLHFlow's rows hold `conversations`: a user turn per
step (the first also the question, before "Step 1:" or the row's `prompt`) each followed by an
assistant turn "+" or "-".

PRM800K (Lightman et al. 2023) rows hold `question` ({`problem`, `ground_truth_answer`}) and
`label.steps[]`, each with `completions[]` of {`text`, `rating`} (-1, 0, 1) and the
`chosen_completion` the labeller went on with. A row becomes one solution: each step's chosen
completion (else the labeller's own `human_completion`, else the first one rated -1, else a
step's only completion), rating 1 -> right, -1 -> wrong, 0 (neutral) -> `neutral` (1.0 by
default: a neutral step counts as right, as the common binary readings of PRM800K do, OpenR's
among them); the solution stops at its first wrong step, as Lightman et al. supervise only up to
the first mistake.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.data import DataError

STEP_TAG = "ки"
GOOD, BAD = "+", "-"


@dataclass(frozen=True)
class StepExample:
    """One solution with a label per step (hard 0/1 or soft fractions)."""

    question: str
    steps: tuple[str, ...]
    labels: tuple[float, ...]
    source_id: str = ""


def to_math_shepherd(question: str, steps: list[str] | tuple[str, ...],
                     labels: list[float] | tuple[float, ...] | None = None,
                     tag: str = STEP_TAG) -> tuple[str, str | None]:
    """(input text with tags, label text with +/- in their place); a label >= 0.5 is `+`."""
    # A tag inside model-written text would fake a step position (and a reward): drop it.
    clean = [step.replace(tag, "").strip() for step in steps]

    def render(marks: list[str]) -> str:
        body = [f"Step {k + 1}: {step} {mark}" for k, (step, mark) in enumerate(zip(clean, marks))]
        return f"{question.replace(tag, '').strip()} " + "\n".join(body)

    text = render([tag] * len(steps))
    if labels is None:
        return text, None
    return text, render([GOOD if y >= 0.5 else BAD for y in labels])


def parse_math_shepherd(input_text: str, label_text: str, tag: str = STEP_TAG,
                        where: str = "") -> tuple[str, tuple[str, ...], tuple[float, ...]]:
    """Invert `to_math_shepherd`: (question, steps, hard labels); errors name `where`."""
    pieces = input_text.split(tag)
    if len(pieces) < 2:
        raise DataError(f"{where}: field 'input': no step tag {tag!r}")
    labels, pos = [], 0
    for k, piece in enumerate(pieces[:-1]):
        if label_text[pos:pos + len(piece)] != piece:
            raise DataError(f"{where}: field 'label': text differs from 'input' before tag {k + 1}"
                            f" ({len(pieces) - 1} tags in 'input')")
        mark = label_text[pos + len(piece):pos + len(piece) + 1]
        if mark not in (GOOD, BAD):
            raise DataError(f"{where}: field 'label': expected '+' or '-' at tag {k + 1} of "
                            f"{len(pieces) - 1}, found {mark!r}")
        labels.append(1.0 if mark == GOOD else 0.0)
        pos += len(piece) + 1
    if label_text[pos:] != pieces[-1]:
        raise DataError(f"{where}: field 'label': tag count does not match 'input' "
                        f"({len(pieces) - 1} tags in 'input')")
    question, steps = _question_and_steps(pieces[:-1])
    return question, steps, tuple(labels)


def _question_and_steps(pieces: list[str]) -> tuple[str, tuple[str, ...]]:
    """The question and the steps of a tagged text's pieces (the text before each tag): the
    question is what precedes "Step 1:", each step its piece less its "Step k:"."""
    question, steps = "", []
    for k, piece in enumerate(pieces):
        head, found, step = piece.partition(f"Step {k + 1}:")
        if k == 0:
            question = head if found else ""
        steps.append((step if found else piece).strip())
    return question.strip(), tuple(steps)


def example_from_row(row: dict, where: str, tag: str = STEP_TAG,
                     use_soft: bool = False) -> StepExample:
    """A StepExample from a row of any layout the module reads (its docstring); with
    `use_soft`, a Math-Shepherd row's labels are its soft estimates."""
    if row.get("input") is not None and row.get("value") is not None \
            and not isinstance(row.get("label"), str):
        return _value_example(row, where, tag)
    if row.get("conversations") is not None:
        return _chat_example(row, where)
    if "input" in row:
        for name in ("input", "label"):
            if not isinstance(row.get(name), str):
                raise DataError(f"{where}: field {name!r}: missing or not a string")
        question, steps, labels = parse_math_shepherd(row["input"], row["label"], tag, where)
        soft = row.get("soft_labels")
        if soft is not None and use_soft:
            if not isinstance(soft, list) or len(soft) != len(steps):
                raise DataError(f"{where}: field 'soft_labels': expected {len(steps)} numbers, "
                                f"one per step tag")
            if any(not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in soft):
                raise DataError(f"{where}: field 'soft_labels': values must lie in [0, 1]")
            labels = tuple(float(v) for v in soft)
        return StepExample(question, steps, labels, row.get("source_id") or where)
    if "completions" in row:
        prompt, steps, labels = row.get("prompt"), row.get("completions"), row.get("labels")
        if not isinstance(prompt, str):
            raise DataError(f"{where}: field 'prompt': missing or not a string")
        if not isinstance(steps, list) or not isinstance(labels, list):
            raise DataError(f"{where}: fields 'completions'/'labels': expected lists")
        if len(steps) != len(labels):
            raise DataError(f"{where}: field 'labels': {len(labels)} labels for "
                            f"{len(steps)} steps")
        if not all(isinstance(step, str) for step in steps):
            raise DataError(f"{where}: field 'completions': expected a list of strings")
        return StepExample(prompt, tuple(steps), _step_labels(labels, "labels", where), where)
    if isinstance(row.get("label"), dict) and isinstance(row.get("question"), dict):
        return prm800k_example(row, where)
    raise DataError(f"{where}: no 'input'/'label' (Math-Shepherd), 'input'/'value' (OpenRLHF), "
                    "'prompt'/'completions'/'labels' (TRL), 'conversations' (RLHFlow) or "
                    "'question'/'label.steps' (PRM800K) fields")


def _step_labels(values, field: str, where: str) -> tuple[float, ...]:
    """Step labels as floats: a bool or "+"/"-" is 1 or 0, a number in [0, 1] is kept as it
    is (a soft target: a Math-Shepherd estimate, ER-PRM's values), anything else an error
    naming the field and the step."""
    out = []
    for k, v in enumerate(values):
        if isinstance(v, str) and v in (GOOD, BAD):
            out.append(1.0 if v == GOOD else 0.0)
        elif isinstance(v, (bool, int, float)) and 0 <= v <= 1:
            out.append(float(v))
        else:
            raise DataError(f"{where}: field {field!r}, step {k + 1}: {v!r}; expected a bool, "
                            f"'{GOOD}'/'{BAD}' or a number in [0, 1]")
    return tuple(out)


def _value_example(row: dict, where: str, tag: str) -> StepExample:
    """OpenRLHF's process-reward layout: `input` the tagged text, `value` one label per tag
    ("+"/"-" or a number in [0, 1], kept soft)."""
    text, values = row["input"], row["value"]
    if not isinstance(text, str):
        raise DataError(f"{where}: field 'input': not a string")
    pieces = text.split(tag)
    if len(pieces) < 2:
        raise DataError(f"{where}: field 'input': no step tag {tag!r}")
    if not isinstance(values, list) or len(values) != len(pieces) - 1:
        raise DataError(f"{where}: field 'value': expected a list of {len(pieces) - 1} labels, "
                        f"one per step tag in 'input'")
    question, steps = _question_and_steps(pieces[:-1])
    return StepExample(question, steps, _step_labels(values, "value", where),
                       row.get("source_id") or where)


def _chat_example(row: dict, where: str) -> StepExample:
    """RLHFlow's chat layout: `conversations` alternates a user turn holding a step (the first
    one the question, then "Step 1:" and the step; or the row's `prompt` then the step) and an
    assistant turn holding its label, "+" or "-"."""
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns or len(turns) % 2:
        raise DataError(f"{where}: field 'conversations': expected user and assistant turns "
                        "in pairs")
    texts = []
    for k, turn in enumerate(turns):
        role = "user" if k % 2 == 0 else "assistant"
        if not isinstance(turn, dict) or turn.get("role") != role \
                or not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: field 'conversations[{k}]': expected a turn of role "
                            f"{role!r} with a string 'content'")
        texts.append(turn["content"])
    pieces, prompt = texts[0::2], row.get("prompt")
    question, steps = _question_and_steps(pieces)
    if isinstance(prompt, str) and prompt and pieces[0].startswith(prompt):
        first = pieces[0][len(prompt):].strip()
        head, found, rest = first.partition("Step 1:")
        question = prompt.strip()
        steps = (rest.strip() if found and not head.strip() else first, *steps[1:])
    elif "Step 1:" not in pieces[0]:
        raise DataError(f"{where}: field 'conversations[0]': the question and the first step "
                        "cannot be told apart (no 'Step 1:' in it, and no 'prompt' field it "
                        "starts with)")
    labels = _step_labels([t.strip() for t in texts[1::2]], "conversations", where)
    return StepExample(question, steps, labels, row.get("source_id") or where)


def prm800k_example(row: dict, where: str, neutral: float = 1.0) -> StepExample:
    """One PRM800K row as a labelled solution (the module's docstring says how)."""
    question, label = row.get("question"), row.get("label")
    if not isinstance(question, dict) or not isinstance(question.get("problem"), str):
        raise DataError(f"{where}: field 'question.problem': missing or not a string")
    if not isinstance(label, dict) or not isinstance(label.get("steps"), list):
        raise DataError(f"{where}: field 'label.steps': missing or not a list")
    steps, labels = [], []
    for k, step in enumerate(label["steps"]):
        chosen = _chosen_completion(step, f"{where}: field 'label.steps[{k}]'")
        if chosen is None:
            break
        text, rating = chosen
        steps.append(text)
        labels.append({1: 1.0, 0: neutral, -1: 0.0}[rating])
        if rating == -1:
            break
    if not steps:
        raise DataError(f"{where}: field 'label.steps': no rated step")
    return StepExample(question["problem"], tuple(steps), tuple(labels), where)


def _chosen_completion(step, where: str) -> tuple[str, int] | None:
    """(text, rating) of the completion the labeller went on with, the first wrong one where
    none was chosen, or the human's own completion; None where the step holds nothing rated."""
    if not isinstance(step, dict) or not isinstance(step.get("completions"), list):
        raise DataError(f"{where}.completions: missing or not a list")
    rated = []
    for j, completion in enumerate(step["completions"]):
        text = completion.get("text") if isinstance(completion, dict) else None
        rating = completion.get("rating") if isinstance(completion, dict) else None
        if not isinstance(text, str) or rating not in (-1, 0, 1):
            raise DataError(f"{where}.completions[{j}]: expected 'text' and a 'rating' of "
                            f"-1, 0 or 1, found {completion!r}"[:300])
        rated.append((text, rating))
    chosen = step.get("chosen_completion")
    if isinstance(chosen, int) and 0 <= chosen < len(rated):
        return rated[chosen]
    human = step.get("human_completion")
    if isinstance(human, dict) and isinstance(human.get("text"), str):
        return human["text"], 1
    wrong = [r for r in rated if r[1] == -1]
    return wrong[0] if wrong else (rated[0] if len(rated) == 1 else None)


class StepRows(Sequence):
    """The labelled rows of a stepwise file as a sequence of `StepExample`s, each parsed when it
    is read from the memory-mapped Arrow table `datasets` keeps of the file: every rank of a
    run shares the table's pages instead of holding its own Python copy (445K Math-Shepherd
    rows are gigabytes as Python strings). `questions[i]` and `lengths[i]` are row i's
    question and characters (grouping by question or by length, and the validation split, read
    them without parsing again); `view` indexes a subset of the rows and `map` applies a
    function to each example as it is read (the ORM's form)."""

    def __init__(self, table, where: str, tag: str, use_soft: bool, indices: list[int],
                 questions: list[str], lengths: list[int], transform=None):
        self.table, self.where, self.tag, self.use_soft = table, where, tag, use_soft
        self.indices, self.questions, self.lengths = indices, questions, lengths
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        row = self.indices[i]
        example = example_from_row(self.table[row], f"{self.where}: row {row + 1}", self.tag,
                                   self.use_soft)
        return self.transform(example) if self.transform is not None else example

    def view(self, positions: list[int]) -> "StepRows":
        return StepRows(self.table, self.where, self.tag, self.use_soft,
                        [self.indices[k] for k in positions],
                        [self.questions[k] for k in positions],
                        [self.lengths[k] for k in positions], self.transform)

    def map(self, transform) -> "StepRows":
        return StepRows(self.table, self.where, self.tag, self.use_soft, self.indices,
                        self.questions, self.lengths, transform)


def read_step_rows(path: str, tag: str = STEP_TAG, split: str = "train",
                   skip_bad_rows: bool = False, use_soft: bool = False,
                   chunk_rows: int = 4096) -> tuple[StepRows, int]:
    """(rows, rows skipped) of a Math-Shepherd/TRL/PRM800K file or hub id, read once through
    `datasets` and checked before any training: every row is parsed once, the ranks sharing the
    chunks (`runtime.shards`), keeping only its question; a bad row stops every rank naming file,
    row and field (or is skipped with `skip_bad_rows`)."""
    from runtime.data import read_rows
    from runtime.shards import map_chunks

    table = read_rows(path, "", split)
    n = len(table)

    def check(chunk: int) -> list[tuple[int, str, int, str | None]]:
        start = chunk * chunk_rows
        columns = table[start:start + chunk_rows]  # one read of the chunk, column by column
        out = []
        for row, values in enumerate(zip(*columns.values()), start):
            try:
                ex = example_from_row(dict(zip(columns, values)), f"{path}: row {row + 1}", tag,
                                      use_soft)
                out.append((row, ex.question, len(ex.question) + sum(map(len, ex.steps)), None))
            except DataError as err:
                out.append((row, "", 0, str(err)))
        return out

    checked = [r for part in map_chunks(-(-n // chunk_rows), check) for r in part]
    bad = [error for *_, error in checked if error is not None]
    if bad and not skip_bad_rows:
        raise DataError(bad[0])
    kept = [r for r in checked if r[3] is None]
    return StepRows(table, path, tag, use_soft, [r[0] for r in kept], [r[1] for r in kept],
                    [r[2] for r in kept]), len(bad)


def write_math_shepherd_jsonl(path: Path, examples: list[StepExample], tag: str = STEP_TAG,
                              soft_labels: list[tuple[float, ...]] | None = None) -> None:
    """Write examples as Math-Shepherd JSONL (the +/- text from `labels`, plus `soft_labels`
    when given), atomically."""
    import json

    from runtime.rundir import atomic_write_text

    lines = []
    for i, ex in enumerate(examples):
        text, label = to_math_shepherd(ex.question, ex.steps, ex.labels, tag)
        row = {"input": text, "label": label, "source_id": ex.source_id}
        if soft_labels is not None:
            row["soft_labels"] = list(soft_labels[i])
        lines.append(json.dumps(row, ensure_ascii=False))
    atomic_write_text(Path(path), "\n".join(lines) + "\n")
