"""What a train message carries and what its reply must hold: the one thing that differs
between fedstale's own ClientApp and any Flower ClientApp.

- `FedstaleContract` (fedstale's ClientApp): the task's full config (task id, version,
  optimiser settings, client rules); the reply names its task and client and carries the
  delta or model the task asked for (replies.py checks it).
- `FlowerContract` (any ClientApp answering Flower's standard train message, the contract
  of Flower's own strategies): "arrays" and "config" in; "arrays" (the trained model) and a
  MetricRecord "metrics" with "num-examples" out. The reply is tied to its task by Flower's
  reply-to id alone, and the server computes the delta from the model it sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fedstale.common.layout import ParamLayout
from fedstale.common.schema import (
    RETURN_DELTA,
    RETURN_MODEL,
    InvalidReply,
    ReplyKeys,
    TaskKeys,
    TaskSpec,
    parse_signals,
)
from fedstale.server_app.replies import Arrival, update_of, validated
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Assignment, Strategy, Update

SERVER_ROUND = "server-round"  # Flower's strategies put the round in every config


class MissingSignal(InvalidReply):
    """A reply lacks what the rule needs from the client: the ClientApp misses a mod."""


class Contract(Protocol):
    def task_config(self, spec: TaskSpec, assignment: Assignment) -> dict[str, Any]: ...

    def outgoing(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The main array set as it goes on the wire."""
        ...

    def sent(self, task_id: int, start: np.ndarray) -> None:
        """Task `task_id` was sent with the flat model `start`."""
        ...

    def update(
        self,
        arrival: Arrival,
        reply: Reply,
        strategy: Strategy,
        layout: ParamLayout,
    ) -> Update: ...

    def forget(self, task_id: int) -> None:
        """The task ended (answered, lost or superseded)."""
        ...

    def replies_carry(self, returns: str) -> str:
        """What a reply's main arrays hold on the wire when the rule `returns` this."""
        ...


class FedstaleContract:
    """fedstale's own ClientApp: the task config in full, replies checked by `validated`."""

    def task_config(self, spec: TaskSpec, assignment: Assignment) -> dict[str, Any]:
        return spec.to_config()

    def outgoing(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return arrays

    def sent(self, task_id: int, start: np.ndarray) -> None:
        pass

    def update(
        self,
        arrival: Arrival,
        reply: Reply,
        strategy: Strategy,
        layout: ParamLayout,
    ) -> Update:
        return validated(arrival, reply, strategy, layout)

    def forget(self, task_id: int) -> None:
        pass

    def replies_carry(self, returns: str) -> str:
        return returns


# TaskSpec field -> its task-config key: a rule's per-task settings (FedQS's lr, MAFSA's
# local steps) win over the user's train config.
SETTING_KEYS = {
    "lr": TaskKeys.LR,
    "local_epochs": TaskKeys.EPOCHS,
    "batch_size": TaskKeys.BATCH_SIZE,
    "proximal_mu": TaskKeys.PROXIMAL_MU,
    "momentum": TaskKeys.MOMENTUM,
    "weight_decay": TaskKeys.WEIGHT_DECAY,
    "grad_clip": TaskKeys.GRAD_CLIP,
    "local_steps": TaskKeys.LOCAL_STEPS,
    "optimizer": TaskKeys.OPTIMIZER,
}


@dataclass
class FlowerContract:
    """Flower's standard train contract. `train_config` is the user's (Strategy.start's
    `train_config`): it goes into every task and wins over fedstale's defaults for the same
    key, except where the rule sets a value per task. `dtypes`: each array's dtype in the
    user's model (the wire keeps them; the rules work in float32). `hints`: per signal,
    what to add to the ClientApp to send it."""

    train_config: Mapping[str, Any]
    dtypes: Mapping[str, np.dtype]
    hints: Mapping[str, str] = field(default_factory=dict)
    starts: dict[int, np.ndarray] = field(default_factory=dict)
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)  # task -> reply metrics

    def task_config(self, spec: TaskSpec, assignment: Assignment) -> dict[str, Any]:
        ours = spec.to_config()
        per_task = {SETTING_KEYS[name]: ours[SETTING_KEYS[name]] for name in assignment.settings}
        return {**ours, **self.train_config, **per_task, SERVER_ROUND: spec.version + 1}

    def outgoing(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: a.astype(self.dtypes[name], copy=False) for name, a in arrays.items()}

    def sent(self, task_id: int, start: np.ndarray) -> None:
        self.starts[task_id] = start.copy()

    def forget(self, task_id: int) -> None:
        self.starts.pop(task_id, None)

    def replies_carry(self, returns: str) -> str:
        return RETURN_MODEL  # a Flower ClientApp replies with its trained model

    def update(
        self,
        arrival: Arrival,
        reply: Reply,
        strategy: Strategy,
        layout: ParamLayout,
    ) -> Update:
        task = arrival.task
        if reply.invalid:
            raise InvalidReply(reply.invalid)
        num_examples = reply.metrics.get(ReplyKeys.NUM_EXAMPLES)
        if isinstance(num_examples, bool) or not isinstance(num_examples, int | float):
            raise InvalidReply(f"reply's MetricRecord lacks an integer '{ReplyKeys.NUM_EXAMPLES}'")
        if num_examples < 1 or num_examples != int(num_examples):
            raise InvalidReply(f"'{ReplyKeys.NUM_EXAMPLES}' = {num_examples} is not a count")
        self.require_signals(strategy, reply)
        if reply.arrays is None:
            raise InvalidReply("reply carries no 'arrays' (the trained model)")
        expected = sorted(task.sets)
        if sorted(reply.sets) != expected:
            raise MissingSignal(self.missing(strategy, f"array sets {expected}"))
        trained = checked_model(reply.arrays, layout)
        start = self.starts[task.task_id]
        vector = trained - start if strategy.returns == RETURN_DELTA else trained
        self.metrics[task.task_id] = dict(reply.metrics)
        return update_of(
            arrival,
            strategy,
            num_examples=int(num_examples),
            vector=vector,
            signals=parse_signals(reply.metrics, strategy.signals()),
            compute_seconds=float(reply.metrics.get(ReplyKeys.COMPUTE_SECONDS, 0.0)),
            sets={name: checked_model(a, layout) for name, a in reply.sets.items()},
        )

    def require_signals(self, strategy: Strategy, reply: Reply) -> None:
        absent = sorted(set(strategy.signals()) - set(reply.metrics))
        if absent:
            raise MissingSignal(self.missing(strategy, ", ".join(f"'{k}'" for k in absent)))

    def missing(self, strategy: Strategy, what: str) -> str:
        hint = "; ".join(sorted(set(self.hints.values()))) or "its client half"
        return f"{strategy.name} needs {what} in every train reply: {hint}"


def checked_model(arrays: Mapping[str, np.ndarray], layout: ParamLayout) -> np.ndarray:
    """A reply's model as one flat float32 vector: names and shapes as sent, all finite."""
    if tuple(arrays) != layout.names:
        missing = sorted(set(layout.names) - set(arrays))
        unexpected = sorted(set(arrays) - set(layout.names))
        if missing or unexpected:
            raise InvalidReply(f"array names differ (missing {missing}, unexpected {unexpected})")
        arrays = {name: arrays[name] for name in layout.names}
    for (name, array), shape in zip(arrays.items(), layout.shapes, strict=True):
        if tuple(array.shape) != shape:
            raise InvalidReply(f"array '{name}' has shape {tuple(array.shape)}, expected {shape}")
        if not np.issubdtype(array.dtype, np.number):
            raise InvalidReply(f"array '{name}' has dtype {array.dtype}, expected a number")
    flat = layout.flatten(dict(arrays))
    if not np.isfinite(flat).all():
        raise InvalidReply("the reply's model holds NaN or Inf")
    return flat
