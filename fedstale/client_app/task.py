"""One training task of one client, free of Flower's message types: the ClientApp's train
handler wraps it, and local running (fedstale/launcher/local.py) calls it directly."""

from __future__ import annotations

import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from fedstale.client_app.faults import corrupt
from fedstale.common.cohort import (
    BatchedTerm,
    Member,
    cohort_train,
    said_alone,
    solo_reason,
    unbatched_terms,
)
from fedstale.common.config import ClientSettings
from fedstale.common.federation import FederationKey
from fedstale.common.layout import ParamLayout
from fedstale.common.models import evaluate, get_flat, set_flat
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
from fedstale.common.threads import limited, on_client_threads
from fedstale.strategies.client import ClientRule, LocalTask, rules_named
from fedstale.strategies.privacy import clip_to
from fedstale.strategies.registry import client_rules, cohort_rules

Arrays = dict[str, np.ndarray]


@cache
def client_model(cfg: ClientSettings) -> tuple[torch.nn.Module, ParamLayout]:
    """One model object per process and config, reloaded with each task's weights."""
    model = run_model(cfg)
    return model, ParamLayout.of(model)


Result = tuple[dict[str, Any], Arrays, dict[str, Arrays]]


def warm_up(cfg: ClientSettings) -> None:
    """What a process's first task would otherwise wait for: the model built and every
    client's training share loaded (both cached per process)."""
    client_model(cfg)
    key = FederationKey.of(cfg)
    for partition in range(cfg.num_clients):
        client_data(key, partition, "train")


@dataclass
class Prepared:
    """A task loaded and ready to train: its LocalTask (model loaded with the start), the
    client rules it runs (their `before` done), its start, the score of the start where
    asked, and when it began."""

    task: LocalTask
    rules: list[ClientRule]
    start: np.ndarray
    score: dict[str, float]
    started: float


@on_client_threads
def train_task(
    cfg: ClientSettings,
    partition: int,
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    sets: ArraySets | None = None,
    state: MutableMapping[str, np.ndarray] | None = None,
) -> Result:
    """Train from `arrays` as the task config says, running the strategy's client rules;
    returns (metrics, delta or model, other named array sets). `state` is the client's
    kept state, updated in place."""
    ready = prepare(cfg, partition, config, arrays, sets, state)
    loss = ready.task.train()  # with the optimiser settings a rule may have set
    return finish(ready, get_flat(ready.task.model), loss, state)


def prepare(
    cfg: ClientSettings,
    partition: int,
    config: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    sets: ArraySets | None,
    state: MutableMapping[str, np.ndarray] | None,
) -> Prepared:
    started = time.perf_counter()
    spec = TaskSpec.from_config(config)
    model, layout = client_model(cfg)
    start = layout.flatten(dict(arrays))
    set_flat(model, start)
    score = start_score(cfg, partition, model) if spec.extra.get(ScoreKeys.ASK) else {}
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in client_data(FederationKey.of(cfg), partition, "train"))
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
    return Prepared(task, rules, start, score, started)


def finish(
    ready: Prepared,
    trained: np.ndarray,
    loss: float,
    state: MutableMapping[str, np.ndarray] | None,
    compute_seconds: float | None = None,
) -> Result:
    """The reply of a trained task: its client rules' `after`, the delta clipped where the
    task says (central DP, client side), the kept state, the metrics."""
    task, spec, start = ready.task, ready.task.spec, ready.start
    delta = trained - start
    if CLIPPING_NORM in spec.extra:  # central DP with client-side clipping
        delta, _ = clip_to(delta, float(spec.extra[CLIPPING_NORM]))
        trained = start + delta
    set_flat(task.model, trained)
    for rule in ready.rules:
        rule.after(task, trained, delta)
    if state is not None:
        state.clear()
        state.update(task.state)
    metrics: dict[str, Any] = {
        ReplyKeys.TASK_ID: spec.task_id,
        ReplyKeys.PARTITION_ID: task.partition,
        ReplyKeys.NUM_EXAMPLES: len(task.y),
        ReplyKeys.TRAIN_LOSS: loss,
        **ready.score,
        **task.signals,
    }
    seconds = time.perf_counter() - ready.started if compute_seconds is None else compute_seconds
    metrics[ReplyKeys.COMPUTE_SECONDS] = seconds
    layout = task.layout
    result = layout.unflatten(delta if spec.returns == RETURN_DELTA else trained)
    outputs = {name: layout.unflatten(vector) for name, vector in task.outputs.items()}
    if spec.task_id in task.cfg.faults:
        return corrupt(task.cfg.faults[spec.task_id], metrics, result, outputs)
    return metrics, result, outputs


def holdout_score(
    cfg: ClientSettings, partition: int, model: torch.nn.Module
) -> tuple[float, float, int]:
    """(metric, mean loss, samples) of `model` on this client's own held-out split."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in client_holdout(FederationKey.of(cfg), partition))
    accuracy, loss = evaluate(model, x, y, cfg.eval_batch_size, objective(cfg.loss, cfg.metric))
    return accuracy, loss, len(y)


def start_score(cfg: ClientSettings, partition: int, model: torch.nn.Module) -> dict[str, float]:
    """The reply metrics scoring the model a task was sent, before it trains (a deployment's
    per-client evaluation asks for them with ScoreKeys.ASK); the model's mode is restored."""
    training = model.training
    accuracy, loss, _ = holdout_score(cfg, partition, model)
    model.train(training)
    return {ScoreKeys.ACCURACY: accuracy, ScoreKeys.LOSS: loss}


@on_client_threads
def evaluate_task(
    cfg: ClientSettings, partition: int, config: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
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


CohortJob = tuple[
    int, Mapping[str, Any], Mapping[str, np.ndarray], ArraySets | None, MutableMapping | None
]  # (partition, task config, arrays, sets, the client's kept state)
_noted: set[str] = set()  # why some tasks train alone, said once per process


RunJobs = tuple[ClientSettings, list[CohortJob]]  # one run's config and its tasks in a cohort
Together = tuple[int, int, Prepared, dict[str, torch.Tensor]]  # (run, job, ready, start params)


def train_cohort(cfg: ClientSettings, jobs: list[CohortJob]) -> list[Result]:
    """One run's cohort: several clients' tasks (at most one each), as `train_cohorts`."""
    return train_cohorts([(cfg, jobs)])[0]


def train_cohorts(batches: list[RunJobs]) -> list[list[Result]]:
    """The cohorts of several runs (a grid's, fedstale/launcher/inprocess.py), each run's
    tasks prepared under its own config: the tasks whose local training is plain minibatch
    SGD on cross-entropy train together, one batched computation per model architecture
    (fedstale/common/cohort.py), whichever run they belong to; any other trains alone, as
    `train_task` would, and the reason is logged once. A task is credited an equal share of
    its computation's time. On the first run's `client-threads`."""
    with limited(batches[0][0].client_threads):
        results: dict[tuple[int, int], Result] = {}
        groups: dict[tuple, list[Together]] = {}
        for run_index, (cfg, jobs) in enumerate(batches):
            for index, (partition, config, arrays, sets, state) in enumerate(jobs):
                ready = prepare(cfg, partition, config, arrays, sets, state)
                why = solo_reason(ready.task.spec, cfg.loss, cohort_rules())
                why = why or unbatched_terms(ready.task.loss_terms)
                if why:
                    said_alone(why, _noted)
                    loss = ready.task.train()
                    results[run_index, index] = finish(
                        ready, get_flat(ready.task.model), loss, state
                    )
                else:
                    params = {n: p.detach().clone() for n, p in ready.task.model.named_parameters()}
                    groups.setdefault(architecture(ready.task.model), []).append(
                        (run_index, index, ready, params)
                    )
        for together in groups.values():
            results.update(train_together(together, batches))
    return [[results[r, i] for i in range(len(jobs))] for r, (_, jobs) in enumerate(batches)]


def architecture(model: torch.nn.Module) -> tuple:
    """What tasks must share to train in one batched computation (one module's forward
    serves them all): the model's class and layers as it prints them, and its parameters'
    names, shapes, dtype and device."""
    params = list(model.named_parameters())
    shapes = tuple((name, tuple(p.shape), p.dtype, str(p.device)) for name, p in params)
    return type(model).__qualname__, repr(model), shapes


def train_together(
    together: list[Together], batches: list[RunJobs]
) -> dict[tuple[int, int], Result]:
    """Tasks of one architecture trained as one cohort; their results by (run, job)."""
    started = time.perf_counter()
    model = together[0][2].task.model
    trained = cohort_train(model, [member_of(ready, params) for *_, ready, params in together])
    share = (time.perf_counter() - started) / len(together)
    results = {}
    for (run_index, index, ready, _), (params, loss) in zip(together, trained, strict=True):
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
        state = batches[run_index][1][index][4]
        results[run_index, index] = finish(ready, get_flat(model), loss, state, share)
    return results


def member_of(ready: Prepared, params: dict[str, torch.Tensor]) -> Member:
    task, spec = ready.task, ready.task.spec
    return Member(
        params,
        task.x,
        task.y,
        spec.local_epochs,
        spec.batch_size,
        spec.lr,
        spec.seed,
        spec.proximal_mu,
        spec.local_steps,
        spec.momentum,
        spec.weight_decay,
        spec.grad_clip,
        tuple(term for term in task.loss_terms if isinstance(term, BatchedTerm)),
    )
