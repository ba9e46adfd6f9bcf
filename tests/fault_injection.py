"""Fault injection: run a command, SIGKILL it at random moments, resume it with the same command.

A *zygote* process imports the project once and forks one child per attempt, so an attempt costs
the run's own work, not 4 s of imports; each child is a fresh process with its own RNG, DeepSpeed
engine and gloo group, killed with SIGKILL (no handler, no cleanup), exactly like a preemption.

    python tests/fault_injection.py --kills 20 --timeline STRAIGHT/manifest.json --run-dir DIR \\
        -- iterate --config configs/tiny.yaml run.root=...

Kill moments are drawn over an uninterrupted run's timeline (its manifest's units, each with its
start and finish time) and replayed unit by unit, so kills spread over every stage at any speed.

`kill_and_resume` returns where each kill landed: the manifest unit that was running, and any
half-written files the kill left behind (temporary exports, checkpoint tags `latest` does not name).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ZYGOTE = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import igrpo, torch, deepspeed, transformers  # noqa: F401  (imported once, before any fork)
import policy.grpo, iteration.loop, reward_model.train, process_supervision.label  # noqa: F401
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        code = 1
        try:
            code = igrpo.main(request["args"]) or 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": status}), flush=True)
"""


@dataclass
class Report:
    kills: list[dict] = field(default_factory=list)
    attempts: int = 0
    exit_code: int | None = None


# A process that already joined a torch.distributed group (e.g. pytest, after an in-process
# test built an engine) holds these; a child inheriting them would reuse that group's port.
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Zygote:
    def __init__(self, env: dict | None = None):
        clean = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(ROOT)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**clean, **(env or {})})
        assert json.loads(self.proc.stdout.readline())["ready"]

    def start(self, args: list[str], log: Path) -> int:
        self.proc.stdin.write(json.dumps({"args": args, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"]

    def wait(self) -> int:
        return json.loads(self.proc.stdout.readline())["status"]

    def run(self, args: list[str], log: Path) -> int:
        self.start(args, log)
        status = self.wait()
        return os.waitstatus_to_exitcode(status)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def where_killed(run_dir: Path) -> dict:
    """The running manifest unit, and half-written files a kill left in the run folder."""
    manifest = run_dir / "manifest.json"
    unit = "before the manifest"
    if manifest.exists():
        units = json.loads(manifest.read_text())["units"]
        running = [name for name, u in units.items() if u["state"] == "running"]
        unit = running[0] if running else "between units"
    partial = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                     if p.name.endswith(".tmp") or p.name.endswith(".old"))
    for latest in run_dir.rglob("latest"):
        named = latest.read_text().strip()
        partial += sorted(str(p.relative_to(run_dir)) for p in latest.parent.iterdir()
                          if p.is_dir() and p.name != named)
    return {"unit": unit, "partial_writes": partial}


def unit_timeline(manifest: Path) -> list[tuple[str, float, float]]:
    """(unit, start, end) of a finished run's manifest, in seconds from its first unit's start."""
    units = json.loads(manifest.read_text())["units"]
    origin = min(u["started"] for u in units.values())
    return sorted(((name, u["started"] - origin, u["finished"] - origin)
                   for name, u in units.items()), key=lambda row: row[1])


def kill_targets(timeline: list[tuple[str, float, float]], kills: int,
                 rng: random.Random) -> list[tuple[str, float]]:
    """`kills` moments of the uninterrupted run, as (unit, seconds into it): a unit drawn
    uniformly (so short stages such as SFT, labelling and RM training are hit as often as long
    ones), then a moment uniform within it; in timeline order, so each kill lands at or after the
    previous one's place and the run keeps moving forward whatever the machine's speed."""
    order = {name: i for i, (name, _, _) in enumerate(timeline)}
    durations = {name: end - start for name, start, end in timeline}
    picks = [rng.choice(timeline)[0] for _ in range(kills)]
    targets = [(name, rng.uniform(0, durations[name])) for name in picks]
    return sorted(targets, key=lambda t: (order[t[0]], t[1]))


def _unit_state(run_dir: Path, unit: str) -> str | None:
    try:
        units = json.loads((run_dir / "manifest.json").read_text())["units"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return units.get(unit, {}).get("state")


def kill_and_resume(zygote: Zygote, args: list[str], run_dir: Path, log: Path,
                    targets: list[tuple[str, float]]) -> Report:
    """For each target (unit, offset): start the command if it is not running, wait until the
    unit runs, then `offset` seconds more (or until the unit is done), and SIGKILL it; re-run.
    Finally let the command finish. Returns where each kill landed and the exit code."""
    report = Report()
    pid = None
    for unit, offset in targets:
        if pid is None:
            report.attempts += 1
            pid = zygote.start(args, log)
        give_up = time.monotonic() + 300
        while _alive(pid) and _unit_state(run_dir, unit) not in ("running", "done"):
            if time.monotonic() > give_up:  # a hung run must fail the test, not stall it
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"unit {unit} did not start within 300 s; see {log}")
            time.sleep(0.01)
        deadline = time.monotonic() + offset
        while _alive(pid) and time.monotonic() < deadline and \
                _unit_state(run_dir, unit) != "done":
            time.sleep(0.01)
        if not _alive(pid):
            break  # the run finished (or failed) before this kill
        os.kill(pid, signal.SIGKILL)
        status = zygote.wait()
        pid = None
        if os.WIFSIGNALED(status):
            report.kills.append({"target": unit, **where_killed(run_dir)})
        else:
            report.exit_code = os.waitstatus_to_exitcode(status)
            return report
    if pid is None:
        report.attempts += 1
        zygote.start(args, log)
    report.exit_code = os.waitstatus_to_exitcode(zygote.wait())
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", required=True, help="the run folder the command writes")
    parser.add_argument("--timeline", required=True,
                        help="manifest.json of an uninterrupted run of the same command")
    parser.add_argument("args", nargs="+")
    ns = parser.parse_args()
    z = Zygote()
    plan = kill_targets(unit_timeline(Path(ns.timeline)), ns.kills, random.Random(ns.seed))
    result = kill_and_resume(z, ns.args, Path(ns.run_dir), Path(ns.run_dir).with_suffix(".log"),
                             plan)
    z.close()
    print(json.dumps(result.__dict__, indent=1))
