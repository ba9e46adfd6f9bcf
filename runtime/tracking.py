"""Metrics to a JSONL file in the run folder and to wandb (offline unless the user set it up).

Metric names live in fixed namespaces, documented in docs/metrics.md:
`rollout/`, `reward/`, `train/`, `time/`, `eval/` (and later `rm/`, `prm/`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from runtime.rundir import atomic_write_text


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Append-only JSONL log plus an optional wandb run; only the main rank writes."""

    def __init__(self, path: Path, *, config: dict, mode: str, project: str, name: str,
                 enabled: bool = True, group: str = "", job_type: str = "",
                 log_checkpoints: bool = False):
        """One wandb run per stage: `name` is `<run>-<stage>`, `group` the run name (so a run's
        stages sit together in the UI), `job_type` the stage kind; `config` is the resolved
        config, verbatim."""
        self.path = path
        self.enabled = enabled
        self.log_checkpoints = log_checkpoints
        self.wandb_run = None
        self.offline = False
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if mode != "disabled":
            import wandb

            if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _has_netrc()):
                print("[igrpo] no wandb credentials found: logging offline "
                      f"(sync later with `wandb sync {path.parent}/wandb/offline-run-*`)")
                mode = "offline"
            self.wandb_run = wandb.init(project=project, name=name, group=group or name,
                                        job_type=job_type or None, config=config,
                                        dir=str(path.parent), mode=mode, reinit="create_new",
                                        id=stage_run_id(path.parent), resume="allow")
            self.offline = mode == "offline"

    def log(self, metrics: dict, step: int, media: dict | None = None) -> None:
        """Scalars to the JSONL file and wandb; lists (a step's question ids) to the JSONL file
        only; `media` (tables, HTML, histograms) to wandb only."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            scalars = {k: v for k, v in metrics.items() if not isinstance(v, (list, tuple))}
            self.wandb_run.log({**scalars, **(media or {})}, step=step)

    def rewind(self, step: int) -> None:
        """Drop JSONL rows logged after `step` (a resumed stage redoes those steps, so they would
        otherwise appear twice)."""
        if not self.enabled or not self.path.exists():
            return
        rows = read_metrics(self.path)
        kept = [r for r in rows if r.get("step", 0) <= step]
        if len(kept) != len(rows):
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log_checkpoint(self, folder: Path, name: str, kind: str = "model") -> None:
        """Log a checkpoint folder as a wandb artifact, when the user opted in
        (`run.wandb_log_checkpoints=true`)."""
        if self.wandb_run is None or not self.log_checkpoints:
            return
        import wandb

        artifact = wandb.Artifact(name, type=kind)
        artifact.add_dir(str(folder))
        self.wandb_run.log_artifact(artifact)

    def close(self) -> None:
        if self.wandb_run is not None:
            run_dir = Path(self.wandb_run.dir).parent
            self.wandb_run.finish()
            self.wandb_run = None
            if self.offline:
                print(f"[igrpo] wandb run saved offline; upload it with `wandb sync {run_dir}`")


def stage_run_id(folder: Path) -> str:
    """The wandb run id of the stage whose folder is `folder`: drawn once and kept in
    `<folder>/wandb-id`, so a stage restarted after a crash logs to the same wandb run (and
    its steps redone after the last save are not logged in a second run)."""
    import secrets

    path = folder / "wandb-id"
    if not path.exists():
        atomic_write_text(path, secrets.token_hex(6) + "\n")
    return path.read_text(encoding="utf-8").strip()


def _has_netrc() -> bool:
    return (Path.home() / ".netrc").exists()


def read_metrics(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
