"""Traces of every rollout: each GRPO step's samples with what the update did with them.

`<stage>/trace/step-NNNNNN.parquet`, one row per sample (columns: `TRACE_COLUMNS`), written by
the main rank from every rank's rows after the step's update; `datasets.load_dataset("parquet",
data_files=".../trace/*.parquet")` and `pandas.read_parquet(".../trace")` read them as they are.
A resumed stage rewrites the steps it redoes (one file a step, replaced atomically) and drops
files past its saved state first, so no step's rows are lost or repeated. `igrpo inspect
TRACE_DIR` writes one static HTML page beside them to browse them (`render_trace_page`).
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

import torch

from policy.inspection import advantage_colour

TRACE_COLUMNS = (
    "step", "question_id", "question", "group", "sample", "completion", "correct", "reward",
    "kept", "tokens", "token_advantages", "step_ends", "step_scores", "step_values",
    "step_advantages", "sampler_logprobs", "trainer_logprobs")
"""step (1-based), the question's id and text, its group in the step and the sample's index in
it, the completion's text and the exact check's verdict, the solution reward, whether the sample
was in the loss; per completion token its text and advantage; per reward step (process rewards)
its last token, reward-model score, normalised value and the advantage of its first token; per
token the sampler's log-prob (vLLM) and the trainer's (the update's first pass), where known."""


def trace_rows(step: int, records, rollout, scores, rewards: torch.Tensor, advantages: torch.Tensor,
               normalised: torch.Tensor, keep: torch.Tensor, tokenizer, first_group: int = 0,
               trainer_logprobs: torch.Tensor | None = None) -> list[dict]:
    """This rank's rows of a step: `records` its questions (one a group), `advantages` [N, T]
    what the loss received, `normalised` the values they came from ([N, S] process, [N, S + 1]
    anchored, [N, 1] outcome), `first_group` the index of its first group in the step."""
    size = rollout.group_size
    # one copy to the CPU, not a device read per value
    advantages, normalised, keep, rewards = (t.detach().float().cpu() for t in
                                             (advantages, normalised, keep, rewards))
    scores = scores.to("cpu")
    sampler = None if rollout.sampler_logprobs is None else rollout.sampler_logprobs.float().cpu()
    if trainer_logprobs is not None:
        trainer_logprobs = trainer_logprobs.detach().float().cpu()
    rollout = rollout.to("cpu")
    lengths = rollout.completion_mask.sum(-1).long().tolist()
    ids = [rollout.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)]
    pieces = tokenizer.batch_decode([[t] for row in ids for t in row], skip_special_tokens=False)
    rows, at = [], 0
    for i, n in enumerate(lengths):
        tokens, at = pieces[at:at + n], at + n
        ends = scores.step_end_index[i][scores.step_mask[i]].tolist() \
            if scores.step_end_index is not None else []
        starts = [0] + [e + 1 for e in ends[:-1]]
        rows.append({
            "step": step, "question_id": records[i // size].source_id,
            "question": records[i // size].question, "group": first_group + i // size,
            "sample": i % size, "completion": rollout.texts[i],
            "correct": None if scores.correct is None else bool(scores.correct[i]),
            "reward": float(rewards[i]), "kept": bool(keep[i]), "tokens": tokens,
            "token_advantages": advantages[i, :n].float().tolist(), "step_ends": ends,
            "step_scores": scores.step_rewards[i][scores.step_mask[i]].float().tolist()
            if scores.step_rewards is not None else [],
            "step_values": normalised[i, :len(ends) or 1].float().tolist(),
            "step_advantages": [float(advantages[i, s]) for s in starts if s < n],
            "sampler_logprobs": None if sampler is None else sampler[i, :n].float().tolist(),
            "trainer_logprobs": None if trainer_logprobs is None
            else trainer_logprobs[i, :n].float().tolist()})
    return rows


def write_trace(folder: Path, step: int, rows: list[dict]) -> Path:
    """`<folder>/step-NNNNNN.parquet`, replaced atomically (a resumed step rewrites its file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:06d}.parquet"
    partial = path.with_name(path.name + ".partial")
    pq.write_table(pa.Table.from_pylist([{c: r[c] for c in TRACE_COLUMNS} for r in rows],
                                        schema=trace_schema()), partial, compression="zstd")
    os.replace(partial, path)
    return path


def trace_schema():
    """The columns' types, fixed: every step's file reads as one table with the others' (a step
    without a trainer's pass or a sampler's log-probs has nulls there, not another type)."""
    import pyarrow as pa

    floats, texts = pa.list_(pa.float32()), pa.list_(pa.string())
    types = {"step": pa.int64(), "question_id": pa.string(), "question": pa.string(),
             "group": pa.int64(), "sample": pa.int64(), "completion": pa.string(),
             "correct": pa.bool_(), "reward": pa.float64(), "kept": pa.bool_(), "tokens": texts,
             "token_advantages": floats, "step_ends": pa.list_(pa.int64()),
             "step_scores": floats, "step_values": floats, "step_advantages": floats,
             "sampler_logprobs": floats, "trainer_logprobs": floats}
    return pa.schema([(name, types[name]) for name in TRACE_COLUMNS])


def drop_steps_after(folder: Path, step: int) -> None:
    """Remove trace files of steps past `step` (a resumed stage redoes them)."""
    if folder.is_dir():
        for path in folder.glob("step-*.parquet*"):
            if int(path.name[5:11]) > step:
                path.unlink()


def read_trace(folder: Path) -> list[dict]:
    """Every row of a trace folder, steps in order."""
    import pyarrow.parquet as pq

    files = sorted(Path(folder).glob("step-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{folder}: no trace files (step-*.parquet); a GRPO stage "
                                "writes them to <stage>/trace/ with inspect.trace=true")
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def render_trace_page(rows: list[dict], title: str) -> str:
    """One static page (no server): a step picker, each step's groups with every sample's tokens
    coloured by advantage (green > 0, red < 0) and its steps' scores, and a filter for the
    samples the update pushed up although their answer is wrong (mean token advantage > 0,
    `class="pushed-wrong"`)."""
    scale = max([abs(a) for r in rows for a in r["token_advantages"]] + [1e-9])
    steps = sorted({r["step"] for r in rows})
    out = ["<!doctype html><meta charset='utf-8'><title>", html.escape(title), "</title><style>",
           "body{font-family:monospace;margin:1em} .s{margin:.4em 0;padding:.4em;border:1px solid "
           "#ccc} .t{white-space:pre-wrap} .end{color:#36c;font-weight:bold} .g{margin:1em 0} "
           "body.only-wrong .s:not(.pushed-wrong){display:none} .step{display:none} "
           ".step.on{display:block}</style>",
           f"<h2>{html.escape(title)}</h2><p>{len(rows)} samples over {len(steps)} steps; tokens "
           f"coloured by advantage (full colour at |A| = {scale:.3f}). Step <select id='pick' "
           "onchange='show(this.value)'>",
           *[f"<option value='{s}'>{s}</option>" for s in steps],
           "</select> <label><input type='checkbox' id='wrong' onchange=\"document.body."
           "classList.toggle('only-wrong', this.checked)\"> only wrong answers pushed up</label>"
           "</p>"]
    for s in steps:
        out.append(f"<div class='step' id='step-{s}'>")
        by_group: dict[int, list[dict]] = {}
        for r in rows:
            if r["step"] == s:
                by_group.setdefault(r["group"], []).append(r)
        for g, samples in sorted(by_group.items()):
            out.append(f"<div class='g'><b>group {g}: {html.escape(samples[0]['question_id'])}"
                       f"</b> <i>{html.escape(samples[0]['question'])}</i>")
            for r in sorted(samples, key=lambda r: r["sample"]):
                out.append(_sample_html(r, scale))
            out.append("</div>")
        out.append("</div>")
    out.append("<script>function show(s){for(const d of document.querySelectorAll('.step'))"
               "d.classList.toggle('on', d.id==='step-'+s)} show("
               f"{json.dumps(str(steps[0]) if steps else '')});</script>")
    return "".join(out)


def _sample_html(r: dict, scale: float) -> str:
    advantages = r["token_advantages"]
    mean = sum(advantages) / max(len(advantages), 1)
    pushed_wrong = r["correct"] is False and mean > 0
    ends = set(r["step_ends"])
    scores = ", ".join(f"{v:.3f}" for v in r["step_scores"])
    parts = [f"<div class='s{' pushed-wrong' if pushed_wrong else ''}' data-mean-advantage="
             f"'{mean:.6f}'>sample {r['sample']}: reward {r['reward']:.3f}, correct "
             f"{r['correct']}, mean advantage {mean:+.4f}"
             + (f", step scores [{scores}]" if scores else "")
             + ("" if r["kept"] else " (not in the loss)") + "<div class='t'>"]
    for t, (text, a) in enumerate(zip(r["tokens"], advantages)):
        shown = html.escape(text).replace("\n", "&#8629;\n") or "&#8709;"
        parts.append(f"<span style='background:{advantage_colour(a, scale)}' title='token {t}, "
                     f"A={a:.4f}'>{shown}</span>")
        if t in ends:
            parts.append("<span class='end'>|</span>")
    parts.append("</div></div>")
    return "".join(parts)


def write_trace_page(trace_dir: Path, out: Path | None = None) -> Path:
    """`igrpo inspect`: the page of a trace folder, `trace.html` beside it by default (inside,
    it would stop pandas and `datasets` reading the folder as parquet)."""
    rows = read_trace(trace_dir)
    out = out or Path(trace_dir).parent / "trace.html"
    out.write_text(render_trace_page(rows, f"GRPO trace: {trace_dir}"), encoding="utf-8")
    return out
