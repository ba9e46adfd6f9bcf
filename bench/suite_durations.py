"""Where the test suite's time goes: pytest's `--durations=0` report as tables (worker-seconds by
file, then the slowest tests), for bench/README.md.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > durations.txt
    python bench/suite_durations.py durations.txt [--top 20]

Seconds are each test's own (setup, call and teardown, module fixtures in the setup of the
first test that needs them), summed per file; on two workers the wall time is about half the
total when the workers stay busy to the end.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

ROW = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+)")


def durations(text: str) -> dict[str, float]:
    """Seconds per test id (its setup, call and teardown together)."""
    seconds: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            seconds[match.group(3)] += float(match.group(1))
    if not seconds:
        raise SystemExit("no `--durations=0` rows found (run pytest with --durations=0)")
    return dict(seconds)


def tables(seconds: dict[str, float], top: int) -> str:
    files: dict[str, float] = defaultdict(float)
    for test, s in seconds.items():
        files[test.split("::")[0]] += s
    total = sum(files.values())
    lines = ["| file | worker-seconds | share |", "| --- | --- | --- |"]
    lines += [f"| {name} | {s:.0f} | {s / total:.0%} |"
              for name, s in sorted(files.items(), key=lambda kv: -kv[1]) if s >= 0.01 * total]
    small = [s for s in files.values() if s < 0.01 * total]
    if small:
        lines.append(f"| the other {len(small)} files | {sum(small):.0f} | "
                     f"{sum(small) / total:.0%} |")
    lines += [f"| **total** | **{total:.0f}** | |", "", "| test | seconds |", "| --- | --- |"]
    lines += [f"| {test} | {s:.0f} |"
              for test, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="pytest's output with --durations=0")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    print(tables(durations(args.log.read_text()), args.top))


if __name__ == "__main__":
    main()
