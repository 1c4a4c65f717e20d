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
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fedstale.common.config import ClientSettings
from fedstale.common.schema import TaskSpec

if TYPE_CHECKING:  # torch where it is used: the rule registry loads without it
    import torch

    from fedstale.common.layout import ParamLayout
    from fedstale.common.training import LossTerm


@dataclass
class LocalTask:
    """One task as the rules see it. `start`: the flat model the task starts from; `x`,
    `y`: this client's training split on the model's device (built once per process);
    `input_shape`, `num_classes`: the dataset's; `inputs`: the other named sets it
    received (flat); `state`: arrays this client keeps between tasks (Flower's
    Context.state; emulated per client in-process); `loss_terms`, `signals` and `outputs`
    are what the rules add."""

    cfg: ClientSettings
    partition: int
    spec: TaskSpec
    model: torch.nn.Module
    layout: ParamLayout
    start: np.ndarray
    x: torch.Tensor
    y: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    loss_terms: list[LossTerm] = field(default_factory=list)
    signals: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)

    def train(self, lr: float | None = None, seed: int | None = None) -> float:
        """Local training of the loaded `model` on this client's data as the task's spec
        says (`lr` and `seed` overridden where given: MAFSA's offline rounds); the mean
        training loss. The one place a client trains."""
        from fedstale.common.objectives import objective
        from fedstale.common.training import Optimiser, local_train

        spec, cfg = self.spec, self.cfg
        return local_train(
            self.model,
            self.x,
            self.y,
            epochs=spec.local_epochs,
            batch_size=spec.batch_size,
            lr=spec.lr if lr is None else lr,
            seed=spec.seed if seed is None else seed,
            proximal_mu=spec.proximal_mu,
            closed_form=cfg.trainer == "auto",
            optimiser=Optimiser(spec.optimizer, spec.momentum, spec.weight_decay, spec.grad_clip),
            steps=spec.local_steps,
            loss_terms=self.loss_terms,
            loss=objective(cfg.loss, cfg.metric).loss,
        )


class ClientRule:
    name: ClassVar[str]  # what a task calls the rule
    # This client half in any Flower ClientApp: the mod that runs it, as
    # "module:function(arguments)" ("": only fedstale's own ClientApp has it). `fedstale`
    # exports the function under its name; a ClientApp that lacks it is told the call.
    mod: ClassVar[str] = ""
    # Whether a task running this rule can train in a cohort (trainer=cohort): its hooks
    # leave local training as the task's spec says (they may change the spec in `before`,
    # add loss terms with a batched form, fedstale/common/cohort.py BatchedTerm, or train
    # further in `after`, which stays per task).
    in_cohorts: ClassVar[bool] = False

    @classmethod
    def mod_function(cls) -> tuple[str, str]:
        """(module, function) of the declared mod; ("", "") where there is none."""
        module, _, call = cls.mod.partition(":")
        return module, call.partition("(")[0]

    @classmethod
    def mod_hint(cls) -> str:
        """What a ClientApp that lacks this half adds to its mods."""
        return f"add fedstale.{cls.mod.partition(':')[2]} to your ClientApp's mods"

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
