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

from runtime.dist import barrier, gather_objects, is_main, world
from runtime.engine import gathered_for_generation
from runtime.lora import is_adapted, save_merged
from runtime.models import output_is_logged, progress_bars_off
from runtime.rundir import atomic_write_text


def recover_export(out_dir: Path) -> None:
    """Finish a swap a crash interrupted: the export was moved aside but the new one not yet in."""
    out_dir = Path(out_dir)
    old = out_dir.with_name(f".{out_dir.name}.old")
    if not out_dir.exists() and old.exists():
        old.rename(out_dir)


def save_pretrained(model, tokenizer, out_dir: Path, config_yaml: str | None = None,
                    files: dict[str, str] | None = None) -> Path:
    """Export weights (safetensors), tokenizer, the resolved config and `files` (name -> text,
    e.g. a model card's README.md); atomic via rename."""
    out_dir = Path(out_dir)
    recover_export(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    module = getattr(model, "module", model)
    with progress_bars_off(output_is_logged()):  # (its "Writing model shards" bar, in a log)
        if is_adapted(module):  # LoRA: the merged plain model (runtime/lora.py)
            save_merged(module, tmp)
        else:
            module.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if config_yaml is not None:
        atomic_write_text(tmp / "igrpo_config.yaml", config_yaml)
    for name, text in (files or {}).items():
        atomic_write_text(tmp / name, text)
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def export(engine, tokenizer, out_dir: Path, config_yaml: str | None = None,
           files: dict[str, str] | None = None) -> Path:
    """`save_pretrained` of a training engine's model, called on every rank: under ZeRO-3 the
    partitions are gathered first (all ranks join), then rank 0 writes."""
    with gathered_for_generation(engine):
        if is_main():
            save_pretrained(engine, tokenizer, out_dir, config_yaml, files)
    barrier()
    return Path(out_dir)


def rng_state() -> dict:
    """This process's random state: Python's, torch's CPU one and the current GPU's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (e.g. a full disk); the previous one is intact."""


def _latest_tag(state_dir: Path) -> str | None:
    latest = state_dir / "latest"
    return latest.read_text().strip() if latest.exists() else None


def save_training_state(engine, state_dir: Path, client_state: dict) -> None:
    """Optimizer, schedule, weights and `client_state` (+ RNG) in DeepSpeed's format, atomically.

    Each save goes to a new tag folder; only when every rank has written it does `latest` (written
    atomically) point to it, and the older tag is removed. A kill mid-save leaves the previous
    state in force. A write error (a full disk) removes the partial folder and raises
    `CheckpointError` naming both folders.
    """
    state_dir = Path(state_dir)
    previous = _latest_tag(state_dir)
    index = int(previous) + 1 if previous and previous.isdigit() else 0
    tag = f"{index:06d}"
    if is_main():  # an orphan of a save killed before `latest` moved: never mix its files in
        shutil.rmtree(state_dir / tag, ignore_errors=True)
    barrier()
    # Every rank's random state: under ZeRO-0/1/2 only rank 0 writes the client state, and the
    # ranks' states differ (each has drawn for its own share of the work).
    rng = gather_objects(rng_state())
    try:
        engine.save_checkpoint(str(state_dir), tag=tag, save_latest=False,
                               client_state={"igrpo": {**client_state, "rng": rng}})
    except OSError as err:
        shutil.rmtree(state_dir / tag, ignore_errors=True)
        kept = f"the previous state {state_dir / previous} is intact" if previous else \
            "no earlier state existed"
        raise CheckpointError(f"could not write the training state {state_dir / tag}: {err}; "
                              f"{kept}. Free space and re-run the same command to resume.") \
            from err
    barrier()
    if is_main():
        atomic_write_text(state_dir / "latest", tag)
        for old in state_dir.iterdir():
            if old.is_dir() and old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    barrier()


def _deepspeed_state_classes() -> list:
    """The DeepSpeed classes a ZeRO-1/2/3 training state pickles beside its tensors (the loss
    scaler, the ZeRO stage, bf16 fragment addresses): the only globals a state may name."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _weights_only_loads(engine) -> None:
    """DeepSpeed's torch checkpoint engine unpickles with `weights_only=False`; ours loads
    tensors, plain containers and DeepSpeed's few state classes only, so a crafted state file
    cannot run code."""
    checkpoint_engine = engine.checkpoint_engine
    allowed = _deepspeed_state_classes()

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    checkpoint_engine.load = load


def load_training_state(engine, state_dir: Path) -> dict | None:
    """Restore a state saved by `save_training_state`; None when there is none yet."""
    tag = _latest_tag(Path(state_dir))
    if tag is None:
        return None
    _weights_only_loads(engine)
    _, client_state = engine.load_checkpoint(str(state_dir), tag=tag)
    if client_state is None:
        raise CheckpointError(f"the training state {Path(state_dir) / tag} could not be loaded")
    ours = dict(client_state["igrpo"])
    rng = ours.pop("rng")  # one per rank (a state written before that: one for all)
    set_rng_state(rng[world()[0] % len(rng)] if isinstance(rng, list) else rng)
    return ours


def save_companion_state(engine, state_dir: Path, step: int) -> None:
    """A second engine of a stage (PPO's critic), saved under the tag of `step` before the main
    state moves to it; the main state's step picks the tag back (`load_companion_state`), so a
    kill between the two saves resumes both from the earlier step."""
    state_dir = Path(state_dir)
    engine.save_checkpoint(str(state_dir), tag=f"{step:06d}", save_latest=False,
                           client_state={"igrpo": {"step": step}})
    barrier()


def prune_companion_state(state_dir: Path, step: int) -> None:
    """Drop a companion's tags other than `step`'s (once the main state has moved to it)."""
    if is_main() and Path(state_dir).exists():
        for old in Path(state_dir).iterdir():
            if old.is_dir() and old.name != f"{step:06d}":
                shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_companion_state(engine, state_dir: Path, step: int) -> None:
    """Restore a companion engine to the main state's `step`."""
    tag = f"{step:06d}"
    if not (Path(state_dir) / tag).exists():
        raise CheckpointError(f"{state_dir}: no saved state for step {step} (the stage's main "
                              "state is at that step); the run folder is incomplete")
    _weights_only_loads(engine)
    engine.load_checkpoint(str(state_dir), tag=tag)

