from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.flower_procs import SimulationSuperLink

# Client shares are cached on disk (fedstale/common/federation.py); keep the tests' out of ~/.cache,
# in a directory of their own that the session removes when it ends (~200 MB per session).
_OWN_CACHE = (
    None if "FEDSTALE_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="fedstale-cache-")
)
if _OWN_CACHE is not None:
    os.environ["FEDSTALE_CACHE_DIR"] = _OWN_CACHE


_TEMP_DIRS: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for folder in [_OWN_CACHE, *_TEMP_DIRS]:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """The container tests run last, and their images (minutes to build on a fresh machine)
    start building, at the lowest priority, as the session starts: in the first worker of a
    parallel session (a worker that runs them finds the build under way behind a lock)."""
    last = [item for item in items if item.path.name == "test_containers.py"]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # each xdist worker collects all
    if last:
        items[:] = [item for item in items if item.path.name != "test_containers.py"] + last
    if last and worker == "gw0":
        from tests.containers import prebuild

        _TEMP_DIRS.append(tempfile.mkdtemp(prefix="fedstale-containers-"))
        prebuild(Path(_TEMP_DIRS[-1]))


FLOWER_COMMANDS = ("flower-superlink", "flower-supernode", "flower-superexec", "flwr-")
# Every process the tests start inherits this mark (a SuperExec orphaned by its SuperLink
# included), so what this process started is found, and a suite running beside it is not.
SESSION_MARK = f"FEDSTALE_TEST_SESSION={os.getpid()}-{time.time_ns()}"
os.environ["FEDSTALE_TEST_SESSION"] = SESSION_MARK.split("=", 1)[1]


def flower_processes_of_this_session() -> list[tuple[int, str]]:
    """Live Flower processes (SuperLink, SuperNode, SuperExec, flwr-*) that carry the mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            marked = SESSION_MARK.encode() in (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if marked and any(m in command for m in FLOWER_COMMANDS):
            found.append((int(entry.name), command[:200]))
    return found


@pytest.fixture(scope="session", autouse=True)
def no_flower_process_left() -> Iterator[None]:
    """Set up first, torn down last: after every test of this process (a worker, in a
    parallel session), no Flower process any of them started may be left running."""
    yield
    deadline = time.monotonic() + 20.0  # a SIGTERMed process may take a moment to exit
    while (left := flower_processes_of_this_session()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"Flower processes left running by the tests: {left}"


@pytest.fixture(scope="session")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulationSuperLink]:
    """One simulation SuperLink for the session, on a free port, stopped by PID."""
    link = SimulationSuperLink(Path(tmp_path_factory.mktemp("flwr-home"))).start()
    yield link
    link.stop()


@pytest.fixture
def in_a_clientapp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity Flower gives a ClientApp's process (a Message needs it)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)
