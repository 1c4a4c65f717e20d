"""Flower simulation on a Ray cluster that is already running: RAY_ADDRESS.

Flower 1.41's simulation (flwr/server/superlink/fleet/vce/backend/raybackend.py) calls
`ray.init(runtime_env=..., **init_args)` in the `flwr-simulation` process, its init args
taken only from the federation keys `init-args-num-cpus`, `init-args-num-gpus`,
`init-args-logging-level` and `init-args-log-to-driver` (flwr/simulation/app.py): there is
no address key. With no address, `ray.init` joins the cluster that the RAY_ADDRESS
environment variable names, and `flwr-simulation` inherits its environment from the
SuperExec and the SuperLink. So the address goes in the SuperLink's environment: `fedstale
run` passes its own environment to the local SuperLink it starts, and checks the value
first, since a wrong one only shows once the simulation is up (an address nobody answers
on leaves `ray.init` retrying for minutes).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from fedstale.common.config import ConfigError

RAY_ADDRESS = "RAY_ADDRESS"
# `ray.init` refuses these when it joins a running cluster ("When connecting to an existing
# cluster, num_cpus and num_gpus must not be provided"): each node declares its own.
REFUSED_ON_A_CLUSTER = ("init-args-num-cpus", "init-args-num-gpus")
REACH_SECONDS = 5.0


def host_and_port(address: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets) -> (host, port), or one ConfigError line."""
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{RAY_ADDRESS}='{address}' is not a Ray cluster's address: give the head's "
            "host:port (what `ray start --head` prints), 'auto', or unset it"
        )
    return host, int(port)


def ray_cluster(
    environ: Mapping[str, str], federation: Mapping[str, Any], timeout: float = REACH_SECONDS
) -> str | None:
    """The running Ray cluster that RAY_ADDRESS in `environ` names for Flower's simulation,
    checked against the `--federation-config` values; None when it names none (unset, empty
    or 'local': the simulation starts Ray on this machine). 'auto' is the cluster `ray start`
    last started on this machine. One ConfigError line for a value Ray would refuse, a
    `host:port` on which nothing answers within `timeout` seconds, a Ray Client address, or
    num-cpus / num-gpus init args, which Ray refuses when it joins a cluster."""
    address = environ.get(RAY_ADDRESS, "").strip()
    if address in ("", "local"):
        return None
    if address.startswith("ray://"):
        raise ConfigError(
            f"{RAY_ADDRESS}='{address}' is a Ray Client address, which fedstale does not "
            "support with Flower's simulation; give the head's GCS address host:port "
            "(ray start --head --port=PORT)"
        )
    if address != "auto":
        host, port = host_and_port(address)
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as err:
            raise ConfigError(
                f"{RAY_ADDRESS}={address}: no Ray head answers there ({err}); "
                f"start one with `ray start --head --port={port}` or fix the address"
            ) from None
    refused = [key for key in REFUSED_ON_A_CLUSTER if key in federation]
    if refused:
        raise ConfigError(
            f"--federation-config {' '.join(refused)}: Ray refuses CPU and GPU counts when it "
            f"joins a running cluster ({RAY_ADDRESS}={address}); each node declares its own "
            "(ray start --num-cpus N --num-gpus G)"
        )
    return address
