"""`igrpo score`: a reward model's score of every step of every solution in a file, and of each
solution under `rm.aggregate`, written beside each row's own fields; resumable, spread over the
ranks.

Input layouts, told apart by the first row's fields (every row must then fit the same one):

- Math-Shepherd: `input` (the question, then "Step k: ... ки" steps) and `label` (the same text,
  `+`/`-` in the tags' places);
- TRL stepwise: `prompt`, `completions` (the steps) and `labels`;
- ProcessBench: `problem`, `steps` and `label` (the first wrong step's index, -1: none);
- PRM800K: `question.problem` and `label.steps[].completions[]` (the solution
  process_supervision/formats.py reads: each step's chosen completion, up to the first wrong one);
- plain solutions: `question` and `solution` (text), the solution split into steps on
  `data.step_separator` (blank pieces are no steps); any other field rides along.

A layout's labels are read and checked as its reader checks them, and change no score. A bad row
stops the command, naming file, row and field, before any model loads.

Output, one JSON object per input row in the input's order: the row's own fields (a local JSONL
row as its line holds it, another file's as `datasets` reads it), then

- `step_scores`: the reward model's score of each step, in order (a step past `rm.max_length`
  gets none, so the list is shorter; `rm.kind=orm` scores the whole solution: one score);
- `score`: `rm.aggregate` (min, prod, last, mean) of `step_scores`; null where there is none;
- `best_of_n`: true on the row of highest `score` among the rows of its question (the same
  question text; ties: the first of them), false on the others: with several samples per
  question, the best-of-N pick;

fields of those names in the input are replaced. Where every row carries its question's known
`answer`, each solution is graded against it and the summary gains `best_of_n_curve`: rm@N, the
reward-weighted vote and maj@N at N = 1, 2, 4, ... with 95% intervals over the questions
(`reward_model.evaluate.best_of_n_curve`), also written as `bon_curve.md` and plotted in
`bon_curve.png` beside `summary.json`.

Resumable: the rows are scored in shards of `rm.score_shard_rows`, each written atomically under
`<run>/score/<input stem>/shards/<the model's fingerprint>/` with a digest of its rows (a shard whose rows changed since is
scored again); a killed run started again with the same command scores only the shards not
written, then writes the output. Each shard's batches are spread over the ranks
(`reward_model.score.spread_score`), so N processes write what one process writes.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from process_supervision.benchmarks import processbench_example
from process_supervision.formats import StepExample, example_from_row, prm800k_example
from reward_model.score import spread_score
from runtime.data import DataError, read_rows
from runtime.dist import barrier, broadcast_from_main, is_main
from runtime.rundir import atomic_write_json
from runtime.shards import map_chunks
from runtime.steps import split_steps

OUTPUT_FIELDS = ("step_scores", "score", "best_of_n")


def plain_example(row: dict, where: str, separator: str) -> StepExample:
    """A plain solution: `question` and `solution` text, its steps split on `separator`."""
    for name in ("question", "solution"):
        if not isinstance(row.get(name), str):
            raise DataError(f"{where}: field {name!r}: missing or not a string")
    steps = tuple(split_steps(row["solution"], separator))
    return StepExample(row["question"], steps, (0.0,) * len(steps), where)


def _math_shepherd(row: dict, where: str, tag: str, separator: str) -> StepExample:
    if not isinstance(row.get("input"), str):
        raise DataError(f"{where}: field 'input': missing or not a string")
    return example_from_row(row, where, tag)


def _trl(row: dict, where: str, tag: str, separator: str) -> StepExample:
    return example_from_row({k: v for k, v in row.items() if k != "input"}, where, tag)


# name: (whether a first row is of it, its reader(row, where, tag, separator) -> StepExample)
LAYOUTS: dict[str, tuple[Callable[[dict], bool], Callable[..., StepExample]]] = {
    "openrlhf": (lambda row: "input" in row and "value" in row
                 and not isinstance(row.get("label"), str),
                 lambda row, where, tag, sep: example_from_row(row, where, tag)),
    "rlhflow": (lambda row: "conversations" in row,
                lambda row, where, tag, sep: example_from_row(row, where, tag)),
    "math_shepherd": (lambda row: "input" in row, _math_shepherd),
    "trl": (lambda row: "completions" in row, _trl),
    "processbench": (lambda row: "problem" in row and "steps" in row,
                     lambda row, where, tag, sep: processbench_example(row, where)),
    "prm800k": (lambda row: isinstance(row.get("question"), dict),
                lambda row, where, tag, sep: prm800k_example(row, where)),
    "plain": (lambda row: "question" in row and "solution" in row,
              lambda row, where, tag, sep: plain_example(row, where, sep)),
}


def present(row: dict) -> dict:
    """The row's fields that hold a value (`datasets` gives every row each field some row has,
    None where it lacks it)."""
    return {k: v for k, v in row.items() if v is not None}


def detect_layout(row: dict, where: str) -> str:
    """The layout (a key of `LAYOUTS`) the row's fields name; `DataError` naming `where` if none."""
    row = present(row)
    for name, (fits, _) in LAYOUTS.items():
        if fits(row):
            return name
    raise DataError(f"{where}: no 'input'/'label' (Math-Shepherd), 'input'/'value' (OpenRLHF), "
                    "'prompt'/'completions'/'labels' (TRL), 'conversations' (RLHFlow), "
                    "'problem'/'steps'/'label' (ProcessBench), 'question'/'label.steps' "
                    "(PRM800K) or 'question'/'solution' (plain solutions) fields")


def table_rows(table, start: int, stop: int) -> list[dict]:
    """Rows start..stop-1 of a `datasets` table as dicts, read column by column once."""
    columns = table[start:stop]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def row_digest(example: StepExample) -> int:
    return zlib.crc32(json.dumps([example.question, example.steps]).encode())


@dataclass(frozen=True)
class ScoreInput:
    """A checked input file: its `datasets` table, its layout, and per row the question, the
    number of steps and a digest of question and steps."""

    path: str
    table: object
    layout: str
    tag: str
    separator: str
    questions: list[str]
    steps: list[int]
    digests: list[int]

    def __len__(self) -> int:
        return len(self.questions)

    def examples(self, start: int, stop: int) -> list[StepExample]:
        read = LAYOUTS[self.layout][1]
        return [read(present(row), f"{self.path}: row {i + 1}", self.tag, self.separator)
                for i, row in enumerate(table_rows(self.table, start, stop), start)]

    def digest(self, start: int, stop: int) -> int:
        return zlib.crc32(json.dumps(self.digests[start:stop]).encode())


def read_score_input(path: str, tag: str, separator: str, chunk_rows: int = 4096) -> ScoreInput:
    """The file's rows, every one parsed once (the ranks sharing the chunks, as
    `process_supervision.formats.read_step_rows` does) before any model loads: a bad row stops
    every rank with a `DataError` naming file, row and field."""
    table = read_rows(path, "", "train")
    if not len(table):
        raise DataError(f"{path}: no rows")
    layout = detect_layout(table_rows(table, 0, 1)[0], f"{path}: row 1")
    source = ScoreInput(path, table, layout, tag, separator, [], [], [])

    def check(chunk: int) -> list[tuple[str, int, int, str | None]]:
        start = chunk * chunk_rows
        stop = min(start + chunk_rows, len(table))
        read, out = LAYOUTS[layout][1], []
        for i, row in enumerate(table_rows(table, start, stop), start):
            try:
                ex = read(present(row), f"{path}: row {i + 1}", tag, separator)
                out.append((ex.question, len(ex.steps), row_digest(ex), None))
            except DataError as err:
                out.append(("", 0, 0, str(err)))
        return out

    checked = [r for part in map_chunks(-(-len(table) // chunk_rows), check) for r in part]
    bad = [error for *_, error in checked if error is not None]
    if bad:
        raise DataError(bad[0])
    for question, steps, digest, _ in checked:
        source.questions.append(question)
        source.steps.append(steps)
        source.digests.append(digest)
    return source


def aggregate_scores(aggregate: Callable, scores: list[float]) -> float | None:
    """`aggregate` (a `reward_model.losses.STEP_AGGREGATORS` entry) of one solution's step
    scores; None where no step was scored."""
    if not scores:
        return None
    return float(aggregate(torch.tensor([scores]), torch.ones(1, len(scores), dtype=torch.bool))[0])


def shard_paths(folder: Path, rows: int, shard_rows: int) -> list[tuple[int, int, Path]]:
    """(first row, row past the last, file) of each shard."""
    bounds = [(a, min(a + shard_rows, rows)) for a in range(0, rows, shard_rows)]
    return [(a, b, folder / f"rows-{a:09d}-{b:09d}.json") for a, b in bounds]


def model_fingerprint(path: str | Path) -> str:
    """What tells one reward model from another at the same path: its config and each weight
    file's name, size and modification time (a model trained again in place gets another);
    a hub id is its own fingerprint. The shards of a model live under it, so a resumed run never
    mixes two models' scores."""
    folder = Path(path)
    if not folder.is_dir():
        return f"{zlib.crc32(str(path).encode()):08x}"
    parts = [(folder / "config.json").read_bytes() if (folder / "config.json").exists() else b""]
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        stat = weights.stat()
        parts.append(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return f"{zlib.crc32(b'|'.join(parts)):08x}"


def _finished(path: Path, digest: int) -> bool:
    """Whether the shard file holds the scores of the rows whose digest is `digest`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))["digest"] == digest
    except (OSError, ValueError, KeyError, TypeError):
        return False


def score_shard(scorer, examples: list[StepExample], aggregate: Callable,
                transform: Callable | None = None) -> dict:
    """{"step_scores", "score"} of a shard's examples, scored over the ranks (every rank calls
    it); a solution with no step gets none. `transform`: examples -> what the reward model reads
    (`reward_model.examples.as_orm` for an ORM)."""
    kept = [ex for ex in examples if ex.steps]
    scored = iter(spread_score(scorer, transform(kept) if transform is not None else kept))
    step_scores = [next(scored) if ex.steps else [] for ex in examples]
    return {"step_scores": step_scores,
            "score": [aggregate_scores(aggregate, s) for s in step_scores]}


def score_in_shards(scorer, source: ScoreInput, folder: Path, shard_rows: int,
                    aggregate: Callable, transform: Callable | None = None,
                    progress: bool = True) -> None:
    """Score the rows not yet scored, a shard at a time, each shard written atomically to
    `folder` by the main rank as soon as it is scored. Every rank calls it."""
    shards = shard_paths(folder, len(source), shard_rows)
    todo = broadcast_from_main([k for k, (a, b, path) in enumerate(shards)
                                if not _finished(path, source.digest(a, b))])  # one view
    left = sum(shards[k][1] - shards[k][0] for k in todo)
    bar = tqdm(total=len(source), initial=len(source) - left, desc="score", unit="row",
               disable=not (progress and is_main()))
    for k in todo:
        a, b, path = shards[k]
        found = score_shard(scorer, source.examples(a, b), aggregate, transform)
        if is_main():
            atomic_write_json(path, {"rows": [a, b], "digest": source.digest(a, b), **found})
        bar.update(b - a)
    bar.close()
    barrier()


def read_shards(folder: Path, rows: int, shard_rows: int) -> tuple[list[list[float]], list]:
    """(step scores, score) of every row, from the shard files."""
    step_scores, scores = [], []
    for _, _, path in shard_paths(folder, rows, shard_rows):
        found = json.loads(path.read_text(encoding="utf-8"))
        step_scores += found["step_scores"]
        scores += found["score"]
    return step_scores, scores


def best_of_n(questions: list[str], scores: list[float | None]) -> list[bool]:
    """Per row: whether it is its question's pick, the highest score among the rows of the same
    question (ties: the first of them; rows without a score are never picked)."""
    best: dict[str, int] = {}
    for i, (question, score) in enumerate(zip(questions, scores)):
        if score is not None and (question not in best or score > scores[best[question]]):
            best[question] = i
    picked = set(best.values())
    return [i in picked for i in range(len(questions))]


def input_rows(source: ScoreInput, chunk_rows: int = 4096) -> Iterator[dict]:
    """The input's rows as the output carries them: a local JSONL file's lines as written
    (blank lines skipped, as `datasets` skips them), else the table's rows."""
    path = Path(source.path)
    if path.suffix == ".jsonl" and path.is_file():
        with open(path, encoding="utf-8") as handle:
            yield from (json.loads(line) for line in handle if line.strip())
        return
    for start in range(0, len(source), chunk_rows):
        yield from table_rows(source.table, start, min(start + chunk_rows, len(source)))


def _write_lines(path: Path, lines: Iterator[str]) -> None:
    """Write `lines` via a temp file + fsync + rename (`runtime.rundir.atomic_write_text`, without
    holding the whole file in memory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_scored(path: Path, source: ScoreInput, folder: Path, shard_rows: int) -> dict:
    """The output JSONL from the input's rows and the shards' scores (module docstring), and a
    summary: rows, questions, rows and steps scored, the mean score and the output's path."""
    step_scores, scores = read_shards(folder, len(source), shard_rows)
    picks = best_of_n(source.questions, scores)

    def lines() -> Iterator[str]:
        rows, count = input_rows(source), 0
        for found, score, pick, row in zip(step_scores, scores, picks, rows):
            count += 1
            row.update(step_scores=found, score=score, best_of_n=pick)
            yield json.dumps(row, ensure_ascii=False, default=str) + "\n"
        if count != len(source) or next(rows, None) is not None:  # the file changed meanwhile
            raise DataError(f"{source.path}: its rows changed while it was scored")

    _write_lines(path, lines())
    valid = [s for s in scores if s is not None]
    curve = answer_curve(source, scores)
    return {"input": source.path, "layout": source.layout, "rows": len(source),
            "questions": len(set(source.questions)), "rows_scored": len(valid),
            "steps_scored": sum(map(len, step_scores)),
            "mean_score": sum(valid) / len(valid) if valid else None, "output": str(path),
            **({"best_of_n_curve": curve} if curve else {})}


def write_curve(folder: Path, curve: dict) -> None:
    """`best_of_n_curve` as a table (`bon_curve.md`) and a plot (`bon_curve.png`) in `folder`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from reward_model.evaluate import BON_METHODS

    lines = ["| N | " + " | ".join(BON_METHODS) + " |", "| --- " * (len(BON_METHODS) + 1) + "|"]
    for n, row in curve.items():
        lines.append(f"| {n} | " + " | ".join(
            f"{m:.3f} [{lo:.3f}, {hi:.3f}]" for m, lo, hi in (row[k] for k in BON_METHODS))
            + " |")
    (folder / "bon_curve.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [int(n) for n in curve]
    for method in BON_METHODS:
        mean, lo, hi = zip(*(curve[str(n)][method] for n in ns))
        ax.plot(ns, mean, marker="o", label=method)
        ax.fill_between(ns, lo, hi, alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="N samples per question", ylabel="accuracy of the pick",
           title="best-of-N (95% intervals over questions)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "bon_curve.png", dpi=100)
    plt.close(fig)


def answer_curve(source: ScoreInput, scores: list[float | None],
                 chunk_rows: int = 4096) -> dict | None:
    """Where every row carries its question's known `answer`: each solution graded against it
    (its steps' text, `tasks.grading.grade`, its final answer extracted for the votes), and
    `reward_model.evaluate.best_of_n_curve` over the questions at N = 1, 2, 4, ... up to the
    largest question's samples (a row without a score ranks last). None without answers."""
    from reward_model.evaluate import best_of_n_curve
    from tasks.grading import extract_final_answer, grade

    groups: dict[str, list] = {}
    for start in range(0, len(source), chunk_rows):
        stop = min(start + chunk_rows, len(source))
        rows = table_rows(source.table, start, stop)
        for i, (row, example) in enumerate(zip(rows, source.examples(start, stop)), start):
            gold = row.get("answer")
            if gold is None:
                return None
            text = source.separator.join(example.steps)
            score = scores[i] if scores[i] is not None else float("-inf")
            groups.setdefault(source.questions[i], []).append(
                (grade(text, str(gold)), score, extract_final_answer(text)))
    largest = max(map(len, groups.values()))
    ns = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256) if n < largest] + [largest]
    return {str(n): v for n, v in best_of_n_curve(list(groups.values()), ns).items()}
