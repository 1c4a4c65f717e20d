"""The in-process transport on several cores: clients' tasks run in worker processes.

Each worker process starts with the transport, loads the data shares and builds the model
at once (`warm`), and keeps them between tasks (the client code caches both per process).
Any worker may run any task; a client's kept state (Flower's Context.state) stays in this
process and travels with its task, and a client's tasks run one after another in the order
they were sent (a superseded task still finishes before its client's next one starts),
exactly as on one worker. On the virtual clock the engine handles replies in finish-time
order whatever order the workers end in, so a seed gives the same run on one worker, on
many, and in Flower simulation.

Each worker holds one task at a time, on a pipe of its own that the engine's thread writes
and reads itself: no executor threads, queues or futures in the engine's process (they
cost more of its CPU per task than the engine's own work, measured in docs/benchmarks.md),
and a worker is handed its next task the moment its reply is read, whichever of the
engine's calls reads it. A worker that dies (killed, out of memory) answers its task with
an error reply and a fresh worker takes its place.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from typing import Any

import numpy as np

from fedstale.common.config import ClientSettings
from fedstale.common.records import ArraySets
from fedstale.launcher.inprocess import Arrays, EvaluateFn, InProcessTransport, TrainFn
from fedstale.server_app.transport import Reply

WarmFn = Callable[[ClientSettings], None]
ERROR_CODE = 1  # a client exception, as Flower's ClientApp error replies carry
STOP_SECONDS = 10.0  # a worker asked to stop and still running after this is terminated


def _cold(run: ClientSettings) -> None:
    """No warm-up: the worker loads what a task needs when the task comes."""


@dataclass
class Job:
    msg_id: str
    kind: str  # "train" (after the client's earlier tasks) or "evaluate" (waits for none)
    partition: int
    config: Mapping[str, Any]
    arrays: dict[str, np.ndarray]
    sets: ArraySets | None = None


def _serve(
    conn: Connection, run: ClientSettings, train: TrainFn, evaluate: EvaluateFn, warm: WarmFn
):
    """A worker process: warm up, say so, then answer each job until told to stop."""
    with contextlib.suppress(Exception):  # the first task meets the same error, replies it
        warm(run)
    try:
        conn.send(None)
        while (job := conn.recv()) is not None:
            conn.send(_answer(job, run, train, evaluate))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        return  # the engine is gone or stopping: nothing is left to answer


def _answer(job: tuple, run: ClientSettings, train: TrainFn, evaluate: EvaluateFn) -> tuple:
    """('ok', result) or ('error', 'Type: message') of one job."""
    kind, partition, config, arrays, sets, state = job
    try:
        if kind == "evaluate":
            return "ok", evaluate(run, partition, config, arrays)
        metrics, result, outputs = train(run, partition, config, arrays, sets, state)
        return "ok", (metrics, result, outputs, state)
    except Exception as error:
        return "error", f"{type(error).__name__}: {error}"


class Worker:
    """One worker process and its pipe; `job` is the task it holds, if any."""

    def __init__(self, context: Any, args: tuple) -> None:
        self.conn, child = context.Pipe()
        self.process: SpawnProcess = context.Process(
            target=_serve, args=(child, *args), daemon=True
        )
        self.process.start()
        child.close()
        self.started = False
        self.job: Job | None = None

    def stop(self) -> None:
        """An idle worker is asked to end; a busy one is terminated: the run no longer wants
        its task, and a reply larger than the pipe's buffer would block it on sending."""
        if self.job is None:
            with contextlib.suppress(OSError):  # it has ended already
                self.conn.send(None)
            self.process.join(STOP_SECONDS)
        self.end()

    def end(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_SECONDS)
        self.conn.close()


class PooledTransport(InProcessTransport):
    def __init__(
        self,
        run: ClientSettings,
        train: TrainFn,
        evaluate: EvaluateFn,
        workers: int,
        warm: WarmFn | None = None,
    ) -> None:
        super().__init__(run, train, evaluate)
        self.context = multiprocessing.get_context("spawn")  # no fork of a process with torch
        self.args = (run, train, evaluate, warm or _cold)
        # Every worker starts now and warms up (the model built, the clients' data loaded)
        # while the engine sets itself up; its clients count as connected once all have
        # (`node_ids`), as a Flower simulation's once its SuperNodes are up.
        self.workers = [Worker(self.context, self.args) for _ in range(workers)]
        self.queued: dict[int, deque[Job]] = {}  # per client: its task running and those behind
        self.ready: deque[Job] = deque()  # tasks free to start, in the order sent

    def node_ids(self) -> list[int]:
        for worker in self.workers:
            self.await_start(worker)
        return super().node_ids()

    def await_start(self, worker: Worker) -> None:
        if not worker.started:
            with contextlib.suppress(EOFError, OSError):  # died starting: its first task says so
                worker.conn.recv()
            worker.started = True

    def train(
        self, msg_id: str, partition: int, config: dict, arrays: Arrays, sets: ArraySets | None
    ) -> None:
        job = Job(msg_id, "train", partition, config, arrays, sets)
        queue = self.queued.setdefault(partition, deque())
        queue.append(job)
        if len(queue) == 1:
            self.ready.append(job)
        self.hand_out()

    def evaluate(self, msg_id: str, partition: int, config: dict, arrays: Arrays) -> None:
        self.ready.append(Job(msg_id, "evaluate", partition, config, arrays))
        self.hand_out()

    def hand_out(self) -> None:
        """Give each idle worker the next task free to start."""
        for worker in self.workers:
            if not self.ready:
                return
            if worker.job is None:
                self.start(worker, self.ready.popleft())

    def start(self, worker: Worker, job: Job) -> None:
        self.await_start(worker)
        worker.job = job
        state = dict(self.states.setdefault(job.partition, {})) if job.kind == "train" else None
        message = (job.kind, job.partition, job.config, job.arrays, job.sets, state)
        try:
            worker.conn.send(message)
        except OSError:
            self.replace(worker)

    def harvest(self, seconds: float = 0.0) -> None:
        """Read every reply that is in (waiting up to `seconds` for the first), handing
        each worker its next task as its reply is read."""
        busy = {worker.conn: worker for worker in self.workers if worker.job is not None}
        if not busy:
            return
        for conn in wait(list(busy), seconds):
            worker = busy[conn]
            try:
                outcome = conn.recv()
            except (EOFError, OSError):
                self.replace(worker)
                continue
            self.finished(worker, *outcome)
        self.hand_out()

    def finished(self, worker: Worker, status: str, result: Any) -> None:
        job, worker.job = worker.job, None
        assert job is not None
        self.replies[job.msg_id] = self.reply(job, status, result)
        if job.kind == "train":
            self.next_of(job.partition)

    def next_of(self, partition: int) -> None:
        """The client's task is done: its next one, if sent, is free to start."""
        queue = self.queued[partition]
        queue.popleft()
        if queue:
            self.ready.append(queue[0])

    def replace(self, worker: Worker) -> None:
        """A worker died: its task gets an error reply; a fresh worker takes its place."""
        job, worker.job = worker.job, None
        worker.process.join(STOP_SECONDS)
        code = worker.process.exitcode
        worker.end()
        self.workers[self.workers.index(worker)] = Worker(self.context, self.args)
        if job is not None:
            why = f"WorkerDied: the worker process running it ended (exit code {code})"
            self.replies[job.msg_id] = Reply(job.msg_id, error_code=ERROR_CODE, error=why)
            if job.kind == "train":
                self.next_of(job.partition)

    def reply(self, job: Job, status: str, result: Any) -> Reply:
        """The work's reply; a client's exception becomes an error reply, as in Flower."""
        if status == "error":
            return Reply(job.msg_id, error_code=ERROR_CODE, error=result)
        if job.kind == "evaluate":
            return Reply(job.msg_id, metrics=result)
        metrics, arrays, outputs, state = result
        self.states[job.partition] = state
        return Reply(job.msg_id, metrics=metrics, arrays=arrays, sets=outputs)

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        self.harvest()
        return super().receive(msg_ids)

    def wait(self, seconds: float) -> None:
        """Idle until some work finishes or `seconds` pass (the engine's poll sleep)."""
        if any(worker.job is not None for worker in self.workers):
            self.harvest(seconds)
        else:
            time.sleep(seconds)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()

    def __enter__(self) -> PooledTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
