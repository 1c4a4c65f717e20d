"""The strategy contract's second edition, each capability over a scripted transport:
planned dispatch per group, superseded tasks, per-client evaluation, named reply array
sets, task deadlines, and a refused misconfigured node."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pytest

from fedstale.common.schema import (
    MSG_EVALUATE,
    MSG_QUERY,
    MSG_TRAIN,
    ReplyKeys,
    ScoreKeys,
    TaskKeys,
)
from fedstale.server_app.engine import Engine
from fedstale.server_app.evaluation import Scoreboard
from fedstale.server_app.nodes import NodeBook
from fedstale.server_app.transport import Reply, SendRefused
from fedstale.strategies.base import (
    Assignment,
    NoParams,
    Outcome,
    PerClientModels,
    Plan,
    Strategy,
    Update,
    View,
    update_record,
)
from tests.helpers import (
    ScriptedTransport,
    delta_reply,
    run_config,
    scripted_engine,
    use_polled_time,
)
from tests.test_engine import LAYOUT, TaskHistoryEngine

SETTINGS = {
    "num-clients": 6,
    "concurrency": 6,
    "max-virtual-time": 3000.0,
    "eval-interval": 500.0,
    "poll-interval": 0.0001,
    "node-wait-seconds": 2.0,
    "progress-interval": 1000.0,
}


def engine_for(
    strategy_cls: type[Strategy],
    transport: ScriptedTransport,
    scorer: Any = None,
    **overrides: Any,
) -> TaskHistoryEngine:
    run = run_config(**{**SETTINGS, **overrides})
    strategy = strategy_cls(run, NoParams(), np.zeros(3, dtype=np.float32))
    evaluator = lambda flat: (float(min(1.0, abs(flat).sum() / 100)), 0.0)  # noqa: E731
    engine = scripted_engine(
        run,
        strategy,
        transport,
        LAYOUT,
        evaluator,
        client_scorer=scorer,
        engine_cls=TaskHistoryEngine,
    )
    assert isinstance(engine, TaskHistoryEngine)
    return engine


def accounted(engine: Engine) -> None:
    """Every dispatched task is exactly one of: accepted, rejected, lost, superseded, or
    still in flight."""
    c = engine.counters
    ended = c.accepted + c.rejected + c.failed + c.superseded
    assert c.dispatched == ended + len(engine.tasks)


# ------------------------------------------------------------------ planned dispatch
class GroupRounds(Strategy):
    """Two groups {0, 1, 2} and {3, 4, 5}, each synchronous on its own: a group's next
    round starts when its last reply is in, whatever the other group does."""

    name = "group-rounds"
    groups: ClassVar[tuple[tuple[int, ...], ...]] = ((0, 1, 2), (3, 4, 5))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting: dict[int, set[int]] = {0: set(), 1: set()}
        self.seen: list[Update] = []

    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        plan = []
        for index, members in enumerate(self.groups):
            if not self.waiting[index] and set(members) <= set(view.idle):
                self.waiting[index] = set(members)
                plan += [self.assign(c, view) for c in members]
        return Plan(plan)

    def on_update(self, update: Update, view: View) -> Outcome:
        self.seen.append(update)
        for members in self.waiting.values():
            members.discard(update.client)
        self.model = self.model + update.vector
        return Outcome(changed=True, records=[update_record(update, 1.0)])


def test_a_plan_can_keep_a_barrier_per_group() -> None:
    engine = engine_for(GroupRounds, ScriptedTransport(6, delta_reply, seed=3))
    engine.run_loop()
    latency = engine.federation.latency.base
    for members in GroupRounds.groups:
        tasks = [t for t in engine.history.values() if t.client in members]
        starts = sorted({round(t.dispatched_at, 9) for t in tasks})
        assert len(starts) >= 3
        for start in starts:
            batch = [t for t in tasks if round(t.dispatched_at, 9) == start]
            assert sorted(t.client for t in batch) == list(members)  # the whole group
        for previous, following in itertools.pairwise(starts):
            slowest = max(latency[c] for c in members)
            assert following == pytest.approx(previous + slowest)  # its own barrier only
    accounted(engine)


# ------------------------------------------------------------------ superseded tasks
class SupersedeSlowest(Strategy):
    """At the first arrival, supersede the task that would finish last and restart its
    client from the current model."""

    name = "supersede-slowest"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Update] = []
        self.victim: int | None = None

    def on_update(self, update: Update, view: View) -> Outcome:
        self.seen.append(update)
        self.model = self.model + update.vector
        outcome = Outcome(changed=True, records=[update_record(update, 1.0)])
        if self.victim is None and view.in_flight:
            victim = max(view.in_flight, key=lambda t: (t.staleness, t.task_id))
            self.victim = victim.task_id
            outcome.supersede = [victim.task_id]
            outcome.dispatch = [self.assign(victim.client, view)]
        return outcome


@pytest.mark.parametrize("clock", ["virtual", "wall"])
def test_a_superseded_task_is_replaced_at_once_and_its_reply_discarded(clock: str) -> None:
    budget = {"max-virtual-time": 0.0, "max-versions": 30} if clock == "wall" else {}
    transport = ScriptedTransport(6, delta_reply, seed=4, max_delay_calls=3)
    engine = engine_for(SupersedeSlowest, transport, clock=clock, concurrency=4, **budget)
    engine.run_loop()
    strategy: SupersedeSlowest = engine.strategy  # type: ignore[assignment]
    victim = engine.history[strategy.victim]  # type: ignore[index]
    assert engine.counters.superseded == 1
    assert strategy.victim not in {u.task_id for u in strategy.seen}  # discarded, not used
    replacement = engine.history[4]  # tasks 0-3 filled the run; the next one is sent first
    assert replacement.client == victim.client  # at once, to the same client
    trigger = engine.history[strategy.seen[0].task_id]
    if clock == "virtual":
        assert replacement.dispatched_at == trigger.finishes_at
    assert engine.counters.failed == 0  # superseded is not lost
    assert not engine.standing.book.superseded  # the late reply came and was dropped
    accounted(engine)
    updates = [u.task_id for u in strategy.seen]
    assert len(updates) == len(set(updates)) == engine.counters.accepted


def test_a_strategy_cannot_supersede_a_task_that_is_not_in_flight() -> None:
    class Bogus(SupersedeSlowest):
        def on_update(self, update: Update, view: View) -> Outcome:
            return Outcome(changed=True, supersede=[10**6])

    engine = engine_for(Bogus, ScriptedTransport(6, delta_reply))
    with pytest.raises(RuntimeError, match="superseded task 1000000, not in flight"):
        engine.run_loop()


# ------------------------------------------------------------------ per-client evaluation
class Personal(Strategy, PerClientModels):
    """Client c's model is the global model plus c in every coordinate."""

    name = "personal"

    def on_update(self, update: Update, view: View) -> Outcome:
        self.model = self.model + update.vector
        return Outcome(changed=True, records=[update_record(update, 1.0)])

    def model_of(self, client: int) -> np.ndarray:
        return self.model + client


def toy_score(client: int, flat: np.ndarray) -> tuple[float, float]:
    return float(flat[0] % 1.0) / 2 + client / 20, float(client)


def expected_row(model: np.ndarray, clients: int) -> tuple[float, float]:
    scores = [toy_score(c, model + c)[0] for c in range(clients)]
    return float(np.mean(scores)), float(np.std(scores))


def test_per_client_evaluation_scores_each_model_on_the_server() -> None:
    engine = engine_for(Personal, ScriptedTransport(6, delta_reply, seed=5), scorer=toy_score)
    engine.run_loop()
    rows = engine.listeners.recorder.metrics  # type: ignore[attr-defined]
    assert [r["virtual_time"] for r in rows] == [500.0 * k for k in range(7)]
    final = engine.strategy.model
    mean, std = expected_row(final, 6)
    assert rows[-1]["accuracy"] == pytest.approx(mean)
    assert rows[-1]["accuracy_std"] == pytest.approx(std)
    assert rows[-1]["loss"] == pytest.approx(2.5)  # mean of clients 0..5
    assert rows[-1]["clients"] == 6


class EvaluatingTransport(ScriptedTransport):
    """Also answers `evaluate` messages with toy_score of the model it carries; client 5
    never answers them."""

    simulated = False
    score = staticmethod(toy_score)

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        if message_type != MSG_EVALUATE:
            return super().send(node_id, message_type, config, arrays, sets)
        self.counter += 1
        msg_id = f"e{self.counter}"
        client = self.nodes[node_id]
        self.sent.append((node_id, message_type, dict(config)))
        if client == 5:
            return msg_id
        accuracy, loss = self.score(client, np.concatenate([a.ravel() for a in arrays.values()]))
        metrics = {
            ReplyKeys.TASK_ID: int(config[TaskKeys.TASK_ID]),
            ReplyKeys.PARTITION_ID: client,
            ReplyKeys.NUM_EXAMPLES: 10,
            ReplyKeys.ACCURACY: accuracy,
            ReplyKeys.LOSS: loss,
        }
        self.pending[msg_id] = (int(self.rng.integers(0, 3)), Reply(msg_id, metrics=metrics))
        return msg_id


def test_per_client_evaluation_on_a_deployment_goes_through_evaluate_messages(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = EvaluatingTransport(6, delta_reply, seed=6)
    use_polled_time(monkeypatch, transport)
    engine = engine_for(Personal, transport, **{"task-timeout": 0.3})
    assert engine.scores.by_message  # not simulated: the clients score their own models
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    rows = engine.listeners.recorder.metrics  # type: ignore[attr-defined]
    assert [r["virtual_time"] for r in rows] == [500.0 * k for k in range(7)]
    assert all(r["clients"] == 5 for r in rows)  # client 5 never answered
    assert all(r["from_train_replies"] == 0 for r in rows)  # no train reply reports a score
    mean, _ = expected_row(engine.strategy.model, 5)
    assert rows[-1]["accuracy"] == pytest.approx(mean)
    asked = [transport.nodes[s[0]] for s in transport.sent if s[1] == MSG_EVALUATE]
    assert sorted(asked).count(0) == len(rows)  # a client without scores: every evaluation
    assert asked.count(5) < len(rows)  # one unanswered message at a time, not one per row
    train = [s[2] for s in transport.sent if s[1] == MSG_TRAIN]
    assert train and all(config[ScoreKeys.ASK] == 1 for config in train)
    lines = [r.getMessage() for r in caplog.records if "did not answer in time" in r.getMessage()]
    assert len(lines) == 1 and "client 5" in lines[0]  # once, however many rows it missed


def flat(arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([a.ravel() for a in arrays.values()])


def age_score(client: int, model: np.ndarray) -> tuple[float, float]:
    """A score that tells models of different versions apart (Personal's client c holds
    version + c in every coordinate)."""
    return float(model[0] % 97.0) / 97.0, float(client)


class ReportingTransport(EvaluatingTransport):
    """Answers evaluate messages with age_score (client 5 never does)."""

    score = staticmethod(age_score)


def scoring_reply(
    sent: dict[int, tuple[int, float]], faults: Mapping[int, dict[str, Any]] | None = None
) -> Any:
    """Train replies that report age_score of the model their task carried when the task
    asks (as fedstale's ClientApp does); `sent`: task id -> (client, that accuracy);
    `faults`: task id -> metrics that overwrite the reply's."""

    def train(partition: int, config: Mapping[str, Any], arrays: dict) -> tuple:
        metrics, out = delta_reply(partition, config, arrays)
        task = int(config[TaskKeys.TASK_ID])
        if config.get(ScoreKeys.ASK):
            accuracy, loss = age_score(partition, flat(arrays))
            sent[task] = (partition, accuracy)
            metrics |= {ScoreKeys.ACCURACY: accuracy, ScoreKeys.LOSS: loss}
        metrics |= (faults or {}).get(task, {})
        return metrics, out

    return train


def last_scores(engine: TaskHistoryEngine, sent: dict[int, tuple[int, float]], at: float) -> dict:
    """Client -> (accuracy, version) of the model its last task handled before `at` carried."""
    done = sorted((t.finishes_at, t.task_id) for t in engine.history.values() if t.finishes_at < at)
    return {sent[i][0]: (sent[i][1], engine.history[i].version) for _, i in done if i in sent}


def reporting_run(
    monkeypatch: pytest.MonkeyPatch,
    strategy_cls: type[Strategy],
    seed: int,
    faults: Mapping[int, dict[str, Any]] | None = None,
) -> tuple[TaskHistoryEngine, ReportingTransport, dict[int, tuple[int, float]]]:
    """A deployment-like run whose train replies report scores: engine, transport, and
    task id -> (client, accuracy reported)."""
    sent: dict[int, tuple[int, float]] = {}
    transport = ReportingTransport(6, scoring_reply(sent, faults), seed=seed)
    use_polled_time(monkeypatch, transport)
    engine = engine_for(strategy_cls, transport, **{"task-timeout": 0.3})
    engine.run_loop()
    return engine, transport, sent


def test_a_deployment_evaluation_uses_the_scores_train_replies_carry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, transport, sent = reporting_run(monkeypatch, Personal, seed=11)
    rows = engine.listeners.recorder.metrics  # type: ignore[attr-defined]
    assert [r["virtual_time"] for r in rows] == [500.0 * k for k in range(7)]
    first = {}  # the first evaluation: each client's first task, all sent at time 0
    for task_id in sorted(sent, reverse=True):
        first[sent[task_id][0]] = (sent[task_id][1], engine.history[task_id].version)
    for row in rows:  # every client replies within 500: scores of the models as sent
        scores = last_scores(engine, sent, row["virtual_time"]) if row["version"] else first
        assert row["clients"] == row["from_train_replies"] == 6
        assert row["accuracy"] == pytest.approx(np.mean([a for a, _ in scores.values()]))
        assert row["oldest_version"] == min(v for _, v in scores.values()) <= row["version"]
    assert rows[0]["oldest_version"] == rows[0]["version"] == 0
    assert [s for s in transport.sent if s[1] == MSG_EVALUATE] == []  # no client was idle


class NeverClient2(Personal):
    """Never gives client 2 a task: it stays idle the whole run."""

    def plan(self, view: View, rng: np.random.Generator) -> Plan:
        return Plan([self.assign(c, view) for c in view.idle[: view.capacity] if c != 2])


def test_an_idle_client_still_gets_an_evaluate_message(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, transport, sent = reporting_run(monkeypatch, NeverClient2, seed=12)
    rows = engine.listeners.recorder.metrics  # type: ignore[attr-defined]
    asked = [transport.nodes[s[0]] for s in transport.sent if s[1] == MSG_EVALUATE]
    assert asked.count(2) == len(rows) == 7  # at every evaluation
    assert len(asked) == asked.count(2)  # the others train from the start: never asked
    for row in rows[1:]:
        assert row["clients"] == 6 and row["from_train_replies"] == 5
        scores = [a for c, (a, _) in last_scores(engine, sent, row["virtual_time"]).items()]
        assert len(scores) == 5
        idle = age_score(2, np.full(3, row["version"] + 2.0))[0]  # its model at the row's version
        assert row["accuracy"] == pytest.approx(np.mean([*scores, idle]))


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({ScoreKeys.ACCURACY: 1.5}, "'start-accuracy' = 1.5 is outside [0, 1]"),
        ({ScoreKeys.LOSS: float("nan")}, "'start-loss' is not finite"),
        ({ScoreKeys.ACCURACY: "high"}, "'start-accuracy' is str, expected float"),
        ({ScoreKeys.LOSS: None}, "'start-loss' is NoneType, expected float"),
    ],
)
def test_a_malformed_score_in_a_train_reply_is_rejected_and_logged(
    fault: dict[str, Any],
    reason: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine, _, _ = reporting_run(monkeypatch, Personal, seed=13, faults={8: fault})
    lines = [r.getMessage() for r in caplog.records if "rejected score" in r.getMessage()]
    client = engine.history[8].client
    assert lines == [
        f"rejected score: node {engine.history[8].node}, task 8 (client {client}): metric {reason}"
    ], lines
    assert engine.counters.rejected == 0  # the update itself stands
    assert 8 in {r["task"] for r in engine.listeners.recorder.updates}  # type: ignore[attr-defined]
    assert len(engine.listeners.recorder.metrics) == 7  # type: ignore[attr-defined]
    accounted(engine)


class DeadEvaluator(EvaluatingTransport):
    """Client 5's node is dead to evaluate messages: each gets Flower's error reply, or
    (`refuse`) the SuperLink refuses it."""

    def __init__(self, *args: Any, refuse: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refuse = refuse
        self.failed = 0

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        if message_type != MSG_EVALUATE or self.nodes[node_id] != 5:
            return super().send(node_id, message_type, config, arrays, sets)
        self.failed += 1
        if self.refuse:
            raise SendRefused(f"the SuperLink refused a evaluate message to node {node_id}")
        msg_id = f"dead{self.failed}"
        reason = "Error: Node Unavailable - no heartbeat"
        self.pending[msg_id] = (0, Reply(msg_id, error_code=5, error=reason))
        return msg_id


@pytest.mark.parametrize("refuse", [False, True])
def test_a_dead_nodes_evaluation_failures_are_logged_once(
    refuse: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = DeadEvaluator(6, delta_reply, seed=14, refuse=refuse)
    use_polled_time(monkeypatch, transport)
    engine = engine_for(Personal, transport, **{"task-timeout": 0.3})
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    rows = engine.listeners.recorder.metrics  # type: ignore[attr-defined]
    assert transport.failed == len(rows) == 7  # asked at every evaluation, failed every time
    assert all(row["clients"] == 5 for row in rows)
    lines = [r.getMessage() for r in caplog.records if "evaluation of client" in r.getMessage()]
    node = next(n for n, c in transport.nodes.items() if c == 5)
    cause = "not sent: the SuperLink refused" if refuse else "rejected: error reply (code 5)"
    assert len(lines) == 1 and f"client 5 (node {node}) {cause}" in lines[0], lines


def test_global_strategies_can_be_scored_per_client_too() -> None:
    from tests.test_engine import Recording

    engine = engine_for(
        Recording, ScriptedTransport(6, delta_reply), scorer=toy_score, eval_target="per-client"
    )
    engine.run_loop()
    row = engine.listeners.recorder.metrics[-1]  # type: ignore[attr-defined]
    scores = [toy_score(c, engine.strategy.model)[0] for c in range(6)]
    assert row["accuracy"] == pytest.approx(np.mean(scores)) and row["clients"] == 6


def test_a_global_evaluation_row_keeps_its_keys() -> None:
    from tests.test_engine import Recording

    engine = engine_for(Recording, ScriptedTransport(6, delta_reply))
    engine.run_loop()
    keys = {"virtual_time", "wall_time", "version", "accuracy", "loss", "updates"}
    assert all(set(row) == keys for row in engine.listeners.recorder.metrics)  # type: ignore[attr-defined]


def test_per_client_evaluation_on_the_server_needs_a_scorer() -> None:
    with pytest.raises(ValueError, match="needs a client scorer"):
        Scoreboard(
            run_config(**SETTINGS),
            Personal(run_config(**SETTINGS), NoParams(), np.zeros(3)),
            ScriptedTransport(6, delta_reply),
            LAYOUT,
            lambda flat: (0.0, 0.0),
            None,
        )


# ------------------------------------------------------------------ named reply sets
class TwoSets(Strategy):
    """Wants a fresh delta and a `stale` set; adds both (MAFSA's shape of reply)."""

    name = "two-sets"

    def assign(self, client: int, view: View) -> Assignment:
        assignment = super().assign(client, view)
        assignment.reply_sets = ("stale",)
        return assignment

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[Update] = []

    def on_update(self, update: Update, view: View) -> Outcome:
        self.seen.append(update)
        self.model = self.model + update.vector + update.sets["stale"]
        return Outcome(changed=True, records=[update_record(update, 1.0)])


def two_set_reply(fault_task: int = -1, fault: str = "") -> Any:
    def train(partition: int, config: Mapping[str, Any], arrays: dict) -> tuple:
        metrics, out = delta_reply(partition, config, arrays)
        sets = {"stale": {k: np.full_like(v, 10.0) for k, v in arrays.items()}}
        if config[TaskKeys.TASK_ID] == fault_task:
            if fault == "missing":
                sets = {}
            elif fault == "extra":
                sets["other"] = sets["stale"]
            elif fault == "shape":
                sets["stale"] = {"w": np.zeros(5, dtype=np.float32)}
        return metrics, out, sets

    return train


def test_a_reply_carries_named_array_sets() -> None:
    engine = engine_for(TwoSets, ScriptedTransport(6, two_set_reply(), seed=7))
    engine.run_loop()
    seen = engine.strategy.seen  # type: ignore[attr-defined]
    assert seen and all(np.array_equal(u.sets["stale"], np.full(3, 10.0)) for u in seen)
    np.testing.assert_allclose(engine.strategy.model, np.full(3, 11.0 * len(seen)))


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("missing", "carries array sets [], expected ['stale']"),
        ("extra", "carries array sets ['other', 'stale'], expected ['stale']"),
        ("shape", "array 'w' has shape (5,), expected (3,)"),
    ],
)
def test_a_missing_extra_or_malformed_set_is_rejected_with_one_line(
    fault: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_for(TwoSets, ScriptedTransport(6, two_set_reply(3, fault), seed=8))
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    lines = [r.getMessage() for r in caplog.records if "rejected update" in r.getMessage()]
    assert len(lines) == 1 and "task 3 " in lines[0] and reason in lines[0], lines
    assert 3 not in {u.task_id for u in engine.strategy.seen}  # type: ignore[attr-defined]
    assert engine.counters.rejected == 1
    accounted(engine)


# ------------------------------------------------------------------ task deadline
class Silent(ScriptedTransport):
    """Node of client 2 takes its first task and never answers it (a hung device)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.swallowed: list[str] = []

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        msg_id = super().send(node_id, message_type, config, arrays, sets)
        if message_type != MSG_QUERY and self.nodes[node_id] == 2 and not self.swallowed:
            self.swallowed.append(msg_id)
            del self.pending[msg_id]
        return msg_id


def test_a_task_past_its_deadline_is_retired_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_engine import Recording

    transport = Silent(6, delta_reply, seed=9)
    use_polled_time(monkeypatch, transport)
    engine = engine_for(Recording, transport, concurrency=3, **{"task-timeout": 0.2})
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
    assert transport.swallowed
    assert engine.stop_reason == "time budget"  # the virtual clock was not held for ever
    assert engine.counters.failed == 1
    lines = [
        r.getMessage() for r in caplog.records if "no reply within task-timeout" in r.getMessage()
    ]
    assert len(lines) == 1 and "(client 2)" in lines[0]
    assert engine.counters.accepted > 10
    accounted(engine)


# ------------------------------------------------------------------ misconfigured node
class Misconfigured(ScriptedTransport):
    """The node of client 5 has no partition-id: it says so in its query reply."""

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        if message_type == MSG_QUERY and self.nodes[node_id] == 5:
            self.counter += 1
            msg_id = f"q{self.counter}"
            self.sent.append((node_id, message_type, dict(config)))
            problem = "no partition-id given; start the SuperNode with --node-config ..."
            self.pending[msg_id] = (0, Reply(msg_id, problem=problem))
            return msg_id
        return super().send(node_id, message_type, config, arrays, sets)


def run_then_refresh(transport: ScriptedTransport, caplog: pytest.LogCaptureFixture) -> Engine:
    """A wall-clock run of 30 versions, then five more node refreshes (queries answered)."""
    from tests.test_engine import Recording

    engine = engine_for(
        Recording,
        transport,
        clock="wall",
        concurrency=3,
        **{"max-virtual-time": 0.0, "max-versions": 30, "node-wait-seconds": 0.1},
    )
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        engine.run_loop()
        for _ in range(5):
            engine.refresh_nodes(force=True)
            engine.federation.nodes.collect(transport)
    return engine


def test_a_node_without_partition_id_is_refused_once(caplog: pytest.LogCaptureFixture) -> None:
    transport = Misconfigured(6, delta_reply, seed=10)
    engine = run_then_refresh(transport, caplog)
    bad_node = next(n for n, c in transport.nodes.items() if c == 5)
    queries = [s for s in transport.sent if s[0] == bad_node and s[1] == MSG_QUERY]
    assert len(queries) == 1
    lines = [
        r.getMessage() for r in caplog.records if f"node {bad_node} gets no work" in r.getMessage()
    ]
    assert len(lines) == 1 and "no partition-id given" in lines[0]
    assert 5 not in {u.client for u in engine.strategy.seen}  # type: ignore[attr-defined]


class QueryLost(ScriptedTransport):
    """The query to client 5's node fails in transit `failures` times (an error reply, as
    Flower gives for an expired message), then is answered."""

    def __init__(self, *args: Any, failures: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures

    def send(self, node_id, message_type, config, arrays=None, sets=None) -> str:  # type: ignore[no-untyped-def]
        if message_type == MSG_QUERY and self.nodes[node_id] == 5 and self.failures:
            self.failures -= 1
            self.counter += 1
            msg_id = f"q{self.counter}"
            self.sent.append((node_id, message_type, dict(config)))
            self.pending[msg_id] = (0, Reply(msg_id, error_code=3, error="Message Unavailable"))
            return msg_id
        return super().send(node_id, message_type, config, arrays, sets)


@pytest.mark.parametrize(("failures", "served"), [(2, True), (3, False)])
def test_a_query_lost_in_transit_is_asked_again_up_to_three_times(
    caplog: pytest.LogCaptureFixture, failures: int, served: bool
) -> None:
    transport = QueryLost(6, delta_reply, seed=10, failures=failures)
    engine = run_then_refresh(transport, caplog)
    node = next(n for n, c in transport.nodes.items() if c == 5)
    queries = [s for s in transport.sent if s[0] == node and s[1] == MSG_QUERY]
    assert len(queries) == 3  # two lost and one answered, or three lost
    refused = [
        r.getMessage() for r in caplog.records if f"node {node} gets no work" in r.getMessage()
    ]
    assert (5 in {u.client for u in engine.strategy.seen}) == served  # type: ignore[attr-defined]
    assert len(refused) == (0 if served else 1)


class RecordingSends:
    """A transport that only records what is sent."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send(self, node: int, kind: str, config: Any, arrays: Any, extra: Any = None) -> str:
        self.sent.append(node)
        return f"m{len(self.sent)}"

    def receive(self, msg_ids: list[str]) -> list[Reply]:
        return []


def test_a_training_client_counts_with_its_last_score_and_gets_no_evaluate_message() -> None:
    """Client 0 reported a score at time 0 and is training again at time 25, past one
    interval (10): it counts with that score and is not asked. Client 1, as old and idle,
    gets an evaluate message."""
    from types import SimpleNamespace

    from fedstale.server_app.clock import Task
    from fedstale.server_app.reports import ClientReports
    from fedstale.server_app.scored import Evaluation

    run = run_config(num_clients=2, eval_interval=10.0, eval_target="per-client")
    model = SimpleNamespace(model=np.zeros(LAYOUT.total, np.float32))
    transport = RecordingSends()
    reports = ClientReports(run, model, transport, LAYOUT)  # type: ignore[arg-type]
    for client in (0, 1):
        task = Task(client, client, 10 + client, f"t{client}", 0, 0, 0.0, 5.0)
        reports.take(task, {ScoreKeys.ACCURACY: 0.5 + client / 10, ScoreKeys.LOSS: 1.0}, 0.0)
    nodes = NodeBook(2, node_of={0: 10, 1: 11})
    evaluation = Evaluation(25.0, 0.0, 3, float("nan"), float("nan"), 4)
    reports.start(evaluation, nodes, frozenset({0}))  # type: ignore[arg-type]
    assert transport.sent == [11]
    pending = reports.pending[-1]
    assert pending.scores[0].accuracy == 0.5 and list(pending.waiting.values()) == [1]


def test_a_training_client_with_no_score_yet_is_scored_by_its_train_reply() -> None:
    """The first evaluation, with every client's first task out: no evaluate message; the
    train replies bring the scores; a client whose reply has none (2) or whose task ended
    with no reply taken (1) gets an evaluate message instead."""
    from types import SimpleNamespace

    from fedstale.server_app.clock import Task
    from fedstale.server_app.reports import ClientReports, Score
    from fedstale.server_app.scored import Evaluation

    run = run_config(num_clients=3, eval_interval=10.0, eval_target="per-client")
    model = SimpleNamespace(model=np.zeros(LAYOUT.total, np.float32))
    transport = RecordingSends()
    reports = ClientReports(run, model, transport, LAYOUT)  # type: ignore[arg-type]
    nodes = NodeBook(3, node_of={0: 10, 1: 11, 2: 12})
    evaluation = Evaluation(0.0, 0.0, 0, float("nan"), float("nan"), 0)
    reports.start(evaluation, nodes, frozenset({0, 1, 2}))  # type: ignore[arg-type]
    assert transport.sent == []
    assert reports.collect(frozenset({0, 1, 2})) == []
    task = Task(0, 0, 10, "t0", 0, 0, 0.0, 5.0)
    reports.take(task, {ScoreKeys.ACCURACY: 0.4, ScoreKeys.LOSS: 2.0}, 5.0)
    assert reports.collect(frozenset({1, 2})) == []  # client 2 still trains
    reports.take(Task(2, 2, 12, "t2", 0, 0, 0.0, 7.0), {ScoreKeys.ACCURACY: 0.6}, 7.0)
    assert reports.collect(frozenset({1})) == []  # 2's reply lacked its loss: no score
    assert transport.sent == [12]
    assert reports.collect(frozenset()) == []  # 1's task ended with no reply taken
    assert transport.sent == [12, 11]
    (pending,) = reports.pending
    assert pending.scores == {0: Score(0.4, 2.0, 0, 0.0, from_training=True)}
    assert sorted(pending.waiting.values()) == [1, 2] and pending.training == {}


@pytest.mark.parametrize(("metric", "kept"), [("accuracy", False), ("neg-mse", True)])
def test_a_score_outside_0_1_stands_only_for_a_metric_other_than_accuracy(
    metric: str, kept: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A regression's neg-mse (or a user's own metric) may be any finite number."""
    from types import SimpleNamespace

    from fedstale.server_app.clock import Task
    from fedstale.server_app.reports import ClientReports

    run = run_config(num_clients=2, eval_target="per-client", metric=metric)
    model = SimpleNamespace(model=np.zeros(LAYOUT.total, np.float32))
    reports = ClientReports(run, model, RecordingSends(), LAYOUT)  # type: ignore[arg-type]
    task = Task(0, 0, 10, "t0", 0, 0, 0.0, 5.0)
    with caplog.at_level(logging.WARNING, logger="fedstale"):
        reports.take(task, {ScoreKeys.ACCURACY: -0.25, ScoreKeys.LOSS: 0.25}, 5.0)
    assert (0 in reports.reported) == kept
    assert any("outside [0, 1]" in r.getMessage() for r in caplog.records) != kept
