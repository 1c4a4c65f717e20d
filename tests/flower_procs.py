"""A simulation SuperLink of the tests' own, on a free loopback port, stopped by PID: the
launcher's LocalDeployment without SuperNodes (the simulation runs the ClientApps)."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedstale.launcher.deploy import CONNECTION, LocalDeployment, start_time
from fedstale.launcher.launch import tool
from fedstale.launcher.ports import proc_stat

__all__ = [
    "CONNECTION",
    "ONE_CLIENTAPP",
    "SimulationSuperLink",
    "abandoned_flower_processes",
    "flower_processes_of_this_session",
]

FLOWER_COMMANDS = (
    "flower-superlink",
    "flower-supernode",
    "flower-superexec",
    "flwr-",
    "fedstale.launcher.warm_exec",  # the warm SuperExec, its zygote and its forked tasks
)
# Ray sized to one CPU: one ClientAppActor and one pre-started worker instead of one per core.
# The tests' runs are seeded on the virtual clock, so their results do not depend on how many
# ClientApps train at once; each run's start costs about 6 s of CPU less (32 s against 37-40 s
# for test_simulation's tiny digits run, measured on a 2-core machine).
ONE_CLIENTAPP = "init-args-num-cpus=1"
# Every process the tests start inherits this mark (a SuperExec orphaned by its SuperLink
# included), so what this process started is found, and a suite running beside it is not.
MARK_KEY = "FEDSTALE_TEST_SESSION"
# A session started with FEDSTALE_TEST_SCOPE (a test's own pytest session, killed on purpose)
# marks its processes "<scope>/<pid>-<ns>" and stops only the abandoned processes of its
# scope; the sessions of other suites on the machine neither see nor stop them, and it
# does not stop theirs.
SCOPE = os.environ.get("FEDSTALE_TEST_SCOPE", "")
SESSION = f"{SCOPE}/" * bool(SCOPE) + f"{os.getpid()}-{time.time_ns()}"  # pid, and when
os.environ[MARK_KEY] = SESSION


def marked_flower_processes() -> list[tuple[int, str, str]]:
    """Live Flower processes (SuperLink, SuperNode, SuperExec, flwr-*, fedstale's warm
    SuperExec) that carry a test session's mark: pid, command, the mark's value."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if (fields := proc_stat(entry.name)) is None or fields[0] == "Z":
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        mark = next((v for v in environ if v.startswith(MARK_KEY.encode() + b"=")), None)
        if mark and any(m in command for m in FLOWER_COMMANDS):
            found.append((int(entry.name), command[:200], mark.decode().split("=", 1)[1]))
    return found


def flower_processes_of_this_session() -> list[tuple[int, str]]:
    """The marked Flower processes this process started."""
    return [(pid, command) for pid, command, mark in marked_flower_processes() if mark == SESSION]


def abandoned_flower_processes() -> list[tuple[int, str]]:
    """The marked Flower processes whose session is gone: its test process was killed
    outright (SIGKILL, the machine's session ending), so nothing stopped them. A suite
    running beside this one is still alive and keeps its own."""
    return [
        (pid, command)
        for pid, command, mark in marked_flower_processes()
        if scope(mark) == SCOPE and gone(mark)
    ]


def scope(mark: str) -> str:
    """The scope a mark was made in: "" for a suite's own session."""
    return mark.rpartition("/")[0]


def gone(mark: str) -> bool:
    """The process that made `mark` ([scope/]pid-nanoseconds) has exited: its pid is not
    running, or is running a process that started after the mark was made (a reused pid)."""
    try:
        pid, made_ns = (int(part) for part in mark.rpartition("/")[2].split("-", 1))
    except ValueError:
        return True
    if (fields := proc_stat(pid)) is None:
        return True
    try:
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
    except (OSError, IndexError, ValueError, StopIteration):
        return True
    return fields[0] == "Z" or started > made_ns / 1e9 + 1.0  # btime is whole seconds


def alive(pid: int) -> bool:
    """`pid` is a live process (a zombie is not: it has exited, only its entry is left)."""
    return start_time(pid) is not None


@dataclass
class _Deployment(LocalDeployment):
    """A LocalDeployment whose processes get `extra` in their environment too."""

    extra: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, **self.extra}


class SimulationSuperLink:
    """`flower-superlink --simulation` plus a FLWR_HOME whose config names it. Flower 1.41
    serves the Runtime, Control and Fleet APIs on one HTTP port. `environment` goes to the
    SuperLink (its SuperExec and simulation inherit it) and to `fedstale run`."""

    def __init__(self, home: Path, **environment: str) -> None:
        self.link = _Deployment(home, 0, simulation=True, extra=environment)

    @property
    def env(self) -> dict[str, str]:
        return self.link.env

    def start(self) -> SimulationSuperLink:
        self.link.start()
        return self

    def stop(self) -> None:
        self.link.stop()

    def run_app(
        self,
        app: Path,
        runs: Path,
        name: str,
        config: str,
        timeout: float,
        federation: str = ONE_CLIENTAPP,
    ) -> tuple[subprocess.CompletedProcess, Path]:
        """`fedstale run` on this SuperLink; returns the process result and the run folder.
        `federation`: its --federation-config ("" for none)."""
        command = [
            tool("fedstale"),
            "run",
            "--app",
            str(app),
            "--superlink",
            CONNECTION,
            *(["--federation-config", federation] if federation else []),
            "--run-config",
            f"{config} run-name={name} runs-dir={runs}",
        ]
        result = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        return result, runs / name
