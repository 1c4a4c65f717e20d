"""`stop_tree` (fedstale/launcher/deploy.py) returns only once the processes it stopped are
gone. Flower's SuperLink starts its SuperExec in a session of its own, so stopping the
SuperLink's group leaves it; `stop_tree` SIGKILLs it by pid. On a loaded machine the kill
lands when the process next runs, which was after `stop_tree` had returned: a suite run
beside a second suite found the SuperExec still up (tests/test_simulation.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedstale.launcher import deploy
from fedstale.launcher.deploy import spawn, start_time, stop_tree
from fedstale.launcher.ports import descendants

# A leader that starts a child in a session of its own (as the SuperLink its SuperExec),
# prints the child's pid, and waits.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""
LATE_SECONDS = 0.5


def test_a_process_outside_the_group_is_gone_when_stop_tree_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each SIGKILL by pid lands LATE_SECONDS after it is sent, as on a busy machine."""
    log = tmp_path / "leader.log"
    leader = spawn([sys.executable, "-c", LEADER], dict(os.environ), log)
    child = 0
    try:
        deadline = time.monotonic() + 60
        while not log.read_text().strip():
            assert time.monotonic() < deadline and leader.poll() is None, log.read_text()
            time.sleep(0.05)
        child = int(log.read_text().split()[0])
        assert child in [pid for pid, _ in descendants(leader.pid)]

        kill = os.kill

        def late_kill(pid: int, sig: int) -> None:
            threading.Timer(LATE_SECONDS, kill, (pid, sig)).start()

        monkeypatch.setattr(deploy.os, "kill", late_kill)  # os.kill itself, until undo()
        stop_tree(leader, grace=5.0)
        assert leader.poll() is not None
        assert start_time(child) is None, "the child outlived stop_tree"
    finally:
        monkeypatch.undo()
        time.sleep(LATE_SECONDS)
        for pid in (leader.pid, child):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if pid:
                    os.kill(pid, signal.SIGKILL)


def test_start_time_tells_a_running_process_from_a_finished_one() -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = start_time(process.pid)
        assert started is not None and started == start_time(process.pid)
        process.kill()
        deadline = time.monotonic() + 10
        while start_time(process.pid) is not None:  # a zombie until reaped: None already
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    assert start_time(process.pid) is None
