"""Client halves of fedstale's rules for any Flower ClientApp, as Flower mods.

A rule that needs a signal from the client (FedPSA's sketch) gets it from a mod the user
adds in one line, given their model factory where the signal is computed on the model:

    app = ClientApp(mods=[fedstale.fedpsa_mod(Net, input_shape=(1, 28, 28))])

The mod lets the user's train function run unchanged and adds the signal to its reply
when the task names the rule (the task config's `client-rules`); other messages pass
through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedstale.common.records import from_array_record
from fedstale.common.schema import ARRAYS, CONFIG, METRICS, TaskKeys
from fedstale.strategies.fedpsa import SensitivitySketch, sketch_signals


def names_rule(msg: Message, rule: str) -> bool:
    """Whether `msg` is a train task that asks for client rule `rule`."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return False
    config = msg.content.config_records.get(CONFIG)
    rules = str(config.get(TaskKeys.CLIENT_RULES, "")) if config is not None else ""
    return rule in rules.split(",")


def flat(record: ArrayRecord, names: Sequence[str]) -> np.ndarray:
    arrays = from_array_record(record)
    return np.concatenate([np.asarray(arrays[n], np.float64).ravel() for n in names])


def fedpsa_mod(model_fn: Callable[[], torch.nn.Module], input_shape: Sequence[int]) -> Mod:
    """FedPSA's client half (eq. 8, 11, 16): after the user's train function, the sketch
    of the trained model's sensitivity on the task's calibration batch and ||delta||^2 go
    into the reply's MetricRecord. `model_fn()` builds the user's model (the reply's arrays
    are loaded into it); `input_shape` is one sample's shape (the calibration batch's)."""
    shape = tuple(int(d) for d in input_shape)
    model = model_fn()
    with torch.no_grad():
        model.eval()
        num_classes = int(model(torch.zeros(1, *shape)).shape[-1])

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or not names_rule(msg, SensitivitySketch.name):
            return reply
        trained = reply.content.array_records[ARRAYS]
        model.load_state_dict(trained.to_torch_state_dict())
        names = list(trained)
        delta = flat(trained, names) - flat(msg.content.array_records[ARRAYS], names)
        config = msg.content.config_records[CONFIG]
        signals = sketch_signals(model, dict(config), shape, num_classes, delta)
        metrics = reply.content.metric_records.get(METRICS, MetricRecord())
        metrics.update(signals)
        reply.content.metric_records[METRICS] = metrics
        return reply

    return mod
