"""The in-process transport on several cores: clients' tasks run in worker processes.

Each worker process loads the data shares and builds the model once and keeps them between
tasks (the client code caches both per process). Any worker may run any task; a client's kept
state (Flower's Context.state) stays in this process and travels with its task, and a
client's tasks run one after another in the order they were sent (a superseded task still
finishes before its client's next one starts), exactly as on one worker. On the virtual clock
the engine handles replies in finish-time order whatever order the workers end in, so a seed
gives the same run on one worker, on many, and in Flower simulation.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedstale.common.config import RunConfig
from fedstale.common.records import ArraySets
from fedstale.launcher.inprocess import Arrays, EvaluateFn, InProcessTransport, TrainFn
from fedstale.server_app.transport import Reply

ERROR_CODE = 1  # a client exception, as Flower's ClientApp error replies carry
_worker: dict[str, Any] = {}  # in each worker process: its run config and client functions


def _start_worker(run: RunConfig, train: TrainFn, evaluate: EvaluateFn) -> None:
    _worker.update(run=run, train=train, evaluate=evaluate)


def _train(partition: int, config: Mapping[str, Any], arrays: dict, sets: Any, state: dict):
    metrics, result, outputs = _worker["train"](
        _worker["run"], partition, config, arrays, sets, state
    )
    return metrics, result, outputs, state


def _evaluate(partition: int, config: Mapping[str, Any], arrays: dict) -> dict[str, Any]:
    return _worker["evaluate"](_worker["run"], partition, config, arrays)


@dataclass
class Job:
    msg_id: str
    partition: int
    config: Mapping[str, Any]
    arrays: dict[str, np.ndarray]
    sets: ArraySets | None


class PooledTransport(InProcessTransport):
    def __init__(self, run: RunConfig, train: TrainFn, evaluate: EvaluateFn, workers: int) -> None:
        super().__init__(run, train, evaluate)
        context = multiprocessing.get_context("spawn")  # no fork of a process holding torch
        self.pool = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker, initargs=(run, train, evaluate)
        )
        self.queued: dict[int, deque[Job]] = {}  # per client: tasks behind its running one
        self.running: dict[str, tuple[Future, int | None]] = {}  # msg -> (future, client)
        self.finished = threading.Event()

    def train(
        self, msg_id: str, partition: int, config: dict, arrays: Arrays, sets: ArraySets | None
    ) -> None:
        queue = self.queued.setdefault(partition, deque())
        queue.append(Job(msg_id, partition, config, arrays, sets))
        if len(queue) == 1:
            self.submit_train(queue[0])

    def evaluate(self, msg_id: str, partition: int, config: dict, arrays: Arrays) -> None:
        self.track(msg_id, self.pool.submit(_evaluate, partition, config, arrays), None)

    def submit_train(self, job: Job) -> None:
        state = self.states.setdefault(job.partition, {})
        future = self.pool.submit(
            _train, job.partition, job.config, job.arrays, job.sets, dict(state)
        )
        self.track(job.msg_id, future, job.partition)

    def track(self, msg_id: str, future: Future, partition: int | None) -> None:
        self.running[msg_id] = (future, partition)
        future.add_done_callback(lambda _: self.finished.set())

    def harvest(self) -> None:
        """Turn finished work into replies; start each client's next queued task."""
        self.finished.clear()
        for msg_id, (future, partition) in list(self.running.items()):
            if not future.done():
                continue
            del self.running[msg_id]
            self.replies[msg_id] = self.reply(msg_id, future, partition)
            if partition is not None:
                queue = self.queued[partition]
                queue.popleft()
                if queue:
                    self.submit_train(queue[0])

    def reply(self, msg_id: str, future: Future, partition: int | None) -> Reply:
        """The work's reply; a client's exception becomes an error reply, as in Flower."""
        error = future.exception()
        if error is not None:
            return Reply(msg_id, error_code=ERROR_CODE, error=f"{type(error).__name__}: {error}")
        if partition is None:
            return Reply(msg_id, metrics=future.result())
        metrics, result, outputs, state = future.result()
        self.states[partition] = state
        return Reply(msg_id, metrics=metrics, arrays=result, sets=outputs)

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        self.harvest()
        return super().receive(msg_ids)

    def wait(self, seconds: float) -> None:
        """Idle until some work finishes or `seconds` pass (the engine's poll sleep)."""
        self.finished.wait(seconds)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PooledTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
