"""One training task of one client, free of Flower's message types: the ClientApp's train
handler wraps it, and local running (fedstale/launcher/local.py) calls it directly."""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from functools import cache
from typing import Any

import numpy as np
import torch

from fedstale.client_app.faults import corrupt
from fedstale.common.config import RunConfig
from fedstale.common.models import (
    ParamLayout,
    evaluate,
    get_flat,
    set_flat,
)
from fedstale.common.objectives import objective
from fedstale.common.records import ArraySets
from fedstale.common.run_model import data_shape, run_model
from fedstale.common.schema import (
    CLIPPING_NORM,
    RETURN_DELTA,
    ReplyKeys,
    ScoreKeys,
    TaskKeys,
    TaskSpec,
)
from fedstale.common.shares import client_data, client_holdout
from fedstale.common.threads import on_client_threads
from fedstale.strategies.client import LocalTask, rules_named
from fedstale.strategies.privacy import clip_to
from fedstale.strategies.registry import client_rules

Arrays = dict[str, np.ndarray]


@cache
def client_model(cfg: RunConfig) -> tuple[torch.nn.Module, ParamLayout]:
    """One model object per process and config, reloaded with each task's weights."""
    model = run_model(cfg)
    return model, ParamLayout.of(model)


@on_client_threads
def train_task(
    cfg: RunConfig,
    partition: int,
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    sets: ArraySets | None = None,
    state: MutableMapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, Any], Arrays, dict[str, Arrays]]:
    """Train from `arrays` as the task config says, running the strategy's client rules;
    returns (metrics, delta or model, other named array sets). `state` is the client's
    kept state, updated in place."""
    started = time.perf_counter()
    spec = TaskSpec.from_config(config)
    model, layout = client_model(cfg)
    start = layout.flatten(dict(arrays))
    set_flat(model, start)
    score = start_score(cfg, partition, model) if spec.extra.get(ScoreKeys.ASK) else {}
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in client_data(cfg, partition, "train"))
    task = LocalTask(
        cfg,
        partition,
        spec,
        model,
        layout,
        start,
        x,
        y,
        *data_shape(cfg),
        inputs={name: layout.flatten(dict(a)) for name, a in (sets or {}).items()},
        state=dict(state or {}),
    )
    rules = rules_named(spec.rules, client_rules())
    for rule in rules:
        rule.before(task)
    loss = task.train()  # with the optimiser settings a rule may have set
    spec = task.spec
    trained = get_flat(model)
    delta = trained - start
    if CLIPPING_NORM in spec.extra:  # central DP with client-side clipping
        delta, _ = clip_to(delta, float(spec.extra[CLIPPING_NORM]))
        trained = start + delta
        set_flat(model, trained)
    for rule in rules:
        rule.after(task, trained, delta)
    if state is not None:
        state.clear()
        state.update(task.state)
    metrics: dict[str, Any] = {
        ReplyKeys.TASK_ID: spec.task_id,
        ReplyKeys.PARTITION_ID: partition,
        ReplyKeys.NUM_EXAMPLES: len(y),
        ReplyKeys.TRAIN_LOSS: loss,
        **score,
        **task.signals,
    }
    metrics[ReplyKeys.COMPUTE_SECONDS] = time.perf_counter() - started
    result = layout.unflatten(delta if spec.returns == RETURN_DELTA else trained)
    outputs = {name: layout.unflatten(vector) for name, vector in task.outputs.items()}
    if spec.task_id in cfg.faults:
        metrics, result, outputs = corrupt(cfg.faults[spec.task_id], metrics, result, outputs)
    return metrics, result, outputs


def holdout_score(
    cfg: RunConfig, partition: int, model: torch.nn.Module
) -> tuple[float, float, int]:
    """(metric, mean loss, samples) of `model` on this client's own held-out split."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in client_holdout(cfg, partition))
    accuracy, loss = evaluate(model, x, y, cfg.eval_batch_size, objective(cfg.loss, cfg.metric))
    return accuracy, loss, len(y)


def start_score(cfg: RunConfig, partition: int, model: torch.nn.Module) -> dict[str, float]:
    """The reply metrics scoring the model a task was sent, before it trains (a deployment's
    per-client evaluation asks for them with ScoreKeys.ASK); the model's mode is restored."""
    training = model.training
    accuracy, loss, _ = holdout_score(cfg, partition, model)
    model.train(training)
    return {ScoreKeys.ACCURACY: accuracy, ScoreKeys.LOSS: loss}


@on_client_threads
def evaluate_task(
    cfg: RunConfig, partition: int, config: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """Score `arrays` on this client's own held-out split."""
    model, layout = client_model(cfg)
    set_flat(model, layout.flatten(dict(arrays)))
    accuracy, loss, samples = holdout_score(cfg, partition, model)
    return {
        ReplyKeys.TASK_ID: int(config[TaskKeys.TASK_ID]),
        ReplyKeys.PARTITION_ID: partition,
        ReplyKeys.NUM_EXAMPLES: samples,
        ReplyKeys.ACCURACY: accuracy,
        ReplyKeys.LOSS: loss,
    }
