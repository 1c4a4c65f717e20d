"""The warm SuperExec (fedstale/launcher/warm_exec.py): each ClientApp task in a process of
its own, forked from one that imported the libraries once, with fresh generators and the
app's modules not yet imported; other tasks go to Flower's own executor. Its use in a real
deployment is every test of tests/test_deployment.py (`LocalDeployment` starts it beside
each SuperNode); tests/test_bounds.py runs it at Flower's lower bound and
tests/test_rule_package.py at the newest."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedstale.launcher.ports import proc_stat
from fedstale.launcher.warm_exec import ForkExecutor, request_of
from tests import timing

ROOT = Path(__file__).resolve().parent.parent


def drive(folder: Path, *tokens: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """tests/warm_probe.py in a process of its own: the zygote's and each task's account."""
    command = [sys.executable, "-m", "tests.warm_probe", str(folder), *tokens]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timing.left())
    assert done.returncode == 0, done.stderr[-2000:]
    tasks = {token: json.loads((folder / f"{token}.json").read_text()) for token in tokens}
    return json.loads(done.stdout.strip().splitlines()[-1]), tasks


def test_each_task_is_its_own_fresh_process(tmp_path: Path) -> None:
    zygote, tasks = drive(tmp_path, "a", "b")
    a, b = tasks["a"], tasks["b"]
    assert a["pid"] != b["pid"] and a["parent"] == b["parent"] == zygote["zygote"]
    assert a["numpy"] != b["numpy"] and a["torch"] != b["torch"]  # reseeded, not shared
    assert not a["fedstale_loaded"] and not b["fedstale_loaded"]  # the app comes from its FAB
    assert a["insecure"] and a["parent_pid"] == zygote["driver"]
    # The default preloads hold what a task's first torch optimizer would import (1.4 s).
    assert a["imported_by_an_optimizer"] == [] == b["imported_by_an_optimizer"]


def test_a_failed_task_costs_only_itself_and_closing_stops_the_warm_process(
    tmp_path: Path,
) -> None:
    zygote, tasks = drive(tmp_path, "fails", "quiet")
    assert tasks["quiet"]["parent"] == zygote["zygote"]  # forked after a task exited with 3
    assert zygote["late"] is False  # closed: a launch no longer reaches it
    with pytest.raises(ProcessLookupError):
        os.kill(zygote["zygote"], 0)


@dataclass(frozen=True)
class Spec:
    task_type: str
    insecure: bool = True
    root_certificates_path: str | None = None
    runtime_dependency_install: bool = False
    runtime_api_address: str = "127.0.0.1:9094"
    token: str = "t"
    parent_pid: int = 1
    suppress_output: bool = False


class Recorder:
    def __init__(self) -> None:
        self.launched: list[Spec] = []

    def launch(self, spec: Spec) -> str:
        self.launched.append(spec)
        return "flower's"


class Requests:
    def __init__(self, reachable: bool = True) -> None:
        self.sent: list[dict[str, Any]] = []
        self.reachable = reachable

    def launch(self, request: dict[str, Any]) -> bool:
        self.sent.append(request)
        return self.reachable


def test_only_clientapp_tasks_are_forked(capsys: pytest.CaptureFixture[str]) -> None:
    executor = ForkExecutor(Requests())  # type: ignore[arg-type]
    executor.flower = Recorder()  # type: ignore[assignment]
    assert executor.launch(Spec("flwr-clientapp")).status == "accepted"
    assert executor.launch(Spec("flwr-serverapp")) == "flower's"
    assert executor.launch(Spec("flwr-clientapp", runtime_dependency_install=True)) == "flower's"
    assert [s.task_type for s in executor.flower.launched] == ["flwr-serverapp", "flwr-clientapp"]
    assert executor.zygote.sent[0]["token"] == "t"  # type: ignore[attr-defined]

    gone = ForkExecutor(Requests(reachable=False))  # type: ignore[arg-type]
    gone.flower = Recorder()  # type: ignore[assignment]
    assert gone.launch(Spec("flwr-clientapp")) == gone.launch(Spec("flwr-clientapp")) == "flower's"
    assert capsys.readouterr().out.count("the warm process is gone") == 1


def test_a_tls_runtime_api_passes_its_certificates(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    sent = request_of(Spec("flwr-clientapp", insecure=False, root_certificates_path=str(ca)))
    assert sent["certificates"] == ca.read_text() and sent["insecure"] is False
    assert request_of(Spec("flwr-clientapp"))["certificates"] is None


LINGERING = """
import os, signal, sys, time
if os.fork() == 0:  # a task still in its exit handlers: it outlives its SuperExec's SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(os.getpid(), flush=True)
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_stopping_a_superexec_stops_what_is_left_of_its_group(tmp_path: Path) -> None:
    """The leader exits at SIGTERM, a forked task does not: the whole group is stopped
    (deploy.stop), where stopping the leader alone had left the task running."""
    import time

    from fedstale.launcher.deploy import group_alive, spawn, stop

    log = tmp_path / "group.log"
    leader = spawn([sys.executable, "-c", LINGERING], dict(os.environ), log)
    try:
        deadline = time.monotonic() + 30
        while not log.read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        task = int(log.read_text().split()[0])
        started = time.monotonic()
        stop(leader, grace=1.0)
        assert not group_alive(leader.pid) and leader.poll() is not None
        assert not Path(f"/proc/{task}").exists() or state(task) == "Z"
        assert time.monotonic() - started < 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, 9)


def test_the_warm_process_dies_with_its_superexec_however_that_ends(tmp_path: Path) -> None:
    """A SuperExec SIGKILLed (no exit handler runs) takes its warm process with it, so no
    process of a stopped node is left (Linux: PR_SET_PDEATHSIG)."""
    import signal
    import time

    from fedstale.launcher.ports import descendants

    command = [sys.executable, "-m", "fedstale.launcher.warm_exec", "--insecure"]
    command += ["--runtime-api-address", "127.0.0.1:1", "--preload", "numpy"]
    superexec = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (below := descendants(superexec.pid)):
            assert time.monotonic() < deadline and superexec.poll() is None
            time.sleep(0.05)
        zygote = below[0][0]
        os.kill(superexec.pid, signal.SIGKILL)
        superexec.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zygote}").exists() and "Z" not in state(zygote):
            assert time.monotonic() < deadline, "the warm process outlived its SuperExec"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(superexec.pid, signal.SIGKILL)
        superexec.wait(10)


def state(pid: int) -> str:
    fields = proc_stat(pid)
    return "Z" if fields is None else fields[0]
