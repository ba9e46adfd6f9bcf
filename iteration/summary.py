"""The run's `summary.json`, `accuracy.png` and the per-iteration table printed at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path

from policy.evaluate import METRICS, lucky_counts
from runtime.rundir import atomic_write_json
from runtime.stats import paired_difference, paired_ratio_difference

CURVES = (("eval.greedy_accuracy", "greedy"), ("eval.mean_at_k", "mean@k"),
          ("eval.maj_accuracy", "maj@k"), ("eval.pass_at_k", "pass@k"))
TRACE_COLUMNS = (("eval.trace_accuracy", "trace"), ("eval.lucky_answer_rate", "lucky"))
"""Shown where the data has a step oracle (policy.evaluate.TRACE_METRICS)."""


def lookup(entry: dict, dotted: str):
    """`entry["eval"]["greedy_accuracy"]` for "eval.greedy_accuracy"; None when absent."""
    head, _, rest = dotted.partition(".")
    value = entry.get(head)
    if rest and isinstance(value, dict):
        return value.get(rest)
    return value if not rest else None


def change_from(before_path: Path, after_path: Path) -> dict:
    """Each metric's change between two evaluations of the same questions, with its paired 95%
    interval (the lucky-answer rate's resamples the questions with their counts), and
    `gap_closed`: the share of the first policy's gap between mean@k and pass@k that the second
    closed."""
    before, after = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    if before["questions"] != after["questions"]:
        raise ValueError(f"{before_path} and {after_path} hold different questions")
    out = {name: paired_difference(before[name], after[name])
           for name in (*METRICS, "trace_accuracy") if name in before and name in after}
    if "sample_trace" in before and "sample_trace" in after:
        counts = [lucky_counts(o["sample_right"], o["sample_trace"]) for o in (before, after)]
        if all(sum(right) for _, right in counts):  # (no share without a right sample)
            out["lucky_answer_rate"] = paired_ratio_difference(*counts)
    if "mean_at_k" in out and "pass_at_k" in before:
        mean0, pass0 = (sum(before[n]) / len(before[n]) for n in ("mean_at_k", "pass_at_k"))
        out["gap_closed"] = out["mean_at_k"]["diff"] / (pass0 - mean0) if pass0 > mean0 else None
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_means(rows: list[dict], skip: tuple[str, ...] = ()) -> dict:
    """Each numeric key's mean over the metric rows holding a finite value of it (keys starting
    with `skip`, and those of a rate, left out)."""
    keys = sorted({key for r in rows for key, v in r.items() if _number(v)
                   and not key.startswith(skip) and not key.endswith("_per_s")} - {"step"})
    means = {}
    for key in keys:
        values = [r[key] for r in rows if _number(r.get(key))]
        means[key] = sum(values) / len(values)
    return means


def watch_ends(rows: list[dict], n: int = 5) -> dict:
    """Each `watch/*` key's mean over an iteration's first `n` and last `n` GRPO steps
    ({"first": ..., "last": ...}; a key undefined on all of them is None there)."""
    first, last = step_means(rows[:n]), step_means(rows[-n:])
    keys = sorted({k for r in rows for k, v in r.items() if k.startswith("watch/") and _number(v)})
    return {key: {"first": first.get(key), "last": last.get(key)} for key in keys}


def write_summary(path: Path, iterations: list[dict]) -> None:
    atomic_write_json(path, {"iterations": iterations})


def plot_accuracy(path: Path, iterations: list[dict],
                  steps: list[list[dict]] | None = None) -> Path:
    """Accuracy per iteration for greedy / mean@k / maj@k / pass@k with their 95% intervals
    (iteration 0 = warm start); with `steps` (each iteration's GRPO metric rows), a second
    panel: gold (the samples' exact-check accuracy) and proxy (the mean reward) per GRPO step,
    with the reward's in-group AUROC, the watch of reward hacking (gold falling as proxy rises)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [it["iteration"] for it in iterations]
    watched = bool(steps) and any("watch/gold" in r for rows in steps for r in rows)
    fig, axes = plt.subplots(1, 2 if watched else 1, figsize=(12 if watched else 6, 4))
    ax = axes[0] if watched else axes
    for offset, (key, label) in zip((-0.09, -0.03, 0.03, 0.09), CURVES):
        points = [(x, lookup(it, key), lookup(it, key + "_lo"), lookup(it, key + "_hi"))
                  for x, it in zip(xs, iterations) if lookup(it, key) is not None]
        if not points:
            continue
        px, ys = [p[0] + offset for p in points], [p[1] for p in points]
        if all(p[2] is not None for p in points):
            err = [[y - p[2] for y, p in zip(ys, points)], [p[3] - y for y, p in zip(ys, points)]]
            ax.errorbar(px, ys, yerr=err, marker="o", capsize=3, label=label)
        else:
            ax.plot(px, ys, marker="o", label=label)
    ax.set_xlabel("iteration (0 = warm start)")
    ax.set_ylabel("held-out accuracy (95% interval)")
    ax.set_xticks(xs)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    if watched:
        _plot_watch(axes[1], steps)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def _plot_watch(ax, steps: list[list[dict]]) -> None:
    """Gold, proxy and in-group AUROC per GRPO step over the run, iterations marked."""
    rows = [r for part in steps for r in part]
    x = list(range(1, len(rows) + 1))
    for key, label, style in (("watch/gold", "gold (exact check)", "-"),
                              ("watch/proxy", "proxy (mean reward)", "-"),
                              ("watch/group_auroc", "in-group AUROC", ":")):
        ax.plot(x, [r[key] if _number(r.get(key)) else float("nan") for r in rows], style,
                label=label)
    at = 0
    for part in steps[:-1]:
        at += len(part)
        ax.axvline(at + 0.5, color="grey", alpha=0.4)
    ax.set_xlabel("GRPO step (lines: iterations)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def with_interval(entry: dict, key: str) -> str:
    """`0.912 [0.89, 0.93]`, or the bare value when no interval was recorded."""
    value, lo, hi = (lookup(entry, key + suffix) for suffix in ("", "_lo", "_hi"))
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" [{lo:.2f},{hi:.2f}]" if lo is not None else "")


def table(iterations: list[dict]) -> str:
    """A terminal table of the per-iteration metrics: accuracies with their 95% intervals (and
    where the data has a step oracle, trace accuracy and the lucky-answer rate), then the reward
    models and GRPO."""
    shown = list(CURVES)
    if any(lookup(it, key) is not None for it in iterations for key, _ in TRACE_COLUMNS):
        shown += TRACE_COLUMNS
    keys = [key for key, _ in shown]
    lines = ["  ".join([f"{'iter':>4}"] + [f"{title:>20}" for _, title in shown]
                       + [f"{'questions':>9}"])]
    for it in iterations:
        lines.append("  ".join([f"{it['iteration']:>4d}"]
                               + [f"{with_interval(it, key):>20}" for key in keys]
                               + [f"{lookup(it, 'eval.questions') or '-':>9}"]))
        change = it.get("change")
        if change:
            cells = [_signed(change.get(key.removeprefix("eval."))) for key in keys]
            lines.append("  ".join([f"{'+/-':>4}"] + [f"{c:>20}" for c in cells]))
    closed = iterations[-1].get("change", {}).get("gap_closed") if iterations else None
    if closed is not None:
        lines.append(f"RL closed {closed:.0%} of the warm start's gap between mean@k and pass@k "
                     "(+/-: change from iteration 0, paired 95% interval over the same questions)")
    if any(lookup(it, "eval.trace_metrics") for it in iterations):
        lines.append("trace accuracy and lucky-answer rate: no step oracle for this data")
    elif len(shown) > len(CURVES):
        lines.append("trace: answer and every step right; lucky: share of right answers "
                     "reached through a wrong step")
    return "\n".join(lines) + "\n\n" + _table_rest(iterations)


def _signed(d: dict | None) -> str:
    if not d:
        return "-"
    return f"{d['diff']:+.3f} [{d['lo']:+.2f},{d['hi']:+.2f}]"


def _table_rest(iterations: list[dict]) -> str:
    columns = [("iteration", "iter", "{:d}"),
               ("rm.prm/step_accuracy", "PRM step acc", "{:.3f}"),
               ("bon.prm_pick", "BoN PRM", "{:.3f}"), ("bon.orm_pick", "BoN ORM", "{:.3f}"),
               ("bon.prm_group_auroc", "PRM in-group", "{:.3f}"),
               ("benchmark.score", "PRM bench", "{:.3f}"),
               ("refresh.prm", "PRM refresh", "{}"),
               ("bon.random", "BoN random", "{:.3f}"), ("grpo.reward/mean", "reward", "{:.3f}"),
               ("grpo.train/kl", "KL", "{:.4f}"), ("watch.watch/gold", "gold 5->5", "{}"),
               ("watch.watch/group_auroc", "AUROC 5->5", "{}")]
    # The PRM's benchmark score shows where a run has one (`eval.prm_benchmark`), the refresh
    # check (in-group AUROC of the previous -> the refreshed PRM) where the run refreshed.
    columns = [c for c in columns if c[0] not in ("benchmark.score", "refresh.prm",
                                                  "watch.watch/gold", "watch.watch/group_auroc")
               or any(lookup(it, c[0]) is not None for it in iterations)]
    lines = ["  ".join(f"{title:>12}" for _, title, _ in columns)]
    for it in iterations:
        cells = []
        for key, _, fmt in columns:
            value = lookup(it, key)
            if key == "refresh.prm" and value is not None:
                value = (f"{value['previous']['group_auroc']:.2f}->"
                         f"{value['refreshed']['group_auroc']:.2f}")
            if key.startswith("watch.") and value is not None:  # first and last 5 GRPO steps
                value = "->".join("-" if v is None else f"{v:.2f}"
                                  for v in (value["first"], value["last"]))
            cells.append(f"{fmt.format(value) if value is not None else '-':>12}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
