"""A SIGTERM sent to pytest ends the session with its tests' processes stopped
(tests/conftest.py): a test's `finally` runs, as on Ctrl-C."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import timing
from tests.flower_procs import alive, gone, scope

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


def sigterm_session(
    tmp_path: Path, source: str, pid_files: list[Path], grace: float, *options: str
) -> None:
    """pytest (with this suite's conftest) on the test file `source`, in a process group of
    its own; once every pid file names the process a test or fixture started, a SIGTERM to
    the group. The session must end as interrupted and, within `grace` seconds, leave none
    of those processes alive."""
    (tmp_path / "test_signalled.py").write_text(source)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    command += ["tests.conftest", *options, "--rootdir", str(tmp_path)]
    command += [str(tmp_path / "test_signalled.py")]
    env = timing.own_session_env(CHILD_PID_FILE=str(tmp_path / "child-"))
    session = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all(f.is_file() and f.read_text() for f in pid_files):
            assert session.poll() is None and time.monotonic() < deadline, session.stdout.read()
            time.sleep(0.2)
        time.sleep(1.0 if len(pid_files) > 1 else 0.0)  # every test started
        children = [int(f.read_text()) for f in pid_files]
        os.killpg(session.pid, signal.SIGTERM)
        output, _ = session.communicate(timeout=60)
    finally:
        session.kill()
        session.wait()
    deadline = time.monotonic() + grace
    while any(alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert session.returncode == 2, output  # pytest's "interrupted"
        assert not any(alive(c) for c in children), output
    finally:
        for child in children:
            if alive(child):
                os.kill(child, signal.SIGKILL)


def test_a_sigterm_to_pytest_stops_the_running_tests_processes(tmp_path: Path) -> None:
    sigterm_session(tmp_path, WAITING_TEST, [tmp_path / "child-"], 0.0)


SESSION_FIXTURE_TEST = """
import os, subprocess, sys, time
from pathlib import Path

import pytest

@pytest.fixture(scope="session")
def server():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True
    )
    Path(os.environ["CHILD_PID_FILE"] + os.environ["PYTEST_XDIST_WORKER"]).write_text(
        str(child.pid)
    )
    yield child
    child.kill()
    child.wait()

@pytest.mark.parametrize("number", [0, 1])
def test_waits_on_a_session_server(server, number):
    time.sleep(300)
"""


def test_a_sigterm_to_a_parallel_session_stops_its_workers_session_fixtures(
    tmp_path: Path,
) -> None:
    """A SIGTERM to a parallel session's process group (a CI job's end) reaches the workers
    too: each unwinds its running test and tears down its session fixtures (the suite's
    simulation SuperLink), which a worker may finish after the main process has ended."""
    files = [tmp_path / f"child-gw{i}" for i in (0, 1)]
    sigterm_session(tmp_path, SESSION_FIXTURE_TEST, files, 20.0, "-n", "2")


LEAVING_TEST = """
import os, subprocess, sys, time
from pathlib import Path

def test_starts_a_flower_process_and_is_killed():
    child = subprocess.Popen(  # a stand-in SuperNode, with this session's mark
        [sys.executable, "-c", "import time; time.sleep(300)", "flower-supernode"],
        start_new_session=True,
    )
    Path(os.environ["CHILD_PID_FILE"]).write_text(str(child.pid))
    time.sleep(300)
"""


def test_a_session_killed_outright_has_its_flower_processes_stopped_by_the_next(
    tmp_path: Path,
) -> None:
    """SIGKILL leaves no teardown to run: the session's SuperNode keeps running. The next
    session stops it as it starts (its mark names a process that is gone)."""
    (tmp_path / "test_killed.py").write_text(LEAVING_TEST)
    (tmp_path / "test_next.py").write_text("def test_nothing():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    command += ["tests.conftest", "--rootdir", str(tmp_path)]
    pid_file = tmp_path / "child"
    # A scope of their own: another session on the machine (a suite beside this one, or a
    # test of this one starting pytest) stops abandoned processes as it starts, and would
    # stop this one's on purpose abandoned stand-in before the next session is run.
    scope_of_its_own = {"FEDSTALE_TEST_SCOPE": secrets.token_hex(8)}
    env = timing.own_session_env(CHILD_PID_FILE=str(pid_file), **scope_of_its_own)
    killed = subprocess.Popen(
        [*command, str(tmp_path / "test_killed.py")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    child = 0
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.is_file() and pid_file.read_text()):
            assert killed.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        child = int(pid_file.read_text())
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        time.sleep(0.5)
        assert alive(child)  # nothing stopped it
        done = subprocess.run(
            [*command, str(tmp_path / "test_next.py")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout[-2000:]
        assert not alive(child), "the next session left the killed one's SuperNode running"
    finally:
        killed.kill()
        killed.wait()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_mark_is_gone_when_its_process_is_or_its_pid_was_reused() -> None:
    assert not gone(f"{os.getpid()}-{time.time_ns()}")  # this process, running
    assert gone(f"{os.getpid()}-0")  # this pid, but a process started after the mark: reused
    exited = subprocess.Popen(["true"])
    exited.wait()
    assert gone(f"{exited.pid}-{time.time_ns()}")
    assert gone("not-a-mark")
    assert gone(f"a-scope/{exited.pid}-{time.time_ns()}")
    assert not gone(f"a-scope/{os.getpid()}-{time.time_ns()}")
    assert scope(f"a-scope/{os.getpid()}-1") == "a-scope" and scope(f"{os.getpid()}-1") == ""
