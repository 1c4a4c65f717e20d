"""Client-side rules: what a strategy asks of a client beyond plain local training.

A rule has a hook before training (it may add loss terms or read the client's kept state)
and one after (it may add reply signals and named array sets). The registry is keyed by
strategy name; a strategy without an entry trains plainly. The server-side half of each
rule lives in strategies/<name>.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from client_app.training import LossTerm, Optimiser, local_train
from common.config import RunConfig
from common.federation import client_data, data_shape
from common.models import ParamLayout, get_flat, set_flat
from common.schema import STALE, RuleKeys, SignalKeys, TaskSpec
from common.sensitivity import sketch_for_task


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
    def before(self, task: LocalTask) -> None:
        """Called with the start model loaded, before local training."""

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        """Called with the trained model loaded."""


class SensitivitySketch(ClientRule):
    """FedPSA (eq. 8, 11): the k-float sketch of the trained model's parameter sensitivity
    on the shared calibration batch, and ||delta||^2 for the thermometer (eq. 16)."""

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        sketch = sketch_for_task(task.model, task.spec.extra, *data_shape(task.cfg))
        task.signals[SignalKeys.SKETCH] = [float(v) for v in sketch]
        task.signals[SignalKeys.UPDATE_NORM_SQ] = float(np.dot(delta.astype(np.float64), delta))


class CosineToStart(ClientRule):
    """PACE and pFedGraph (eq. 4): the objective adds lambda (1 - cos(w, w_start)) over all
    parameters, w_start the model the task started from."""

    def before(self, task: LocalTask) -> None:
        weight = float(task.spec.extra.get(RuleKeys.PACE_LAMBDA, 0.0))
        if weight == 0:
            return
        params = list(task.model.state_dict(keep_vars=True).values())  # the layout's order
        start = torch.from_numpy(task.start).to(params[0].device)

        def term(model: torch.nn.Module) -> torch.Tensor:
            flat = torch.cat([p.reshape(-1) for p in params])
            return weight * (1.0 - torch.nn.functional.cosine_similarity(flat, start, 0, 1e-12))

        task.loss_terms.append(term)


class ClassSpread(ClientRule):
    """FedQS: a slow, misaligned client (SBC) measures the received model's per-class
    accuracy spread on its own training data before it trains; a wide spread turns its
    momentum off and raises the feedback flag. Every FedQS reply carries the task's flag,
    the momentum it trained with and the spread (-1 where it was not asked for)."""

    SAMPLES_PER_CLASS = 20
    FEW = 10  # a class with fewer samples counts half

    def before(self, task: LocalTask) -> None:
        kind = str(task.spec.extra.get(RuleKeys.FEDQS_TYPE, ""))
        task.signals[RuleKeys.FEDQS_FLAG] = 1.0 if kind == "FBC" else 0.0
        task.signals[RuleKeys.FEDQS_SPREAD] = -1.0
        if kind == "SBC":
            spread = self.spread(task)
            wide = spread >= float(task.spec.extra[RuleKeys.FEDQS_SPREAD_LIMIT])
            momentum = 0.0 if wide else float(task.spec.extra[RuleKeys.FEDQS_M0])
            task.spec = replace(task.spec, momentum=momentum)
            task.signals[RuleKeys.FEDQS_FLAG] = float(wide)
            task.signals[RuleKeys.FEDQS_SPREAD] = spread
        task.signals[RuleKeys.FEDQS_MOMENTUM] = float(task.spec.momentum)

    def spread(self, task: LocalTask) -> float:
        """max - min, in points, of the per-class accuracy on up to 20 samples of each class
        the client holds (halved for a class with fewer than 10)."""
        x, y = client_data(task.cfg, task.partition, "train")
        device = next(task.model.parameters()).device
        accuracies = []
        task.model.eval()
        with torch.no_grad():
            for label in torch.unique(y):
                rows = torch.nonzero(y == label).flatten()
                picked = rows[: self.SAMPLES_PER_CLASS]
                guess = task.model(x[picked].to(device)).argmax(dim=1).cpu()
                accuracy = float((guess == label).float().mean())
                accuracies.append(accuracy / 2 if len(rows) < self.FEW else accuracy)
        return 100.0 * (max(accuracies) - min(accuracies))


class StaleTraining(ClientRule):
    """MAFSA (Alg. 2): a client back from E_i offline rounds does the offline work lazily:
    its last local model (the task's `stale` set) trains E_i local updates, each as long
    as the fresh one, with the lr decaying per offline round, and goes back beside the
    fresh model."""

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        rounds = int(task.spec.extra.get(RuleKeys.MAFSA_OFFLINE, 0))
        if rounds <= 0:
            return
        spec, extra = task.spec, task.spec.extra
        set_flat(task.model, task.inputs[STALE])
        device = next(task.model.parameters()).device
        x, y = (t.to(device) for t in client_data(task.cfg, task.partition, "train"))
        lr, step = float(extra[RuleKeys.MAFSA_STALE_LR]), float(extra[RuleKeys.MAFSA_LR_STEP])
        for offline_round in range(rounds):
            local_train(
                task.model,
                x,
                y,
                epochs=spec.local_epochs,
                batch_size=spec.batch_size,
                lr=lr * step**offline_round,
                seed=spec.seed + 1 + offline_round,
                closed_form=task.cfg.trainer == "auto",
                optimiser=Optimiser(
                    spec.optimizer, spec.momentum, spec.weight_decay, spec.grad_clip
                ),
                steps=spec.local_steps,
            )
        task.outputs[STALE] = get_flat(task.model)


RULES: dict[str, tuple[ClientRule, ...]] = {
    "fedpsa": (SensitivitySketch(),),
    "pace": (CosineToStart(),),
    "pfedgraph-async": (CosineToStart(),),
    "fedqs-sgd": (ClassSpread(),),
    "fedqs-avg": (ClassSpread(),),
    "mafsa": (StaleTraining(),),
}


def rules_for(strategy: str) -> tuple[ClientRule, ...]:
    return RULES.get(strategy, ())
