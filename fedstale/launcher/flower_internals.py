"""Every use fedstale makes of Flower's internal modules, in one place.

The two apps and the library use only Flower's public API (`flwr.app`, `flwr.serverapp`,
`flwr.clientapp`, `flwr.common`'s public names; tests/test_architecture.py checks it). The
launcher drives Flower's processes as Flower's own CLI does, and for that it reads a few of
Flower's internals: the managed local SuperLink's address and command line, the Flower
configuration file, the simulation options' schema, and the SuperExec loop that the warm
executor plugs into. Each is named here once, with the Flower versions it was checked at.
If a Flower release moves one, the command that needs it stops with one line naming the
installed Flower version and what to do (exit code 2), instead of a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fedstale.common.config import ConfigError

# The Flower releases every internal below was checked at (tests/test_bounds.py at the ends,
# `python -m bench.environments --flwr-nightly` against Flower's nightly).
CHECKED = "flwr 1.41.0, 1.42.0 and 1.43.0.dev20261026"
SUPPORTED = "flwr>=1.41.0,<1.43"


@dataclass(frozen=True)
class Internal:
    """`name` in Flower's module `module`, and what fedstale uses it for."""

    module: str
    name: str
    purpose: str

    def load(self) -> Any:
        try:
            return getattr(import_module(self.module), self.name)
        except (ImportError, AttributeError):
            raise ConfigError(moved(self)) from None


def flower_version() -> str:
    try:
        return version("flwr")
    except PackageNotFoundError:
        return "(not installed)"


def moved(internal: Internal) -> str:
    return (
        f"Flower {flower_version()} has no {internal.module}.{internal.name}, which fedstale "
        f"needs for {internal.purpose} (checked with {CHECKED}); install {SUPPORTED}"
    )


# flwr/cli: the managed local SuperLink (`flwr run` on a `:local:` connection) and the
# Flower configuration file of SuperLink connections.
LOCAL_HTTP_PORT = Internal(
    "flwr.cli.constant", "LOCAL_SUPERLINK_HTTP_API_PORT", "the local SuperLink's port"
)
LOCAL_CONTROL_ADDRESS = Internal(
    "flwr.cli.constant", "LOCAL_CONTROL_API_ADDRESS", "the local SuperLink's Control API"
)
LOCAL_MAGIC = Internal(
    "flwr.cli.constant", "LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE", "the `:local:` connection"
)
LOCAL_MAGIC_IN_MEMORY = Internal(
    "flwr.cli.constant",
    "LOCAL_SUPERLINK_ADDRESS_MAGIC_VALUE_IN_MEMORY",
    "the in-memory `:local:` connection",
)
READ_CONNECTION = Internal(
    "flwr.cli.flower_config", "read_superlink_connection", "reading Flower's configuration"
)
FLWR_HOME = Internal("flwr.supercore.utils", "get_flwr_home", "finding FLWR_HOME")
ISOLATION_SUBPROCESS = Internal(
    "flwr.common.constant", "ISOLATION_MODE_SUBPROCESS", "starting the local SuperLink"
)
# The simulation options a `--federation-config` may set.
SIMULATION_CONFIG = Internal(
    "flwr.proto.federation_config_pb2", "SimulationConfig", "checking --federation-config"
)
SIMULATION_FROM_JSON = Internal(
    "flwr.supercore.utils", "simulation_config_from_json", "checking --federation-config"
)
# The SuperExec loop and its executor protocol (fedstale/launcher/warm_exec.py).
SUPEREXEC = Internal(
    "flwr.supercore.superexec.run_superexec", "run_superexec", "the warm SuperExec"
)
SUBPROCESS_EXECUTOR = Internal(
    "flwr.supercore.superexec.executor.subprocess_executor",
    "SubprocessExecutor",
    "the warm SuperExec",
)
LAUNCH_RESULT = Internal("flwr.supercore.superexec.executor", "LaunchResult", "the warm SuperExec")
TASK_TYPE = Internal("flwr.supercore.constant", "TaskType", "the warm SuperExec")
RUN_CLIENTAPP = Internal(
    "flwr.supernode.runtime.run_clientapp", "run_clientapp", "the warm SuperExec's tasks"
)

WARM_EXEC = (SUPEREXEC, SUBPROCESS_EXECUTOR, LAUNCH_RESULT, TASK_TYPE, RUN_CLIENTAPP)
ALL = (
    LOCAL_HTTP_PORT,
    LOCAL_CONTROL_ADDRESS,
    LOCAL_MAGIC,
    LOCAL_MAGIC_IN_MEMORY,
    READ_CONNECTION,
    FLWR_HOME,
    ISOLATION_SUBPROCESS,
    SIMULATION_CONFIG,
    SIMULATION_FROM_JSON,
    SUPEREXEC,
    SUBPROCESS_EXECUTOR,
    LAUNCH_RESULT,
    TASK_TYPE,
    RUN_CLIENTAPP,
)


def superexec_module() -> Any:
    """Flower's run_superexec module, whose `get_executor` the warm SuperExec replaces."""
    SUPEREXEC.load()
    return import_module(SUPEREXEC.module)


def missing(internals: tuple[Internal, ...] = ALL) -> list[str]:
    """One line for each of `internals` the installed Flower lacks (none: all found)."""
    lines = []
    for internal in internals:
        try:
            internal.load()
        except ConfigError as err:
            lines.append(str(err))
    return lines
