"""fedstale: asynchronous federated learning on Flower.

One import name, five layers (docs/architecture.md): `fedstale.common`,
`fedstale.strategies`, the two Flower apps `fedstale.server_app` and `fedstale.client_app`,
and `fedstale.launcher` (the `fedstale` command).

For a Flower user's own apps (docs/library.md): the rules as Flower strategies,
`from fedstale import FedBuff`, the client halves as mods, `fedstale.fedpsa_mod`, and
Flower's central-DP wrappers for them, `fedstale.DifferentialPrivacyServerSideFixedClipping`.
Both are derived from the rules' declarations (fedstale/strategies/rule.py), an installed
package's rules included, and imported on first use, so that a ClientApp importing one mod
does not load the server's engine.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker and an IDE see; at run time, __getattr__ below
    from fedstale.client_app.mods import fedpsa_mod as fedpsa_mod
    from fedstale.client_app.mods import fedqs_mod as fedqs_mod
    from fedstale.client_app.mods import mafsa_mod as mafsa_mod
    from fedstale.client_app.secagg import secagg_mod as secagg_mod
    from fedstale.common.config import ConfigError as ConfigError
    from fedstale.server_app.engine import EngineError as EngineError
    from fedstale.server_app.flower_privacy import (
        DifferentialPrivacyClientSideFixedClipping as DifferentialPrivacyClientSideFixedClipping,
    )
    from fedstale.server_app.flower_privacy import (
        DifferentialPrivacyServerSideFixedClipping as DifferentialPrivacyServerSideFixedClipping,
    )
    from fedstale.server_app.flower_strategy import AsyncStrategy as AsyncStrategy
    from fedstale.server_app.library import *  # noqa: F403  (one class per rule)

LIBRARY = "fedstale.server_app.library_classes"
BASE = "fedstale.server_app.flower_strategy"
PRIVACY = "fedstale.server_app.flower_privacy"
SECURE = {"secagg_mod": "fedstale.client_app.secagg"}  # secure aggregation's client half
ERRORS = {
    "ConfigError": "fedstale.common.config",  # a ValueError: a setting or key is wrong
    "EngineError": "fedstale.server_app.engine",  # a RuntimeError: the run cannot go on
}
DP_WRAPPERS = (
    "DifferentialPrivacyServerSideFixedClipping",
    "DifferentialPrivacyClientSideFixedClipping",
)


def exports() -> dict[str, str]:
    """Exported name -> the module holding it: the library's base class, a class per
    rule declared with a library name, each declared client half's Flower mod, the
    central-DP wrappers with Flower's names and secure aggregation's mod."""
    from fedstale.strategies.registry import declarations

    found = {}
    for rule in declarations().values():  # no two share a name (registry.name_taken)
        if rule.library:
            found[rule.library] = LIBRARY
        found.update(rule.mods)
    # fedstale's own names last: no rule can stand in for them
    own = {"AsyncStrategy": BASE, **dict.fromkeys(DP_WRAPPERS, PRIVACY), **SECURE, **ERRORS}
    return {**found, **own}


def __dir__() -> list[str]:
    """`dir(fedstale)`, and so a REPL's or notebook's completion of `fedstale.Fed<TAB>`:
    the module's own names and every export, found as `__getattr__` finds them."""
    return sorted({*globals(), *exports()})


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return ["__version__", *exports()]
    found = exports() if not name.startswith("__") else {}
    if name not in found:
        raise AttributeError(f"module 'fedstale' has no attribute '{name}'")
    return getattr(import_module(found[name]), name)


try:
    __version__ = version("fedstale")
except PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
