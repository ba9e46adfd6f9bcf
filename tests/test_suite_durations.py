"""bench/suite_durations.py: pytest's `--durations=0` report read into per-file and per-test
tables (hand-built report)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("suite_durations",
                                                  ROOT / "bench" / "suite_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_durations_report_sums_each_tests_phases_and_each_file():
    sd = _module()
    report = """........ [100%]
============================= slowest durations ==============================
120.50s setup    tests/test_a.py::test_one
30.00s call     tests/test_a.py::test_one
9.50s call     tests/test_b.py::test_two[x]
0.50s teardown tests/test_a.py::test_one
(3 durations < 0.005s hidden.)
3 passed in 80.00s
"""
    seconds = sd.durations(report)
    assert seconds == {"tests/test_a.py::test_one": 151.0, "tests/test_b.py::test_two[x]": 9.5}
    table = sd.tables(seconds, top=1)
    assert "| tests/test_a.py | 151 | 94% |" in table and "| tests/test_b.py | 10 | 6% |" in table
    assert "| **total** | **160** | |" in table
    assert table.endswith("| tests/test_a.py::test_one | 151 |")  # top 1 only
    with pytest.raises(SystemExit, match="--durations=0"):
        sd.durations("3 passed in 1.0s")
