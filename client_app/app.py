"""fedstale ClientApp: train, evaluate and query handlers.

Kept light to import: torch and the project's own modules only (no sklearn, matplotlib or
pydantic-heavy work at import), since a deployed SuperNode starts a fresh process per task.
"""

from __future__ import annotations

import time
from functools import cache

import numpy as np
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.task import client_model, train_task
from common.config import RunConfig, parse_run_config
from common.federation import client_data
from common.models import evaluate, set_flat
from common.records import from_array_record, to_array_record
from common.schema import ARRAYS, CONFIG, METRICS, ReplyKeys

app = ClientApp()


@cache
def _config(items: frozenset) -> RunConfig:
    return parse_run_config(dict(items))


def run_config(context: Context) -> RunConfig:
    return _config(frozenset(context.run_config.items()))


def partition_of(context: Context, cfg: RunConfig) -> int:
    partition = int(context.node_config.get("partition-id", -1))
    if not 0 <= partition < cfg.num_clients:
        raise ValueError(
            f"node-config partition-id={partition} outside 0..{cfg.num_clients - 1}; "
            "start the SuperNode with --node-config 'partition-id=<i> num-partitions=<N>'"
        )
    return partition


def _reply(msg: Message, metrics: dict, arrays: dict[str, np.ndarray] | None = None) -> Message:
    content = RecordDict({METRICS: MetricRecord(metrics)})
    if arrays is not None:
        content[ARRAYS] = to_array_record(arrays)
    return Message(content, reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    partition = partition_of(context, cfg)
    return _reply(
        msg,
        {ReplyKeys.PARTITION_ID: partition, ReplyKeys.NUM_PARTITIONS: cfg.num_clients},
    )


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    arrays = from_array_record(msg.content[ARRAYS])
    metrics, result = train_task(cfg, partition_of(context, cfg), msg.content[CONFIG], arrays)
    time.sleep(injected_delay(context))
    return _reply(msg, metrics, result)


def injected_delay(context: Context) -> float:
    """Seconds a deployed node waits after training (node-config `delay-seconds`): a slow
    device on a local deployment (server_app/deploy.py)."""
    delay = float(context.node_config.get("delay-seconds", 0.0))
    if delay < 0:
        raise ValueError(f"node-config delay-seconds={delay} is negative; use 0 or more")
    return delay


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    partition = partition_of(context, cfg)
    model, layout = client_model(cfg)
    set_flat(model, layout.flatten(from_array_record(msg.content[ARRAYS])))
    x, y = client_data(cfg, partition, "val")
    if len(y) == 0:
        x, y = client_data(cfg, partition, "train")
    accuracy, loss = evaluate(model, x, y, cfg.eval_batch_size)
    metrics = {
        ReplyKeys.TASK_ID: int(msg.content[CONFIG][ReplyKeys.TASK_ID]),
        ReplyKeys.PARTITION_ID: partition,
        ReplyKeys.NUM_EXAMPLES: len(y),
        ReplyKeys.ACCURACY: accuracy,
        ReplyKeys.LOSS: loss,
    }
    return _reply(msg, metrics)
