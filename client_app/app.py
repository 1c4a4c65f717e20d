"""fedstale ClientApp: train, evaluate and query handlers.

Kept light to import: torch and the project's own modules only (no sklearn, matplotlib or
pydantic-heavy work at import), since a deployed SuperNode starts a fresh process per task.
"""

from __future__ import annotations

import time
from functools import cache

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.faults import corrupt
from client_app.training import local_train
from common.config import RunConfig, parse_run_config
from common.federation import client_data, federation_of
from common.models import ParamLayout, build_model, evaluate, get_flat, resolve_device, set_flat
from common.records import from_array_record, to_array_record
from common.schema import ARRAYS, CONFIG, METRICS, RETURN_DELTA, ReplyKeys, SignalKeys, TaskSpec
from common.sensitivity import sketch_for_task

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


@cache
def _model(cfg: RunConfig) -> tuple[torch.nn.Module, ParamLayout]:
    fed = federation_of(cfg)
    model = build_model(cfg.model_name, fed.input_shape, fed.num_classes, cfg.seed)
    return model.to(resolve_device(cfg.device)), ParamLayout.of(model)


def _received_model(msg: Message, cfg: RunConfig) -> tuple[torch.nn.Module, ParamLayout]:
    model, layout = _model(cfg)
    set_flat(model, layout.flatten(from_array_record(msg.content[ARRAYS])))
    return model, layout


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
    started = time.perf_counter()
    cfg = run_config(context)
    partition = partition_of(context, cfg)
    task = TaskSpec.from_config(msg.content[CONFIG])
    model, layout = _received_model(msg, cfg)
    start = get_flat(model)
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in client_data(cfg, partition, "train"))
    loss = local_train(
        model,
        x,
        y,
        epochs=task.local_epochs,
        batch_size=task.batch_size,
        lr=task.lr,
        seed=task.seed,
        proximal_mu=task.proximal_mu,
    )
    trained = get_flat(model)
    delta = trained - start
    result = delta if task.returns == RETURN_DELTA else trained
    metrics = {
        ReplyKeys.TASK_ID: task.task_id,
        ReplyKeys.PARTITION_ID: partition,
        ReplyKeys.NUM_EXAMPLES: len(y),
        ReplyKeys.TRAIN_LOSS: loss,
        ReplyKeys.COMPUTE_SECONDS: time.perf_counter() - started,
    }
    if SignalKeys.SKETCH_K in task.extra:
        fed = federation_of(cfg)
        sketch = sketch_for_task(model, task.extra, fed.input_shape, fed.num_classes)
        metrics[SignalKeys.SKETCH] = [float(v) for v in sketch]
        metrics[SignalKeys.UPDATE_NORM_SQ] = float(np.dot(delta.astype(np.float64), delta))
    arrays = layout.unflatten(result)
    if task.task_id in cfg.faults:
        metrics, arrays = corrupt(cfg.faults[task.task_id], metrics, arrays)
    return _reply(msg, metrics, arrays)


@app.evaluate()
def evaluate_handler(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    partition = partition_of(context, cfg)
    model, _ = _received_model(msg, cfg)
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
