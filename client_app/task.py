"""One training task of one client, free of Flower's message types: the ClientApp's train
handler wraps it, and the in-process transport (server_app/inprocess.py) calls it directly."""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import cache
from typing import Any

import numpy as np
import torch

from client_app.faults import corrupt
from client_app.training import local_train
from common.config import RunConfig
from common.federation import client_data, data_shape
from common.models import ParamLayout, build_model, get_flat, resolve_device, set_flat
from common.schema import RETURN_DELTA, ReplyKeys, SignalKeys, TaskSpec
from common.sensitivity import sketch_for_task


@cache
def client_model(cfg: RunConfig) -> tuple[torch.nn.Module, ParamLayout]:
    """One model object per process and config, reloaded with each task's weights."""
    input_shape, num_classes = data_shape(cfg)
    model = build_model(cfg.model_name, input_shape, num_classes, cfg.seed)
    return model.to(resolve_device(cfg.device)), ParamLayout.of(model)


def train_task(
    cfg: RunConfig, partition: int, config: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Train from `arrays` as the task config says; returns (metrics, delta or model)."""
    started = time.perf_counter()
    if cfg.client_threads:
        torch.set_num_threads(cfg.client_threads)
    task = TaskSpec.from_config(config)
    model, layout = client_model(cfg)
    start = layout.flatten(dict(arrays))
    set_flat(model, start)
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
        closed_form=cfg.trainer == "auto",
    )
    trained = get_flat(model)
    delta = trained - start
    metrics: dict[str, Any] = {
        ReplyKeys.TASK_ID: task.task_id,
        ReplyKeys.PARTITION_ID: partition,
        ReplyKeys.NUM_EXAMPLES: len(y),
        ReplyKeys.TRAIN_LOSS: loss,
    }
    if SignalKeys.SKETCH_K in task.extra:
        sketch = sketch_for_task(model, task.extra, *data_shape(cfg))
        metrics[SignalKeys.SKETCH] = [float(v) for v in sketch]
        metrics[SignalKeys.UPDATE_NORM_SQ] = float(np.dot(delta.astype(np.float64), delta))
    metrics[ReplyKeys.COMPUTE_SECONDS] = time.perf_counter() - started
    result = layout.unflatten(delta if task.returns == RETURN_DELTA else trained)
    if task.task_id in cfg.faults:
        metrics, result = corrupt(cfg.faults[task.task_id], metrics, result)
    return metrics, result
