"""Every key that travels between the ServerApp and the ClientApps, and their validation.

Server -> client: ConfigRecord `config` (TaskKeys) and ArrayRecord `arrays` (the model the
client starts from, state-dict names), plus any other named set under `arrays.<name>`.
Client -> server: ArrayRecord `arrays` (delta or model, as the task asks), the named sets
the strategy asks for under `arrays.<name>`, and MetricRecord `metrics` (ReplyKeys plus
strategy signals). A `query` message asks a node which client (partition) it serves; a
node that cannot say answers with a ConfigRecord `config` holding `problem`. An `evaluate`
message scores the model it carries on the node's own held-out split. On a real
deployment with per-client evaluation a train message may ask (ScoreKeys.ASK) for the same
score of the model it carries, taken before training and sent back in the train reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CONFIG = "config"
ARRAYS = "arrays"
STALE = "stale"  # MAFSA: the named array set of a returning client's last local model
METRICS = "metrics"
# trainer=cohort in simulation: one message carries several tasks (a reply their replies),
# each part's records under "<i>/<key>", their count in this ConfigRecord
COHORT = "cohort"
COHORT_SIZE = "size"

MSG_TRAIN = "train"
MSG_EVALUATE = "evaluate"
MSG_QUERY = "query"
MSG_COHORT = "train.cohort"  # the ClientApp's train handler for a cohort of tasks

RETURN_DELTA = "delta"
RETURN_MODEL = "model"
OPTIMIZERS = ("sgd", "adam")


def set_key(name: str) -> str:
    """The RecordDict key of a named array set other than the main one."""
    return f"{ARRAYS}.{name}"


def set_name(key: str) -> str | None:
    """The set name behind a RecordDict key, or None when it is not an extra array set."""
    prefix = f"{ARRAYS}."
    return key[len(prefix) :] if key.startswith(prefix) else None


# The partition a message's node serves it for, where the server assigns partitions
# (node-partitions=assign): every train and evaluate message names it.
ASSIGNED_PARTITION = "partition-id"

# Flower's task-config key for the clipping norm (flwr.supercore.differential_privacy): its
# fixedclipping_mod reads it, and so does fedstale's ClientApp.
CLIPPING_NORM = "clipping_norm"


class TaskKeys:
    TASK_ID = "task-id"
    VERSION = "version"
    LR = "lr"
    EPOCHS = "local-epochs"
    BATCH_SIZE = "batch-size"
    SEED = "seed"
    RETURN = "return"
    PROXIMAL_MU = "proximal-mu"
    MOMENTUM = "momentum"
    WEIGHT_DECAY = "weight-decay"
    GRAD_CLIP = "grad-clip"
    LOCAL_STEPS = "local-steps"  # > 0: this many minibatch steps instead of epochs
    OPTIMIZER = "optimizer"
    CLIENT_RULES = "client-rules"  # the strategy's client rules, comma-separated ("" none)


class ReplyKeys:
    TASK_ID = "task-id"
    PARTITION_ID = "partition-id"
    EDGE_ID = "edge-id"  # query reply: the edge a SuperNode names (node config), if any
    NUM_EXAMPLES = "num-examples"
    TRAIN_LOSS = "train-loss"
    COMPUTE_SECONDS = "compute-seconds"
    ACCURACY = "accuracy"
    LOSS = "loss"
    PROBLEM = "problem"  # ConfigRecord entry of a query reply from a misconfigured node


class ScoreKeys:
    """Per-client evaluation carried by train messages (a real deployment): the task asks
    the client to score the model it was sent on its own held-out split before it trains;
    the reply's metrics carry that score."""

    ASK = "score-start"  # task config: 1 asks for the score
    ACCURACY = "start-accuracy"  # reply: the metric (accuracy) of the model as sent
    LOSS = "start-loss"  # reply: its mean loss


def keys_of(holder: type) -> tuple[str, ...]:
    """The key strings a class of key constants holds (its upper-case attributes)."""
    return tuple(v for k, v in vars(holder).items() if k.isupper())


def common_keys() -> frozenset[str]:
    """The keys every task and reply may carry, whatever its rule: no rule's own key
    (`Rule.wire`) may be one of them."""
    held = (TaskKeys, ReplyKeys, ScoreKeys)
    return frozenset({k for h in held for k in keys_of(h)} | {ASSIGNED_PARTITION, CLIPPING_NORM})


class InvalidReply(ValueError):
    """A client reply that must not reach the strategy; the message is the reason."""


@dataclass(frozen=True)
class TaskSpec:
    """What one task asks of a client."""

    task_id: int
    version: int
    lr: float
    local_epochs: int
    batch_size: int
    seed: int
    returns: str = RETURN_DELTA
    proximal_mu: float = 0.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    local_steps: int = 0
    optimizer: str = "sgd"
    rules: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def to_config(self) -> dict[str, Any]:
        return {
            TaskKeys.TASK_ID: self.task_id,
            TaskKeys.VERSION: self.version,
            TaskKeys.LR: float(self.lr),
            TaskKeys.EPOCHS: self.local_epochs,
            TaskKeys.BATCH_SIZE: self.batch_size,
            TaskKeys.SEED: self.seed,
            TaskKeys.RETURN: self.returns,
            TaskKeys.PROXIMAL_MU: float(self.proximal_mu),
            TaskKeys.MOMENTUM: float(self.momentum),
            TaskKeys.WEIGHT_DECAY: float(self.weight_decay),
            TaskKeys.GRAD_CLIP: float(self.grad_clip),
            TaskKeys.LOCAL_STEPS: int(self.local_steps),
            TaskKeys.OPTIMIZER: self.optimizer,
            TaskKeys.CLIENT_RULES: ",".join(self.rules),
            **self.extra,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TaskSpec:
        known = set(keys_of(TaskKeys))
        missing = known - set(config)
        if missing:
            raise InvalidReply(f"task config lacks {sorted(missing)}")
        returns = str(config[TaskKeys.RETURN])
        if returns not in (RETURN_DELTA, RETURN_MODEL):
            raise InvalidReply(f"task asks to return '{returns}'")
        optimizer = str(config[TaskKeys.OPTIMIZER])
        if optimizer not in OPTIMIZERS:
            raise InvalidReply(f"task asks for optimizer '{optimizer}'")
        return cls(
            task_id=int(config[TaskKeys.TASK_ID]),
            version=int(config[TaskKeys.VERSION]),
            lr=float(config[TaskKeys.LR]),
            local_epochs=int(config[TaskKeys.EPOCHS]),
            batch_size=int(config[TaskKeys.BATCH_SIZE]),
            seed=int(config[TaskKeys.SEED]),
            returns=returns,
            proximal_mu=float(config[TaskKeys.PROXIMAL_MU]),
            momentum=float(config[TaskKeys.MOMENTUM]),
            weight_decay=float(config[TaskKeys.WEIGHT_DECAY]),
            grad_clip=float(config[TaskKeys.GRAD_CLIP]),
            local_steps=int(config[TaskKeys.LOCAL_STEPS]),
            optimizer=optimizer,
            rules=tuple(n for n in str(config[TaskKeys.CLIENT_RULES]).split(",") if n),
            extra={k: v for k, v in config.items() if k not in known},
        )


@dataclass(frozen=True)
class SignalSpec:
    """A strategy signal a client must send: a float, or a list of `length` floats."""

    length: int = 0


@dataclass(frozen=True)
class TrainReply:
    task_id: int
    partition_id: int
    num_examples: int
    train_loss: float
    compute_seconds: float
    signals: dict[str, Any]


def _require_int(metrics: Mapping[str, Any], key: str, minimum: int) -> int:
    if key not in metrics:
        raise InvalidReply(f"metric '{key}' missing")
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidReply(f"metric '{key}' is {type(value).__name__}, expected int")
    if value < minimum:
        raise InvalidReply(f"metric '{key}' = {value} is below {minimum}")
    return value


def _require_float(metrics: Mapping[str, Any], key: str) -> float:
    if key not in metrics:
        raise InvalidReply(f"metric '{key}' missing")
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidReply(f"metric '{key}' is {type(value).__name__}, expected float")
    if not np.isfinite(value):
        raise InvalidReply(f"metric '{key}' is not finite")
    return float(value)


def _require_signal(metrics: Mapping[str, Any], key: str, spec: SignalSpec) -> Any:
    if spec.length == 0:
        return _require_float(metrics, key)
    value = metrics.get(key)
    if not isinstance(value, list) or len(value) != spec.length:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise InvalidReply(f"signal '{key}' should be {spec.length} floats, got {got}")
    array = np.asarray(value, dtype=np.float64)
    if not np.isfinite(array).all():
        raise InvalidReply(f"signal '{key}' is not finite")
    return array


def parse_train_metrics(
    metrics: Mapping[str, Any], signals: Mapping[str, SignalSpec] | None = None
) -> TrainReply:
    """Validate a train reply's MetricRecord; raises InvalidReply naming the first fault."""
    return TrainReply(
        task_id=_require_int(metrics, ReplyKeys.TASK_ID, 0),
        partition_id=_require_int(metrics, ReplyKeys.PARTITION_ID, 0),
        num_examples=_require_int(metrics, ReplyKeys.NUM_EXAMPLES, 1),
        train_loss=_require_float(metrics, ReplyKeys.TRAIN_LOSS),
        compute_seconds=_require_float(metrics, ReplyKeys.COMPUTE_SECONDS),
        signals=parse_signals(metrics, signals),
    )


def parse_signals(
    metrics: Mapping[str, Any], signals: Mapping[str, SignalSpec] | None
) -> dict[str, Any]:
    """The strategy signals a train reply carries, each checked against its spec."""
    return {k: _require_signal(metrics, k, s) for k, s in (signals or {}).items()}


def check_arrays(
    arrays: Mapping[str, np.ndarray],
    names: tuple[str, ...],
    shapes: tuple[tuple[int, ...], ...],
) -> None:
    """Names, shapes and dtypes must match the model's exactly; every value finite."""
    if tuple(arrays) != names:
        unexpected = sorted(set(arrays) - set(names))
        missing = sorted(set(names) - set(arrays))
        raise InvalidReply(f"array names differ (missing {missing}, unexpected {unexpected})")
    for (name, array), shape in zip(arrays.items(), shapes, strict=True):
        if array.dtype != np.float32:
            raise InvalidReply(f"array '{name}' has dtype {array.dtype}, expected float32")
        if tuple(array.shape) != shape:
            raise InvalidReply(f"array '{name}' has shape {tuple(array.shape)}, expected {shape}")
        if not np.isfinite(array).all():
            raise InvalidReply(f"array '{name}' holds NaN or Inf")


def _require_accuracy(metrics: Mapping[str, Any], key: str, bounded: bool) -> float:
    """The score under `key`; in [0, 1] when `bounded` (the run's metric is `accuracy`; a
    regression's `neg-mse` or a user's own metric is any finite number)."""
    accuracy = _require_float(metrics, key)
    if bounded and not 0.0 <= accuracy <= 1.0:
        raise InvalidReply(f"metric '{key}' = {accuracy} is outside [0, 1]")
    return accuracy


def parse_start_score(
    metrics: Mapping[str, Any], bounded: bool = True
) -> tuple[float, float] | None:
    """The (accuracy, loss) a train reply reports for the model it was sent, None when it
    reports none; raises InvalidReply when the score is there but does not hold up
    (`bounded`: the accuracy must be in [0, 1])."""
    if ScoreKeys.ACCURACY not in metrics and ScoreKeys.LOSS not in metrics:
        return None
    accuracy = _require_accuracy(metrics, ScoreKeys.ACCURACY, bounded)
    return accuracy, _require_float(metrics, ScoreKeys.LOSS)


def parse_eval_metrics(metrics: Mapping[str, Any], bounded: bool = True) -> dict[str, Any]:
    """Validate an evaluate reply's MetricRecord; raises InvalidReply naming the first fault
    (`bounded`: the accuracy must be in [0, 1])."""
    accuracy = _require_accuracy(metrics, ReplyKeys.ACCURACY, bounded)
    return {
        ReplyKeys.TASK_ID: _require_int(metrics, ReplyKeys.TASK_ID, 0),
        ReplyKeys.PARTITION_ID: _require_int(metrics, ReplyKeys.PARTITION_ID, 0),
        ReplyKeys.NUM_EXAMPLES: _require_int(metrics, ReplyKeys.NUM_EXAMPLES, 0),
        ReplyKeys.ACCURACY: accuracy,
        ReplyKeys.LOSS: _require_float(metrics, ReplyKeys.LOSS),
    }
