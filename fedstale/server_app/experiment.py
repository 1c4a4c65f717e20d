"""Everything a run needs, built from the run config, around one Engine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from fedstale.common.config import (
    KebabModel,
    RunConfig,
)
from fedstale.common.federation import FederationKey, effective_test_split, federation_of, test_data
from fedstale.common.layout import ParamLayout
from fedstale.common.models import evaluate, get_flat, set_flat
from fedstale.common.objectives import Objective, objective
from fedstale.common.run_model import run_model
from fedstale.common.shares import client_holdout
from fedstale.common.threads import blas_threads
from fedstale.common.usercode import require_dataset
from fedstale.server_app import lifecycle
from fedstale.server_app.engine import Engine
from fedstale.server_app.lifecycle import Door, Model
from fedstale.server_app.nodes import AssignedNodes, Nodes
from fedstale.server_app.results import run_name
from fedstale.server_app.scored import ClientScorer, Evaluator
from fedstale.server_app.transport import Transport
from fedstale.strategies.base import ModelServices, Setup, TorchModel

log = logging.getLogger("fedstale")


def make_evaluator(
    key: FederationKey, scoring: Objective, batch_size: int, model: torch.nn.Module
) -> Evaluator:
    """A function scoring a flat parameter vector on the test set."""
    x_test, y_test = test_data(key)

    def score(flat: np.ndarray) -> tuple[float, float]:
        set_flat(model, flat)
        return evaluate(model, x_test, y_test, batch_size, scoring)

    return score


def make_client_scorer(
    key: FederationKey, scoring: Objective, batch_size: int, model: torch.nn.Module
) -> ClientScorer:
    """Scores a client's model on that client's own held-out split, exactly as its
    ClientApp's evaluate handler would (fedstale/client_app/task.py evaluate_task)."""

    def score(client: int, flat: np.ndarray) -> tuple[float, float]:
        set_flat(model, flat)
        x, y = client_holdout(key, client)
        return evaluate(model, x, y, batch_size, scoring)

    return score


def setup_for(key: FederationKey, layout: ParamLayout) -> Setup:
    """What every rule may take before the run (Strategy.bind)."""
    fed = federation_of(key)
    return Setup(
        segments=tuple(layout.segments),
        client_sizes=np.array([len(idx) for idx in fed.train_idx], dtype=np.float64),
    )


def services_for(key: FederationKey, model: torch.nn.Module) -> ModelServices:
    """What a rule computing on the model at the server may take (ServerModel): the run's
    model and the test split; nothing is computed until the rule asks for it."""
    fed = federation_of(key)
    return ModelServices(
        model=lambda: TorchModel(model, fed.input_shape, fed.num_classes),
        held_out=lambda setting: test_data(key),
    )


def settings_of(run: RunConfig, params: KebabModel, name: str) -> dict[str, Any]:
    """The run config and the strategy's keys, as config.json records them."""
    return {**run.model_dump(by_alias=True), **params.model_dump(by_alias=True), "run-name": name}


class AppDoor(Door):
    """fedstale's own ServerApp (`fedstale run`, `--local`, `deploy`): the dataset and
    model come from the run config, and every client's data size is known."""

    def __init__(self, run: RunConfig, transport: Transport | None, label: str = "") -> None:
        self.run = run
        self.given = transport  # None: a door that only checks a run (`fedstale check`)
        self.label = label
        self.torch_model: torch.nn.Module | None = None

    def transport(self) -> Transport:
        assert self.given is not None, "a door without a transport only checks a run"
        return self.given

    def name(self) -> str:
        return run_name(self.run)

    def nodes(self) -> Nodes | None:
        """`node-partitions=assign`: partitions assigned in node order, named in messages."""
        return AssignedNodes(self.run.num_clients) if self.run.node_partitions == "assign" else None

    def settings(self, params: KebabModel, name: str) -> dict[str, Any]:
        return settings_of(self.run, params, name)

    def refuse(self) -> None:
        require_dataset(self.run)

    def config_extras(self) -> dict[str, Any]:
        split = effective_test_split(self.run)
        if split != self.run.test_split:
            log.warning(
                "%s has no standard test split: testing on a 10%% holdout", self.run.dataset
            )
        return {"test-split-effective": split}

    def model(self) -> Model:
        self.torch_model = run_model(self.run)  # the one model the server scores and sketches with
        return Model(ParamLayout.of(self.torch_model), get_flat(self.torch_model))

    def module(self) -> torch.nn.Module:
        assert self.torch_model is not None, "model() comes first"
        return self.torch_model

    def setup(self, model: Model) -> Setup:
        return setup_for(FederationKey.of(self.run), model.layout)

    def services(self, model: Model) -> ModelServices:
        return services_for(FederationKey.of(self.run), self.module())

    def evaluator(self, model: Model, version: Callable[[], int]) -> Evaluator:
        return make_evaluator(*self.scoring(), self.module())

    def client_scorer(self) -> ClientScorer:
        return make_client_scorer(*self.scoring(), self.module())

    def scoring(self) -> tuple[FederationKey, Objective, int]:
        """What the server scores on and with: the clients' data, the objective, the batch."""
        return (
            FederationKey.of(self.run),
            objective(self.run.loss, self.run.metric),
            self.run.eval_batch_size,
        )

    def plot_title(self) -> str:
        return f"{self.run.strategy} on {self.run.dataset}"

    def started(self, engine: Engine) -> None:
        if self.run.test_faults:
            log.warning(
                "test-faults is set: clients corrupt tasks %s on purpose", self.run.test_faults
            )

    def looping(self) -> AbstractContextManager[Any]:
        return blas_threads(1)


def prepare(run: RunConfig, params: KebabModel) -> None:
    """Everything that can refuse the run before its folder is touched (`fedstale check`)."""
    lifecycle.prepare(AppDoor(run, None), params)


def run_experiment(
    run: RunConfig, params: KebabModel, transport: Transport, label: str = ""
) -> dict[str, Any]:
    """One run through fedstale's door; `label` names it in its progress lines (a grid's
    runs share one stderr)."""
    if not log.level:
        log.setLevel(logging.INFO)
    return lifecycle.run_through(AppDoor(run, transport, label), params)
