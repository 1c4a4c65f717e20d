"""fedstale: asynchronous federated learning on Flower.

One import name, five layers (docs/architecture.md): `fedstale.common`,
`fedstale.strategies`, the two Flower apps `fedstale.server_app` and `fedstale.client_app`,
and `fedstale.launcher` (the `fedstale` command)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedstale")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
