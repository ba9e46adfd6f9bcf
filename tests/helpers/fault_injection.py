"""Fault injection: run a command, SIGKILL it at random moments, resume it with the same command.

A *zygote* process imports the project once and forks one child per attempt, so an attempt costs
the run's own work, not 4 s of imports; each child is a fresh process with its own RNG, DeepSpeed
engine and gloo group, killed with SIGKILL (no handler, no cleanup), exactly like a preemption.

    python tests/helpers/fault_injection.py --kills 20 --timeline STRAIGHT/manifest.json --run-dir DIR \\
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

ROOT = Path(__file__).resolve().parents[2]

ZYGOTE = r"""
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
import igrpo, torch, deepspeed, transformers  # noqa: F401  (imported once, before any fork)
import policy.algorithms, iteration.loop, reward_model.train, process_supervision.label  # noqa: F401
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    ranks = request.get("ranks", 1)
    if ranks > 1:  # what a launcher (torchrun) gives each rank, on a fresh port per attempt
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            if ranks > 1:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                  LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
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
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    print(json.dumps({"statuses": [os.waitpid(pid, 0)[1] for pid in pids]}), flush=True)
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
    """Forks attempts of a command from a process that imported the project once. With `ranks`
    > 1 each attempt is that many processes of one torch.distributed job (gloo), given the
    variables torchrun gives its workers, all killed together (a node's preemption)."""

    def __init__(self, env: dict | None = None, ranks: int = 1):
        clean = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
        self.ranks = ranks
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(ROOT)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**clean, **(env or {})})
        assert json.loads(self.proc.stdout.readline())["ready"]

    def start(self, args: list[str], log: Path) -> list[int]:
        self.proc.stdin.write(json.dumps({"args": args, "log": str(log),
                                          "ranks": self.ranks}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pids"]

    def wait(self) -> list[int]:
        """Every rank's wait status."""
        return json.loads(self.proc.stdout.readline())["statuses"]

    def run(self, args: list[str], log: Path) -> int:
        """Run to the end; the first failing rank's exit code (0 when all succeed)."""
        self.start(args, log)
        codes = [os.waitstatus_to_exitcode(s) for s in self.wait()]
        return next((c for c in codes if c != 0), 0)

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
                 rng: random.Random, required: tuple[str, ...] = ()) -> list[tuple[str, float]]:
    """`kills` moments of the uninterrupted run, as (unit, seconds into it): one in each
    `required` unit, the others in a unit drawn uniformly (so short stages such as SFT,
    labelling and RM training are hit as often as long ones), then a moment uniform within it
    (within its first quarter for a required unit, which must be hit even when the killed run
    goes up to 4x faster than the timeline's, a machine less loaded); in timeline order, so each
    kill lands at or after the previous one's place and the run keeps moving forward whatever
    the machine's speed."""
    order = {name: i for i, (name, _, _) in enumerate(timeline)}
    durations = {name: end - start for name, start, end in timeline}
    picks = [*((name, 0.25) for name in required),
             *((rng.choice(timeline)[0], 1.0) for _ in range(kills - len(required)))]
    targets = [(name, rng.uniform(0, share * durations[name])) for name, share in picks]
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
    unit runs, then `offset` seconds more (or until the unit is done), and SIGKILL it (every
    rank); re-run. Finally let the command finish. Returns where each kill landed and the exit
    code."""
    report = Report()
    pids: list[int] = []

    def alive() -> bool:
        return any(_alive(pid) for pid in pids)

    for unit, offset in targets:
        if not pids:
            report.attempts += 1
            pids = zygote.start(args, log)
        give_up = time.monotonic() + 300
        while alive() and _unit_state(run_dir, unit) not in ("running", "done"):
            if time.monotonic() > give_up:  # a hung run must fail the test, not stall it
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"unit {unit} did not start within 300 s; see {log}")
            time.sleep(0.01)
        deadline = time.monotonic() + offset
        while alive() and time.monotonic() < deadline and \
                _unit_state(run_dir, unit) != "done":
            time.sleep(0.01)
        if not all(_alive(pid) for pid in pids):
            break  # the run finished (or a rank failed) before this kill
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        statuses = zygote.wait()
        pids = []
        if all(os.WIFSIGNALED(s) for s in statuses):
            report.kills.append({"target": unit, **where_killed(run_dir)})
        else:
            report.exit_code = next((os.waitstatus_to_exitcode(s) for s in statuses
                                     if not os.WIFSIGNALED(s)), None)
            return report
    if not pids:
        report.attempts += 1
        zygote.start(args, log)
    codes = [os.waitstatus_to_exitcode(s) for s in zygote.wait()]
    report.exit_code = next((c for c in codes if c != 0), 0)
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
