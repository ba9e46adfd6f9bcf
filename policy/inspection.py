"""Inspecting advantages: a per-step table, a token heatmap and distributions, every K GRPO steps.

What the loss used is what is shown: the rows are read from the very `[N, T]` advantage tensor the
update receives, over the token range of each step (the reward's own step ends for process
supervision; the solution's lines for outcome supervision, where every token of a sample carries
the same advantage). Written to `<stage>/inspect/step-NNNNNN.{jsonl,html}` (readable with pandas or
`datasets`, no wandb needed) and logged to wandb as `inspect/advantages` (Table) and
`inspect/tokens` (Html), with histograms of step rewards, normalised step rewards and token
advantages.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

import torch

from configs.schema import InspectConfig
from policy.rewards import Scores
from policy.stage import GRPOSpec
from policy.generation.rollout import Rollout
from runtime.data import MathRecord
from runtime.dist import is_main
from runtime.rundir import atomic_write_text
from runtime.steps import step_end_token_indices

COLUMNS = ("step", "question_id", "question", "sample", "step_index", "step_text", "token_start",
           "token_end", "step_score", "normalised_reward", "advantage", "final_reward", "correct",
           "supervision")


def group_sum_check(normalised: torch.Tensor, group_size: int) -> float:
    """Largest |sum of normalised rewards| over a group: 0 by construction (a logged check)."""
    return float(normalised.reshape(-1, group_size * normalised.shape[1]).sum(-1).abs().max())


def step_spans(scores: Scores, rollout: Rollout, tokenizer, i: int) -> list[tuple[int, int]]:
    """Inclusive completion-token ranges of sample i's steps (reward's step ends if it has them)."""
    if scores.step_end_index is not None:
        ends = scores.step_end_index[i][scores.step_mask[i]].tolist()
    else:
        ids = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        ends = step_end_token_indices(tokenizer, ids, rollout.texts[i])
    starts = [0] + [e + 1 for e in ends[:-1]]
    return list(zip(starts, ends))


def advantage_rows(step: int, records: list[MathRecord], rollout: Rollout, scores: Scores,
                   rewards: torch.Tensor, advantages: torch.Tensor, normalised: torch.Tensor,
                   tokenizer, samples: list[int], per_step: bool,
                   supervision: str) -> list[dict]:
    """One row per (question, sample, step) of the chosen sample indices (into the rollout)."""
    rows = []
    for i in samples:
        ids = rollout.completion_ids[i].tolist()
        for k, (start, end) in enumerate(step_spans(scores, rollout, tokenizer, i)):
            rows.append({
                "step": step, "question_id": records[i].source_id,
                "question": records[i].question, "sample": i % rollout.group_size,
                "step_index": k,
                "step_text": tokenizer.decode(ids[start:end + 1], skip_special_tokens=True),
                "token_start": start, "token_end": end,
                "step_score": float(scores.step_rewards[i, k]) if per_step else None,
                "normalised_reward": float(normalised[i, k]) if per_step else None,
                "advantage": float(advantages[i, start]),
                "final_reward": float(rewards[i]),
                "correct": None if scores.correct is None else bool(scores.correct[i]),
                "supervision": supervision,
            })
    return rows


def advantage_colour(value: float, scale: float) -> str:
    """Diverging background: green for positive advantages, red for negative."""
    alpha = 0.0 if scale <= 0 else min(abs(value) / scale, 1.0) * 0.85
    rgb = "34,160,70" if value >= 0 else "210,50,50"
    return f"rgba({rgb},{alpha:.3f})"


def render_html(step: int, records: list[MathRecord], rollout: Rollout, advantages: torch.Tensor,
                rows: list[dict], tokenizer, samples: list[int], supervision: str) -> str:
    """Each chosen completion with every token coloured by its advantage; a `|` marker
    (`class="step-end"`) closes every step."""
    scale = max([abs(r["advantage"]) for r in rows] + [1e-9])
    parts = [
        "<!doctype html><meta charset='utf-8'><style>",
        "body{font-family:monospace} .s{margin:1em 0;padding:.5em;border:1px solid #ccc}",
        ".t{white-space:pre-wrap} .step-end{color:#36c;font-weight:bold}</style>",
        f"<h3>GRPO step {step}: token advantages ({html.escape(supervision)} supervision; "
        f"green &gt; 0, red &lt; 0, full colour at |A| = {scale:.3f})</h3>"]
    for i in samples:
        key = (records[i].source_id, i % rollout.group_size)
        steps = [r for r in rows if (r["question_id"], r["sample"]) == key]
        ids = rollout.completion_ids[i].tolist()
        ends = {r["token_end"]: r["step_index"] for r in steps}
        parts.append(f"<div class='s'><b>{html.escape(key[0])} sample {key[1]}</b> "
                     f"reward {float(steps[0]['final_reward']) if steps else float('nan'):.3f} "
                     f"correct {steps[0]['correct'] if steps else None}<br>"
                     f"<i>{html.escape(records[i].question)}</i><div class='t'>")
        for t in range(int(rollout.completion_mask[i].sum())):
            text = tokenizer.decode(ids[t:t + 1], skip_special_tokens=True)
            a = float(advantages[i, t])
            shown = html.escape(text).replace("\n", "&#8629;\n") or "&#8709;"
            parts.append(f"<span style='background:{advantage_colour(a, scale)}' "
                         f"title='token {t}, A={a:.4f}'>{shown}</span>")
            if t in ends:
                parts.append(f"<span class='step-end' title='end of step {ends[t]}'>|</span>")
        parts.append("</div></div>")
    return "".join(parts)


def write_inspection(folder: Path, step: int, rows: list[dict], page: str) -> tuple[Path, Path]:
    """`<folder>/step-NNNNNN.jsonl` (one JSON object per row) and `.html`, written atomically."""
    stem = folder / f"step-{step:06d}"
    table = stem.with_suffix(".jsonl")
    atomic_write_text(table, "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(stem.with_suffix(".html"), page)
    return table, stem.with_suffix(".html")


def wandb_media(rows: list[dict], page: str, scores: Scores, normalised: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, process: bool) -> dict:
    """wandb objects for `inspect/*`: the table, the HTML page and three histograms."""
    import wandb

    data = [[r[c] for c in COLUMNS] for r in rows]
    media = {"inspect/advantages": wandb.Table(columns=list(COLUMNS), data=data),
             "inspect/tokens": wandb.Html(page),
             "inspect/token_advantages": wandb.Histogram(advantages[mask.bool()].tolist())}
    if process:
        steps = scores.step_mask
        media["inspect/step_rewards"] = wandb.Histogram(scores.step_rewards[steps].tolist())
        # the steps' columns: the anchored credit form appends its outcome part
        media["inspect/normalised_step_rewards"] = wandb.Histogram(
            normalised[:, :steps.shape[1]][steps].tolist())
    else:
        media["inspect/normalised_step_rewards"] = wandb.Histogram(
            [v for v in normalised[:, 0].tolist() if math.isfinite(v)])
    return media


def chosen_samples(num_samples: int, group_size: int, groups: int, per_group: int) -> list[int]:
    """Rollout rows shown: the first `per_group` samples of the first `groups` groups."""
    num_groups = num_samples // group_size
    return [q * group_size + s for q in range(min(groups, num_groups))
            for s in range(min(per_group, group_size))]


def inspect_step(folder: Path, step: int, inspect: InspectConfig, spec: GRPOSpec, tokenizer,
                 sampled, batch, logger) -> dict | None:
    """Every `inspect.every` steps (main rank): write a GRPO step's advantage table and token
    heatmap (`sampled`: the step's `policy.scoring.Sampled`, `batch` its `StepBatch`); return the
    wandb media to log (None otherwise)."""
    if not (inspect.every and step % inspect.every == 0 and is_main()):
        return None
    records, rollout, scores = sampled.records, sampled.rollout, sampled.scores
    advantages, normalised = batch.advantages, batch.normalised
    size = rollout.group_size
    per_sample = [r for r in records for _ in range(size)]
    samples = chosen_samples(len(per_sample), size, inspect.groups, inspect.samples)
    rows = advantage_rows(step, per_sample, rollout, scores, sampled.rewards, advantages,
                          normalised, tokenizer, samples, spec.per_step, spec.supervision)
    page = render_html(step, per_sample, rollout, advantages, rows, tokenizer, samples,
                       spec.supervision)
    write_inspection(folder, step, rows, page)
    return None if logger.wandb_run is None else wandb_media(
        rows, page, scores, normalised, advantages, rollout.completion_mask,
        spec.per_step)
