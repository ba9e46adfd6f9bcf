"""The run's `summary.json`, `accuracy.png` and the per-iteration table printed at the end."""

from __future__ import annotations

from pathlib import Path

from runtime.rundir import atomic_write_json

CURVES = (("eval.greedy_accuracy", "greedy (pass@1)"), ("eval.maj_accuracy", "maj@K"),
          ("eval.pass_at_k", "pass@K"))


def lookup(entry: dict, dotted: str):
    """`entry["eval"]["greedy_accuracy"]` for "eval.greedy_accuracy"; None when absent."""
    head, _, rest = dotted.partition(".")
    value = entry.get(head)
    if rest and isinstance(value, dict):
        return value.get(rest)
    return value if not rest else None


def write_summary(path: Path, iterations: list[dict]) -> None:
    atomic_write_json(path, {"iterations": iterations})


def plot_accuracy(path: Path, iterations: list[dict]) -> Path:
    """Accuracy per iteration for greedy / maj@K / pass@K (iteration 0 = warm start)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [it["iteration"] for it in iterations]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in CURVES:
        ax.plot(xs, [lookup(it, key) for it in iterations], marker="o", label=label)
    ax.set_xlabel("iteration (0 = warm start)")
    ax.set_ylabel("held-out accuracy")
    ax.set_xticks(xs)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def table(iterations: list[dict]) -> str:
    """A terminal table of the per-iteration metrics."""
    columns = [("iteration", "iter", "{:d}"), ("eval.greedy_accuracy", "greedy", "{:.3f}"),
               ("eval.maj_accuracy", "maj@K", "{:.3f}"), ("eval.pass_at_k", "pass@K", "{:.3f}"),
               ("rm.prm/step_accuracy", "PRM step acc", "{:.3f}"),
               ("bon.prm_pick", "BoN PRM", "{:.3f}"), ("bon.orm_pick", "BoN ORM", "{:.3f}"),
               ("bon.prm_group_auroc", "PRM in-group", "{:.3f}"),
               ("bon.random", "BoN random", "{:.3f}"), ("grpo.reward/mean", "reward", "{:.3f}"),
               ("grpo.train/kl", "KL", "{:.4f}")]
    lines = ["  ".join(f"{title:>12}" for _, title, _ in columns)]
    for it in iterations:
        cells = []
        for key, _, fmt in columns:
            value = lookup(it, key)
            cells.append(f"{fmt.format(value) if value is not None else '-':>12}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
