"""The asynchronous engine: keeps C tasks in flight over a Transport, hands validated
replies to the strategy in clock order, evaluates on a virtual-time schedule, and stops at
a budget. With its parts (tasks.py: the book of tasks; replies.py: checking a reply;
budgets.py: counters and budgets; clock.py, nodes.py, evaluation.py) the only code that
knows about time, tasks and nodes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any, Protocol

import numpy as np

from fedstale.common.config import RunConfig, score_row
from fedstale.common.latency import LatencyProfile
from fedstale.common.layout import ParamLayout
from fedstale.common.schema import ARRAYS, MSG_TRAIN, InvalidReply, TaskSpec
from fedstale.common.seeding import task_seed
from fedstale.server_app.budgets import (
    TIME_BUDGET,
    Counters,
    Stopwatch,
    spent,
    time_budget,
    wall_budget,
)
from fedstale.server_app.clock import Clock, Task, make_clock
from fedstale.server_app.contract import Contract, FedstaleContract, MissingSignal
from fedstale.server_app.evaluation import Scoreboard
from fedstale.server_app.nodes import NodeBook, Nodes
from fedstale.server_app.replies import Arrival
from fedstale.server_app.scored import ClientScorer, Evaluation, Evaluator
from fedstale.server_app.stages.pipeline import Pipeline, Sets, Stage, StageError
from fedstale.server_app.tasks import TaskBook
from fedstale.server_app.transport import Reply, SendRefused, Transport
from fedstale.strategies.base import (
    Assignment,
    InFlight,
    Outcome,
    Strategy,
    Update,
    View,
    declare_edges,
)

log = logging.getLogger("fedstale")

NODE_REFRESH_SECONDS = 1.0


class Recorder(Protocol):
    def metric(self, row: dict[str, Any]) -> None: ...

    def update(self, row: dict[str, Any]) -> None: ...


class EngineError(RuntimeError):
    """The run cannot go on (no nodes, a federation that does not match the config)."""


class Engine:
    def __init__(
        self,
        run: RunConfig,
        strategy: Strategy,
        transport: Transport,
        layout: ParamLayout,
        latency: LatencyProfile,
        evaluator: Evaluator,
        recorder: Recorder,
        progress: Callable[[Engine], None] | None = None,
        checkpointer: Callable[[Engine], None] | None = None,
        client_scorer: ClientScorer | None = None,
        contract: Contract | None = None,
        nodes: Nodes | None = None,
        stages: Sequence[Stage] = (),
    ) -> None:
        self.run = run
        self.strategy = strategy
        self.transport = transport
        self.layout = layout
        self.latency = latency
        self.recorder = recorder
        self.progress = progress
        self.checkpointer = checkpointer
        self.clock: Clock = make_clock(run.clock)
        self.contract: Contract = contract or FedstaleContract()
        self.nodes: Nodes = nodes or NodeBook(run.num_clients)
        self.rng = np.random.default_rng([run.seed, 0xD15])
        self.book = TaskBook()
        self.version = 0
        self.next_task_id = 0
        self.counters = Counters()
        self.missing_signals = 0  # replies without the rule's client signal
        self.scores = Scoreboard(run, strategy, transport, layout, evaluator, client_scorer)
        self.scores.on_result = lambda e: recorder.metric(score_row(e.row(), run.metric))
        self.next_eval = 0.0
        self.wall_start = time.monotonic()
        self.loop_started: float | None = None
        self.watch = Stopwatch()
        self.last_refresh = -math.inf
        self.stop_reason = ""
        # A caller's own stop rule, asked once per new version ("" goes on): the library's
        # `should_stop` (Flower's early stopping)
        self.stop_check: Callable[[int], str] | None = None
        self.stop_asked_at = 0
        self.stall_since: float | None = None
        self.edges_bound: dict[int, int] = {}  # the nodes' edges last handed to the rule
        self.stages = Pipeline(stages)
        self.messages = EngineMessages(self)
        self.first_update_time: float | None = None  # Unix time of the first accepted update
        self.first_update_at: float | None = None  # and its monotonic time

    @property
    def evaluations(self) -> list[Evaluation]:
        return self.scores.done

    @property
    def target_hit(self) -> bool:
        return self.scores.target_hit

    @property
    def time_to_target(self) -> float | None:
        return self.scores.time_to_target

    @property
    def tasks(self) -> dict[int, Task]:
        return self.book.tasks

    @property
    def superseded(self) -> dict[str, int]:
        return self.book.superseded

    # ---------------------------------------------------------------- dispatch
    @property
    def busy(self) -> set[int]:
        return self.book.busy

    def idle_clients(self) -> list[int]:
        busy = self.busy
        return [c for c in self.nodes.clients if c not in busy]

    def prefetch_clients(self) -> list[int]:
        """Clients with exactly one task: with `prefetch`, each may queue one more."""
        counts = self.book.per_client()
        return [c for c in self.nodes.clients if counts.get(c) == 1]

    def view(self, candidates: list[int], capacity: int) -> View:
        in_flight = tuple(self.in_flight(t) for t in self.tasks.values())
        return View(self.version, tuple(candidates), in_flight, capacity)

    def in_flight(self, task: Task) -> InFlight:
        """A task as a strategy sees it: staleness in versions and in arrivals."""
        arrivals = self.counters.accepted - task.accepted_before
        return InFlight(
            task.task_id, task.client, task.version, self.version - task.version, arrivals
        )

    def fill(self) -> None:
        """Dispatch what the strategy plans while a client can take a task."""
        while True:
            candidates, capacity = self.dispatch_candidates()
            if not candidates:
                return
            plan = self.strategy.plan(self.view(candidates, capacity), self.rng)
            if plan.closed is not None:
                self.apply(plan.closed)
            if not plan.assignments:
                if plan.closed is None:
                    return
                continue
            self.check_plan(plan.assignments, candidates, capacity)
            for assignment in plan.assignments:
                self.dispatch(assignment)

    def dispatch_candidates(self) -> tuple[list[int], int]:
        """Idle clients while fewer than `concurrency` tasks run; then, with `prefetch`,
        clients that may queue a second task, up to twice `concurrency`. With how many
        tasks may start."""
        concurrency = self.run.concurrency
        if len(self.tasks) < concurrency:
            idle = self.idle_clients()
            if idle:
                return idle, concurrency - len(self.tasks)
        if self.run.prefetch and len(self.tasks) < 2 * concurrency:
            return self.prefetch_clients(), 2 * concurrency - len(self.tasks)
        return [], 0

    def check_plan(self, plan: list[Assignment], candidates: list[int], capacity: int) -> None:
        clients = [a.client for a in plan]
        if len(plan) > capacity or len(set(clients)) < len(clients):
            raise RuntimeError(
                f"strategy {self.strategy.name} planned {clients} with room for {capacity} "
                "distinct clients"
            )
        unavailable = sorted(set(clients) - set(candidates))
        if unavailable:
            raise RuntimeError(
                f"strategy {self.strategy.name} planned clients {unavailable} "
                "that cannot take a task now"
            )

    def task_spec(self, task_id: int, assignment: Assignment) -> TaskSpec:
        run = self.run
        training = {**run.client_training(), "lr": run.lr * run.lr_decay**self.version}
        spec = TaskSpec(
            task_id=task_id,
            version=self.version,
            seed=task_seed(run.seed, assignment.client, task_id),
            returns=self.strategy.returns,
            **training,
            rules=tuple(rule.name for rule in self.strategy.client_rules),
            extra={
                **assignment.entries,
                **self.scores.task_entries(),
                **self.stages.task_entries(),
                **self.nodes.entries(assignment.client),
            },
        )
        return replace(spec, **assignment.settings)

    def dispatch(self, assignment: Assignment) -> None:
        with self.watch("dispatch"):
            self._dispatch(assignment)

    def _dispatch(self, assignment: Assignment) -> None:
        client = assignment.client
        task_id, node = self.next_task_id, self.nodes.node_of[client]
        spec = self.task_spec(task_id, assignment)
        models = {name: self.layout.unflatten(v) for name, v in assignment.models.items()}
        main = self.contract.outgoing(models.pop(ARRAYS))
        carries = self.contract.replies_carry(self.strategy.returns)
        stage_config, stage_sets = self.stages.task_parts(task_id, client, carries)
        config = {**self.contract.task_config(spec, assignment), **stage_config}
        try:
            msg_id = self.send(node, config, main, {**models, **stage_sets})
        except SendRefused as err:
            log.warning(
                "node %d (client %d) left: %s; it gets no work until it returns", node, client, err
            )
            self.nodes.forget(node)
            return
        self.next_task_id += 1
        self.contract.sent(task_id, assignment.models[ARRAYS])
        self.stages.sent(task_id, assignment.models[ARRAYS], self.strategy.returns, carries)
        latency = self.latency.task_latency(client, task_id, spec)
        timeout = self.run.task_timeout
        self.book.add(
            Task(
                task_id=task_id,
                client=client,
                node=node,
                msg_id=msg_id,
                version=self.version,
                accepted_before=self.counters.accepted,
                dispatched_at=self.clock.now(),
                finishes_at=self.clock.finish_time(latency),
                deadline=time.monotonic() + timeout if timeout else math.inf,
                sets=tuple(sorted(assignment.reply_sets)),
            )
        )
        self.strategy.on_dispatch(client)
        self.counters.dispatched += 1

    # ---------------------------------------------------------------- replies
    def collect(self) -> None:
        """Pull whatever replies are ready; error replies retire their task at once, replies
        to superseded tasks are discarded, and those to written-off tasks are offered late."""
        for reply in self.transport.receive(self.book.watched()):
            late = self.book.late(reply.msg_id)
            if late is not None:
                self.handle_late(late, reply)
                continue
            task = self.book.sort(reply)
            if task is None:
                continue
            if reply.error_code is not None:
                reason = f"error reply (code {reply.error_code}): {reply.error}"
                self.retire(task, reason, may_answer=False)
            else:
                self.book.arrived[task.task_id] = reply

    def retire(self, task: Task, reason: str, may_answer: bool = True) -> None:
        """End a task without an update; its client becomes idle if its node is online. A
        task whose reply `may_answer` yet (timed out, node gone) stays watched until the
        SuperLink's TTL: a reply that comes is offered late (`handle_late`)."""
        self.book.drop(task)
        if may_answer:
            self.book.write_off(task, time.monotonic() + self.run.task_ttl)
        else:
            self.forget(task.task_id)
        self.counters.failed += 1
        log.warning(
            "task %d lost: node %d (client %d): %s", task.task_id, task.node, task.client, reason
        )
        self.task_lost(task.client)

    def handle_late(self, task: Task, reply: Reply) -> None:
        """A reply to a written-off task: taken by the rule unless it refuses (counted with
        the reason), never dropped silently. It counts once: the watch ended with it."""
        if reply.error_code is not None:
            self.forget(task.task_id)
            log.info("task %d (client %d) ended with an error reply too", task.task_id, task.client)
            return
        reason = self.strategy.refuses_late(self.in_flight(task))
        if reason:
            self.forget(task.task_id)
            refused = self.counters.late_refused
            refused[reason] = refused.get(reason, 0) + 1
            log.warning(
                "late reply to task %d (client %d) refused: %s", task.task_id, task.client, reason
            )
            return
        self.book.answered.add(task.task_id)  # as `TaskBook.take` does for a live task
        update = self.checked(task, reply, on_reject=lambda: None)
        if update is None:
            return
        log.info(
            "late reply to task %d (client %d) taken, staleness %d",
            task.task_id,
            task.client,
            update.staleness,
        )
        self.counters.failed -= 1
        self.counters.late += 1
        self.accept(task, reply, replace(update, late=True))

    def supersede(self, task_ids: list[int]) -> None:
        """Withdraw tasks in flight: a reply that is in is dropped now, one still to come is
        dropped when it arrives; each counts as superseded, never as lost or accepted."""
        for task_id in task_ids:
            task = self.book.withdraw(task_id)
            if task is None:
                raise RuntimeError(
                    f"strategy {self.strategy.name} superseded task {task_id}, not in flight"
                )
            self.forget(task_id)
            self.counters.superseded += 1
            log.debug("task %d (client %d) superseded", task_id, task.client)

    def expire_overdue(self) -> None:
        """Retire tasks that have gone unanswered past `task-timeout` (a node that is alive
        but never answers would otherwise hold the virtual clock until Flower's TTL)."""
        now = time.monotonic()
        for task in self.book.overdue(now):
            self.retire(task, f"no reply within task-timeout {self.run.task_timeout:g} s")
        for task in self.book.unwatched(now):
            self.forget(task.task_id)

    def handle(self, task: Task, reply: Reply) -> None:
        update = self.checked(task, reply, on_reject=lambda: self.task_lost(task.client))
        if update is not None:
            self.accept(task, reply, update)

    def checked(self, task: Task, reply: Reply, on_reject: Callable[[], None]) -> Update | None:
        """The reply as an Update, or None when it is rejected (logged, counted, then
        `on_reject`)."""
        try:
            arrival = Arrival(task, self.version, self.counters.accepted, self.book.answered)
            seen = self.stages.reply(task.task_id, task.client, reply)
            update = self.contract.update(arrival, seen, self.strategy, self.layout)
            return self.stages.update(task.task_id, update)
        except InvalidReply as err:
            self.reject(task, err)
            on_reject()
            return None
        finally:
            self.forget(task.task_id)

    def accept(self, task: Task, reply: Reply, update: Update) -> None:
        self.scores.take(task, reply.metrics, self.clock.now())
        with self.watch("aggregate"):
            view = self.view(self.idle_clients(), self.run.concurrency - len(self.tasks))
            outcome = self.strategy.on_update(update, view)
        if self.first_update_time is None:
            self.first_update_time, self.first_update_at = time.time(), time.monotonic()
        self.counters.accepted += 1
        self.counters.client_compute_seconds += update.compute_seconds
        self.apply(outcome)

    def reject(self, task: Task, err: InvalidReply) -> None:
        """Log and count a reply that cannot be used. Replies that all lack the rule's
        client signal before any update was accepted mean the ClientApp lacks the rule's
        client half: the run stops with that one line."""
        self.counters.rejected += 1
        log.warning(
            "rejected update: node %d, task %d (client %d): %s",
            task.node,
            task.task_id,
            task.client,
            err,
        )
        if self.stages.excludes(task.node, task.client, err):
            self.exclude(task.node)
        if isinstance(err, MissingSignal):
            self.missing_signals += 1
            if not self.counters.accepted and self.missing_signals >= self.run.concurrency:
                raise EngineError(str(err))

    def exclude(self, node: int) -> None:
        """Exclude a node a stage refuses (central DP: its updates exceed the clipping norm)
        and retire its tasks; with no node left, the run ends (its results kept)."""
        self.nodes.exclude(node)
        for other in self.book.on_nodes({node}):
            self.retire(other, "its node was excluded", may_answer=False)
        if not self.nodes.clients:
            self.stop_reason = (
                "every node was excluded for updates above dp-clipping-norm: add Flower's "
                "fixedclipping_mod to the ClientApp's train handler, or use dp-clipping=server"
            )

    def task_lost(self, client: int) -> None:
        """Tell the strategy a task of `client` ended without an update; a rule that closes
        a round on it (MAFSA's edges) may change the model then."""
        outcome = self.strategy.on_task_lost(client)
        if outcome is not None:
            self.apply(outcome)

    def apply(self, outcome: Outcome) -> None:
        """Release a changed model through the stages (a new version), record the weights,
        supersede and replace, checkpoint."""
        released = False
        if outcome.changed:
            verdict = self.stages.release(self.strategy, outcome, self.version + 1, self.messages)
            self.stop_reason = verdict.stop or self.stop_reason
            released = verdict.released
            if released:
                self.version += 1
        for record in outcome.records:
            public = self.stages.record(record)
            self.recorder.update(
                {"time": self.clock.now(), "version": self.version, **_plain(public)}
            )
        if (outcome.supersede or outcome.dispatch) and (released or not outcome.changed):
            self.supersede(outcome.supersede)
            self.dispatch_now(outcome.dispatch)
        every = self.run.checkpoint_every
        if released and every and self.version % every == 0 and self.checkpointer:
            self.checkpointer(self)

    def forget(self, task_id: int) -> None:
        """Task `task_id` ended (answered, lost or superseded): what was kept for it goes."""
        self.contract.forget(task_id)
        self.stages.forget(task_id)

    def send(
        self, node: int, config: dict[str, Any], arrays: dict[str, np.ndarray], sets: Sets
    ) -> str:
        """Every train message the run sends, a task's or a stage's (SendRefused: the node
        left)."""
        return self.transport.send(node, MSG_TRAIN, config, arrays, sets or None)

    def dispatch_now(self, assignments: list[Assignment]) -> None:
        """The replacements an outcome names, sent at once to clients that are idle now."""
        if assignments:
            self.check_plan(assignments, self.idle_clients(), len(assignments))
        for assignment in assignments:
            self.dispatch(assignment)

    def process_ready(self) -> bool:
        """Handle every reply the clock allows now; False when nothing could be handled."""
        handled = False
        while not self.stop_reason:
            task = self.clock.next_ready(self.tasks, self.book.arrived)
            if task is None:
                return handled
            done_at = self.clock.completion_time(task)
            if done_at > self.time_budget():
                self.stop_reason = TIME_BUDGET
                return handled
            self.evaluate_due(done_at)
            if self.target_hit:
                self.stop_reason = f"target accuracy {self.run.target_accuracy}"
                return handled
            self.clock.advance(task)
            with self.watch("handle"):
                self.handle(task, self.book.take(task))
            handled = True
            self.check_budgets()
            if not self.stop_reason:  # a task sent now would train for nothing
                self.fill()
        return handled

    # ---------------------------------------------------------------- evaluation
    def time_budget(self) -> float:
        return time_budget(self.run)

    def evaluate_due(self, up_to: float) -> None:
        """Evaluate at every scheduled time <= up_to (the model is current until then)."""
        while self.next_eval <= min(up_to, self.time_budget()) and not self.target_hit:
            self.evaluate(self.next_eval)
            self.next_eval += self.run.eval_interval

    def evaluate(self, at: float) -> None:
        evaluation = Evaluation(
            virtual_time=at,
            wall_time=time.monotonic() - self.wall_start,
            version=self.version,
            accuracy=math.nan,
            loss=math.nan,
            updates=self.counters.accepted,
        )
        with self.watch("evaluate"):
            self.scores.evaluate(evaluation, self.nodes, frozenset(self.busy))

    # ---------------------------------------------------------------- budgets
    def check_budgets(self) -> None:
        wall_seconds = time.monotonic() - self.wall_start
        reason = spent(
            self.run,
            self.version,
            self.counters.accepted,
            wall_seconds,
            self.clock.now(),
            self.target_hit,
        )
        if not reason and self.version > self.stop_asked_at:
            self.stop_asked_at = self.version
            reason = self.stop_check(self.version) if self.stop_check is not None else ""
        if reason:
            self.stop_reason = reason

    # ---------------------------------------------------------------- main loop
    def refresh_nodes(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_refresh < NODE_REFRESH_SECONDS:
            return
        self.last_refresh = now
        gone = set(self.nodes.refresh(self.transport))
        for task in self.book.on_nodes(gone):
            self.retire(task, "node went offline")
        self.nodes.collect(self.transport)
        for task in self.book.moved(self.nodes.node_of):
            now_on = self.nodes.node_of[task.client]
            self.retire(task, f"client {task.client} is now served by node {now_on}")
        if self.nodes.edge_of != self.edges_bound:
            self.edges_bound = dict(self.nodes.edge_of)
            declare_edges(self.strategy, dict(self.edges_bound))

    def wait_for_clients(self) -> None:
        """Block until every client has a node (virtual clock) or the wait runs out."""
        deadline = time.monotonic() + self.run.node_wait_seconds
        warned = False
        while len(self.nodes.clients) < self.run.num_clients and time.monotonic() < deadline:
            self.refresh_nodes(force=True)
            if not warned:
                warned = True
                self.warn_wait_against_budget()
            time.sleep(self.run.poll_interval)
        found, wanted = len(self.nodes.clients), self.run.num_clients
        if found == wanted:
            log.info("all %d clients connected", wanted)
            return
        message = (
            f"only {found} of {wanted} clients answered within {self.run.node_wait_seconds:g} s; "
            f"start {wanted} SuperNodes with partition-id 0..{wanted - 1} (in simulation: "
            f"--federation-config 'num-supernodes={wanted}') or set num-clients={found}"
        )
        if self.run.clock == "virtual" or found == 0:
            raise EngineError(message)
        log.warning(message)

    def warn_wait_against_budget(self) -> None:
        """Say before waiting when the wait for missing clients could take half the run's
        wall-clock budget or more (the budget counts the wait)."""
        found, wanted = len(self.nodes.clients), self.run.num_clients
        budget, wait = wall_budget(self.run), self.run.node_wait_seconds
        if found >= wanted or wait < budget / 2:
            return
        left = max(budget - wait, 0.0)
        log.warning(
            "waiting up to %g s (node-wait-seconds) for %d clients (%d answered so far), but the "
            "run's wall-clock budget is %g s and counts the wait: if they are late, %g s are "
            "left to train; start every node first, lower node-wait-seconds or raise the budget",
            wait,
            wanted,
            found,
            budget,
            left,
        )

    def run_loop(self) -> None:
        self.stop_reason = self.stages.opening(self.strategy) or self.stop_reason
        if not self.stop_reason:
            self.begin()
        while not self.stop_reason:
            self.refresh_nodes()
            self.fill()
            with self.watch("pull"):
                self.collect()
                self.scores.collect(frozenset(self.busy))
            self.expire_overdue()
            if not self.process_ready():
                self.check_budgets()
                self.evaluate_due(self.wall_due_time())
                self.guard_stall()
                with self.watch("idle"):
                    self.idle(self.run.poll_interval)
            if self.progress is not None:
                self.progress(self)
        self.finish()

    def begin(self) -> None:
        self.wait_for_clients()
        try:
            left_out = self.stages.joined(self.nodes.clients, self.messages)
        except StageError as err:
            raise EngineError(str(err)) from None
        for client in left_out:
            self.nodes.exclude(self.nodes.node_of[client])
        self.loop_started = time.monotonic()
        if self.scores.by_message:  # the first train replies score the initial models
            self.fill()
        self.evaluate_due(0.0)
        self.fill()

    def idle(self, seconds: float) -> None:
        """Sleep between polls; a transport that can tell when work finishes ends it early."""
        self.transport.wait(seconds)

    def wall_due_time(self) -> float:
        """On the wall clock evaluations fall due as time passes, not only on replies."""
        return self.clock.now() if self.run.clock == "wall" else -math.inf

    def guard_stall(self) -> None:
        """Fail with one line when no task has been in flight for `node-wait-seconds` (no
        node to send to, or a synchronous rule waiting on an edge with no node left)."""
        if self.tasks:
            self.stall_since = None
            return
        if self.stall_since is None:
            self.stall_since = time.monotonic()
        if time.monotonic() - self.stall_since > self.run.node_wait_seconds:
            raise EngineError(
                f"no task in flight for {self.run.node_wait_seconds:g} s: "
                f"{len(self.nodes.clients)} clients online, strategy {self.strategy.name} "
                "planned none; check that the SuperNodes are up"
            )

    def end_time(self) -> float:
        if self.stop_reason == TIME_BUDGET:
            return self.time_budget()
        return self.clock.now()

    def finish(self) -> None:
        end = self.end_time()
        self.evaluate_due(end)
        last = self.scores.latest
        if last is None or last.virtual_time < end or last.version != self.version:
            self.evaluate(end)
        self.scores.drain(self.run.poll_interval)
        log.info("stopped: %s", self.stop_reason)

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """The engine's own state for a checkpoint (the clock and strategy keep theirs)."""
        return {
            "version": self.version,
            "next_task_id": self.next_task_id,
            "counters": asdict(self.counters),
            "evaluations": [asdict(e) for e in self.evaluations],
            "next_eval": self.next_eval,
            "rng": self.rng.bit_generator.state,
            "time_to_target": self.time_to_target,
            "target_hit": self.target_hit,
            **self.stages.state(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.version = state["version"]
        self.next_task_id = state["next_task_id"]
        self.counters = Counters(**state["counters"])
        self.scores.done[:] = [Evaluation(**e) for e in state["evaluations"]]
        self.next_eval = state["next_eval"]
        self.rng.bit_generator.state = state["rng"]
        self.scores.time_to_target = state["time_to_target"]
        self.scores.target_hit = state["target_hit"]
        self.stages.load_state(state)


class EngineMessages:
    """The stages' way to the clients: a client's node looked up, the message sent as every
    task is (`Engine.send`); a client without a node, or a node that refused, gets none."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def send(self, client: int, config: dict[str, Any], sets: Sets) -> str | None:
        node = self.engine.nodes.node_of.get(client)
        if node is None:
            return None
        try:
            return self.engine.send(node, config, {}, sets)
        except SendRefused:
            return None

    def receive(self, msg_ids: list[str]) -> list[Reply]:
        return self.engine.transport.receive(msg_ids)

    def pause(self) -> None:
        self.engine.transport.wait(self.engine.run.poll_interval)


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
