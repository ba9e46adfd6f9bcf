"""The run folder: resolved config, atomic file writes, and paths that cannot escape the folder."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + fsync + rename, so a crash leaves the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


class UnsafePathError(ValueError):
    """A name (run name, stage, file) that would write outside the run folder."""


def safe_child(root: Path, *parts: str) -> Path:
    """`root/parts...`, refusing names that would land outside `root`."""
    path = root.joinpath(*parts).resolve()
    if root.resolve() not in (path, *path.parents):
        raise UnsafePathError(f"refusing to write outside the run folder {root}: {'/'.join(parts)!r}")
    return path


class RunDir:
    """`<root>/<name>/` with the resolved config written in it."""

    def __init__(self, root: str | Path, name: str):
        self.path = safe_child(Path(root), name)
        self.path.mkdir(parents=True, exist_ok=True)

    def child(self, *parts: str) -> Path:
        return safe_child(self.path, *parts)

    def write_config(self, config_yaml: str, filename: str = "config.yaml") -> Path:
        target = self.child(filename)
        atomic_write_text(target, config_yaml)
        return target

    def read_config(self, filename: str = "config.yaml") -> dict | None:
        target = self.child(filename)
        if not target.exists():
            return None
        return yaml.safe_load(target.read_text(encoding="utf-8"))
