"""The stages around the rule (fedstale/server_app/stages/pipeline.py): a stage added to the
list sees what the rule sees, releases stop at the first stage that does not release, each
stage's state is kept under its own key, and a stage's messages are gathered as asked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedstale.server_app.stages.pipeline import Pipeline, Request, Stage, Verdict, gather
from fedstale.server_app.transport import Reply
from fedstale.strategies.base import NoParams, Outcome, Update
from tests.helpers import ScriptedTransport, delta_reply, run_config, scripted_engine
from tests.test_engine import LAYOUT, Recording


class NormLog(Stage):
    """docs/architecture.md's example: the norm of every update, before the rule sees it."""

    def __init__(self) -> None:
        self.norms: list[tuple[int, float]] = []

    def update(self, task_id: int, update: Update) -> Update:
        self.norms.append((task_id, float(np.linalg.norm(update.vector))))
        return update


def test_a_stage_added_to_the_list_sees_every_update_the_rule_sees() -> None:
    run = run_config(
        **{"num-clients": 4, "concurrency": 2, "max-updates": 9, "max-virtual-time": 0.0},
        **{"poll-interval": 0.0001, "node-wait-seconds": 2.0, "eval-interval": 250.0},
    )
    strategy = Recording(run, NoParams(), np.zeros(3, dtype=np.float32))
    norm_log = NormLog()
    transport = ScriptedTransport(4, delta_reply, seed=3)
    engine = scripted_engine(run, strategy, transport, LAYOUT, stages=[norm_log])
    engine.run_loop()
    seen = [(u.task_id, float(np.linalg.norm(u.vector))) for u in strategy.seen]
    assert len(seen) == 9 and norm_log.norms == seen


class Fixed(Stage):
    """A stage whose verdict, record and state are given; it counts its releases."""

    def __init__(self, key: str, verdict: Verdict, field: str = "") -> None:
        self.verdict, self.field, self.released = verdict, field, 0
        self.key = key  # type: ignore[misc]

    def release(self, strategy: Any, outcome: Outcome, version: int, messages: Any) -> Verdict:
        self.released += 1
        return self.verdict

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k != self.field}

    def state(self) -> dict[str, Any]:
        return {"released": self.released}


def test_a_release_stops_at_the_first_stage_that_does_not_release_and_a_later_stop_wins() -> None:
    outcome = Outcome(changed=True)
    first = Fixed("a", Verdict(released=True, stop="first stops"))
    second = Fixed("b", Verdict(released=True, stop="second stops"))
    assert Pipeline([first, second]).release(None, outcome, 1, None) == Verdict(  # type: ignore[arg-type]
        released=True, stop="second stops"
    )
    dropping = Fixed("c", Verdict(released=False))
    third = Fixed("d", Verdict())
    verdict = Pipeline([first, dropping, third]).release(None, outcome, 2, None)  # type: ignore[arg-type]
    assert verdict == Verdict(released=False, stop="first stops")
    assert (first.released, dropping.released, third.released) == (2, 1, 0)
    assert Pipeline().release(None, outcome, 1, None) == Verdict()  # type: ignore[arg-type]


def test_records_pass_every_stage_and_state_is_kept_under_each_stages_key() -> None:
    pipeline = Pipeline([Fixed("a", Verdict(), "kappa"), Stage(), Fixed("b", Verdict(), "w")])
    row = {"client": 1, "kappa": 0.5, "w": 0.2}
    assert pipeline.record(row) == {"client": 1}
    state = pipeline.state()
    assert state == {"a": {"released": 0}, "b": {"released": 0}}  # a keyless stage has none
    fresh = [Fixed("a", Verdict()), Fixed("b", Verdict())]
    loaded: list[dict[str, Any]] = []
    for stage in fresh:
        stage.load_state = loaded.append  # type: ignore[method-assign,assignment]
    Pipeline(fresh).load_state({"a": {"released": 3}})
    assert loaded == [{"released": 3}, {}]


class Inbox:
    """Messages that answer client c after c + 1 receives; client 2 with an error."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.receives = 0
        self.pauses = 0

    def send(self, client: int, config: dict[str, Any], sets: Any) -> str | None:
        if client == 9:  # no node
            return None
        self.sent[f"m{client}"] = client
        return f"m{client}"

    def receive(self, msg_ids: list[str]) -> list[Reply]:
        self.receives += 1
        ready = [m for m in msg_ids if self.sent[m] + 1 <= self.receives]
        return [
            Reply(m, metrics={}, error_code=1 if self.sent[m] == 2 else None, error="e")
            for m in ready
        ]

    def pause(self) -> None:
        self.pauses += 1


@pytest.mark.parametrize(("needed", "answered"), [(1, [0]), (2, [0, 1]), (3, [0, 1, 2, 3])])
def test_gather_collects_until_enough_replies_came_without_an_error(
    needed: int, answered: list[int]
) -> None:
    """Clients 0..3 answer on receives 1..4; client 2's reply is an error, so three
    good replies need all four; client 9 has no node and is never waited for."""
    inbox = Inbox()
    requests: list[Request] = [(client, {}, {}) for client in (0, 1, 2, 3, 9)]
    replies = gather(inbox, requests, needed, seconds=60.0)
    assert [client for client, _ in replies] == answered
    assert inbox.pauses == len(answered) - 1


def test_without_stages_the_pipeline_hands_everything_on_as_it_came() -> None:
    pipeline = Pipeline()
    update = Update(0, 0, 0, 0, 1, np.ones(3, np.float32))
    reply = Reply("m", metrics={})
    assert pipeline.update(0, update) is update and pipeline.reply(0, 0, reply) is reply
    assert pipeline.task_parts(0, 0, "delta") == ({}, {}) and pipeline.joined([1], None) == []  # type: ignore[arg-type]
    assert pipeline.keeps_client_values and pipeline.opening(None) == ""  # type: ignore[arg-type]
