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
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedstale.launcher.deploy import TlsFiles, make_keys
from fedstale.launcher.launch import flower_env, tool
from fedstale.launcher.ports import free_port
from fedstale.server_app.results import read_jsonl
from tests import containers, timing
from tests.containers import Compose, Runtime, project_name, sweep_abandoned

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("deployments")]
ROOT, DOCKER = containers.ROOT, containers.DOCKER
FMNIST = Path("/usr/share/datasets/fashion-mnist")
# Fashion-MNIST from the SuperNodes' data mount, the linear model, short local work.
RUN = (
    "strategy=fedbuff clock=wall num-clients=3 concurrency=3 buffer-size=2 dataset=fmnist "
    "model=linear local-steps=20 eval-interval=10"
)
CONTAINER_UID = 1000  # not root and not Flower's app user: the README's FEDSTALE_UID case


@pytest.fixture(scope="module")
def ready(tmp_path_factory: pytest.TempPathFactory) -> containers.Prepared:
    """The runtime and the images, built in the background since the session began."""
    found = containers.prepared(tmp_path_factory.mktemp("runtime"))
    if found.runtime is None:
        pytest.skip(found.skip)
    print(f"runtime and images ready after {found.seconds:.0f} s: {found.sizes}")
    return found


@pytest.fixture(scope="module")
def runtime(ready: containers.Prepared) -> Runtime:
    assert ready.runtime is not None
    if abandoned := sweep_abandoned(ready.runtime):
        print(f"torn down the projects of test processes no longer running: {abandoned}")
    return ready.runtime


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


def workspace(root: Path, port: int) -> Path:
    """A checkout as the README's commands expect it (its app, docker/, .venv), with the
    demo's connection on the test's port."""
    root.mkdir()
    (root / ".venv").symlink_to(Path(sys.prefix))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, root)
    shutil.copytree(
        ROOT / "fedstale", root / "fedstale", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(DOCKER, root / "docker", ignore=shutil.ignore_patterns("*.sh"))
    config = root / "docker" / "flwr-home" / "config.toml"
    config.write_text(config.read_text().replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    return root


@pytest.fixture
def project(runtime: Runtime, tmp_path: Path) -> Iterator[Compose]:
    """A compose project of docker/compose.yml in a checkout-like workspace; `env` holds what
    the README exports (the container user: see container_user). Torn down by label at the
    end, and nothing of it may be left."""
    assert FMNIST.is_dir(), f"no {FMNIST}: the SuperNodes' data mount needs it (make data)"
    port = free_port()
    work = workspace(tmp_path / "work", port)
    uid = container_user(runtime)
    runs = owned(work / "runs", uid) if uid else work / "runs"
    runs.mkdir(exist_ok=True)
    env = {
        "FEDSTALE_RUNS": str(runs),
        "FEDSTALE_UID": str(uid),
        "FEDSTALE_GID": str(uid),
        "FEDSTALE_PORT": str(port),
        "FEDSTALE_DATA": str(FMNIST.parent),
    }
    compose = Compose(runtime, project_name(), ["compose.yml"], env, folder=work / "docker")
    try:
        yield compose
    finally:
        compose.teardown()
        assert not compose.leftovers(), compose.leftovers()


def readme_compose_lines() -> list[str]:
    """The README's docker-compose block, one command a line."""
    section = (ROOT / "README.md").read_text().split("### docker-compose", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


# `docker compose` as the README writes it, on the tests' runtime and project; --build
# dropped (the images are built, from local stand-ins, by the `images` fixture).
DOCKER_SHIM = """docker() {
  if [ "$1" != compose ]; then command docker "$@"; return; fi
  shift; local args=(); for a in "$@"; do [ "$a" = --build ] || args+=("$a"); done
  $FEDSTALE_TEST_COMPOSE -p "$FEDSTALE_TEST_PROJECT" "${args[@]}"
}
"""


def shell(compose: Compose, line: str, background: Path | None = None) -> subprocess.Popen:
    """One README line in bash in the workspace, with the exports of the lines before it
    (kept in state.sh); in the background with its output to `background`."""
    work = compose.folder.parent
    state = work / "state.sh"
    state.touch()
    script = f"source {state}\n{DOCKER_SHIM}{line}\n"
    script += "" if background else f"status=$?; export -p > {state}; exit $status\n"
    env = {**compose.runtime.env, **compose.env, "FEDSTALE_TEST_PROJECT": compose.name}
    env |= {"FEDSTALE_TEST_COMPOSE": " ".join(compose.runtime.compose)}
    env |= {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    out = open(background, "w") if background else subprocess.PIPE  # noqa: SIM115
    return subprocess.Popen(
        ["bash", "-c", script], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, text=True
    )


def run_line(compose: Compose, line: str, timeout: float = 300) -> str:
    process = shell(compose, line)
    output = process.communicate(timeout=timeout)[0]
    assert process.returncode == 0, f"{line}\n{output[-3000:]}"
    return output


def fedstale_run(compose: Compose, connection: str, name: str, config: str) -> subprocess.Popen:
    runs = Path(compose.env["FEDSTALE_RUNS"])
    command = [tool("fedstale"), "run", "--app", str(ROOT), "--superlink", connection]
    command += ["--run-config", f"{RUN} {config} run-name={name} runs-dir={runs}"]
    log = open(runs.parent / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
    env = flower_env(FLWR_HOME=str(compose.folder / "flwr-home"))
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def listed_runs(compose: Compose, connection: str, timeout: float = 90) -> list[dict]:
    """`flwr ls` of the SuperLink, retried while its container starts to listen."""
    command = [tool("flwr"), "ls", connection, "--format", "json"]
    env = flower_env(FLWR_HOME=str(compose.folder / "flwr-home"))
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


def test_the_readme_compose_block_runs_survives_a_killed_node_and_keeps_state(
    runtime: Runtime, project: Compose
) -> None:
    """Each line of the README's block, as written, in order; the run line (in the
    background, the test's budget appended) gets one SuperNode container killed mid-run."""
    lines = readme_compose_lines()
    assert len(lines) == 5 and lines[0].startswith("export "), lines
    runs = Path(project.env["FEDSTALE_RUNS"])
    updates, log = runs / "demo" / "updates.jsonl", runs.parent / "demo.log"
    started = time.monotonic()
    timings: dict[str, float] = {}
    for line in lines:
        if " fedstale run " not in f" {line} ".replace(".venv/bin/", ""):
            run_line(project, line)
            key = "up" if " up " in line else line.split()[0]
            timings.setdefault(key, time.monotonic() - started)
            continue
        run = shell(project, f'{line} --run-config "{RUN} max-versions=4 run-name=demo"', log)
        try:
            deadline = time.monotonic() + 240
            while not rows(updates):
                assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            timings["first aggregation"] = time.monotonic() - started
            first_ids = node_ids(project)  # each container has logged its id by now
            project.kill("supernode-1")
            before_kill = len(rows(updates))
            assert wait_for(run, timing.left()) == 0, log.read_text()[-4000:]
        finally:
            if run.poll() is None:
                run.kill()
        output = log.read_text()
        check_demo_run(project, runs / "demo", output, first_ids, before_kill)
    print(f"README block timings (s from its first line): {timings}")
    assert not project.containers()  # the block ends with `down`

    # State survives `down` and `up`: the SuperLink's database lists the run again.
    run_line(project, "docker compose -f docker/compose.yml up -d")
    runs_listed = listed_runs(project, "docker-local")
    assert len(runs_listed) == 1 and "finished" in str(runs_listed[0]), runs_listed


def check_demo_run(
    project: Compose, folder: Path, output: str, first_ids: dict[int, int], before_kill: int
) -> None:
    """The run went on after the kill on the other two containers, nothing counted twice;
    the killed node's task, once Flower reports it lost, is never counted."""
    summary = json.loads((folder / "summary.json").read_text())
    handled = rows(folder / "updates.jsonl")
    tasks = [row["task"] for row in handled]
    assert summary["stop_reason"] == "version budget 4" and summary["versions"] == 4, summary
    assert len(tasks) == len(set(tasks)), "an update counted twice"
    assert {row["client"] for row in handled[before_kill:]} & {0, 2}, "no update after the kill"
    lost = {int(t) for t in re.findall(r"task (\d+) lost: node \d+ \(client 1\)", output)}
    assert not lost & set(tasks), output[-3000:]
    # Every update came from a container's partition: clients 0..2, each served by the node
    # id its container logged (client 1's container came back under a new id, or not).
    assert {row["client"] for row in handled} <= {0, 1, 2}
    served = {int(c): int(n) for n, c in re.findall(r"node (\d+) serves client (\d+)", output)}
    for client in (0, 2):
        assert served[client] == first_ids[client], (served, first_ids)
    assert served.get(1) in {first_ids[1], *node_ids(project).values()}, (served, first_ids)
    # Results on the host, owned by the README's user; the data came from the mount.
    assert (folder / "metrics.jsonl").stat().st_uid == os.getuid()
    assert summary["final_accuracy"] > 0.5, summary


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
    home = project.folder / "flwr-home"
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
    log = Path(project.env["FEDSTALE_RUNS"]).parent / "tls.log"
    assert wait_for(run, timing.left()) == 0, log.read_text()[-4000:]
    output = log.read_text()
    assert "all 3 clients connected" in output, output[-3000:]
    intruder_log = runtime("logs", intruder)
    assert "SuperNode ID" not in intruder_log.stdout + intruder_log.stderr
    served = {int(n) for n, _ in re.findall(r"node (\d+) serves client (\d+)", output)}
    assert served == {i for i in node_ids(project).values() if i >= 0}


def test_a_killed_sessions_project_is_torn_down_and_a_running_ones_is_kept(
    runtime: Runtime,
) -> None:
    """A session killed outright leaves its project running; the next session's sweep tears
    down the projects of processes that are gone and keeps those of a suite still running."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = f"fedstale-test-{gone.pid}-{os.urandom(4).hex()}"
    kept = project_name()  # this process's: running
    for name in (dead, kept):
        runtime.check("volume", "create", f"{name}_state")
        runtime.check("network", "create", f"{name}_default")
        runtime.check(
            "run", "-d", "--label", f"com.docker.compose.project={name}",
            "--network", f"{name}_default", "-v", f"{name}_state:/state",
            containers.BASE_IMAGE, "sleep", "300",
        )  # fmt: skip
    running = Compose(runtime, kept, ["compose.yml"], {})
    try:
        sweep_abandoned(runtime)
        assert Compose(runtime, dead, ["compose.yml"], {}).leftovers() == []
        assert len(running.leftovers()) == 3, running.leftovers()  # container, network, volume
    finally:
        running.teardown()
        Compose(runtime, dead, ["compose.yml"], {}).teardown()
