from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import timing
from tests.flower_procs import (
    SimulationSuperLink,
    abandoned_flower_processes,
    flower_processes_of_this_session,
)

# Client shares are cached on disk (fedstale/common/federation.py); keep the tests' out of ~/.cache,
# in a directory of their own that the session removes when it ends (~200 MB per session).
_OWN_CACHE = (
    None if "FEDSTALE_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="fedstale-cache-")
)
if _OWN_CACHE is not None:
    os.environ["FEDSTALE_CACHE_DIR"] = _OWN_CACHE
# Secure aggregation's holders record what they answered (fedstale/client_app/secagg.py):
# the suite's records in a folder of its own, removed with the cache.
_OWN_SECAGG = (
    None if "FEDSTALE_SECAGG_DIR" in os.environ else tempfile.mkdtemp(prefix="fedstale-secagg-")
)
if _OWN_SECAGG is not None:
    os.environ["FEDSTALE_SECAGG_DIR"] = _OWN_SECAGG


# This machine's environment sets PYTHONDONTWRITEBYTECODE; a user's Python writes bytecode.
# With it, every process the suite starts (each SuperNode's ClientApp task, each Ray worker,
# each `fedstale` command) compiled fedstale's modules again: a forked ClientApp task of a
# deployment took 0.54 s of CPU, and 0.41 s with the bytecode written once.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

_TEMP_DIRS: list[str] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for folder in [_OWN_CACHE, _OWN_SECAGG, *_TEMP_DIRS]:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        help="merge each passed test's seconds into the time-bound table at PATH (tests/timing.py)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    """Every test bounded by its measured time (tests/timing.py), setup to teardown."""
    timing.arm(item.nodeid, item.user_properties)
    try:
        return (yield)
    finally:
        timing.disarm()


class DurationRecorder:
    """Each passed test's seconds (its one-time costs apart), merged into a table at the
    session's end: in the process that sees every report (xdist's controller)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, float] = {}
        self.once: dict[str, float] = {}
        self.failed: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = timing.key(report.nodeid)
        self.tests[name] = self.tests.get(name, 0.0) + report.duration
        if report.failed or report.skipped:
            self.failed.add(name)
        if report.when != "teardown":
            return
        for kind, value in report.user_properties:
            if kind == timing.ONE_TIME_PROPERTY:
                cost, seconds = value  # type: ignore[misc]
                self.once[cost] = max(self.once.get(cost, 0.0), seconds)
                self.tests[name] -= seconds

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        passed = {name: s for name, s in self.tests.items() if name not in self.failed}
        workers = getattr(session.config.option, "numprocesses", None) or 0
        note = (
            f"{time.strftime('%Y-%m-%d %H:%M')}: {len(passed)} tests, {os.cpu_count()} cores, "
            f"{workers} xdist workers, load average {os.getloadavg()[0]:.1f} at the end"
        )
        timing.record(self.path, passed, self.once, note)


def pytest_configure(config: pytest.Config) -> None:
    if (path := config.getoption("record_durations")) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(Path(path).resolve()), "durations")
    _stop_on_sigterm()


def _stop_on_sigterm() -> None:
    """A SIGTERM (a CI time limit, a job manager, `kill`) ends the session as Ctrl-C does:
    the running test unwinds, so the `with` blocks and fixtures that started Flower
    processes stop them. Without this the process died at once and its SuperLinks and
    SuperNodes, each in a session of its own, kept running."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


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
    if last and worker == "gw0" and not config.option.collectonly:
        from tests.containers import prebuild

        _TEMP_DIRS.append(tempfile.mkdtemp(prefix="fedstale-containers-"))
        prebuild(Path(_TEMP_DIRS[-1]))


@pytest.fixture(scope="session", autouse=True)
def no_flower_process_left() -> Iterator[None]:
    """Set up first, torn down last: the Flower processes of a session killed outright (whose
    teardown never ran) are stopped first; after every test of this process (a worker, in a
    parallel session), no Flower process any of them started may be left running."""
    for pid, _ in abandoned_flower_processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    stopped_within(abandoned_flower_processes, 10.0)
    yield
    left = stopped_within(flower_processes_of_this_session, 20.0)
    assert not left, f"Flower processes left running by the tests: {left}"


def stopped_within(
    find: Callable[[], list[tuple[int, str]]], grace: float
) -> list[tuple[int, str]]:
    """Wait up to `grace` seconds for `find()` to come back empty (a SIGTERMed process may
    take a moment to exit), then SIGKILL what it still finds; returns those."""
    deadline = time.monotonic() + grace
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


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


_SEEN: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _SEEN.add(timing.key(report.nodeid))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if missing := sorted(_SEEN - set(timing.table().tests)):
        terminalreporter.write_line(
            f"{len(missing)} tests have no measured time in tests/durations.json and were "
            f"bounded by its largest (record them: make durations): {', '.join(missing[:5])}"
        )
