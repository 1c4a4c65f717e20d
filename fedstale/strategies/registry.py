"""Strategy names -> classes (one line per rule: `RULES`), their client rules by name, and
the full validation of a run config."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedstale.common.config import FIX_HINT, ConfigError, KebabModel, RunConfig, parse_model
from fedstale.strategies.base import Strategy
from fedstale.strategies.ca2fl import CA2FL
from fedstale.strategies.client import ClientRule
from fedstale.strategies.fedasync import FedAsync
from fedstale.strategies.fedavg import FedAvg
from fedstale.strategies.fedbuff import FedBuff
from fedstale.strategies.fedfa import FedFa
from fedstale.strategies.fedpsa import FedPSA
from fedstale.strategies.fedqs import FedQSAvg, FedQSSGD, SaflFedAvg, SaflFedSGD
from fedstale.strategies.hierfedavg import HierFedAvg
from fedstale.strategies.local_only import LocalOnly
from fedstale.strategies.mafsa import MAFSA
from fedstale.strategies.pace import PACE, PFedGraphAsync

RULES = (FedAvg, FedAsync, FedBuff, CA2FL, FedFa, FedPSA, PACE, PFedGraphAsync)
RULES += (FedQSSGD, FedQSAvg, SaflFedSGD, SaflFedAvg, MAFSA, HierFedAvg, LocalOnly)
STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in RULES}


def client_rules() -> dict[str, ClientRule]:
    """Every registered strategy's client rules, by the name a task gives them."""
    return {rule.name: rule for cls in STRATEGIES.values() for rule in cls.client_rules}


def known_keys() -> set[str]:
    keys = RunConfig.keys()
    for cls in STRATEGIES.values():
        keys |= cls.Params.keys()
    return keys


def _reject_unknown_keys(values: Mapping[str, Any]) -> None:
    known = known_keys()
    for key in sorted(set(values) - known):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "see [tool.flwr.app.config]"
        raise ConfigError(f"run config: unknown key '{key}'; {hint}")


def load_config(values: Mapping[str, Any]) -> tuple[RunConfig, KebabModel]:
    """The run config and the strategy's own parameters, or one ConfigError line."""
    _reject_unknown_keys(values)
    run = parse_model(RunConfig, values)
    if run.strategy not in STRATEGIES:
        raise ConfigError(
            f"run config: unknown strategy '{run.strategy}'; choose one of "
            f"{', '.join(sorted(STRATEGIES))}; {FIX_HINT}"
        )
    # Every strategy's keys are checked, so a bad value never waits for the day it is used.
    all_params = {name: parse_model(c.Params, values) for name, c in STRATEGIES.items()}
    cls, params = STRATEGIES[run.strategy], all_params[run.strategy]
    try:
        cls.check(run, params)
    except ValueError as err:
        raise ConfigError(f"run config: {err}; {FIX_HINT}") from None
    return run, params


def build_strategy(run: RunConfig, params: KebabModel, initial: np.ndarray) -> Strategy:
    return STRATEGIES[run.strategy](run, params, initial)
