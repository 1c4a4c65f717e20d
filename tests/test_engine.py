"""The engine's ordering logic, faults and budgets, over a scripted transport."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

from fedstale.common.layout import ParamLayout
from fedstale.common.schema import MSG_TRAIN
from fedstale.server_app.clock import Task
from fedstale.server_app.engine import Engine, EngineError
from fedstale.server_app.transport import Reply, SendRefused
from fedstale.strategies.base import (
    Assignment,
    NoParams,
    Outcome,
    Strategy,
    Update,
    View,
    update_record,
)
from fedstale.strategies.fedavg import FedAvg
from tests.helpers import ListRecorder, ScriptedTransport, delta_reply, run_config, scripted_engine

LAYOUT = ParamLayout(names=("w",), shapes=((3,),))


class Recording(Strategy):
    """Adds every delta to the model and remembers the order it saw them in."""

    name = "recording"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Update] = []

    def on_update(self, update: Update, view: View) -> Outcome:
        self.seen.append(update)
        self.model = self.model + update.vector
        return Outcome(changed=True, records=[update_record(update, 1.0)])


class TaskHistoryEngine(Engine):
    """Keeps every task it dispatched, so that tests can read dispatch times."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history: dict[int, Task] = {}
        add = self.standing.book.add

        def add_and_keep(task: Task) -> None:
            add(task)
            self.history[task.task_id] = task

        self.standing.book.add = add_and_keep  # type: ignore[method-assign]


def make_engine(
    transport: ScriptedTransport, strategy_cls: type[Strategy] = Recording, **overrides: Any
) -> TaskHistoryEngine:
    settings = {
        "num-clients": 6,
        "concurrency": 3,
        "max-virtual-time": 2000.0,
        "eval-interval": 250.0,
        "poll-interval": 0.0001,
        "node-wait-seconds": 2.0,
        "progress-interval": 1000.0,
        **overrides,
    }
    run = run_config(**settings)
    strategy = strategy_cls(run, NoParams(), np.zeros(3, dtype=np.float32))
    evaluator = lambda flat: (float(min(1.0, abs(flat).sum() / 100)), 0.0)  # noqa: E731
    engine = scripted_engine(
        run, strategy, transport, LAYOUT, evaluator, engine_cls=TaskHistoryEngine
    )
    assert isinstance(engine, TaskHistoryEngine)
    return engine


def finish_order(engine: Engine, transport: ScriptedTransport) -> list[int]:
    return [u.task_id for u in engine.strategy.seen]  # type: ignore[attr-defined]


def test_completions_are_handled_in_virtual_time_order() -> None:
    transport = ScriptedTransport(6, delta_reply, seed=1)
    engine = make_engine(transport)
    engine.run_loop()
    recorder: ListRecorder = engine.listeners.recorder  # type: ignore[assignment]
    times = [row["time"] for row in recorder.updates]
    assert len(times) > 10
    assert times == sorted(times)
    # every handled update finished at dispatch time + its client's latency
    for row in recorder.updates:
        assert row["time"] == pytest.approx(
            engine_dispatch_time(engine, row["task"])
            + engine.federation.latency.base[row["client"]]
        )


def engine_dispatch_time(engine: TaskHistoryEngine, task_id: int) -> float:
    return engine.history[task_id].dispatched_at


def test_arrival_order_does_not_change_the_run() -> None:
    runs = []
    for arrival_seed in (1, 2, 3):
        engine = make_engine(
            ScriptedTransport(6, delta_reply, seed=arrival_seed, max_delay_calls=9)
        )
        engine.run_loop()
        runs.append(
            (
                [(u.task_id, u.client, u.staleness) for u in engine.strategy.seen],  # type: ignore[attr-defined]
                [
                    (m["virtual_time"], m["version"], m["accuracy"])
                    for m in engine.listeners.recorder.metrics  # type: ignore[attr-defined]
                ],
            )
        )
    assert runs[0] == runs[1] == runs[2]


def test_at_most_concurrency_tasks_and_one_per_client() -> None:
    transport = ScriptedTransport(6, delta_reply, seed=4)
    engine = make_engine(transport)
    original_dispatch = engine.dispatcher.dispatch

    def checked_dispatch(assignment: Assignment) -> None:
        assert assignment.client not in engine.standing.book.busy
        original_dispatch(assignment)
        assert len(engine.tasks) <= engine.run.concurrency

    engine.dispatcher.dispatch = checked_dispatch  # type: ignore[method-assign]
    engine.run_loop()
    assert engine.counters.accepted > 0


def test_staleness_counts_versions_since_dispatch() -> None:
    engine = make_engine(ScriptedTransport(6, delta_reply, seed=5))
    engine.run_loop()
    seen = engine.strategy.seen  # type: ignore[attr-defined]
    for index, item in enumerate(seen):
        assert item.staleness == index - item.base_version  # Recording bumps every update
    assert max(u.staleness for u in seen) >= 1


def corrupting(kind: str, bad_task: int):  # type: ignore[no-untyped-def]
    def train(partition, config, arrays):  # type: ignore[no-untyped-def]
        metrics, out = delta_reply(partition, config, arrays)
        if config["task-id"] != bad_task:
            return metrics, out
        if kind == "nan":
            out["w"][0] = np.nan
        elif kind == "shape":
            out["w"] = np.ones(4, dtype=np.float32)
        elif kind == "unknown-task":
            metrics["task-id"] = 424242
        elif kind == "dtype":
            out["w"] = out["w"].astype(np.float64)
        elif kind == "no-metric":
            del metrics["num-examples"]
        elif kind == "float-metric":
            metrics["num-examples"] = 3.5
        return metrics, out

    return train


@pytest.mark.parametrize(
    "kind", ["nan", "shape", "unknown-task", "dtype", "no-metric", "float-metric"]
)
def test_invalid_reply_is_rejected_logged_and_never_reaches_the_model(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(ScriptedTransport(6, corrupting(kind, bad_task=4), seed=6))
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    seen = engine.strategy.seen  # type: ignore[attr-defined]
    assert 4 not in [u.task_id for u in seen]
    assert engine.counters.rejected == 1
    lines = [r.getMessage() for r in caplog.records if "rejected update" in r.getMessage()]
    assert len(lines) == 1 and "task 4 " in lines[0]
    # the model is exactly the sum of the accepted deltas (each +1 per coordinate)
    np.testing.assert_allclose(engine.strategy.model, np.full(3, float(len(seen))))
    assert engine.stop_reason == "time budget"


def test_error_reply_retires_the_task_and_work_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(ScriptedTransport(6, delta_reply, seed=7, errors={2, 5}))
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    seen_ids = [u.task_id for u in engine.strategy.seen]  # type: ignore[attr-defined]
    assert 2 not in seen_ids and 5 not in seen_ids
    assert engine.counters.failed == 2
    assert engine.counters.accepted == len(seen_ids) > 5
    assert sum("task 2 lost" in r.getMessage() for r in caplog.records) == 1


def test_node_that_disappears_has_its_task_retired() -> None:
    transport = ScriptedTransport(6, delta_reply, seed=8, max_delay_calls=50)
    engine = make_engine(transport)
    engine.wait_for_clients()
    engine.fill()
    victim = next(iter(engine.tasks.values()))
    del transport.nodes[victim.node]
    engine.refresh_nodes(force=True)
    assert victim.task_id not in engine.tasks
    assert victim.client not in engine.federation.nodes.clients
    engine.fill()
    assert len(engine.tasks) == engine.run.concurrency


def test_a_node_restarted_for_its_client_takes_over_the_task_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SIGKILLed SuperNode stays listed until the SuperLink misses its heartbeats; the
    node started again for its partition gets the client at once, and the task the old node
    held is written off (its reply, should it come, is offered late)."""
    transport = ScriptedTransport(6, delta_reply, seed=8, max_delay_calls=50)
    engine = make_engine(transport)
    engine.wait_for_clients()
    engine.fill()
    victim = next(iter(engine.tasks.values()))
    transport.nodes[5000] = victim.client  # the old node is still listed
    with caplog.at_level(logging.INFO, logger="fedstale"):
        for _ in range(200):  # until its query's reply is in (train replies wait meanwhile)
            engine.refresh_nodes(force=True)
            if engine.federation.nodes.node_of[victim.client] == 5000:
                break
    assert victim.task_id not in engine.tasks
    said = f"task {victim.task_id} lost: node {victim.node} (client {victim.client}): "
    assert said + f"client {victim.client} is now served by node 5000" in caplog.text
    others = [t for t in engine.tasks.values() if t.client != victim.client]
    assert len(others) == engine.run.concurrency - 1  # no other task touched
    assert (
        victim.client in engine.federation.nodes.clients
        and engine.federation.nodes.node_of[victim.client] == 5000
    )
    engine.fill()
    assert len(engine.tasks) == engine.run.concurrency
    assert all(t.node == engine.federation.nodes.node_of[t.client] for t in engine.tasks.values())


def test_virtual_time_budget_and_evaluation_schedule() -> None:
    engine = make_engine(ScriptedTransport(6, delta_reply, seed=9))
    engine.run_loop()
    times = [m["virtual_time"] for m in engine.listeners.recorder.metrics]  # type: ignore[attr-defined]
    assert times == [250.0 * k for k in range(9)]  # 0, 250, ..., 2000
    assert engine.standing.clock.now() <= 2000.0


def test_version_budget_stops_the_run() -> None:
    engine = make_engine(ScriptedTransport(6, delta_reply), max_versions=7, max_virtual_time=0.0)
    engine.run_loop()
    assert engine.version == 7
    assert engine.stop_reason == "version budget 7"


def test_target_accuracy_stops_at_first_evaluation_reaching_it() -> None:
    engine = make_engine(ScriptedTransport(6, delta_reply), target_accuracy=0.3)
    engine.run_loop()
    assert engine.scores.time_to_target is not None
    assert engine.scores.done[-1].accuracy >= 0.3
    assert all(e.accuracy < 0.3 for e in engine.scores.done[:-1])


def test_fedavg_round_lasts_as_long_as_its_slowest_client() -> None:
    engine = make_engine(
        ScriptedTransport(6, delta_reply, seed=10), FedAvg, max_virtual_time=3000.0
    )
    engine.run_loop()
    rounds: dict[int, list[float]] = {}
    for task_id, task in engine.history.items():
        rounds.setdefault(round(task.dispatched_at, 6), []).append(task_id)
    starts = sorted(rounds)
    assert all(len(rounds[s]) == 3 for s in starts)
    for previous, nxt in itertools.pairwise(starts):
        slowest = max(
            engine.federation.latency.base[engine.history[t].client] for t in rounds[previous]
        )
        assert nxt == pytest.approx(previous + slowest)


def test_missing_clients_fail_with_one_clear_line() -> None:
    engine = make_engine(ScriptedTransport(4, delta_reply), node_wait_seconds=0.2)
    with pytest.raises(EngineError, match="only 4 of 6 clients answered"):
        engine.run_loop()


def test_node_joining_mid_run_gets_work() -> None:
    transport = ScriptedTransport(6, delta_reply, seed=11)
    late_node, late_client = transport.nodes.popitem()
    engine = make_engine(
        transport, node_wait_seconds=0.05, clock="wall", max_virtual_time=0.0, max_versions=400
    )
    engine.wait_for_clients()  # wall clock: goes on with 5 of 6 clients, with a warning
    assert late_client not in engine.federation.nodes.clients
    transport.nodes[late_node] = late_client
    engine.last_refresh = float("-inf")
    engine.run_loop()
    assert late_client in {u.client for u in engine.strategy.seen}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("budget", "wait", "said"),
    [
        ({"max-wall-seconds": 0.3}, 0.2, True),  # the wait may take 2/3 of the budget
        ({"max-virtual-time": 0.3}, 0.2, True),  # on the wall clock, the time budget
        ({"max-wall-seconds": 10.0}, 0.2, False),
    ],
)
def test_a_wall_budget_the_wait_for_clients_could_eat_is_said_before_waiting(
    caplog: pytest.LogCaptureFixture, budget: dict[str, float], wait: float, said: bool
) -> None:
    transport = ScriptedTransport(5, delta_reply)
    settings = {"clock": "wall", "max-virtual-time": 0.0, "max-versions": 5, **budget}
    engine = make_engine(transport, node_wait_seconds=wait, **settings)
    caplog.set_level(logging.INFO, logger="fedstale")
    started = time.monotonic()
    engine.wait_for_clients()
    lines = [r.getMessage() for r in caplog.records]
    budget_lines = [line for line in lines if "counts the wait" in line]
    assert len(budget_lines) == int(said), lines
    if said:
        first = budget_lines[0]
        assert "for 6 clients" in first and f"budget is {min(budget.values()):g} s" in first
        assert lines.index(first) < next(i for i, x in enumerate(lines) if "only 5 of 6" in x)
    assert time.monotonic() - started >= wait


class RefusingOnce(ScriptedTransport):
    """The SuperLink refuses the first train push to one node (it has just left), then that
    node is gone from the node list."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused_node: int | None = None

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        if message_type == MSG_TRAIN and self.refused_node is None:
            self.refused_node = node_id
            del self.nodes[node_id]
            raise SendRefused(f"the SuperLink refused a train message to node {node_id}")
        return super().send(node_id, message_type, config, arrays, sets)


def test_refused_push_drops_the_node_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    transport = RefusingOnce(6, delta_reply, seed=9)
    engine = make_engine(transport)
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    assert transport.refused_node is not None
    assert transport.refused_node not in {node for node, _, _ in transport.sent[6:]}
    assert engine.counters.accepted > 5 and engine.counters.failed == 0
    assert (
        engine.counters.dispatched == engine.standing.next_task_id
    )  # no task id spent on the refusal
    assert any("gets no work until it returns" in r.getMessage() for r in caplog.records)


def test_prefetch_queues_at_most_one_extra_task_per_client() -> None:
    engine = make_engine(
        ScriptedTransport(6, delta_reply, seed=10),
        clock="wall",
        prefetch=True,
        **{"max-virtual-time": 0.0, "max-versions": 40},
    )
    original_dispatch = engine.dispatcher.dispatch
    most = 0

    def checked_dispatch(assignment: Assignment) -> None:
        nonlocal most
        original_dispatch(assignment)
        per_client = [t.client for t in engine.tasks.values()]
        assert max(per_client.count(c) for c in per_client) <= 2
        most = max(most, len(engine.tasks))

    engine.dispatcher.dispatch = checked_dispatch  # type: ignore[method-assign]
    engine.run_loop()
    assert most == 2 * engine.run.concurrency
    assert engine.version >= 40


def test_update_budget_counts_accepted_updates() -> None:
    engine = make_engine(
        ScriptedTransport(6, delta_reply), FedAvg, max_updates=9, max_virtual_time=0.0
    )
    engine.run_loop()
    assert engine.counters.accepted == 9  # three rounds of three
    assert engine.version == 3
    assert engine.stop_reason == "update budget 9"


class HoldingBack(ScriptedTransport):
    """Holds back the replies of tasks `held` until `released()` says so (a node that answers
    after its task timed out), then hands each out `copies` times."""

    def __init__(self, *args: Any, held: set[int], copies: int = 1, **kw: Any):
        super().__init__(*args, **kw)
        self.held, self.copies = held, copies
        self.held_msgs: set[str] = set()
        self.released: Callable[[], bool] = lambda: True

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        msg_id = super().send(node_id, message_type, config, arrays, sets)
        if message_type == MSG_TRAIN and config["task-id"] in self.held:
            self.held_msgs.add(msg_id)
        return msg_id

    def receive(self, msg_ids: Iterable[str]) -> list[Reply]:
        asked = list(msg_ids)
        if not self.released():
            asked = [m for m in asked if m not in self.held_msgs]
        replies = super().receive(asked)
        for reply in [r for r in replies if r.msg_id in self.held_msgs]:
            replies += [reply] * (self.copies - 1)
        return replies


def late_run(strategy_cls: type[Strategy], copies: int = 1) -> TaskHistoryEngine:
    """Task 1 times out as soon as it is sent, and its reply comes once two more rounds'
    worth of updates are in. Only task 1 has a deadline that can pass, so how busy the
    machine is changes nothing (a 0.2 s task-timeout for all once failed under load)."""
    transport = HoldingBack(6, delta_reply, seed=3, held={1}, copies=copies)
    engine = make_engine(
        transport, strategy_cls, task_timeout=600.0, max_virtual_time=0.0, max_updates=30
    )
    transport.released = lambda: (
        1 not in engine.standing.book.tasks and engine.counters.accepted >= 6
    )
    dispatch = engine.dispatcher.dispatch

    def dispatch_then_expire_task_1(assignment: Assignment) -> None:
        dispatch(assignment)
        if 1 in engine.standing.book.tasks:
            engine.standing.book.tasks[1].deadline = 0.0

    engine.dispatcher.dispatch = dispatch_then_expire_task_1  # type: ignore[method-assign]
    engine.run_loop()
    return engine


def test_a_reply_after_its_task_timed_out_is_taken_late_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="fedstale"):
        engine = late_run(Recording, copies=2)
    rows = engine.listeners.recorder.updates  # type: ignore[attr-defined]
    late = [row for row in rows if row.get("late")]
    assert [row["task"] for row in late] == [1]
    assert late[0]["staleness"] > 0  # the others went on meanwhile
    assert [row["task"] for row in rows].count(1) == 1  # the second copy is not counted
    assert engine.counters.late == 1 and engine.counters.failed == 0
    assert sum("late reply to task 1 (client" in r.getMessage() for r in caplog.records) == 1
    seen = [u.task_id for u in engine.strategy.seen]  # type: ignore[attr-defined]
    assert seen.count(1) == 1


def test_a_late_reply_a_closed_synchronous_round_cannot_take_is_refused_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine = late_run(FedAvg)
    assert engine.counters.late == 0 and engine.counters.failed == 1
    (reason,) = engine.counters.late_refused
    assert "synchronous round" in reason and engine.counters.late_refused[reason] == 1
    assert 1 not in [row["task"] for row in engine.listeners.recorder.updates]  # type: ignore[attr-defined]
    assert any(
        "late reply to task 1" in r.getMessage() and reason in r.getMessage()
        for r in caplog.records
    )


def test_assigned_partitions_ask_no_node_and_name_the_client_in_every_task() -> None:
    """node-partitions=assign: the nodes take clients 0..n-1 in node-id order, no query
    message goes out, and every train message names its client's partition."""
    from fedstale.common.schema import ASSIGNED_PARTITION, MSG_QUERY, TaskKeys
    from fedstale.server_app.nodes import AssignedNodes

    transport = ScriptedTransport(6, delta_reply)
    engine = make_engine(transport)
    engine.federation.nodes = AssignedNodes(6)
    engine.run_loop()
    assert engine.counters.accepted > 0
    assert not [kind for _, kind, _ in transport.sent if kind == MSG_QUERY]
    tasks = [(node, config) for node, kind, config in transport.sent if kind == MSG_TRAIN]
    assert tasks and all(
        config[ASSIGNED_PARTITION] == transport.nodes[node] for node, config in tasks
    )
    assert all(TaskKeys.TASK_ID in config for _, config in tasks)
