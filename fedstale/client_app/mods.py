"""Client halves of fedstale's rules for any Flower ClientApp, as Flower mods.

A rule that needs something from the client gets it from a mod the user adds in one
line, given their model factory (and data) where the signal is computed on the model:

    app = ClientApp(mods=[fedstale.fedpsa_mod(Net, input_shape=(1, 28, 28))])
    app = ClientApp(mods=[fedstale.fedqs_mod(Net, data_fn)])  # data_fn(context) -> (x, y)
    app = ClientApp(mods=[fedstale.mafsa_mod()])

The mod lets the user's train function run unchanged (MAFSA's calls it again on the stale
model; FedQS's sets the config's momentum before it) and adds the signal to its reply when
the task names the rule (the task config's `client-rules`); other messages pass through
untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedstale.common.models import output_width
from fedstale.common.records import flat, from_array_record, to_array_record
from fedstale.common.schema import ARRAYS, CONFIG, METRICS, STALE, TaskKeys, set_key
from fedstale.strategies.fedpsa import SensitivitySketch, sketch_signals
from fedstale.strategies.fedqs import ClassSpread, FedQSKeys, class_spread, spread_signals
from fedstale.strategies.mafsa import StaleTraining, stale_schedule


def names_rule(msg: Message, rule: str) -> bool:
    """Whether `msg` is a train task that asks for client rule `rule`."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return False
    config = msg.content.config_records.get(CONFIG)
    rules = str(config.get(TaskKeys.CLIENT_RULES, "")) if config is not None else ""
    return rule in rules.split(",")


def fedpsa_mod(model_fn: Callable[[], torch.nn.Module], input_shape: Sequence[int]) -> Mod:
    """FedPSA's client half (eq. 8, 11, 16): after the user's train function, the sketch
    of the trained model's sensitivity on the task's calibration batch and ||delta||^2 go
    into the reply's MetricRecord. `model_fn()` builds the user's model (the reply's arrays
    are loaded into it); `input_shape` is one sample's shape (the calibration batch's)."""
    shape = tuple(int(d) for d in input_shape)
    model = model_fn()
    model.eval()  # the mode its sketches are taken in
    num_classes = output_width(model, shape)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or not names_rule(msg, SensitivitySketch.name):
            return reply
        trained = reply.content.array_records[ARRAYS]
        model.load_state_dict(trained.to_torch_state_dict())
        names = list(trained)
        start = from_array_record(msg.content.array_records[ARRAYS])
        delta = flat(from_array_record(trained), names) - flat(start, names)
        config = msg.content.config_records[CONFIG]
        add_metrics(reply, sketch_signals(model, dict(config), shape, num_classes, delta))
        return reply

    return mod


def mafsa_mod() -> Mod:
    """MAFSA's client half (Alg. 2): a client back from E_i offline rounds trains its last
    local model (the task's "arrays.stale") E_i times more. After the user's train function
    ran on the fresh model, the mod calls it again once per offline round, on a copy of the
    message whose "arrays" is the stale model (then the previous round's result) and whose
    config's "lr" (and "seed") is that round's (`stale_schedule`); the last result goes
    into the reply as "arrays.stale". The train function must read its lr from
    msg.content["config"]["lr"], as Flower's quickstart does."""

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or not names_rule(msg, StaleTraining.name):
            return reply
        config = dict(msg.content.config_records[CONFIG])
        schedule = stale_schedule(config, int(config.get(TaskKeys.SEED, 0)))
        stale_key = set_key(STALE)
        if not schedule or stale_key not in msg.content.array_records:
            return reply
        stale = like(msg.content.array_records[stale_key], msg.content.array_records[ARRAYS])
        for lr, seed in schedule:
            offline = {**config, TaskKeys.LR: lr, TaskKeys.SEED: seed}
            trained = call_next(with_content(msg, stale, offline), context)
            if trained.has_error():
                return trained
            stale = trained.content.array_records[ARRAYS]
        reply.content[stale_key] = stale
        return reply

    return mod


def like(record: ArrayRecord, model: ArrayRecord) -> ArrayRecord:
    """`record`'s arrays in `model`'s dtypes (the server sends extra sets in float32)."""
    dtypes = {name: array.numpy().dtype for name, array in model.items()}
    arrays = from_array_record(record)
    return to_array_record({n: a.astype(dtypes.get(n, a.dtype)) for n, a in arrays.items()})


def with_content(msg: Message, arrays: ArrayRecord, config: dict[str, Any]) -> Message:
    """A copy of train message `msg` (same metadata, so a reply to it is well formed)
    carrying `arrays` and `config` instead."""
    content = RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord(config)})
    return Message(metadata=copy.copy(msg.metadata), content=content)


DataFn = Callable[[Context], tuple[torch.Tensor, torch.Tensor]]


def fedqs_mod(model_fn: Callable[[], torch.nn.Module], data_fn: DataFn) -> Mod:
    """FedQS's client half: before the user's train function, a slow, misaligned (SBC)
    task measures the received model's per-class accuracy spread on the node's training
    data, `data_fn(context) -> (x, y)`, in `model_fn()`'s model; a wide spread turns
    momentum off (else fedqs-m0). The chosen momentum goes into the config's "momentum"
    (a train function that ignores it trains without momentum, and the server is told
    the value set), and the reply's MetricRecord gets the flag, momentum and spread."""
    model = model_fn()

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not names_rule(msg, ClassSpread.name):
            return call_next(msg, context)
        config = msg.content.config_records[CONFIG]

        def spread() -> float:
            model.load_state_dict(msg.content.array_records[ARRAYS].to_torch_state_dict())
            x, y = data_fn(context)
            return class_spread(model, x, y.cpu())

        momentum = config.get(TaskKeys.MOMENTUM, 0.0)
        as_set = float(momentum) if isinstance(momentum, int | float) else 0.0
        signals = spread_signals(dict(config), as_set, spread)
        config[TaskKeys.MOMENTUM] = signals[FedQSKeys.MOMENTUM]
        reply = call_next(msg, context)
        if not reply.has_error():
            add_metrics(reply, signals)
        return reply

    return mod


def add_metrics(reply: Message, signals: dict[str, Any]) -> None:
    metrics = reply.content.metric_records.get(METRICS, MetricRecord())
    metrics.update(signals)
    reply.content.metric_records[METRICS] = metrics
