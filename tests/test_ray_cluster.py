"""Flower simulation on a Ray cluster that is already running, named by RAY_ADDRESS
(fedstale/launcher/ray_cluster.py): a real two-node cluster on this machine (two `ray start`
raylets, one CPU each, each with a resource naming it), a SuperLink started with the
cluster's address in its environment, `fedstale run` on it. The ClientApp actors run on both
nodes, and the run is the one the same seed gives on one machine. Then the checks of the
address `fedstale run` and `fedstale check` make, without a cluster."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedstale.common.config import ConfigError
from fedstale.launcher.cli import main
from fedstale.launcher.deploy import spawn, stop_tree
from fedstale.launcher.ports import descendants, free_port, start_listening
from fedstale.launcher.ray_cluster import ray_cluster
from fedstale.server_app.results import read_jsonl
from tests import timing
from tests.flower_procs import SimulationSuperLink, alive

pytestmark = pytest.mark.xdist_group("deployments")  # a Ray cluster: one at a time
ROOT = Path(__file__).resolve().parent.parent
RAY = Path(sys.executable).parent / "ray"  # installed with flwr[simulation]
NODES = ("fedstale-node-a", "fedstale-node-b")  # a custom resource naming each node
CONFIG = (
    "dataset=digits num-clients=10 concurrency=3 lr=0.1 max-virtual-time=1500 "
    "eval-interval=250 seed=5"
)
STOP_SECONDS = 20.0


class RayCluster:
    """Ray nodes started with `ray start --block` on 127.0.0.1, each in a process session of
    its own and with a temp dir under one short folder in /tmp (Ray's socket paths must stay
    under ~107 characters). Stopped by PID: `ray stop` stops every Ray process of the user,
    and has no way to name one cluster."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        self.port = 0  # the head's GCS port, once it listens
        self.starts: list[subprocess.Popen] = []
        self.pids: set[int] = set()
        env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
        self.env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add_node(self, name: str) -> None:
        """A node of one CPU and the resource `name`: the first one the head (its GCS on a
        reserved port, started again on another if it does not come up), the others joining
        it. Every port Ray would otherwise take fixed is free."""
        command = [str(RAY), "start", "--block", "--disable-usage-stats"]
        command += ["--node-ip-address=127.0.0.1", "--num-cpus=1", f"--temp-dir={self.root / name}"]
        command += [f"--resources={json.dumps({name: 1})}"]
        command += [f"--dashboard-agent-listen-port={free_port()}"]
        log = self.root / f"{name}.log"
        if self.starts:
            command += [f"--address={self.address}"]
            self.starts.append(spawn(command, self.env, log))
            return

        def head(port: int) -> subprocess.Popen:
            flags = ["--head", f"--port={port}", "--include-dashboard=false"]
            flags += [f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"]
            return spawn([*command, *flags], self.env, log)

        process, self.port = start_listening(head, "the Ray head", log, stop=stop_tree)
        self.starts.append(process)

    def state(self, nodes: int = 0) -> dict:
        """tests/ray_state.py's report (after waiting for `nodes` live nodes)."""
        command = [sys.executable, "-m", "tests.ray_state", self.address, "--nodes", str(nodes)]
        result = subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.splitlines()[-1])

    def processes(self) -> set[int]:
        """Every process of this cluster now: each `ray start` and all below it."""
        found = set()
        for process in self.starts:
            found |= {process.pid, *(pid for pid, _ in descendants(process.pid))}
        return {pid for pid in found if alive(pid)}

    def stop(self) -> list[int]:
        """Stop the nodes (the head last), then remove the temp dirs; the PIDs of this
        cluster still alive after STOP_SECONDS (none expected)."""
        self.pids |= self.processes()
        for process in reversed(self.starts):
            stop_tree(process)
        deadline = time.monotonic() + STOP_SECONDS
        while any(alive(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.starts = []
        shutil.rmtree(self.root, ignore_errors=True)
        return sorted(pid for pid in self.pids if alive(pid))


@pytest.fixture
def cluster() -> Iterator[RayCluster]:
    if not RAY.is_file():
        pytest.skip(f"no `ray` command in this virtualenv ({RAY}); install flwr[simulation]")
    ray = RayCluster()
    try:
        yield ray
    finally:
        ray.stop()


def without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "wall_time"} for row in rows]


@pytest.mark.integration
def test_a_simulation_on_a_two_node_ray_cluster(
    cluster: RayCluster, superlink: SimulationSuperLink, tmp_path: Path
) -> None:
    started = time.monotonic()
    for name in NODES:
        cluster.add_node(name)
    nodes = {
        node["id"]: next(name for name in NODES if name in node["resources"])
        for node in cluster.state(nodes=len(NODES))["nodes"]
    }
    assert sorted(nodes.values()) == sorted(NODES)
    up = time.monotonic()

    link = SimulationSuperLink(tmp_path / "flwr-home", RAY_ADDRESS=cluster.address).start()
    try:
        # No Ray init args: Ray refuses them when it joins a cluster (each node declares its own).
        result, run_dir = link.run_app(
            ROOT, tmp_path, "cluster", CONFIG, timing.left(), federation=""
        )
    finally:
        link.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"RAY_ADDRESS={cluster.address} reaches the simulation only" in result.stderr
    ran = time.monotonic()
    report = cluster.state()

    # (a) Flower's actor pool: one ClientAppActor per CPU of the cluster, so one on each
    # node, and each ran ClientApps (a simulation that started a Ray of its own instead
    # leaves no actor and no task in this cluster).
    actors = Counter(nodes[actor["node"]] for actor in report["actors"])
    tasks = {nodes[node]: count for node, count in report["run_tasks"].items()}
    assert actors == dict.fromkeys(NODES, 1), report
    assert set(tasks) == set(NODES) and min(tasks.values()) > 0, report

    # No process of the cluster outlives it, checked by PID.
    pids = cluster.processes()
    assert len(pids) >= 5  # two `ray start`, a GCS and two raylets at least
    assert cluster.stop() == []
    stopped = time.monotonic()

    # (b) The run is the one the same seed gives on one machine (the session's SuperLink,
    # whose simulation starts a Ray of its own), on the virtual clock.
    alone, alone_dir = superlink.run_app(ROOT, tmp_path, "one-node", CONFIG, timeout=timing.left())
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert without_wall(read_jsonl(run_dir / "metrics.jsonl")) == without_wall(
        read_jsonl(alone_dir / "metrics.jsonl")
    )
    assert read_jsonl(run_dir / "updates.jsonl") == read_jsonl(alone_dir / "updates.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.3
    print(
        f"\ncluster up in {up - started:.1f} s, run on it {ran - up:.1f} s, stopped in "
        f"{stopped - ran:.1f} s, one-node run {time.monotonic() - stopped:.1f} s, "
        f"{time.monotonic() - started:.1f} s in all; actors per node {dict(actors)}, "
        f"ClientApp tasks per node {tasks}, {summary['updates_accepted']} updates, "
        f"{len(pids)} cluster processes stopped"
    )


def test_no_or_a_local_address_is_no_cluster() -> None:
    assert ray_cluster({}, {"init-args-num-cpus": 2}) is None
    assert ray_cluster({"RAY_ADDRESS": "local"}, {"init-args-num-cpus": 2}) is None
    assert ray_cluster({"RAY_ADDRESS": "auto"}, {"client-resources-num-cpus": 1}) == "auto"


def test_a_listening_head_is_the_cluster() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert ray_cluster({"RAY_ADDRESS": address}, {"num-supernodes": 10}) == address
        with pytest.raises(ConfigError, match="Ray refuses CPU and GPU counts"):
            ray_cluster({"RAY_ADDRESS": address}, {"init-args-num-gpus": 1})


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("head", "is not a Ray cluster's address"),
        ("head:", "is not a Ray cluster's address"),
        (":6379", "is not a Ray cluster's address"),
        ("head:70000", "is not a Ray cluster's address"),
        ("head:port", "is not a Ray cluster's address"),
        ("ray://head:10001", "is a Ray Client address"),
        ("127.0.0.1:CLOSED", "no Ray head answers there"),  # a free port, chosen in the test
    ],
)
def test_a_bad_address_is_one_line(address: str, message: str) -> None:
    address = address.replace("CLOSED", str(free_port()))  # not at collection: xdist workers
    with pytest.raises(ConfigError, match=message) as info:
        ray_cluster({"RAY_ADDRESS": address}, {})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("command", ["check", "run"])
def test_fedstale_refuses_a_bad_address_in_one_line(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    argv = [command, "--app", str(ROOT), "--run-config", f"dataset=digits runs-dir={tmp_path}"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no Ray head answers there" in lines[0], lines
    assert list(tmp_path.iterdir()) == []
