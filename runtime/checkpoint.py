"""Checkpoint IO: `save_pretrained` exports (safetensors) and resumable DeepSpeed training state.

Exports are written to a temporary folder and renamed into place, so a crash mid-write leaves the
previous export intact. Training state (optimizer, schedule, RNG, loop position) uses DeepSpeed's
own checkpoint format, so ZeRO-partitioned states resume on the same world size.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from runtime.rundir import atomic_write_text


def save_pretrained(model, tokenizer, out_dir: Path, config_yaml: str | None = None) -> Path:
    """Export weights (safetensors), tokenizer and the resolved config; atomic via rename."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    module = getattr(model, "module", model)
    module.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if config_yaml is not None:
        atomic_write_text(tmp / "igrpo_config.yaml", config_yaml)
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


def save_training_state(engine, state_dir: Path, client_state: dict) -> None:
    """Optimizer, schedule, weights and `client_state` (+ RNG) in DeepSpeed's format."""
    engine.save_checkpoint(str(state_dir), tag="state",
                           client_state={"igrpo": {**client_state, "rng": rng_state()}})


def load_training_state(engine, state_dir: Path) -> dict | None:
    """Restore a state saved by `save_training_state`; None when there is none yet."""
    if not (Path(state_dir) / "latest").exists():
        return None
    _, client_state = engine.load_checkpoint(str(state_dir), tag="state")
    ours = dict(client_state["igrpo"])
    set_rng_state(ours.pop("rng"))
    return ours
