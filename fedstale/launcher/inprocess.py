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

from fedstale.common.cohort import first_of_each, said_together
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


CohortFn = Callable[
    [RunConfig, list[tuple[int, Mapping[str, Any], Arrays, ArraySets | None, dict]]],
    list[tuple[dict[str, Any], Arrays, dict[str, Arrays]]],
]


class CohortTransport(InProcessTransport):
    """`trainer=cohort`: a train task is not run when it is sent but when the engine waits
    for a reply it lacks; then every task sent and not yet trained (each client's first,
    in the order sent) trains together as one batched computation (on `client-threads`).
    A task's inputs are fixed when it is sent, so its result does not depend on when it
    is trained; tasks the run stops before needing are never trained."""

    def __init__(self, run: RunConfig, cohort: CohortFn, evaluate: EvaluateFn) -> None:
        super().__init__(run, lambda *args: {}, evaluate)  # type: ignore[arg-type,return-value]
        self.cohort_fn = cohort
        self.pending: list[tuple[str, int, dict, Arrays, ArraySets | None]] = []
        self.sizes: list[int] = []  # tasks per cohort trained (the tests read it)

    def train(
        self, msg_id: str, partition: int, config: dict, arrays: Arrays, sets: ArraySets | None
    ) -> None:
        self.pending.append((msg_id, partition, config, arrays, sets))

    def wait(self, seconds: float) -> None:
        if self.pending:
            self.train_pending()
        else:
            time.sleep(seconds)

    def train_pending(self) -> None:
        batch, self.pending = first_of_each(self.pending, lambda job: job[1])
        jobs = [
            (partition, config, arrays, sets, self.states.setdefault(partition, {}))
            for _, partition, config, arrays, sets in batch
        ]
        results = self.cohort_fn(self.run, jobs)
        self.sizes.append(len(batch))
        said_together(len(batch), "in this process")
        for (msg_id, *_), (metrics, result, outputs) in zip(batch, results, strict=True):
            self.replies[msg_id] = Reply(msg_id, metrics=metrics, arrays=result, sets=outputs)
