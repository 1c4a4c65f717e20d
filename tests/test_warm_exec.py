"""The warm SuperExec (fedstale/launcher/warm_exec.py): each ClientApp task in a process of
its own, forked from one that imported the libraries once, with fresh generators and the
app's modules not yet imported; other tasks go to Flower's own executor. Its use in a real
deployment is every test of tests/test_deployment.py (`LocalDeployment` starts it beside
each SuperNode); tests/test_bounds.py runs it at Flower's lower and newest bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fedstale.launcher.warm_exec import ForkExecutor, request_of

ROOT = Path(__file__).resolve().parent.parent


def drive(folder: Path, *tokens: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """tests/warm_probe.py in a process of its own: the zygote's and each task's account."""
    command = [sys.executable, "-m", "tests.warm_probe", str(folder), *tokens]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
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
