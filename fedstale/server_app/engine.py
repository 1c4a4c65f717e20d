"""The asynchronous engine: keeps C tasks in flight over the federation, hands validated
replies to the strategy in clock order, evaluates on a virtual-time schedule, and stops at
a budget. With its parts (dispatch.py: sending tasks; intake.py: taking replies in;
tasks.py: the book of tasks and where the run stands; budgets.py, clock.py, nodes.py,
evaluation.py) the only code that knows about time, tasks and nodes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from fedstale.common.config import RunConfig, score_row
from fedstale.server_app.budgets import (
    TIME_BUDGET,
    Counters,
    spent,
    time_budget,
    warn_wait_against_budget,
)
from fedstale.server_app.clock import Task, make_clock
from fedstale.server_app.dispatch import Dispatcher, StageMessages
from fedstale.server_app.evaluation import Scoreboard
from fedstale.server_app.federation import Federation
from fedstale.server_app.intake import Intake
from fedstale.server_app.scored import Evaluation
from fedstale.server_app.stages.pipeline import Pipeline, Stage, StageError
from fedstale.server_app.tasks import EngineError, Standing
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import Outcome, Strategy, Update, declare_edges

__all__ = ["Engine", "EngineError", "Listeners", "Recorder"]

log = logging.getLogger("fedstale")

NODE_REFRESH_SECONDS = 1.0


class Recorder(Protocol):
    def metric(self, row: dict[str, Any]) -> None: ...

    def update(self, row: dict[str, Any]) -> None: ...


@dataclass
class Listeners:
    """Who hears of the run as it goes: the recorder (every evaluation and update row),
    the progress display (once a loop) and the checkpointer (every `checkpoint-every`
    versions)."""

    recorder: Recorder
    progress: Callable[[Engine], None] | None = None
    checkpointer: Callable[[Engine], None] | None = None


class Engine:
    def __init__(
        self,
        run: RunConfig,
        strategy: Strategy,
        federation: Federation,
        scores: Scoreboard,
        listeners: Listeners,
        stages: Sequence[Stage] = (),
    ) -> None:
        self.run = run
        self.strategy = strategy
        self.federation = federation
        self.scores = scores
        self.listeners = listeners
        self.stages = Pipeline(stages)
        self.standing = Standing(make_clock(run.clock))
        parts = (run, strategy, federation, self.stages, self.standing)
        self.dispatcher = Dispatcher(*parts, scores=scores)
        self.intake = Intake(*parts, sink=self)
        self.messages = StageMessages(self.dispatcher, run.poll_interval)
        scores.on_result = lambda e: listeners.recorder.metric(score_row(e.row(), run.metric))
        self.rng = np.random.default_rng([run.seed, 0xD15])
        self.next_eval = 0.0
        self.wall_start = time.monotonic()
        self.loop_started: float | None = None
        self.last_refresh = -math.inf
        # A caller's own stop rule, asked once per new version ("" goes on): the library's
        # `should_stop` (Flower's early stopping)
        self.stop_check: Callable[[int], str] | None = None
        self.stop_asked_at = 0
        self.stall_since: float | None = None
        self.edges_bound: dict[int, int] = {}  # the nodes' edges last handed to the rule
        self.first_update_time: float | None = None  # Unix time of the first accepted update
        self.first_update_at: float | None = None  # and its monotonic time

    @property
    def version(self) -> int:
        return self.standing.version

    @property
    def counters(self) -> Counters:
        return self.standing.counters

    @property
    def tasks(self) -> dict[int, Task]:
        return self.standing.book.tasks

    @property
    def stop_reason(self) -> str:
        return self.standing.stop_reason

    # ---------------------------------------------------------------- the rule
    def fill(self) -> None:
        """Dispatch what the strategy plans while a client can take a task."""
        while True:
            candidates, capacity = self.dispatcher.candidates()
            if not candidates:
                return
            plan = self.strategy.plan(self.standing.view(candidates, capacity), self.rng)
            if plan.closed is not None:
                self.apply(plan.closed)
            if not plan.assignments:
                if plan.closed is None:
                    return
                continue
            self.dispatcher.check_plan(plan.assignments, candidates, capacity)
            for assignment in plan.assignments:
                self.dispatcher.dispatch(assignment)

    def handle(self, task: Task, reply: Reply) -> None:
        on_reject = lambda: self.task_lost(task.client)  # noqa: E731
        update = self.intake.checked(task, reply, on_reject)
        if update is not None:
            self.accept(task, reply, update)

    def accept(self, task: Task, reply: Reply, update: Update) -> None:
        standing = self.standing
        self.scores.take(task, reply.metrics, standing.clock.now())
        with standing.watch("aggregate"):
            capacity = self.run.concurrency - len(standing.book)
            view = standing.view(self.dispatcher.idle_clients(), capacity)
            outcome = self.strategy.on_update(update, view)
        if self.first_update_time is None:
            self.first_update_time, self.first_update_at = time.time(), time.monotonic()
        standing.counters.accepted += 1
        standing.counters.client_compute_seconds += update.compute_seconds
        self.apply(outcome)

    def task_lost(self, client: int) -> None:
        """Tell the strategy a task of `client` ended without an update; a rule that closes
        a round on it (MAFSA's edges) may change the model then."""
        outcome = self.strategy.on_task_lost(client)
        if outcome is not None:
            self.apply(outcome)

    def apply(self, outcome: Outcome) -> None:
        """Release a changed model through the stages (a new version), record the weights,
        supersede and replace, checkpoint."""
        standing, released = self.standing, False
        if outcome.changed:
            next_version = standing.version + 1
            verdict = self.stages.release(self.strategy, outcome, next_version, self.messages)
            standing.stop_reason = verdict.stop or standing.stop_reason
            released = verdict.released
            if released:
                standing.version += 1
        for record in outcome.records:
            public = self.stages.record(record)
            row = {"time": standing.clock.now(), "version": standing.version, **_plain(public)}
            self.listeners.recorder.update(row)
        if (outcome.supersede or outcome.dispatch) and (released or not outcome.changed):
            self.intake.supersede(outcome.supersede)
            self.dispatcher.dispatch_now(outcome.dispatch)
        every, checkpointer = self.run.checkpoint_every, self.listeners.checkpointer
        if released and every and standing.version % every == 0 and checkpointer:
            checkpointer(self)

    # ---------------------------------------------------------------- time
    def process_ready(self) -> bool:
        """Handle every reply the clock allows now; False when nothing could be handled."""
        standing, handled = self.standing, False
        while not standing.stop_reason:
            task = standing.clock.next_ready(standing.book.tasks, standing.book.arrived)
            if task is None:
                return handled
            done_at = standing.clock.completion_time(task)
            if done_at > time_budget(self.run):
                standing.stop_reason = TIME_BUDGET
                return handled
            self.evaluate_due(done_at)
            if self.scores.target_hit:
                standing.stop_reason = f"target accuracy {self.run.target_accuracy}"
                return handled
            standing.clock.advance(task)
            with standing.watch("handle"):
                self.handle(task, standing.book.take(task))
            handled = True
            self.check_budgets()
            if not standing.stop_reason:  # a task sent now would train for nothing
                self.fill()
        return handled

    def evaluate_due(self, up_to: float) -> None:
        """Evaluate at every scheduled time <= up_to (the model is current until then)."""
        while self.next_eval <= min(up_to, time_budget(self.run)) and not self.scores.target_hit:
            self.evaluate(self.next_eval)
            self.next_eval += self.run.eval_interval

    def evaluate(self, at: float) -> None:
        standing = self.standing
        evaluation = Evaluation(
            virtual_time=at,
            wall_time=time.monotonic() - self.wall_start,
            version=standing.version,
            accuracy=math.nan,
            loss=math.nan,
            updates=standing.counters.accepted,
        )
        with standing.watch("evaluate"):
            busy = frozenset(standing.book.busy)
            self.scores.evaluate(evaluation, self.federation.nodes, busy)

    def check_budgets(self) -> None:
        standing = self.standing
        wall_seconds = time.monotonic() - self.wall_start
        accepted, now = standing.counters.accepted, standing.clock.now()
        reason = spent(
            self.run, standing.version, accepted, wall_seconds, now, self.scores.target_hit
        )
        if not reason and standing.version > self.stop_asked_at:
            self.stop_asked_at = standing.version
            reason = self.stop_check(standing.version) if self.stop_check is not None else ""
        if reason:
            standing.stop_reason = reason

    # ---------------------------------------------------------------- nodes
    def refresh_nodes(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_refresh < NODE_REFRESH_SECONDS:
            return
        self.last_refresh = now
        nodes, transport = self.federation.nodes, self.federation.transport
        book = self.standing.book
        gone = set(nodes.refresh(transport))
        for task in book.on_nodes(gone):
            self.intake.retire(task, "node went offline")
        nodes.collect(transport)
        for task in book.moved(nodes.node_of):
            now_on = nodes.node_of[task.client]
            self.intake.retire(task, f"client {task.client} is now served by node {now_on}")
        if nodes.edge_of != self.edges_bound:
            self.edges_bound = dict(nodes.edge_of)
            declare_edges(self.strategy, dict(self.edges_bound))

    def wait_for_clients(self) -> None:
        """Block until every client has a node (virtual clock) or the wait runs out."""
        run, nodes = self.run, self.federation.nodes
        deadline = time.monotonic() + run.node_wait_seconds
        warned = False
        while len(nodes.clients) < run.num_clients and time.monotonic() < deadline:
            self.refresh_nodes(force=True)
            if not warned:
                warned = True
                warn_wait_against_budget(run, len(nodes.clients))
            time.sleep(run.poll_interval)
        found, wanted = len(nodes.clients), run.num_clients
        if found == wanted:
            log.info("all %d clients connected", wanted)
            return
        message = (
            f"only {found} of {wanted} clients answered within {run.node_wait_seconds:g} s; "
            f"start {wanted} SuperNodes with partition-id 0..{wanted - 1} (in simulation: "
            f"--federation-config 'num-supernodes={wanted}') or set num-clients={found}"
        )
        if run.clock == "virtual" or found == 0:
            raise EngineError(message)
        log.warning(message)

    def guard_stall(self) -> None:
        """Fail with one line when no task has been in flight for `node-wait-seconds` (no
        node to send to, or a synchronous rule waiting on an edge with no node left)."""
        if self.standing.book.tasks:
            self.stall_since = None
            return
        if self.stall_since is None:
            self.stall_since = time.monotonic()
        if time.monotonic() - self.stall_since > self.run.node_wait_seconds:
            raise EngineError(
                f"no task in flight for {self.run.node_wait_seconds:g} s: "
                f"{len(self.federation.nodes.clients)} clients online, strategy "
                f"{self.strategy.name} planned none; check that the SuperNodes are up"
            )

    # ---------------------------------------------------------------- the loop
    def run_loop(self) -> None:
        standing = self.standing
        standing.stop_reason = self.stages.opening(self.strategy) or standing.stop_reason
        if not standing.stop_reason:
            self.begin()
        wall = self.run.clock == "wall"
        while not standing.stop_reason:
            self.refresh_nodes()
            self.fill()
            with standing.watch("pull"):
                self.intake.collect()
                self.scores.collect(frozenset(standing.book.busy))
            self.intake.expire_overdue()
            if not self.process_ready():
                self.check_budgets()
                # On the wall clock evaluations fall due as time passes, not only on replies.
                self.evaluate_due(standing.clock.now() if wall else -math.inf)
                self.guard_stall()
                with standing.watch("idle"):
                    # A transport that can tell when work finishes ends the wait early.
                    self.federation.transport.wait(self.run.poll_interval)
            if self.listeners.progress is not None:
                self.listeners.progress(self)
        self.finish()

    def begin(self) -> None:
        self.wait_for_clients()
        nodes = self.federation.nodes
        try:
            left_out = self.stages.joined(nodes.clients, self.messages)
        except StageError as err:
            raise EngineError(str(err)) from None
        for client in left_out:
            nodes.exclude(nodes.node_of[client])
        self.loop_started = time.monotonic()
        if self.scores.by_message:  # the first train replies score the initial models
            self.fill()
        self.evaluate_due(0.0)
        self.fill()

    def finish(self) -> None:
        standing = self.standing
        timed_out = standing.stop_reason == TIME_BUDGET
        end = time_budget(self.run) if timed_out else standing.clock.now()
        self.evaluate_due(end)
        last = self.scores.latest
        if last is None or last.virtual_time < end or last.version != standing.version:
            self.evaluate(end)
        self.scores.drain(self.run.poll_interval)
        log.info("stopped: %s", standing.stop_reason)

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """The engine's own state for a checkpoint (the clock and strategy keep theirs)."""
        standing, scores = self.standing, self.scores
        return {
            "version": standing.version,
            "next_task_id": standing.next_task_id,
            "counters": asdict(standing.counters),
            "evaluations": [asdict(e) for e in scores.done],
            "next_eval": self.next_eval,
            "rng": self.rng.bit_generator.state,
            "time_to_target": scores.time_to_target,
            "target_hit": scores.target_hit,
            **self.stages.state(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        standing, scores = self.standing, self.scores
        standing.version = state["version"]
        standing.next_task_id = state["next_task_id"]
        standing.counters = Counters(**state["counters"])
        scores.done[:] = [Evaluation(**e) for e in state["evaluations"]]
        self.next_eval = state["next_eval"]
        self.rng.bit_generator.state = state["rng"]
        scores.time_to_target = state["time_to_target"]
        scores.target_hit = state["target_hit"]
        self.stages.load_state(state)


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """numpy scalars and arrays -> JSON-friendly Python values."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, np.ndarray):
            out[key] = value.tolist()
        elif isinstance(value, np.generic):
            out[key] = value.item()
        else:
            out[key] = value
    return out
