"""The metrics logger's wandb runs: one per stage, the same one after a restart."""

import re
from pathlib import Path

from runtime.tracking import MetricsLogger, stage_run_id


def _offline_runs(folder: Path) -> list[str]:
    """The run id of each offline run folder (`offline-run-<date>_<time>-<id>`, `-1` appended
    where two start in the same second)."""
    return sorted(re.fullmatch(r"offline-run-\d{8}_\d{6}-([0-9a-z]+)(-\d+)?", p.name).group(1)
                  for p in (folder / "wandb").glob("offline-run-*"))


def test_a_restarted_stage_logs_to_the_same_wandb_run(tmp_path):
    """A stage killed and started again opens its wandb run by the id it drew the first time,
    so its steps land in one run (`wandb sync` of both folders resumes it); another stage's
    folder draws another id."""
    stage = tmp_path / "grpo" / "iteration-1"
    for steps in (range(0, 3), range(2, 5)):  # the restart redoes step 2
        logger = MetricsLogger(stage / "metrics.jsonl", config={"x": 1}, mode="offline",
                               project="p", name="run-grpo")
        for step in steps:
            logger.log({"train/loss": float(step)}, step=step)
        logger.close()
    ids = _offline_runs(stage)
    assert len(ids) == 2 and ids[0] == ids[1] == stage_run_id(stage)
    other = tmp_path / "grpo" / "iteration-2"
    MetricsLogger(other / "metrics.jsonl", config={}, mode="offline", project="p",
                  name="run-grpo-2").close()
    assert _offline_runs(other) == [stage_run_id(other)] != ids[:1]
