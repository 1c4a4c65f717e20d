"""fedstale: asynchronous federated learning on Flower.

One import name, five layers (docs/architecture.md): `fedstale.common`,
`fedstale.strategies`, the two Flower apps `fedstale.server_app` and `fedstale.client_app`,
and `fedstale.launcher` (the `fedstale` command).

For a Flower user's own apps (docs/library.md): the rules as Flower strategies,
`from fedstale import FedBuff`, and the client halves as mods, `fedstale.fedpsa_mod`.
They are imported on first use, so that a ClientApp importing one mod does not load the
server's engine.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

STRATEGIES = "fedstale.server_app.flower_strategy"
MODS = "fedstale.client_app.mods"
EXPORTS = {
    **{
        name: STRATEGIES
        for name in ("AsyncStrategy", "FedAvg", "FedAsync", "FedBuff", "CA2FL", "FedFa")
    },
    **{name: STRATEGIES for name in ("FedPSA", "SaflFedSGD", "SaflFedAvg", "HierFedAvg")},
    **{name: STRATEGIES for name in ("MAFSA", "FedQSSGD", "FedQSAvg")},
    **{name: MODS for name in ("fedpsa_mod", "mafsa_mod", "fedqs_mod")},
}
__all__ = ["__version__", *EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'fedstale' has no attribute '{name}'")
    return getattr(import_module(EXPORTS[name]), name)


try:
    __version__ = version("fedstale")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
