"""A real local deployment without docker: one `flower-superlink` and N `flower-supernode`
processes on 127.0.0.1, the app run on them with `flwr run`, everything stopped by PID.

    fedstale deploy --nodes 3 [--delays 0,1,4] [--tls] [--database PATH]
                    [--run-config "k=v ..."] [--keep-dir DIR] [--edges E]

Each SuperNode gets `--node-config "partition-id=i num-partitions=N delay-seconds=d"`; the
ClientApp sleeps `delay-seconds` after training (injected latency). With `--edges E` (MAFSA,
HierFedAvg) the nodes form E edges of consecutive partitions, each node naming its edge
(`edge-id=k`), and the run gets E under its rule's edges key (`Topology.edges_key`,
`mafsa-edges` for both). The run uses the wall clock unless
`clock=virtual` is given. The same flags appear in docker/compose.yml. `--nodes` is the
number of clients (`num-clients` follows it; another value is refused before anything
starts). FLWR_HOME, the logs and certificates go to a temporary folder, removed after a run
that ended well and kept (and named) after one that did not; `--keep-dir DIR` keeps them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedstale.common.config import ConfigError, RunConfig
from fedstale.launcher.launch import (
    PACKAGE,
    PACKAGE_APP,
    find_app,
    flower_env,
    parse_pairs,
    resolve,
    to_flower,
    tool,
)
from fedstale.launcher.ports import (
    LaunchError,
    cause,
    descendants,
    log_tail,
    proc_stat,
    start_listening,
)
from fedstale.server_app.results import runs_root

CONNECTION = "fedstale-local"
SUPERNODE_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
ONLINE_SECONDS = 60.0  # for every SuperNode started to register with the SuperLink
LIST_SECONDS = 30.0  # at least, for one `flwr supernode ls` (a first start compiles Flower)
# Wall-clock defaults of a deployment; the user's --run-config wins.
WALL_DEFAULTS: dict[str, Any] = {"clock": "wall", "eval-interval": 10.0, "max-virtual-time": 300.0}


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left of it: every member, its leader
    alive or not (a warm SuperExec that exited with its node may leave forked tasks in the
    group it led). A group id is not reused while a member lives, so a group found alive
    after its leader was reaped is still this one."""
    if process.poll() is not None and not group_alive(process.pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (process.poll() is None or group_alive(process.pid)):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(5)
    deadline = time.monotonic() + 5.0  # a SIGKILLed process takes a moment to be gone
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def group_alive(group: int) -> bool:
    """Whether a process of the group still runs (a zombie, waiting to be reaped, does not)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit() or (fields := proc_stat(entry.name)) is None:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("a") as handle:
        return subprocess.Popen(
            command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop_tree(process: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop a process group and every process below its leader that left the group
    (Flower's SuperLink starts a SuperExec, which starts the simulation or ServerApp)."""
    below = [pid for pid, _ in descendants(process.pid)] if process.poll() is None else []
    started = {pid: ticks for pid in below if (ticks := start_time(pid)) is not None}
    stop(process, grace)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    # A SIGKILL is delivered when its process next runs: on a loaded machine that can be
    # after this returns, and a caller would find the process still up.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(start_time(p) == t for p, t in started.items()):
        time.sleep(0.05)


def start_time(pid: int) -> int | None:
    """When a running process started (clock ticks after boot); None for a zombie or a pid
    no process has. Told apart by it, a pid reused by a new process is not the old one."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def docker_script(name: str) -> Path:
    """A docker/ script: the wheel's copy in fedstale/app/docker/, else a checkout's."""
    for folder in (PACKAGE_APP / "docker", PACKAGE.parent / "docker"):
        if (folder / name).is_file():
            return folder / name
    raise ConfigError(
        f"docker/{name} is not in this fedstale install ({PACKAGE_APP / 'docker'}); "
        "reinstall the wheel, or run from a checkout"
    )


def run_script(name: str, *args: str) -> None:
    script = docker_script(name)
    result = subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"docker/{name} failed: {result.stderr.strip()[-500:]}")


def make_keys(folder: Path, count: int) -> None:
    """ECDSA P-384 key pairs supernode-<i>(.pub) for SuperNode authentication."""
    run_script("keys.sh", str(folder), str(count))


@dataclass(frozen=True)
class TlsFiles:
    """The SuperLink's certificate and key, and the CA that signed them (docker/certs.sh)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, folder: Path) -> TlsFiles:
        run_script("certs.sh", str(folder))
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")


@dataclass
class LocalDeployment:
    """A SuperLink and its SuperNodes; `home` holds FLWR_HOME, logs and state."""

    home: Path
    num_nodes: int
    delays: list[float] = field(default_factory=list)
    tls: TlsFiles | None = None
    database: Path | None = None
    auth_keys: Path | None = None  # a folder of supernode-<i> keys: SuperNode authentication
    simulation: bool = False  # a simulation SuperLink: Flower runs the ClientApps itself
    task_poll_interval: float = 0.1
    edges: int = 0  # > 0: node i names edge-id i * edges // num_nodes (MAFSA's topology)
    bin_dir: Path | None = None  # Flower's and fedstale's commands from here (another venv)
    # Where a SuperExec of its own (Flower's `--isolation process`) reaches the SuperLink's
    # runtime API; None: the SuperLink starts its SuperExec itself.
    superexec_runtime: str | None = None
    port: int = 0  # 0: a reserved one, chosen at start (fedstale/launcher/ports.py)
    # How a SuperNode starts its ClientApp tasks: "fork", from a warm process beside it
    # (fedstale/launcher/warm_exec.py), or "flower", a fresh flwr-clientapp per message.
    clientapp_exec: str = "fork"
    superlink: subprocess.Popen | None = None
    superexec: subprocess.Popen | None = None
    nodes: dict[int, subprocess.Popen] = field(default_factory=dict)
    execs: dict[int, subprocess.Popen] = field(default_factory=dict)  # "fork": each node's
    node_ports: dict[int, int] = field(default_factory=dict)
    # where each SuperNode's last start begins in its log (a log holds every restart)
    node_log_starts: dict[int, int] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        env = flower_env(FLWR_HOME=str(self.home))
        if self.bin_dir is not None:
            env["PATH"] = os.pathsep.join([str(self.bin_dir), env["PATH"]])
        return env

    def tool(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir is not None else tool(name)

    def security(self) -> list[str]:
        return ["--insecure"] if self.tls is None else []

    def superlink_command(self) -> list[str]:
        command = [self.tool("flower-superlink"), *self.security()]
        if self.tls is not None:
            command += ["--ssl-ca-certfile", str(self.tls.ca)]
            command += ["--ssl-certfile", str(self.tls.cert), "--ssl-keyfile", str(self.tls.key)]
        if self.database is not None:
            command += ["--database", str(self.database)]
        if self.auth_keys is not None:
            command += ["--enable-supernode-auth"]
        if self.simulation:
            command += ["--simulation"]
        if self.superexec_runtime is not None:
            command += ["--isolation", "process"]
        local = ["--host", "127.0.0.1", "--port", str(self.port)]
        return [*command, "--disable-runtime-dependency-installation", *local]

    def node_command(self, partition: int, port: int, insecure: bool = False) -> list[str]:
        delay = self.delays[partition % len(self.delays)] if self.delays else 0.0
        if insecure or self.tls is None:
            security = ["--insecure"]
        else:
            security = ["--root-certificates", str(self.tls.ca)]
        if self.auth_keys is not None:
            security += ["--auth-supernode-private-key", str(self.key_of(partition))]
        node_config = f"partition-id={partition} num-partitions={self.num_nodes}"
        node_config += f" delay-seconds={delay:g}"
        if self.edges:
            node_config += f" edge-id={self.edge_of(partition)}"
        if self.clientapp_exec == "fork":
            security += ["--isolation", "process"]
        return [
            self.tool("flower-supernode"),
            *security,
            "--superlink",
            self.address,
            "--port",
            str(port),
            "--node-config",
            node_config,
        ]

    def edge_of(self, partition: int) -> int:
        return partition * self.edges // self.num_nodes

    def write_connection(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        security = "insecure = true" if self.tls is None else f'root-certificates = "{self.tls.ca}"'
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "{self.address}"\n{security}\n'
        )

    def key_of(self, partition: int) -> Path:
        assert self.auth_keys is not None
        return self.auth_keys / f"supernode-{partition}"

    def register(self, partition: int) -> None:
        """`flwr supernode register` the node's public key with the SuperLink."""
        public_key = f"{self.key_of(partition)}.pub"
        command = [self.tool("flwr"), "supernode", "register", public_key, CONNECTION]
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"registering {public_key} failed: {result.stdout[-500:]}")

    def start(self) -> LocalDeployment:
        """The SuperLink, then every SuperNode, each checked to listen on its own port; on a
        LaunchError nothing started is left running."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalDeployment:
        self.home.mkdir(parents=True, exist_ok=True)
        self.superlink, self.port = start_listening(
            self.launch_superlink,
            "flower-superlink",
            self.home / "superlink.log",
            port=self.port or None,
            stop=stop_tree,
        )
        self.write_connection()
        if self.superexec_runtime is not None:
            self.start_superexec(self.superexec_runtime)
        if self.auth_keys is not None:
            make_keys(self.auth_keys, self.num_nodes)
        for partition in range(self.num_nodes):
            if self.auth_keys is not None:
                self.register(partition)
            self.start_node(partition)
        if self.nodes:
            self.await_online(len(self.nodes))
        return self

    def online_nodes(self, timeout: float = LIST_SECONDS) -> int | None:
        """SuperNodes the SuperLink lists as online (`flwr supernode ls`); None when it
        cannot be asked within `timeout`."""
        command = [self.tool("flwr"), "supernode", "ls", CONNECTION, "--format", "json"]
        try:
            result = subprocess.run(
                command, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
            )
            listing = json.loads(result.stdout)
        except (subprocess.TimeoutExpired, json.JSONDecodeError):
            return None
        if not listing.get("success"):
            return None
        return sum(node.get("status") == "online" for node in listing.get("nodes", []))

    def await_online(self, wanted: int, timeout: float = ONLINE_SECONDS) -> None:
        """Every SuperNode started is alive and registered with the SuperLink, or one
        LaunchError line naming the first that is not (its log, the cause read from it).
        An ask that fails or runs long is asked again until the deadline: on a busy machine
        the `flwr` CLI alone once took over 30 s to start."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_nodes_alive()
            online = self.online_nodes(max(LIST_SECONDS, deadline - time.monotonic()))
            if (online is not None and online >= wanted) or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        self.check_nodes_alive()
        if online is None:
            raise LaunchError(
                f"the SuperLink on {self.address} did not list its SuperNodes "
                f"(flwr supernode ls) within {timeout:g} s; its log: {self.home / 'superlink.log'}"
            )
        if online < wanted:
            raise LaunchError(
                f"only {online} of {wanted} SuperNodes registered with the SuperLink within "
                f"{timeout:g} s; their logs: {self.home}/supernode-<i>.log"
            )

    def check_nodes_alive(self) -> None:
        for partition, process in sorted(self.nodes.items()):
            for what, started in (("", process), (" its SuperExec", self.execs.get(partition))):
                if started is None or started.poll() is None:
                    continue
                log = self.home / f"supernode-{partition}.log"
                why = cause(log_tail(log, self.node_log_starts.get(partition, 0)))
                raise LaunchError(
                    f"SuperNode {partition} (partition-id={partition}){what} exited with code "
                    f"{started.returncode} after it started: {why}; its log: {log}"
                )

    def launch_superlink(self, port: int) -> subprocess.Popen:
        self.port = port
        return spawn(self.superlink_command(), self.env, self.home / "superlink.log")

    def start_superexec(self, runtime: str) -> None:
        security = ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca)]
        command = [self.tool("flower-superexec"), *security, "--runtime-api-address", runtime]
        self.superexec = spawn(command, self.env, self.home / "superexec.log")

    def start_node(self, partition: int, insecure: bool = False) -> subprocess.Popen:
        """Start SuperNode `partition` and wait until it listens on its Runtime API port
        (another port if a bind race took it); a LaunchError line naming it otherwise."""
        env = {**self.env, SUPERNODE_POLL_ENV: f"{self.task_poll_interval:g}"}
        log = self.home / f"supernode-{partition}.log"

        def launch(port: int) -> subprocess.Popen:
            self.node_log_starts[partition] = log.stat().st_size if log.exists() else 0
            return spawn(self.node_command(partition, port, insecure), env, log)

        name = f"SuperNode {partition} (partition-id={partition})"
        process, port = start_listening(launch, name, log, stop=stop_tree)
        self.nodes[partition], self.node_ports[partition] = process, port
        if self.clientapp_exec == "fork":
            self.start_exec(partition, env, log)
        return process

    def start_exec(self, partition: int, env: dict[str, str], log: Path) -> None:
        """The node's warm SuperExec, in the node's log; it exits when the node is gone."""
        python = self.tool("python") if self.bin_dir is not None else sys.executable
        command = [python, "-m", "fedstale.launcher.warm_exec", "--insecure"]
        command += ["--runtime-api-address", f"127.0.0.1:{self.node_ports[partition]}"]
        command += ["--parent-pid", str(self.nodes[partition].pid)]
        self.execs[partition] = spawn(command, env, log)

    def kill_node(self, partition: int, sig: int = signal.SIGKILL) -> None:
        """Signal a SuperNode's whole process group (its ClientApps die with it)."""
        process = self.nodes[partition]
        os.killpg(process.pid, sig)
        process.wait(30)
        if partition in self.execs:  # the node's tasks run below its SuperExec
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.execs[partition].pid, sig)
            self.execs[partition].wait(30)

    def app_command(self, app: Path, overrides: dict[str, Any]) -> list[str]:
        """`fedstale run` against this SuperLink, with the wall-clock defaults."""
        config = deployment_config(self.num_nodes, overrides, self.edges)
        run_config = ["--run-config", to_flower(config)]
        launch = ["run", "--app", str(app), "--superlink", CONNECTION]
        return [self.tool("fedstale"), *launch, *run_config]

    def run_app(
        self, app: Path, overrides: dict[str, Any], timeout: float, capture: bool = True
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.app_command(app, overrides),
            env=self.env,
            capture_output=capture,
            text=True,
            timeout=timeout,
            check=False,
        )

    def launch_app(self, app: Path, overrides: dict[str, Any], log: Path) -> subprocess.Popen:
        """The same in the background, its output to `log` (tests watch it)."""
        return spawn(self.app_command(app, overrides), self.env, log)

    def serverapp_pids(self) -> list[int]:
        """`flwr-serverapp` processes started under this SuperLink (to crash one on purpose)."""
        roots = [p.pid for p in (self.superlink, self.superexec) if p is not None]
        below = [entry for root in roots for entry in descendants(root)]
        return [pid for pid, cmd in below if "flwr-serverapp" in cmd]

    def stop(self) -> None:
        for process in [*self.nodes.values(), *self.execs.values()]:
            stop(process)
        if self.superexec is not None:
            stop_tree(self.superexec)
        if self.superlink is not None:
            stop_tree(self.superlink)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def deployment_config(num_nodes: int, overrides: dict[str, Any], edges: int = 0) -> dict[str, Any]:
    """The wall-clock defaults, one client per node all training at once, then the user's
    (with `edges`, also the edge count under the rule's own key)."""
    topology = {edges_key(overrides): edges} if edges else {}
    base = {**WALL_DEFAULTS, "num-clients": num_nodes, "concurrency": num_nodes, **topology}
    return {**base, **overrides}


def edges_key(overrides: dict[str, Any]) -> str:
    """The run-config key of the number of edges, as the run's Topology rule declares it."""
    from fedstale.strategies.base import Topology
    from fedstale.strategies.registry import STRATEGIES

    name = str(overrides.get("strategy", RunConfig().strategy))
    strategy = STRATEGIES.get(name)
    if strategy is None or not issubclass(strategy, Topology):
        raise ConfigError(f"--edges needs a rule with edges (a Topology), not {name}")
    return strategy.edges_key


def check_edges(edges: int, nodes: int, overrides: dict[str, Any]) -> None:
    """--edges is for the hierarchical rules, with at least one node per edge."""
    if not edges:
        return
    strategy = overrides.get("strategy")
    from fedstale.strategies.registry import with_topology

    hierarchical = with_topology()
    if strategy not in hierarchical:
        raise ConfigError(
            f"--edges needs strategy {' or '.join(hierarchical)} "
            f"(--run-config 'strategy={hierarchical[0]}'), not {strategy or 'the default'}"
        )
    if not 1 <= edges <= nodes:
        raise ConfigError(f"--edges {edges}: give 1 to --nodes ({nodes}) edges")
    key = edges_key(overrides)
    named = overrides.get(key)
    if named is not None and named != edges:
        raise ConfigError(f"--edges {edges} and {key}={named} disagree; give one")


def parse_delays(text: str) -> list[float]:
    try:
        delays = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        message = f"--delays '{text}': write seconds separated by commas, e.g. 0,1,4"
        raise ConfigError(message) from None
    if any(d < 0 for d in delays):
        raise ConfigError(f"--delays '{text}': delays cannot be negative")
    return delays


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fedstale deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes to start (clients)")
    parser.add_argument("--delays", default="", help="injected seconds per node, cycled")
    parser.add_argument("--run-config", default="", help="key=value pairs over the defaults")
    parser.add_argument("--app", type=Path, default=None, help="the fedstale app directory")
    parser.add_argument("--tls", action="store_true", help="TLS with certificates made here")
    parser.add_argument("--database", type=Path, help="SuperLink state file (persistent)")
    parser.add_argument(
        "--auth", action="store_true", help="SuperNode authentication (needs --tls)"
    )
    parser.add_argument("--keep-dir", type=Path, help="keep FLWR_HOME and logs here")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the run")
    parser.add_argument(
        "--edges", type=int, default=0, help="MAFSA / HierFedAvg: nodes form this many edges"
    )
    parser.add_argument(
        "--clientapp-exec",
        choices=("fork", "flower"),
        default="fork",
        help="fork: each ClientApp task forked from a warm process beside its node, which "
        "imported torch once; flower: Flower's own, a fresh flwr-clientapp per message",
    )
    args = parser.parse_args(argv)
    if args.nodes < 1:
        raise ConfigError("--nodes must be at least 1")
    app = find_app(args.app)
    overrides = parse_pairs(args.run_config)
    check_edges(args.edges, args.nodes, overrides)
    run, _ = resolve(app, deployment_config(args.nodes, overrides, args.edges))  # fail fast
    check_nodes_serve_clients(args.nodes, run.num_clients)
    if run.dp_noise_seed >= 0:
        raise ConfigError(
            "dp-noise-seed makes the DP noise replayable (anyone who knows the seed can "
            "subtract it): refused in a deployment; drop it"
        )
    home = args.keep_dir or Path(tempfile.mkdtemp(prefix="fedstale-deploy-"))
    home = home.resolve()
    if args.auth and not args.tls:
        raise ConfigError("--auth needs --tls: Flower authenticates SuperNodes over TLS only")
    if args.auth:
        docker_script("keys.sh")  # refuse before anything starts
    tls = TlsFiles.make(home / "certs") if args.tls else None
    deployment = LocalDeployment(
        home,
        args.nodes,
        parse_delays(args.delays),
        tls=tls,
        database=args.database,
        auth_keys=home / "keys" if args.auth else None,
        edges=args.edges,
        clientapp_exec=args.clientapp_exec,
    )
    with deployment:
        print(
            f"fedstale: deployment in {home}: SuperLink on {deployment.address}, "
            f"{args.nodes} SuperNode(s) up",
            file=sys.stderr,
        )
        print("fedstale: " + shlex.join(deployment.superlink_command()), file=sys.stderr)
        result = deployment.run_app(app, overrides, args.timeout, capture=False)
    if args.keep_dir is None:
        tidy(home, result.returncode, [runs_root(run.runs_dir), args.database])
    return result.returncode


def check_nodes_serve_clients(nodes: int, clients: int) -> None:
    """Node k serves client k (its partition-id): a client without a node would be waited
    for (node-wait-seconds) and a node without a client refused, so say it before starting."""
    if nodes != clients:
        raise ConfigError(
            f"--nodes {nodes} start one SuperNode per client, but num-clients={clients}: "
            f"start --nodes {clients}, or drop num-clients (it follows --nodes)"
        )


def tidy(home: Path, returncode: int, kept: list[Path | None]) -> None:
    """The deployment's temporary folder (FLWR_HOME, logs, certificates) removed after a run
    that ended well; kept, and said, after one that did not, or where it holds results."""
    holds = any(path is not None and path.resolve().is_relative_to(home) for path in kept)
    if returncode == 0 and not holds:
        shutil.rmtree(home, ignore_errors=True)
    else:
        print(f"fedstale: the deployment's logs are kept in {home}", file=sys.stderr)
