"""Each test bounded by its measured time (tests/timing.py): the table's arithmetic, its
recording, and a session whose test runs past its bound failing in one line with the
processes it started stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests import timing
from tests.flower_procs import alive
from tests.test_session_signals import WAITING_TEST

ROOT = Path(__file__).resolve().parent.parent
SLOW_TEST = (
    WAITING_TEST
    + """
from tests import timing

def test_quick():
    pass

def test_pays_a_one_time_cost():
    with timing.one_time("a setup"):
        time.sleep(2.5)  # past the test's own bound, within the cost's
"""
)


def table(path: Path, tests: dict[str, float], once: dict[str, float]) -> Path:
    path.write_text(json.dumps({"margin": 2.0, "floor": 1.0, "tests": tests, "once": once}))
    return path


def test_a_bound_is_the_margin_over_the_measure_at_least_the_floor() -> None:
    found = timing.Table(margin=3.0, floor=60.0, tests={"a": 100.0, "b": 1.0}, once={"c": 50.0})
    assert found.bound("a") == 300.0 and found.bound("b") == 60.0 and found.bound("x") is None
    assert found.largest() == 300.0
    assert found.once_bound("c") == 150.0 and found.once_bound("unmeasured") == 300.0
    assert timing.key("tests/t.py::test_x[a-b]@venvs") == "tests/t.py::test_x[a-b]"


def test_recording_keeps_the_slower_of_two_runs(tmp_path: Path) -> None:
    path = tmp_path / "durations.json"
    timing.record(path, {"a": 10.0, "b": 5.0}, {"c": 7.0}, "quiet")
    timing.record(path, {"a": 4.0, "b": 9.0}, {"c": 3.0}, "beside a second suite")
    found = timing.Table.read(path)
    assert found.tests == {"a": 10.0, "b": 9.0} and found.once == {"c": 7.0}
    assert found.measured == ["quiet", "beside a second suite"]
    assert (found.margin, found.floor) == (timing.MARGIN, timing.FLOOR)


def test_the_suites_table_measures_every_test_that_starts_flower_processes() -> None:
    """Each integration test (tests that start SuperLinks, SuperNodes, containers) has its
    own measure: none falls back to the largest bound."""
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "integration"],
        cwd=ROOT,
        env=timing.own_session_env(),
        capture_output=True,
        text=True,
        timeout=timing.left(),
    )
    names = [line for line in listed.stdout.splitlines() if "::" in line]
    assert names, listed.stdout[-2000:]
    missing = [name for name in names if timing.key(name) not in timing.table().tests]
    assert not missing, f"not measured (make durations): {missing}"


def test_a_test_past_its_bound_fails_in_one_line_and_stops_what_it_started(
    tmp_path: Path,
) -> None:
    source = tmp_path / "test_slow.py"
    source.write_text(SLOW_TEST)
    name = "test_slow.py::test_waits_with_a_process_of_its_own"
    durations = table(
        tmp_path / "durations.json",
        {"test_slow.py::test_quick": 0.1, name: 1.0, "test_slow.py::test_pays_a_one_time_cost": 0},
        {"a setup": 2.0},
    )
    pid_file = tmp_path / "child"
    env = timing.own_session_env(**{timing.TABLE_ENV: str(durations)}, CHILD_PID_FILE=str(pid_file))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    command += ["tests.conftest", "--rootdir", str(tmp_path), str(source)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout[-3000:]
    assert "1 failed, 2 passed" in done.stdout, done.stdout[-3000:]
    assert "ran past its time bound of 2 s (2 x its measured 1.0 s)" in done.stdout
    assert took < 60, took  # not the test's own 300 s
    assert not alive(int(pid_file.read_text())), "the test's process outlived its bound"
