"""A SIGTERM sent to pytest ends the session with its tests' processes stopped
(tests/conftest.py): a test's `finally` runs, as on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.flower_procs import alive

ROOT = Path(__file__).resolve().parent.parent
WAITING_TEST = """
import os, subprocess, sys, time
from pathlib import Path

def test_waits_with_a_process_of_its_own():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True
    )
    try:
        Path(os.environ["CHILD_PID_FILE"]).write_text(str(child.pid))
        time.sleep(300)
    finally:
        child.kill()
        child.wait()
"""


def test_a_sigterm_to_pytest_stops_the_running_tests_processes(tmp_path: Path) -> None:
    (tmp_path / "test_waiting.py").write_text(WAITING_TEST)
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    command += ["tests.conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_waiting.py")]
    env = {**os.environ, "CHILD_PID_FILE": str(pid_file)}
    session = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.is_file() or not pid_file.read_text():
            assert session.poll() is None and time.monotonic() < deadline, session.stdout.read()
            time.sleep(0.2)
        child = int(pid_file.read_text())
        session.send_signal(signal.SIGTERM)
        output, _ = session.communicate(timeout=60)
    finally:
        session.kill()
        session.wait()
    try:
        assert session.returncode == 2, output  # pytest's "interrupted"
        assert not alive(child), output
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
