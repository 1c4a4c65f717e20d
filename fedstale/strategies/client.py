"""The client half of a rule: what a strategy asks of a client beyond plain local training.

A `ClientRule` has a hook before training (it may add loss terms, set the task's optimiser
settings or read the client's kept state) and one after (it may add reply signals and named
array sets). Each lives in its strategy's file beside the server half and is declared there
(`Strategy.client_rules`); every task names the rules it needs (the task config's
`client-rules`), and a client that lacks one refuses the task (`rules_named`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from fedstale.common.config import RunConfig
from fedstale.common.models import ParamLayout
from fedstale.common.schema import TaskSpec
from fedstale.common.training import LossTerm


@dataclass
class LocalTask:
    """One task as the rules see it. `start`: the flat model the task starts from;
    `inputs`: the other named sets it received (flat); `state`: arrays this client keeps
    between tasks (Flower's Context.state; emulated per client in-process);
    `loss_terms`, `signals` and `outputs` are what the rules add."""

    cfg: RunConfig
    partition: int
    spec: TaskSpec
    model: torch.nn.Module
    layout: ParamLayout
    start: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    loss_terms: list[LossTerm] = field(default_factory=list)
    signals: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)


class ClientRule:
    name: ClassVar[str]  # what a task calls the rule
    # What a Flower ClientApp adds to run this rule's client half (a mod); empty where
    # only fedstale's own ClientApp has it.
    mod: ClassVar[str] = ""

    def before(self, task: LocalTask) -> None:
        """Called with the start model loaded, before local training."""

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        """Called with the trained model loaded."""


class UnknownClientRule(ValueError):
    """A task names a client rule this client does not have."""


def rules_named(names: Iterable[str], known: Mapping[str, ClientRule]) -> tuple[ClientRule, ...]:
    """The rules a task names, in its order; an unknown name refuses the task."""
    rules = []
    for name in names:
        if name not in known:
            raise UnknownClientRule(
                f"the task asks for client rule '{name}', which this ClientApp does not have "
                f"(it has {', '.join(sorted(known)) or 'none'}); install the fedstale "
                "version the server runs"
            )
        rules.append(known[name])
    return tuple(rules)
