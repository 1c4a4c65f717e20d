"""A transport that runs the clients' work in this process, without Flower.

For quick experiments and long paper reproductions on a small box: the engine, strategies
and client code are the ones a Flower run uses, and on the virtual clock a run gives the
same metrics as in Flower simulation (tests check it), at the speed of a bare PyTorch loop.
The client functions are injected (fedstale/launcher/local.py builds this transport with them),
so the server side never imports client_app. Each client keeps its own state between tasks,
as Flower's Context.state does on a node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from fedstale.common.cohort import first_of_each, said_together
from fedstale.common.config import ClientSettings
from fedstale.common.records import ArraySets, frozen_copy
from fedstale.common.schema import MSG_EVALUATE, MSG_QUERY, MSG_TRAIN, ReplyKeys
from fedstale.server_app.transport import Reply

NODE_BASE = 1000
Arrays = dict[str, np.ndarray]
TrainFn = Callable[
    [
        ClientSettings,
        int,
        Mapping[str, Any],
        Arrays,
        ArraySets | None,
        MutableMapping[str, np.ndarray],
    ],
    tuple[dict[str, Any], Arrays, dict[str, Arrays]],
]
EvaluateFn = Callable[[ClientSettings, int, Mapping[str, Any], Arrays], dict[str, Any]]


class InProcessTransport:
    simulated = True

    def __init__(self, run: ClientSettings, train: TrainFn, evaluate: EvaluateFn) -> None:
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


Job = tuple[int, Mapping[str, Any], Arrays, ArraySets | None, dict]
Result = tuple[dict[str, Any], Arrays, dict[str, Arrays]]
CohortsFn = Callable[[list[tuple[ClientSettings, list[Job]]]], list[list[Result]]]


class CohortTransport(InProcessTransport):
    """`trainer=cohort`: a train task is not run when it is sent but when the engine waits
    for a reply it lacks; then every task sent and not yet trained (each client's first,
    in the order sent) trains in one batched computation, together with the waiting tasks
    of every other run in the same `CohortPool` (a grid's runs). A task's inputs are fixed
    when it is sent, so its result does not depend on when or beside what it is trained;
    tasks the run stops before needing are never trained."""

    def __init__(self, run: ClientSettings, pool: CohortPool, evaluate: EvaluateFn) -> None:
        super().__init__(run, lambda *args: {}, evaluate)  # type: ignore[arg-type,return-value]
        self.pool = pool
        self.pending: list[tuple[str, int, dict, Arrays, ArraySets | None]] = []
        self.cohort_sizes: list[int] = []  # tasks in each computation that trained this run's
        self.own_sizes: list[int] = []  # of which this run's own
        self.failure: BaseException | None = None
        pool.expect(self)

    def train(
        self, msg_id: str, partition: int, config: dict, arrays: Arrays, sets: ArraySets | None
    ) -> None:
        kept, kept_sets = frozen_copy(arrays, sets)  # trained later: as they are now
        self.pending.append((msg_id, partition, config, kept or {}, kept_sets))

    def wait(self, seconds: float) -> None:
        if self.pending:
            self.pool.train_when_all_wait(self)
        else:
            self.pool.pause(seconds)

    def next_cohort(self) -> list[tuple[str, int, dict, Arrays, ArraySets | None]]:
        """Each client's first waiting task, taken off the waiting list."""
        cohort, self.pending = first_of_each(self.pending, lambda job: job[1])
        return cohort

    def jobs(self, cohort: list[tuple[str, int, dict, Arrays, ArraySets | None]]) -> list[Job]:
        return [
            (partition, config, arrays, sets, self.states.setdefault(partition, {}))
            for _, partition, config, arrays, sets in cohort
        ]

    def answer(self, cohort: list, results: list[Result], size: int) -> None:
        self.cohort_sizes.append(size)
        self.own_sizes.append(len(cohort))
        for (msg_id, *_), (metrics, result, outputs) in zip(cohort, results, strict=True):
            self.replies[msg_id] = Reply(msg_id, metrics=metrics, arrays=result, sets=outputs)


class CohortPool:
    """Where the cohort transports of the runs in one process meet, so that the tasks all of
    them wait for train as one cohort. The runs take turns: a run's thread holds the turn
    while its engine works and gives it up only while it waits (`turn`), so no two engines
    ever run at once (torch's and BLAS's thread settings are the process's). When every
    run still going waits for tasks to train, the last to wait trains them all, one batched
    computation per model architecture (`cohorts`, fedstale/client_app/task.py
    train_cohorts), and every run goes on with its replies. A run alone in its pool (a
    plain `trainer=cohort` run) trains its own tasks whenever it waits."""

    def __init__(self, cohorts: CohortsFn) -> None:
        self.cohorts = cohorts
        self.changed = threading.Condition()  # its lock is the turn
        # Joining needs no turn (a run made while another works must be counted at once,
        # or a run alone in the pool would keep the turn to its end): a lock of its own.
        self.joining = threading.Lock()
        self.expected: list[CohortTransport] = []  # the runs still going, in the order made
        self.waiting: list[CohortTransport] = []  # of those, the ones waiting for a cohort
        self.trained = 0  # cohorts trained so far: a waiting run goes on when it moves
        self.sizes: list[int] = []  # tasks per cohort, every run's together
        self.cancelled = False

    def expect(self, transport: CohortTransport) -> None:
        with self.joining:
            self.expected.append(transport)

    @contextmanager
    def turn(self, transport: CohortTransport) -> Iterator[None]:
        """Hold the turn while `transport`'s run works; when it ends, however it ends, it
        leaves the pool (training what the others wait for, if they all do)."""
        with self.changed:
            try:
                self.check_cancelled()
                yield
            finally:
                with self.joining:
                    self.expected.remove(transport)
                self.train_if_all_wait()
                self.changed.notify_all()

    def train_when_all_wait(self, transport: CohortTransport) -> None:
        """Called by a run that waits for its tasks (holding the turn when in a pool's
        `turn`): returns once they are trained."""
        with self.changed:
            self.check_cancelled()
            self.waiting.append(transport)
            count = self.trained
            self.train_if_all_wait()
            while self.trained == count:
                self.changed.wait()
                self.check_cancelled()
        if transport.failure is not None:
            failure, transport.failure = transport.failure, None
            raise failure

    def pause(self, seconds: float) -> None:
        """A run idle with nothing to train: the others may work meanwhile."""
        with self.changed:
            self.changed.wait(seconds)
            self.check_cancelled()

    def cancel(self) -> None:
        """Every run stops at its next wait (Ctrl-C, SIGTERM): KeyboardInterrupt there."""
        with self.changed:
            self.cancelled = True
            self.changed.notify_all()

    def check_cancelled(self) -> None:
        if self.cancelled:
            raise KeyboardInterrupt

    def train_if_all_wait(self) -> None:
        with self.joining:
            everyone = len(self.expected)
        if not self.waiting or len(self.waiting) < everyone:
            return
        runs, self.waiting = self.waiting, []
        cohorts = [run.next_cohort() for run in runs]
        size = sum(map(len, cohorts))
        batches = [(run.run, run.jobs(cohort)) for run, cohort in zip(runs, cohorts, strict=True)]
        try:
            results = self.cohorts(batches)
        except Exception as err:  # every run whose tasks were in it fails
            for run in runs:
                run.failure = err
        else:
            for run, cohort, answers in zip(runs, cohorts, results, strict=True):
                run.answer(cohort, answers, size)
            self.sizes.append(size)
            said_together(size, "in this process")
        self.trained += 1
        self.changed.notify_all()
