"""Read an offline wandb run's `.wandb` file back: its logged history rows and its config.

The file is a LevelDB-style log (7-byte file header ':W&B' + magic + version, then 32 KiB blocks of
records, each with a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) of protobuf
`Record`s. Tests use this to check what a run really logged, without a wandb server.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a wandb run file (missing ':W&B' header)")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block tail too small for a header: zero padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += room
            continue
        if pos + _HEADER + length > len(data):
            return  # a record still being written: the file ends mid-record
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def _settled_bytes(path: Path, settle_s: float) -> bytes:
    """The file's bytes once its size stopped changing for `settle_s` (wandb's service process
    may still be flushing right after `run.finish()` returns); at most 30 s of waiting."""
    import time

    deadline = time.monotonic() + 30
    size = -1
    while time.monotonic() < deadline:
        current = path.stat().st_size
        if current == size:
            break
        size = current
        time.sleep(settle_s)
    return path.read_bytes()


def read_offline_run(run_dir: str | Path, settle_s: float = 0.3) -> dict:
    """{"history": [row, ...], "config": {...}, "run": {name, group, job_type},
    "artifacts": [name, ...]} of the offline run in `run_dir`."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = next(Path(run_dir).glob("*.wandb"))
    history, config, run, artifacts = [], {}, {}, []
    raws = list(_records(_settled_bytes(path, settle_s)))
    for index, raw in enumerate(raws):
        record = pb.Record()
        try:
            record.ParseFromString(raw)
        except Exception:
            if index == len(raws) - 1:
                break  # a torn final record (the writer was still at work): ignore it
            raise
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "artifact":
            artifacts.append(record.artifact.name)
        if kind == "run":
            run = {"name": record.run.display_name, "group": record.run.run_group,
                   "job_type": record.run.job_type}
        if kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"history": history, "config": config, "run": run, "artifacts": artifacts}
