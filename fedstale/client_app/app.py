"""fedstale ClientApp: train, evaluate and query handlers.

Kept light to import: torch and the project's own modules only (no sklearn, matplotlib or
pydantic-heavy work at import), since a deployed SuperNode starts a fresh process per task.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from fedstale.client_app.secagg import secagg_mod
from fedstale.client_app.task import evaluate_task, train_cohort, train_task
from fedstale.common.config import RunConfig, RunSettings, parse_run_config
from fedstale.common.records import (
    ArraySets,
    cohort_content,
    cohort_parts,
    decode_sets,
    from_array_record,
    message_content,
    to_array_record,
)
from fedstale.common.schema import ARRAYS, ASSIGNED_PARTITION, CONFIG, ReplyKeys

app = ClientApp()
STATE_KEY = "fedstale-state"  # the ArrayRecord in Context.state holding a client's kept arrays
NODE_CONFIG_HINT = "start the SuperNode with --node-config 'partition-id=<i> num-partitions=<N>'"


@cache
def _config(items: frozenset) -> RunConfig:
    return parse_run_config(dict(items))


def run_config(context: Context) -> RunConfig:
    return _config(frozenset(context.run_config.items()))


def partition_problem(context: Context, cfg: RunSettings) -> str:
    """Why this node cannot serve a client, or "" when its partition-id (and edge-id, which
    a hierarchical run's SuperNode may name) is fine."""
    raw = context.node_config.get("partition-id")
    if raw is None:
        return f"no partition-id given; {NODE_CONFIG_HINT}"
    try:
        partition = int(raw)
    except (TypeError, ValueError):
        return f"partition-id={raw!r} is not an integer; {NODE_CONFIG_HINT}"
    if not 0 <= partition < cfg.num_clients:
        return (
            f"partition-id={partition} is outside 0..{cfg.num_clients - 1} "
            f"(num-clients={cfg.num_clients}); {NODE_CONFIG_HINT}"
        )
    edge = context.node_config.get("edge-id")
    if edge is not None and not (str(edge).isdigit()):
        return f"edge-id={edge!r} is not a non-negative integer; start with 'edge-id=<k>'"
    return ""


def partition_of(context: Context, cfg: RunSettings, config: Mapping[str, Any]) -> int:
    """The partition a message asks this node to serve: the one the server assigned
    (node-partitions=assign, named in the message), else the node's own partition-id."""
    assigned = config.get(ASSIGNED_PARTITION)
    if assigned is not None:
        if not isinstance(assigned, int) or not 0 <= assigned < cfg.num_clients:
            raise ValueError(f"the message assigns partition {assigned!r}, not a client")
        return assigned
    problem = partition_problem(context, cfg)
    if problem:
        raise ValueError(f"node-config: {problem}")
    return int(context.node_config["partition-id"])


def _reply(
    msg: Message,
    metrics: dict[str, Any],
    arrays: dict[str, np.ndarray] | None = None,
    sets: ArraySets | None = None,
    config: dict[str, Any] | None = None,
) -> Message:
    return Message(message_content(config, arrays, sets, metrics), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Which client this node serves; a misconfigured node says what is wrong instead."""
    cfg = run_config(context)
    problem = partition_problem(context, cfg)
    if problem:
        return _reply(msg, {}, config={ReplyKeys.PROBLEM: problem})
    metrics = {ReplyKeys.PARTITION_ID: partition_of(context, cfg, {})}
    if "edge-id" in context.node_config:
        metrics[ReplyKeys.EDGE_ID] = int(context.node_config["edge-id"])
    return _reply(msg, metrics)


def kept_state(context: Context) -> dict[str, np.ndarray]:
    record = context.state.get(STATE_KEY)
    return from_array_record(record) if isinstance(record, ArrayRecord) else {}


@app.train(mods=[secagg_mod()])  # passes every task through unless the run masks updates
def train(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    arrays = from_array_record(msg.content[ARRAYS])
    state = kept_state(context)
    metrics, result, outputs = train_task(
        cfg,
        partition_of(context, cfg, msg.content[CONFIG]),
        msg.content[CONFIG],
        arrays,
        decode_sets(msg.content),
        state,
    )
    if state:
        context.state[STATE_KEY] = to_array_record(state)
    time.sleep(injected_delay(context))
    return _reply(msg, metrics, result, outputs)


@app.train("cohort")
def train_together(msg: Message, context: Context) -> Message:
    """A cohort of tasks (trainer=cohort in simulation, fedstale/server_app/cohorts.py), each
    naming its partition, trained together; one reply part per task, in order."""
    cfg = run_config(context)
    parts = cohort_parts(msg.content) or []
    jobs = [
        (
            partition_of(context, cfg, part[CONFIG]),
            part[CONFIG],
            from_array_record(part[ARRAYS]),
            decode_sets(part),
            None,  # tasks that keep client state train alone on their own node
        )
        for part in parts
    ]
    replies = [
        message_content(None, result, outputs, metrics)
        for metrics, result, outputs in train_cohort(cfg, jobs)
    ]
    return Message(cohort_content(replies), reply_to=msg)


def injected_delay(context: Context) -> float:
    """Seconds a deployed node waits after training (node-config `delay-seconds`): a slow
    device on a local deployment (fedstale/launcher/deploy.py)."""
    delay = float(context.node_config.get("delay-seconds", 0.0))
    if delay < 0:
        raise ValueError(f"node-config delay-seconds={delay} is negative; use 0 or more")
    return delay


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    """Score the model the message carries on this client's own held-out split."""
    cfg = run_config(context)
    arrays = from_array_record(msg.content[ARRAYS])
    config = msg.content[CONFIG]
    return _reply(msg, evaluate_task(cfg, partition_of(context, cfg, config), config, arrays))
