"""Ports that cannot collide (fedstale/launcher/ports.py): a SuperNode whose port another
process takes first is started again on another port, a node that cannot start is one line
naming it, and two deployments started at once both complete."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedstale.launcher import cli, deploy, ports
from fedstale.launcher.deploy import LocalDeployment
from fedstale.launcher.launch import tool
from fedstale.launcher.ports import LaunchError, owner_listens, reserved_port
from tests import timing

pytestmark = pytest.mark.xdist_group("deployments")  # with the tests that start SuperNodes
ROOT = Path(__file__).resolve().parent.parent
TINY = "strategy=fedbuff dataset=digits buffer-size=2 max-virtual-time=0 eval-interval=500"


def test_a_reserved_port_is_handed_to_nobody_else_but_its_server_can_listen() -> None:
    with reserved_port() as port:
        handed = set()
        for _ in range(5000):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                handed.add(sock.getsockname()[1])
        assert port not in handed
        with socket.socket() as server:  # as uvicorn binds: SO_REUSEADDR
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()


class KernelHands:
    """A socket whose bind(0) gets the next port of `ports` (a kernel that happens to hand
    Flower's default ports first), for `reserved_port`."""

    ports: Iterator[int] = iter(())
    closed = 0

    def __enter__(self) -> KernelHands:
        return self

    def __exit__(self, *exc: object) -> None:
        KernelHands.closed += 1

    def setsockopt(self, *args: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        self.port = next(KernelHands.ports)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_reserved_port_is_never_one_of_flowers_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SuperLink of ours on 39091 would be taken by `fedstale run` for the user's local one."""
    monkeypatch.setattr(KernelHands, "ports", iter([39091, 9093, 39093, 41234]))
    monkeypatch.setattr(KernelHands, "closed", 0)
    monkeypatch.setattr(ports.socket, "socket", KernelHands)
    with reserved_port() as port:
        assert port == 41234
        assert KernelHands.closed == 0  # the defaults drawn stay held, so none comes back
    assert KernelHands.closed == 4


def test_a_listener_counts_only_when_it_is_the_process_own() -> None:
    with reserved_port() as port, socket.socket() as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.bind(("127.0.0.1", port))
        code = "import time; time.sleep(30)"
        process = subprocess.Popen([sys.executable, "-c", code])
        try:
            assert owner_listens(process, port) is None
            stranger.listen()
            assert owner_listens(process, port) is False  # someone listens, not the process
        finally:
            process.kill()
            process.wait()


class PortThief:
    """Listens on the port a SuperNode was given just before it starts, as another process
    on a busy machine can: `times` times for each partition named."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, times: dict[int, int]) -> None:
        self.left = dict(times)
        self.stolen: list[socket.socket] = []
        self.spawned: list[subprocess.Popen] = []
        self.real_spawn = deploy.spawn
        monkeypatch.setattr(deploy, "spawn", self.spawn)

    def spawn(self, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        found = re.search(r"partition-id=(\d+)", " ".join(command))
        if "flower-supernode" in command[0] and found:
            partition = int(found.group(1))
            if self.left.get(partition, 0) > 0:
                self.left[partition] -= 1
                self.take(int(command[command.index("--port") + 1]))
        process = self.real_spawn(command, env, log)
        self.spawned.append(process)
        return process

    def take(self, port: int) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        self.stolen.append(sock)

    def close(self) -> None:
        for sock in self.stolen:
            sock.close()


@pytest.fixture
def thief(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[PortThief]:
    taker = PortThief(monkeypatch, request.param)
    yield taker
    taker.close()


class SlowToList(LocalDeployment):
    """A deployment whose `flwr supernode ls` fails (None: timed out) `failures` times, then
    lists every node online; no process is started."""

    def __init__(self, home: Path, failures: int) -> None:
        super().__init__(home, 3)
        self.answers = [None] * failures
        self.timeouts: list[float] = []

    def online_nodes(self, timeout: float = deploy.LIST_SECONDS) -> int | None:
        self.timeouts.append(timeout)
        return self.answers.pop(0) if self.answers else 3


def test_a_slow_or_failed_node_listing_is_asked_again_until_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once, under load, the lower bound's first `flwr supernode ls` took over its 30 s while
    every node was up, and the deployment failed at once; the wait now asks again."""
    monkeypatch.setattr(deploy.time, "sleep", lambda _: None)
    slow = SlowToList(tmp_path, failures=2)
    slow.await_online(3, timeout=60.0)
    assert len(slow.timeouts) == 3 and all(t >= deploy.LIST_SECONDS for t in slow.timeouts)
    never = SlowToList(tmp_path, failures=10**6)
    with pytest.raises(LaunchError, match=r"did not list its SuperNodes .* within 0.2 s"):
        never.await_online(3, timeout=0.2)


@pytest.mark.integration
@pytest.mark.parametrize("thief", [{0: 1, 2: 2}], indirect=True)
def test_nodes_whose_ports_are_taken_first_start_on_others_and_all_are_online(
    thief: PortThief, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    deployment = LocalDeployment(tmp_path / "home", 3)
    with deployment:
        taken = {sock.getsockname()[1] for sock in thief.stolen}
        assert len(taken) == 3 and not taken & set(deployment.node_ports.values())
        assert all(node.poll() is None for node in deployment.nodes.values())
        assert deployment.online_nodes() == 3
    said = capfd.readouterr().err
    assert said.count("was taken; starting it again on another port") == 3, said
    assert all(process.poll() is not None for process in thief.spawned)


@pytest.mark.integration
@pytest.mark.parametrize("thief", [{1: 99}], indirect=True)
def test_a_node_that_cannot_start_fails_the_deployment_in_one_line_naming_it(
    thief: PortThief, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    config = f"{TINY} max-updates=4"
    argv = ["deploy", "--nodes", "2", "--keep-dir", str(home), "--run-config", config]
    assert cli.main(argv) == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("fedstale: SuperNode 1 (partition-id=1) did not start on 4 ports")
    assert f"its log: {home / 'supernode-1.log'}" in last and "listens on port" in last
    assert all(process.poll() is not None for process in thief.spawned)  # nothing left
    # the SuperLink, node 0 and its warm SuperExec, four tries of node 1 (no SuperExec)
    assert len(thief.spawned) == 1 + 2 + 4


@pytest.mark.integration
@pytest.mark.parametrize("thief", [{}], indirect=True)  # steals nothing, watches the starts
def test_a_superlink_on_a_port_fixed_by_the_user_that_is_taken_is_one_line(
    thief: PortThief, tmp_path: Path
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        deployment = LocalDeployment(tmp_path / "home", 1, port=port)
        with pytest.raises(LaunchError, match=rf"flower-superlink did not start on port {port}"):
            deployment.start()
    assert len(thief.spawned) == 1 and thief.spawned[0].poll() is not None
    assert deployment.nodes == {}


@pytest.mark.integration
def test_the_same_deployment_started_twice_at_once_both_complete(tmp_path: Path) -> None:
    """Two `fedstale deploy` of the same config at the same moment, each its own SuperLink
    and SuperNodes on ports of their own."""
    config = f"{TINY} max-updates=4 run-name=twice"
    results: dict[int, subprocess.CompletedProcess] = {}

    def deploy_one(index: int) -> None:
        folder = tmp_path / f"user{index}"
        folder.mkdir()
        command = [tool("fedstale"), "deploy", "--nodes", "2", "--timeout", timing.deploy_timeout()]
        command += ["--app", str(ROOT), "--run-config", f"{config} runs-dir={folder / 'runs'}"]
        home_parent = {**os.environ, "TMPDIR": str(folder)}  # its home inside tmp_path
        results[index] = subprocess.run(
            command,
            cwd=folder,
            env=home_parent,
            capture_output=True,
            text=True,
            timeout=timing.left(),
            check=False,
        )

    threads = [threading.Thread(target=deploy_one, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, result in results.items():
        assert result.returncode == 0, result.stderr[-3000:]
        assert "2 SuperNode(s) up" in result.stderr
        assert f"deployment in {(tmp_path / f'user{index}').resolve()}" in result.stderr
        summary = json.loads((tmp_path / f"user{index}/runs/twice/summary.json").read_text())
        assert summary["updates_accepted"] == 4


def test_deploy_says_a_node_and_client_count_that_cannot_work_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node k serves client k: `--nodes 2` with num-clients=6 would wait node-wait-seconds
    (120 s) for clients no node serves; it is one line before any process starts."""
    home = tmp_path / "home"
    config = "dataset=digits num-clients=6"
    argv = ["deploy", "--app", str(ROOT), "--nodes", "2", "--keep-dir", str(home)]
    assert cli.main([*argv, "--run-config", config]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("fedstale: --nodes 2 start one SuperNode per client, but num-clients=6")
    assert not home.exists()


def test_deploy_removes_its_temporary_folder_only_after_a_run_that_ended_well(
    tmp_path: Path,
) -> None:
    def home_with_logs(name: str) -> Path:
        home = tmp_path / name
        (home / "logs").mkdir(parents=True)
        (home / "supernode-0.log").write_text("ok\n")
        return home

    done = home_with_logs("done")
    deploy.tidy(done, 0, [tmp_path / "runs", None])
    assert not done.exists()
    failed = home_with_logs("failed")
    deploy.tidy(failed, 1, [tmp_path / "runs", None])
    assert (failed / "supernode-0.log").exists()  # what a user reads to see why
    holding = home_with_logs("holding")
    deploy.tidy(holding, 0, [holding / "runs", None])  # runs-dir inside it: never removed
    assert holding.exists()
