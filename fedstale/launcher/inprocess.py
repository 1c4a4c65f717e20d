"""A transport that runs the clients' work in this process, without Flower.

For quick experiments and long paper reproductions on a small box: the engine, strategies
and client code are the ones a Flower run uses, and on the virtual clock a run gives the
same metrics as in Flower simulation (tests check it), at the speed of a bare PyTorch loop.
The client functions are injected (fedstale/launcher/local.py builds this transport with them),
so the server side never imports client_app. Each client keeps its own state between tasks,
as Flower's Context.state does on a node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

import numpy as np

from fedstale.common.config import RunConfig
from fedstale.common.records import ArraySets
from fedstale.common.schema import MSG_EVALUATE, MSG_QUERY, MSG_TRAIN, ReplyKeys
from fedstale.server_app.transport import Reply

NODE_BASE = 1000
Arrays = dict[str, np.ndarray]
TrainFn = Callable[
    [RunConfig, int, Mapping[str, Any], Arrays, ArraySets | None, MutableMapping[str, np.ndarray]],
    tuple[dict[str, Any], Arrays, dict[str, Arrays]],
]
EvaluateFn = Callable[[RunConfig, int, Mapping[str, Any], Arrays], dict[str, Any]]


class InProcessTransport:
    simulated = True

    def __init__(self, run: RunConfig, train: TrainFn, evaluate: EvaluateFn) -> None:
        self.run = run
        self.train_fn = train
        self.evaluate_fn = evaluate
        self.replies: dict[str, Reply] = {}
        self.states: dict[int, dict[str, np.ndarray]] = {}  # per client: its Context.state
        self.count = 0

    def node_ids(self) -> list[int]:
        return [NODE_BASE + client for client in range(self.run.num_clients)]

    def send(
        self,
        node_id: int,
        message_type: str,
        config: Mapping[str, Any],
        arrays: Mapping[str, np.ndarray] | None = None,
        sets: ArraySets | None = None,
    ) -> str:
        self.count += 1
        msg_id = f"local-{self.count}"
        partition = node_id - NODE_BASE
        if message_type == MSG_QUERY:
            self.replies[msg_id] = Reply(msg_id, metrics={ReplyKeys.PARTITION_ID: partition})
        elif message_type == MSG_TRAIN:
            self.train(msg_id, partition, dict(config), dict(arrays or {}), sets)
        elif message_type == MSG_EVALUATE:
            self.evaluate(msg_id, partition, dict(config), dict(arrays or {}))
        else:
            raise ValueError(f"the in-process transport does not run '{message_type}' tasks")
        return msg_id

    def train(
        self, msg_id: str, partition: int, config: dict, arrays: Arrays, sets: ArraySets | None
    ) -> None:
        state = self.states.setdefault(partition, {})
        metrics, result, outputs = self.client_work(
            self.train_fn, partition, config, arrays, sets, state
        )
        self.replies[msg_id] = Reply(msg_id, metrics=metrics, arrays=result, sets=outputs)

    def evaluate(self, msg_id: str, partition: int, config: dict, arrays: Arrays) -> None:
        metrics = self.client_work(self.evaluate_fn, partition, config, arrays)
        self.replies[msg_id] = Reply(msg_id, metrics=metrics)

    def client_work(self, work: Callable[..., Any], *args: Any) -> Any:
        """The client's work, on `client-threads` threads; the server keeps its own."""
        return work(self.run, *args)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        return [self.replies.pop(m) for m in list(msg_ids) if m in self.replies]
