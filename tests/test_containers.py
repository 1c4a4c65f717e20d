"""The docker-compose demo really run: images built from docker/Dockerfile (on local
stand-ins of Flower's images), docker/compose.yml brought up with podman-compose (or
`docker compose`), a FedBuff run over its three SuperNode containers with one killed
mid-run, state kept across `down` and `up`, the TLS variant with an unregistered SuperNode
refused, and nothing left behind. Skipped, with one line, only where no container runtime
can start a container."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedstale.launcher.deploy import TlsFiles, make_keys
from fedstale.launcher.launch import flower_env, tool
from fedstale.server_app.results import read_jsonl
from tests import containers
from tests.containers import Compose, Runtime

pytestmark = pytest.mark.integration
ROOT = containers.ROOT
FMNIST = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST from the SuperNodes' data mount, the linear model, short local work.
RUN = (
    "strategy=fedbuff clock=wall num-clients=3 concurrency=3 buffer-size=2 dataset=fmnist "
    "model=linear local-steps=20 eval-interval=10"
)
RUN_TIMEOUT = 420
CONTAINER_UID = 1000  # not root and not Flower's app user: the README's FEDSTALE_UID case


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    found = containers.find_runtime(tmp_path_factory.mktemp("runtime"))
    if isinstance(found, str):
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def images(runtime: Runtime) -> dict[str, int]:
    started = time.monotonic()
    containers.build_images(runtime)
    sizes = {
        name: containers.image_size(runtime, name)
        for name in ("fedstale-superlink:0.1.0", "fedstale-supernode:0.1.0")
    }
    print(f"images built in {time.monotonic() - started:.0f} s: {sizes}")
    return sizes


def owned(path: Path, uid: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for item in [path, *path.rglob("*")]:
        os.chown(item, uid, uid)
    return path


def container_user(runtime: Runtime) -> int:
    """Docker and rootful podman: a non-root user as the README says; rootless podman: 0,
    which is the host user."""
    if runtime.engine == "podman" and os.geteuid() != 0:
        return 0
    return CONTAINER_UID if os.geteuid() == 0 else os.getuid()


@pytest.fixture
def project(runtime: Runtime, images: dict[str, int], tmp_path: Path) -> Iterator[Compose]:
    """A compose project of docker/compose.yml; `env` is what the README exports. Torn down
    by label at the end, and nothing of it may be left."""
    uid = container_user(runtime)
    runs = owned(tmp_path / "runs", uid) if uid else tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    port = containers_port()
    env = {
        "FEDSTALE_RUNS": str(runs),
        "FEDSTALE_UID": str(uid),
        "FEDSTALE_GID": str(uid),
        "FEDSTALE_PORT": str(port),
        "FEDSTALE_DATA": str(FMNIST.parent),
        "FLOWER_IMAGES": containers.STANDIN,
    }
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "docker-local"\n\n'
        f'[superlink.docker-local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    compose = Compose(runtime, f"fedstale-test-{uuid.uuid4().hex[:8]}", ["compose.yml"], env)
    compose.home, compose.runs = home, runs  # type: ignore[attr-defined]
    try:
        yield compose
    finally:
        compose.teardown()
        assert not compose.leftovers(), compose.leftovers()


def containers_port() -> int:
    from fedstale.launcher.deploy import free_port

    return free_port()


def fedstale_run(compose: Compose, connection: str, name: str, config: str) -> subprocess.Popen:
    runs = compose.runs  # type: ignore[attr-defined]
    command = [tool("fedstale"), "run", "--app", str(ROOT), "--superlink", connection]
    command += ["--run-config", f"{RUN} {config} run-name={name} runs-dir={runs}"]
    log = open(runs.parent / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    env = flower_env(FLWR_HOME=str(compose.home))  # type: ignore[attr-defined]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def listed_runs(compose: Compose, connection: str, timeout: float = 90) -> list[dict]:
    """`flwr ls` of the SuperLink, retried while its container starts to listen."""
    command = [tool("flwr"), "ls", connection, "--format", "json"]
    env = flower_env(FLWR_HOME=str(compose.home))  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        answer = json.loads(done.stdout) if done.stdout.startswith("{") else {}
        if answer.get("success"):
            return answer["runs"]
        assert time.monotonic() < deadline, done.stdout + done.stderr
        time.sleep(1)


def wait_for(process: subprocess.Popen, timeout: float) -> int:
    try:
        return process.wait(timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def rows(path: Path) -> list[dict]:
    return read_jsonl(path) if path.exists() else []


def node_ids(compose: Compose) -> dict[int, int]:
    """SuperNode container -> the node id it logged, for supernode-0..2."""
    found = {}
    for index in range(3):
        ids = re.findall(r"SuperNode ID: (\d+)", compose.logs(f"supernode-{index}"))
        found[index] = int(ids[0]) if ids else -1
    return found


def test_compose_demo_runs_survives_a_killed_node_and_keeps_its_state(
    runtime: Runtime, project: Compose
) -> None:
    started = time.monotonic()
    project("up", "-d", timeout=300)
    up_seconds = time.monotonic() - started
    assert listed_runs(project, "docker-local") == []
    ready_seconds = time.monotonic() - started
    first_ids = node_ids(project)
    run = fedstale_run(project, "docker-local", "demo", "max-versions=6")
    runs: Path = project.runs  # type: ignore[attr-defined]
    updates = runs / "demo" / "updates.jsonl"
    log = runs.parent / "demo.log"
    try:
        deadline = time.monotonic() + 240
        while not rows(updates):
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        first_update = time.monotonic() - started
        project.kill("supernode-1")
        assert wait_for(run, RUN_TIMEOUT) == 0, log.read_text()[-4000:]
    finally:
        if run.poll() is None:
            run.kill()
    output = log.read_text()
    print(
        f"compose up {up_seconds:.1f} s, SuperLink answering {ready_seconds:.1f} s, "
        f"first aggregation {first_update:.1f} s after up"
    )
    summary = json.loads((runs / "demo" / "summary.json").read_text())
    handled = rows(updates)
    tasks = [row["task"] for row in handled]
    assert summary["stop_reason"] == "version budget 6" and summary["versions"] == 6, summary
    assert len(tasks) == len(set(tasks)), "an update counted twice"
    lost = {int(t) for t in re.findall(r"task (\d+) lost: node \d+ \(client 1\)", output)}
    assert lost and not lost & set(tasks), output[-3000:]
    # Every update came from a container's partition: clients 0..2, each served by the node
    # id its container logged.
    assert {row["client"] for row in handled} <= {0, 1, 2}
    served = {int(c): int(n) for n, c in re.findall(r"node (\d+) serves client (\d+)", output)}
    for client in (0, 2):
        assert served[client] == first_ids[client], (served, first_ids)
    assert served.get(1) in {first_ids[1], *node_ids(project).values()}, (served, first_ids)
    # Results on the host, owned by the container user; the data came from the mount.
    assert (runs / "demo" / "metrics.jsonl").stat().st_uid == int(project.env["FEDSTALE_UID"])
    assert summary["final_accuracy"] > 0.5, summary

    # State survives `down` and `up`: the SuperLink's database lists the run again.
    project("down", "-t", "5", timeout=180)
    assert not project.containers()
    project("up", "-d", timeout=300)
    runs_listed = listed_runs(project, "docker-local")
    assert len(runs_listed) == 1 and "finished" in str(runs_listed[0]), runs_listed


@pytest.mark.skipif(not FMNIST.is_dir(), reason="no Fashion-MNIST (make data installs it)")
def test_compose_tls_with_registered_keys_refuses_an_unregistered_node(
    runtime: Runtime, project: Compose, tmp_path: Path
) -> None:
    uid = int(project.env["FEDSTALE_UID"])
    certs, keys = tmp_path / "certificates", tmp_path / "keys"
    TlsFiles.make(certs)
    make_keys(keys, 4)  # supernode-3's key is never registered
    for path in (certs, keys):
        if uid:
            owned(path, uid)
    project.files.append("compose.tls.yml")
    project.env |= {"FEDSTALE_CERTS": str(certs), "FEDSTALE_KEYS": str(keys)}
    home: Path = project.home  # type: ignore[attr-defined]
    with open(home / "config.toml", "a") as config:
        port = project.env["FEDSTALE_PORT"]
        config.write(
            f'\n[superlink.docker-tls]\naddress = "127.0.0.1:{port}"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n'
        )
    project("up", "-d", "superlink", timeout=300)
    assert listed_runs(project, "docker-tls") == []
    env = flower_env(FLWR_HOME=str(home))
    for index in range(3):
        register = [tool("flwr"), "supernode", "register", f"{keys}/supernode-{index}.pub"]
        done = subprocess.run(
            [*register, "docker-tls"], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
    project("up", "-d", timeout=300)
    intruder = f"{project.name}-intruder"
    runtime.check(
        "run", "-d", "--name", intruder, "--network", f"{project.name}_default",
        "--label", f"com.docker.compose.project={project.name}",
        "-v", f"{certs}/ca.crt:/app/certificates/ca.crt:ro", "-v", f"{keys}:/app/keys:ro",
        "--user", f"{uid}:{uid}", "fedstale-supernode:0.1.0",
        "--root-certificates", "/app/certificates/ca.crt",
        "--auth-supernode-private-key", "/app/keys/supernode-3",
        "--superlink", "superlink:8000", "--node-config", "partition-id=0 num-partitions=3",
    )  # fmt: skip
    run = fedstale_run(project, "docker-tls", "tls", "max-versions=2")
    log = Path(project.runs).parent / "tls.log"  # type: ignore[attr-defined]
    assert wait_for(run, RUN_TIMEOUT) == 0, log.read_text()[-4000:]
    output = log.read_text()
    assert "all 3 clients connected" in output, output[-3000:]
    intruder_log = runtime("logs", intruder)
    assert "SuperNode ID" not in intruder_log.stdout + intruder_log.stderr
    served = {int(n) for n, _ in re.findall(r"node (\d+) serves client (\d+)", output)}
    assert served == {i for i in node_ids(project).values() if i >= 0}
