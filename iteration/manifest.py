"""The run manifest: every unit of work (stage, iteration) with its state and outputs.

Written atomically after each change, so a run killed anywhere resumes from the last finished
unit and never redoes one. Only the main rank writes it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable

from runtime.rundir import atomic_write_json


def seed_unit(seed: int, name: str) -> None:
    """Seed every RNG from (run seed, unit name): a unit computes the same thing whether the
    run went straight through or resumed just before it."""
    import random
    import zlib

    import torch

    unit_seed = zlib.crc32(f"{seed}:{name}".encode())
    random.seed(unit_seed)
    torch.manual_seed(unit_seed)


class Manifest:
    def __init__(self, path: Path, seed: int = 0, write: bool = True):
        self.path, self.seed, self.write = path, seed, write
        self.units: dict[str, dict] = {}
        if path.exists():
            self.units = json.loads(path.read_text(encoding="utf-8"))["units"]

    def done(self, name: str) -> bool:
        return self.units.get(name, {}).get("state") == "done"

    def outputs(self, name: str) -> dict:
        return self.units[name]["outputs"]

    def _save(self) -> None:
        if self.write:
            atomic_write_json(self.path, {"units": self.units})

    def eta(self, plan: list[str]) -> float | None:
        """Seconds the unfinished units of `plan` should take: each as long as the finished units
        of its kind took on average (`grpo/1` is of kind `grpo`), else as the finished ones that
        did work (a second or more) took; None before any has."""
        took: dict[str, list[float]] = {}
        for name, unit in self.units.items():
            if unit.get("state") == "done" and "finished" in unit:
                took.setdefault(name.split("/")[0], []).append(unit["finished"] - unit["started"])
        every = [t for ts in took.values() for t in ts if t >= 1.0]  # not a skipped SFT
        if not every:
            return None
        return sum(sum(took.get(n.split("/")[0], every)) / len(took.get(n.split("/")[0], every))
                   for n in plan if not self.done(n))

    def run(self, name: str, work: Callable[[], dict], plan: list[str] | None = None) -> dict:
        """`work()` once: a finished unit returns its recorded outputs without running again.
        With `plan` (every unit of the run, in order), prints where the run stands and an ETA."""
        if self.done(name):
            return self.outputs(name)
        if plan and self.write:
            eta = self.eta(plan)
            left = f", ETA {eta / 60:.0f} min" if eta is not None else ""
            print(f"[iterate] unit {plan.index(name) + 1}/{len(plan)}: {name}{left}", flush=True)
        self.units[name] = {"state": "running", "started": time.time(), "outputs": {}}
        self._save()
        seed_unit(self.seed, name)
        outputs = work()
        self.units[name].update(state="done", finished=time.time(), outputs=outputs)
        self._save()
        return outputs


# What a fork leaves behind: the source's configs (the fork runs under its own overrides) and
# wandb files, at any depth, and what the finished run wrote last (rewritten when the fork ends).
NOT_FORKED, NOT_FORKED_TOP = ("config.yaml", "wandb"), ("summary.json", "accuracy.png")


def fork(src: Path, dst: Path, keep: Callable[[str], bool] | None = None,
         replace: dict[str, dict] | None = None, drop: Iterable[str] = ()) -> None:
    """A new run folder `dst` that resumes from `src`'s finished units: `src` copied (but
    NOT_FORKED), its manifest holding the units `keep` (a unit's name -> bool) keeps (default:
    every unit), each unit of
    `replace` given those outputs (as done, no time of its own), and the folders or files
    `drop` (relative to the run) removed, for the units left to redo. Written to a temporary
    folder and renamed, so a fork killed midway leaves no `dst`; an existing `dst` (a fork
    done before) is left as it is."""
    if dst.exists():
        return
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(*NOT_FORKED))
    units = json.loads((tmp / "manifest.json").read_text(encoding="utf-8"))["units"]
    if keep is not None:
        units = {name: unit for name, unit in units.items() if keep(name)}
    for name, outputs in (replace or {}).items():
        units[name] = {**units.get(name, {}), "state": "done", "started": 0.0, "finished": 0.0,
                       "outputs": outputs}
    for rel in (*NOT_FORKED_TOP, *drop):
        # a reward model's ensemble members (`<folder>-member-M`, `rm.ensemble`) go with it
        for path in (tmp / rel, *(tmp / rel).parent.glob(f"{Path(rel).name}-member-*")):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    atomic_write_json(tmp / "manifest.json", {"units": units})
    tmp.rename(dst)
