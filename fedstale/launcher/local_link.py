"""The local SuperLink behind Flower's `local` connection, owned by `fedstale run`.

`flwr run` on a connection whose address is `:local:` starts a detached
`flower-superlink --simulation` when none answers on the local port and leaves it (with its
`flower-superexec` and a defunct `flwr-simulation`) running for good. `fedstale run` starts that
SuperLink itself first, with Flower's own command line, so that `flwr run` finds and uses it,
and stops it and everything below it when the run ends. A local SuperLink that was already up
is someone else's: it is used and left running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fedstale.common.config import ConfigError
from fedstale.launcher import flower_internals as internal
from fedstale.launcher.deploy import spawn, stop_tree
from fedstale.launcher.launch import flower_env, tool
from fedstale.launcher.ports import LISTEN_SECONDS, start_listening

# As long as for any process the launcher starts: a first start in a new virtualenv compiles
# Flower, and on a loaded machine the first `flwr` command there once took over 30 s.
STARTUP_SECONDS = LISTEN_SECONDS
PORT_ENV = "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"  # Flower's: where `flwr run` finds it
REMOTE_WAIT_SECONDS = 90.0  # a SuperLink container just brought up answers after ~10 s


def local_ports() -> tuple[str, str]:
    """(HTTP port, Control API address) of Flower's local SuperLink (env-overridable)."""
    return internal.LOCAL_HTTP_PORT.load(), internal.LOCAL_CONTROL_ADDRESS.load()


def connection_of(connection_name: str) -> Any:
    """Flower's SuperLinkConnection of that name (its default for ''), or one line."""
    import click

    read_superlink_connection = internal.READ_CONNECTION.load()
    try:
        return read_superlink_connection(connection_name or None)
    except click.ClickException as err:
        raise ConfigError(f"Flower's configuration: {err.message}") from None


def is_local(connection_name: str) -> tuple[bool, bool]:
    """(is the connection Flower's managed local SuperLink, is it the in-memory kind)."""
    magic, magic_in_memory = internal.LOCAL_MAGIC.load(), internal.LOCAL_MAGIC_IN_MEMORY.load()
    connection = connection_of(connection_name)
    address = connection.address
    if address is None and connection.options is not None:
        address = magic  # Flower's deprecated options-only form
    in_memory = address == magic_in_memory
    return address == magic or in_memory, in_memory


def healthy(port: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success
    except httpx.HTTPError:
        return False


def await_healthy(
    process: subprocess.Popen, port: int, log_file: Path, timeout: float = STARTUP_SECONDS
) -> None:
    """Wait until the SuperLink `process` started on `port` answers its health check; one
    line naming its log when it exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while not healthy(str(port)):
        if process.poll() is not None or time.monotonic() > deadline:
            raise ConfigError(
                f"the local SuperLink on 127.0.0.1:{port} did not answer (see {log_file})"
            )
        time.sleep(0.2)


def answers(address: str, insecure: bool, root_certificates: str | None) -> bool:
    """Something serves HTTP at the SuperLink's address (any status: `flwr run` judges the
    rest, and a TLS failure too); False while nothing accepts or a proxy resets."""
    url = f"{'http' if insecure else 'https'}://{address}/health"
    try:
        httpx.get(url, timeout=2.0, verify=root_certificates or True)
    except httpx.TransportError as err:
        return "SSL" in str(err) or "certificate" in str(err).lower()
    return True


def await_remote(connection_name: str, timeout: float = REMOTE_WAIT_SECONDS) -> None:
    """Wait until the connection's SuperLink answers, saying so once if it does not at
    first (a container still starting); one line if it never does."""
    connection = connection_of(connection_name)
    address = connection.address
    security = (connection.insecure, connection.root_certificates)
    if not address or answers(address, *security):
        return
    print(f"fedstale: waiting for the SuperLink at {address} to answer", file=sys.stderr)
    deadline = time.monotonic() + timeout
    while not answers(address, *security):
        if time.monotonic() > deadline:
            raise ConfigError(
                f"the SuperLink at {address} (connection {connection.name!r}) did not answer "
                f"within {timeout:g} s: is it up? (docker compose ps; its log)"
            )
        time.sleep(1.0)


def local_folder() -> Path:
    """FLWR_HOME/local-superlink, where Flower keeps its local SuperLink's state."""
    folder = internal.FLWR_HOME.load()() / "local-superlink"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def superlink_command(port: str, database: Path | None) -> list[str]:
    """Flower's own command for the managed local SuperLink (flwr/cli/local_superlink.py) on
    `port`, its state in `database` (None: in memory)."""
    _, control = local_ports()
    command = [tool("flower-superlink"), "--insecure", "--simulation"]
    isolation = internal.ISOLATION_SUBPROCESS.load()
    command += ["--isolation", isolation, "--control-api-address", control]
    command += ["--host", "127.0.0.1", "--port", port]
    return command + (["--database", str(database)] if database is not None else [])


@dataclass
class LocalLink:
    """The SuperLink a `flwr run` on the local connection uses: `process` when fedstale
    started it (None: someone else's, or a remote one), and the environment `flwr run`
    needs to find it."""

    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)


@contextmanager
def owned_local_superlink(connection_name: str) -> Iterator[LocalLink]:
    """Around a `flwr run` on `connection_name`: the SuperLink this started (stopped on exit),
    or none where the connection is remote or Flower's local SuperLink was already up. Unless
    FLWR_LOCAL_SUPERLINK_HTTP_API_PORT fixes the port, the SuperLink started here listens on
    a port of its own (fedstale/launcher/ports.py), so two runs at once never share one and
    a taken default port is no failure."""
    local, in_memory = is_local(connection_name)
    port, _ = local_ports()
    if not local:
        await_remote(connection_name)
        yield LocalLink()
        return
    if healthy(port):
        print(
            f"fedstale: using the local SuperLink already up on 127.0.0.1:{port} (it stays up)",
            file=sys.stderr,
        )
        yield LocalLink()
        return
    fixed = int(port) if PORT_ENV in os.environ else None
    folder = local_folder()
    # A SuperLink on a port of its own keeps its state apart too: two at once sharing
    # Flower's state.db would each see, and could start, the other's runs.
    own = None if fixed else Path(tempfile.mkdtemp(prefix="fedstale-", dir=folder))
    database = None if in_memory else (own or folder) / "state.db"
    log_file = folder / f"fedstale-superlink-{os.getpid()}.log"

    def launch(chosen: int) -> subprocess.Popen:
        return spawn(superlink_command(str(chosen), database), flower_env(), log_file)

    process: subprocess.Popen | None = None
    try:
        process, chosen = start_listening(
            launch,
            "the local SuperLink",
            log_file,
            port=fixed,
            timeout=STARTUP_SECONDS,
            stop=stop_tree,
        )
        await_healthy(process, chosen, log_file)
        yield LocalLink(process, {PORT_ENV: str(chosen)})
    finally:
        if process is not None:
            stop_tree(process)
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
