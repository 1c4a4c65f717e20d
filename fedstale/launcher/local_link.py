"""The local SuperLink behind Flower's `local` connection, owned by `fedstale run`.

`flwr run` on a connection whose address is `:local:` starts a detached
`flower-superlink --simulation` when none answers on the local port and leaves it (with its
`flower-superexec` and a defunct `flwr-simulation`) running for good. `fedstale run` starts that
SuperLink itself first, with Flower's own command line, so that `flwr run` finds and uses it,
and stops it and everything below it when the run ends. A local SuperLink that was already up
is someone else's: it is used and left running.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from fedstale.common.config import ConfigError
from fedstale.launcher.deploy import spawn, stop_tree
from fedstale.launcher.launch import flower_env, tool

STARTUP_SECONDS = 30.0


def local_ports() -> tuple[str, str]:
    """(HTTP port, Control API address) of Flower's local SuperLink (env-overridable)."""
    from flwr.cli.constant import LOCAL_CONTROL_API_ADDRESS, LOCAL_SUPERLINK_HTTP_API_PORT

    return LOCAL_SUPERLINK_HTTP_API_PORT, LOCAL_CONTROL_API_ADDRESS


def is_local(connection_name: str) -> tuple[bool, bool]:
    """(is the connection Flower's managed local SuperLink, is it the in-memory kind)."""
    import click
    from flwr.cli.constant import (
        LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE,
        LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY,
    )
    from flwr.cli.flower_config import read_superlink_connection

    try:
        connection = read_superlink_connection(connection_name or None)
    except click.ClickException as err:
        raise ConfigError(f"Flower's configuration: {err.message}") from None
    address = connection.address
    if address is None and connection.options is not None:
        address = LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE  # Flower's deprecated options-only form
    in_memory = address == LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY
    return address == LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE or in_memory, in_memory


def healthy(port: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).is_success
    except httpx.HTTPError:
        return False


def superlink_command(in_memory: bool) -> tuple[list[str], Path]:
    """Flower's own command for the managed local SuperLink (flwr/cli/local_superlink.py),
    and its log file."""
    from flwr.common.constant import ISOLATION_MODE_SUBPROCESS
    from flwr.supercore.utils import get_flwr_home

    port, control = local_ports()
    folder = get_flwr_home() / "local-superlink"
    folder.mkdir(parents=True, exist_ok=True)
    command = [tool("flower-superlink"), "--insecure", "--simulation"]
    command += ["--isolation", ISOLATION_MODE_SUBPROCESS, "--control-api-address", control]
    command += ["--host", "127.0.0.1", "--port", port]
    if not in_memory:
        command += ["--database", str(folder / "state.db")]
    return command, folder / "fedstale-superlink.log"


@contextmanager
def owned_local_superlink(connection_name: str) -> Iterator[subprocess.Popen | None]:
    """Around a `flwr run` on `connection_name`: the SuperLink process this started (stopped
    on exit), or None where the connection is remote or a local SuperLink was already up."""
    local, in_memory = is_local(connection_name)
    port, _ = local_ports()
    if not local:
        yield None
        return
    if healthy(port):
        print(
            f"fedstale: using the local SuperLink already up on 127.0.0.1:{port} (it stays up)",
            file=sys.stderr,
        )
        yield None
        return
    command, log_file = superlink_command(in_memory)
    process = spawn(command, flower_env(), log_file)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(
                    f"the local SuperLink did not start on 127.0.0.1:{port} (see {log_file}); "
                    "is a port taken? set FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and "
                    "FLWR_LOCAL_CONTROL_API_PORT to free ones"
                )
            time.sleep(0.2)
        yield process
    finally:
        stop_tree(process)
