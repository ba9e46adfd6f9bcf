"""The run manifest: every unit of work (stage, iteration) with its state and outputs.

Written atomically after each change, so a run killed anywhere resumes from the last finished
unit and never redoes one. Only the main rank writes it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

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

    def run(self, name: str, work: Callable[[], dict]) -> dict:
        """`work()` once: a finished unit returns its recorded outputs without running again."""
        if self.done(name):
            return self.outputs(name)
        self.units[name] = {"state": "running", "started": time.time(), "outputs": {}}
        self._save()
        seed_unit(self.seed, name)
        outputs = work()
        self.units[name].update(state="done", finished=time.time(), outputs=outputs)
        self._save()
        return outputs
