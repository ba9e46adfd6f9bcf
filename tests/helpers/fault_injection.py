"""Fault injection: run a command, SIGKILL it at random moments, resume it with the same command.

A *zygote* process imports the project once and forks one child per attempt, so an attempt costs
the run's own work, not 4 s of imports; each child is a fresh process with its own RNG, DeepSpeed
engine and gloo group, killed with SIGKILL (no handler, no cleanup), exactly like a preemption.

    python tests/helpers/fault_injection.py --kills 20 --timeline STRAIGHT/manifest.json --run-dir DIR \\
        -- iterate --config configs/tiny.yaml run.root=...

Kill moments are drawn over an uninterrupted run's timeline (its manifest's units, each with its
start and finish time) and replayed unit by unit, so kills spread over every stage at any speed.
Each attempt times its own kill from inside (a watchdog forked as it enters the unit): a watcher
polling the manifest from outside misses a 0.05 s unit on a loaded machine.

`kill_and_resume` returns where each kill landed: the manifest unit that was running, and any
half-written files the kill left behind (temporary exports, checkpoint tags `latest` does not name).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ZYGOTE = r"""
import importlib, json, os, signal, socket, sys, time, traceback
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "helpers"))
import igrpo, torch, deepspeed, transformers  # noqa: F401  (imported once, before any fork)
import policy.algorithms, iteration.loop, reward_model.train, process_supervision.label  # noqa: F401
from iteration.manifest import Manifest

run_unit = Manifest.run


def kill_in(unit, seconds):
    # SIGKILL this process `seconds` into `unit`'s work (its state `running` written), from a
    # watchdog process it forks there, so a unit of 0.05 s is hit whatever the load: a watcher
    # polling the manifest comes too late, a timer thread waits for the GIL, and the grader's
    # alarm() cancels an itimer. Rank 0 only, the rank that writes the manifest (the others run
    # ahead of it into a unit); the zygote then kills the others. A unit the resumed run has
    # already passed (an earlier kill landed after it) is replaced by the first unit it does;
    # a unit whose work ends before the moment is killed at its end.
    armed = []

    def watchdog():
        target = os.getpid()
        if os.fork() == 0:
            time.sleep(seconds)
            if os.getppid() == target:  # still running (not ended, its pid not reused)
                os.kill(target, signal.SIGKILL)
            os._exit(0)

    def killed(work):
        watchdog()
        work()
        # the unit's work ended before its moment (this run goes faster than the timeline's):
        # die at its end, before its `done` is written, so every attempt's kill lands in its unit
        os.kill(os.getpid(), signal.SIGKILL)

    def run(self, name, work, plan=None):
        if not armed and not self.done(name) and (name == unit or self.done(unit)) \
                and os.environ.get("RANK", "0") == "0":
            armed.append(name)
            return run_unit(self, name, lambda: killed(work), plan)
        return run_unit(self, name, work, plan)
    Manifest.run = run


print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    ranks, script = request.get("ranks", 1), request.get("script")
    launched = ranks > 1 or script  # a helper script runs as torchrun starts it, 1 rank or more
    if launched:  # what a launcher (torchrun) gives each rank, on a fresh port per attempt
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            if launched:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                  LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port))
            os.environ.update(request.get("env") or {})
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(log, 1)
            os.dup2(log, 2)
            if request.get("kill"):
                kill_in(*request["kill"])
            code = 1
            try:
                if script:  # `python tests/helpers/SCRIPT.py ARGS`: its main(), then its exit
                    from runtime.dist import finish_process

                    sys.argv = [f"{script}.py", *request["args"]]
                    importlib.import_module(script).main()
                    code = finish_process(0)
                else:
                    code = igrpo.main(request["args"]) or 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    print(json.dumps({"pids": pids}), flush=True)
    statuses = {}
    while len(statuses) < len(pids):
        pid, status = os.wait()
        statuses[pid] = status
        if os.WIFSIGNALED(status):  # a preemption takes the whole node: every rank goes
            for other in pids:
                if other not in statuses:
                    os.kill(other, signal.SIGKILL)
    print(json.dumps({"statuses": [statuses[pid] for pid in pids]}), flush=True)
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
        self.ranks, self.pids = ranks, []
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(ROOT)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**clean, **(env or {})})
        assert json.loads(self.proc.stdout.readline())["ready"]

    def start(self, args: list[str], log: Path, kill: tuple[str, float] | None = None,
              ranks: int | None = None, script: str | None = None,
              env: dict | None = None) -> list[int]:
        """Start an attempt of `igrpo ARGS` (or, with `script`, of the helper
        `tests/helpers/SCRIPT.py ARGS` as torchrun starts it) on `ranks` processes (the
        zygote's by default), `env` added to theirs; with `kill` (unit, seconds), every rank is
        SIGKILLed that many seconds after it enters the unit, the others with the first."""
        self.proc.stdin.write(json.dumps({"args": [str(a) for a in args], "log": str(log),
                                          "ranks": ranks or self.ranks, "kill": kill,
                                          "script": script, "env": env}) + "\n")
        self.proc.stdin.flush()
        self.pids = json.loads(self.proc.stdout.readline())["pids"]
        return self.pids

    def wait(self, timeout: float | None = None) -> list[int]:
        """Every rank's wait status; past `timeout` seconds the attempt is killed and the wait
        fails (a hung run must fail a test, not stall it)."""
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            for pid in self.pids:
                os.kill(pid, signal.SIGKILL)
            self.proc.stdout.readline()
            raise TimeoutError(f"the attempt ran past {timeout:.0f} s")
        return json.loads(self.proc.stdout.readline())["statuses"]

    def run(self, args: list[str], log: Path) -> int:
        """Run to the end; the first failing rank's exit code (0 when all succeed)."""
        self.start(args, log)
        codes = [os.waitstatus_to_exitcode(s) for s in self.wait()]
        return next((c for c in codes if c != 0), 0)

    def launch(self, nproc: int, script: str, *args, log: Path, env: dict | None = None,
               timeout: float = 300) -> None:
        """`torchrun --nproc_per_node NPROC tests/helpers/SCRIPT.py ARGS` without the cold
        start: the ranks are forked from this zygote (its imports done), with the variables
        torchrun gives them; asserts every rank succeeded, showing the log's end if not."""
        self.start(list(args), log, ranks=nproc, script=script, env=env)
        codes = [os.waitstatus_to_exitcode(s) for s in self.wait(timeout)]
        assert codes == [0] * nproc, f"exit codes {codes}\n" + log.read_text()[-3000:]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


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


REQUIRED_WITHIN = 0.01
"""Seconds: a required unit's kill lands this early in it (the shortest, a labelling round of
the small test runs, takes 0.05 s on a quiet machine)."""


def kill_targets(timeline: list[tuple[str, float, float]], kills: int,
                 rng: random.Random, required: tuple[str, ...] = ()) -> list[tuple[str, float]]:
    """`kills` moments of the uninterrupted run, as (unit, seconds into it): one in each
    `required` unit, the others in a unit drawn uniformly (so short stages such as SFT,
    labelling and RM training are hit as often as long ones), then a moment uniform within it
    (within its first quarter, and its first REQUIRED_WITHIN seconds, for a required unit, which
    must be hit even when the killed run goes many times faster than the timeline's: a timeline
    recorded while the suite loads both cores ran 12x slower than the same run alone); in
    timeline order, so each kill lands at or after the previous one's place and the run keeps
    moving forward whatever the machine's speed."""
    order = {name: i for i, (name, _, _) in enumerate(timeline)}
    durations = {name: end - start for name, start, end in timeline}
    picks = [*((name, min(0.25 * durations[name], REQUIRED_WITHIN)) for name in required),
             *((name, durations[name]) for name, _, _ in
               (rng.choice(timeline) for _ in range(kills - len(required))))]
    targets = [(name, rng.uniform(0, within)) for name, within in picks]
    return sorted(targets, key=lambda t: (order[t[0]], t[1]))


def kill_and_resume(zygote: Zygote, args: list[str], run_dir: Path, log: Path,
                    targets: list[tuple[str, float]], timeout: float = 600) -> Report:
    """For each target (unit, offset): start the command, SIGKILLed (every rank) `offset`
    seconds after it enters the unit; re-run. Finally let the command finish. Returns where
    each kill landed and the exit code; a run that ends before a kill ends the report."""
    report = Report()
    for kill in [*targets, None]:
        report.attempts += 1
        zygote.start(args, log, kill)
        statuses = zygote.wait(timeout)
        # killed: rank 0 by its watchdog, the others by the zygote (or failing first, as the
        # collective they were in lost rank 0)
        if kill is None or not any(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL
                                   for s in statuses):
            report.exit_code = next((c for c in map(os.waitstatus_to_exitcode, statuses)
                                     if c != 0), 0)
            return report
        report.kills.append({"target": kill[0], **where_killed(run_dir)})
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
