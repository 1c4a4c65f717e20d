"""Run configuration: Flower's run config (kebab-case keys) turned into pydantic models.

Every key the app reads is a field here or in a strategy's own model; anything else is
refused. Errors surface as one `ConfigError` line naming the key, the value and the fix.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

DATASETS = ("fmnist", "mnist", "cifar10", "cifar100", "digits")
MODELS = ("auto", "linear", "cnn-mnist", "cnn-cifar", "mlp", "lenet")
LOSSES = ("cross-entropy", "mse")
METRICS = ("accuracy", "neg-mse")
_IDENTIFIER = r"[A-Za-z_]\w*"
REFERENCE = re.compile(rf"^{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*$")
DEFAULT_MODEL: dict[str, str] = {
    "fmnist": "linear",
    "mnist": "cnn-mnist",
    "cifar10": "cnn-cifar",
    "cifar100": "cnn-cifar",
    "digits": "mlp",
}
MODEL_DATASETS: dict[str, set[str]] = {
    "linear": {"fmnist", "mnist"},
    "cnn-mnist": {"fmnist", "mnist"},
    "cnn-cifar": {"cifar10", "cifar100"},
    "mlp": {"digits", "fmnist", "mnist"},
    "lenet": {"fmnist", "mnist", "cifar10", "cifar100"},
}
NUM_CLASSES: dict[str, int] = {
    "fmnist": 10,
    "mnist": 10,
    "cifar10": 10,
    "cifar100": 100,
    "digits": 10,
}
ModelT = TypeVar("ModelT", bound="KebabModel")
KEYS_HINT = "see [tool.flwr.app.config] of pyproject.toml for every key"
FIX_HINT = "fix it in [tool.flwr.app.config] of pyproject.toml or with --run-config"


def did_you_mean(key: str, known: Iterable[str], otherwise: str) -> str:
    """ "did you mean '<the closest known key>'?", or `otherwise` when none is close."""
    close = difflib.get_close_matches(key, list(known), n=1)
    return f"did you mean '{close[0]}'?" if close else otherwise


def metric_name(metric: str) -> str:
    """How a run's score is named in logs, tables and plots: the built-in metric, or a
    user's metric function by its name ("pkg.mod:r2" -> "r2")."""
    return metric.rsplit(":", 1)[-1]


def score_key(metric: str) -> str:
    """The key of a run's score in summary.json and metrics.jsonl: "accuracy" for accuracy
    (what every earlier run wrote), else the metric's name in snake case ("neg_mse")."""
    return metric_name(metric).replace("-", "_").replace(".", "_")


def score_label(metric: str, per_client: bool) -> str:
    """A plot's axis: "test accuracy", "mean client neg-mse", ..."""
    return f"{'mean client' if per_client else 'test'} {metric_name(metric)}"


def summary_score(summary: dict[str, Any], metric: str, which: str) -> float:
    """summary.json's "final" or "best" score of a run scored by `metric` (NaN: none)."""
    value = summary.get(f"{which}_{score_key(metric)}")
    return math.nan if value is None else float(value)


def score_words(summary: dict[str, Any], metric: str) -> str:
    """The run's scores as the closing lines say them: "final accuracy 0.8123, best 0.8200"."""
    final, best = (summary_score(summary, metric, which) for which in ("final", "best"))
    return f"final {metric_name(metric)} {final:.4f}, best {best:.4f}"


def score_row(row: dict[str, Any], metric: str) -> dict[str, Any]:
    """A metrics.jsonl row (scored as "accuracy" inside the engine) under the run's key."""
    key = score_key(metric)
    if key == "accuracy":
        return row
    renamed = {"accuracy": key, "accuracy_std": f"{key}_std"}
    return {renamed.get(k, k): v for k, v in row.items()}


class ConfigError(ValueError):
    """A run-config problem, phrased as one line a user can act on."""


class KebabModel(BaseModel):
    """Fields are read from kebab-case keys (`local-epochs` -> `local_epochs`). `renamed`:
    a key's old name -> its new one; the old name is read for a release, with one line
    naming the new key (`strategies.registry.with_new_names`)."""

    renamed: ClassVar[dict[str, str]] = {}

    model_config = ConfigDict(
        alias_generator=lambda name: name.replace("_", "-"),
        populate_by_name=True,
        extra="ignore",
        frozen=True,
    )

    @classmethod
    def keys(cls) -> set[str]:
        return {field.alias or name for name, field in cls.model_fields.items()}


# Who reads a RunConfig key, marked on its field (`json_schema_extra`); unmarked: the
# engine (the server's run: clock, budgets, DP, records, checkpoints). A rule's own keys
# are its Params. CLIENT: what every task asks of the client's local training (each is a
# TaskSpec field of the same name, carried in the task config). APP_ONLY: only fedstale's
# own app (its data, model, ClientApp and evaluation); a library user's ServerApp and
# ClientApp decide these themselves, so AsyncStrategy refuses them.
READERS = ("engine", "client", "app")
CLIENT: dict[str, Any] = {"reader": "client"}
APP_ONLY: dict[str, Any] = {"reader": "app"}


@cache  # read for every task the engine sends (RunConfig.client_training)
def _fields_read_by(model: type[KebabModel], reader: str) -> tuple[str, ...]:
    if reader not in READERS:
        raise ValueError(f"reader '{reader}' is not one of {READERS}")
    marks = {name: (f.json_schema_extra or {}) for name, f in model.model_fields.items()}
    return tuple(n for n, mark in marks.items() if mark.get("reader", "engine") == reader)


class RunSettings(KebabModel):
    """What the engine runs: the rule, the federation's size and pace, where results go,
    resuming, and how it talks to the nodes."""

    run_name: str = ""
    runs_dir: str = ""
    seed: int = Field(default=0, ge=0)
    loss: str = "cross-entropy"
    metric: str = "accuracy"
    num_clients: int = Field(default=50, ge=1)
    concurrency: int = Field(default=10, ge=1)
    lr_decay: float = Field(default=0.999, gt=0, le=1)
    server_step: Literal["spec", "client-lr"] = "spec"
    progress_interval: float = Field(default=5.0, gt=0)
    checkpoint_every: int = Field(default=20, ge=0)
    resume_from: str = ""
    overwrite: bool = False
    prefetch: bool = False
    node_partitions: Literal["ask", "assign"] = "ask"
    poll_interval: float = Field(default=0.02, gt=0, le=5)
    node_wait_seconds: float = Field(default=120.0, gt=0)
    task_ttl: float = Field(default=3600.0, gt=0)
    task_timeout: float = Field(default=900.0, ge=0)


class TrainingSettings(KebabModel):
    """What every task asks of the client's local training (each a `TaskSpec` field)."""

    local_epochs: int = Field(default=5, ge=1, json_schema_extra=CLIENT)
    batch_size: int = Field(default=64, ge=1, json_schema_extra=CLIENT)
    lr: float = Field(default=0.01, gt=0, json_schema_extra=CLIENT)  # decayed by the engine
    proximal_mu: float = Field(default=0.0, ge=0, json_schema_extra=CLIENT)
    optimizer: Literal["sgd", "adam"] = Field(default="sgd", json_schema_extra=CLIENT)
    momentum: float = Field(default=0.0, ge=0, lt=1, json_schema_extra=CLIENT)
    weight_decay: float = Field(default=0.0, ge=0, json_schema_extra=CLIENT)
    grad_clip: float = Field(default=0.0, ge=0, json_schema_extra=CLIENT)
    local_steps: int = Field(default=0, ge=0, json_schema_extra=CLIENT)

    def client_training(self) -> dict[str, Any]:
        """What every task asks of the client's training: field name -> value."""
        return {name: getattr(self, name) for name in _fields_read_by(type(self), "client")}


class PrivacySettings(KebabModel):
    """Central differential privacy (docs/privacy.md)."""

    dp_clipping: Literal["server", "client"] = "server"
    dp_noise_multiplier: float = Field(default=0.0, ge=0)
    dp_clipping_norm: float = Field(default=0.0, ge=0)
    dp_target_delta: float = Field(default=1e-5, gt=0, lt=1)
    dp_max_epsilon: float = Field(default=0.0, ge=0)
    dp_noise_seed: int = Field(default=-1, ge=-1)
    dp_accountant: Literal["rdp", "pld"] = "rdp"
    dp_max_rejections: int = Field(default=3, ge=1)
    dp_client_values: Literal["auto", "keep", "omit"] = "auto"
    dp_secure_noise: bool = False

    @property
    def clips(self) -> bool:
        """Central DP's clipping is on (`dp-clipping-norm` > 0); noise too when
        `dp-noise-multiplier` > 0."""
        return self.dp_clipping_norm > 0


class SecureSettings(KebabModel):
    """Secure aggregation of buffers (docs/privacy.md)."""

    secure_aggregation: bool = False
    secagg_privacy: int = Field(default=-1, ge=-1)  # T; -1: a third of the holders
    secagg_recovery: int = Field(default=0, ge=0)  # U; 0: all but a third of the holders
    secagg_clip_range: float = Field(default=0.0, ge=0)  # 0: dp-clipping-norm, else 1
    secagg_precision_bits: int = Field(default=16, ge=1, le=24)
    secagg_weight_bits: int = Field(default=10, ge=1, le=20)
    secagg_min_clients: int = Field(default=2, ge=2)
    # a holder's smallest W / largest
    secagg_min_weight_ratio: float = Field(default=0.0625, gt=0, le=1)
    secagg_wrong_answers: int = Field(default=1, ge=1)  # f: wrong answers a decode withstands
    secagg_timeout: float = Field(default=60.0, gt=0)


class LatencySettings(KebabModel):
    """How long each client's task takes on the clock."""

    latency: Literal["uniform", "long-tail", "slow-fraction", "proportional"] = "uniform"
    latency_min: float = Field(default=10.0, gt=0)
    latency_max: float = Field(default=500.0, gt=0)
    slow_fraction: float = Field(default=0.3, ge=0, le=1)
    slow_factor: float = Field(default=5.0, ge=1)
    latency_jitter: float = Field(default=0.0, ge=0, lt=1)
    latency_step_time: float = Field(default=1.0, gt=0)
    latency_network: float = Field(default=0.0, ge=0)


class BudgetSettings(KebabModel):
    """The clock, when the run stops on it (the first budget reached; 0: off), and how
    often it is scored."""

    clock: Literal["virtual", "wall"] = "virtual"
    max_virtual_time: float = Field(default=43200.0, ge=0)
    max_versions: int = Field(default=0, ge=0)
    max_updates: int = Field(default=0, ge=0)
    target_accuracy: float = Field(default=0.0, ge=0, le=1)
    max_wall_seconds: float = Field(default=0.0, ge=0)
    eval_interval: float = Field(default=1000.0, gt=0)


TRACKERS = ("mlflow", "tensorboard", "wandb")


class TrackingSettings(KebabModel):
    """Experiment trackers the run logs to as it goes (fedstale/server_app/tracking/)."""

    tracking: str = ""  # comma-separated: mlflow, tensorboard, wandb
    tracking_uri: str = ""  # MLflow's tracking URI; "": SQLite in the runs directory
    tracking_experiment: str = ""  # the MLflow experiment / W&B project; "": fedstale

    @field_validator("tracking")
    @classmethod
    def _known_trackers(cls, value: str) -> str:
        for name in tracker_names(value):
            if name not in TRACKERS:
                raise ValueError(f"unknown tracker '{name}'; choose from {', '.join(TRACKERS)}")
        return value


def tracker_names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


class AppSettings(KebabModel):
    """Only fedstale's own app reads these (its data, model, ClientApp and evaluation); a
    library user's ServerApp and ClientApp decide them, so the library refuses them."""

    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", json_schema_extra=APP_ONLY)
    dataset: str = Field(default="fmnist", json_schema_extra=APP_ONLY)
    data_dir: str = Field(default="", json_schema_extra=APP_ONLY)
    model: str = Field(default="auto", json_schema_extra=APP_ONLY)
    partition: Literal["iid", "dirichlet", "quantity-dirichlet", "pathological"] = Field(
        default="iid", json_schema_extra=APP_ONLY
    )
    dirichlet_alpha: float = Field(default=1.0, gt=0, json_schema_extra=APP_ONLY)
    dirichlet_convention: Literal["hsu", "per-class"] = Field(
        default="hsu", json_schema_extra=APP_ONLY
    )
    classes_per_client: int = Field(default=2, ge=1, json_schema_extra=APP_ONLY)
    test_split: Literal["standard", "holdout", "local"] = Field(
        default="standard", json_schema_extra=APP_ONLY
    )
    client_val_fraction: float = Field(default=0.1, ge=0, lt=1, json_schema_extra=APP_ONLY)
    client_threads: int = Field(default=1, ge=0, json_schema_extra=APP_ONLY)
    trainer: Literal["auto", "autograd", "cohort"] = Field(
        default="auto", json_schema_extra=APP_ONLY
    )
    eval_target: Literal["auto", "global", "per-client"] = Field(
        default="auto", json_schema_extra=APP_ONLY
    )
    eval_where: Literal["auto", "server", "clients"] = Field(
        default="auto", json_schema_extra=APP_ONLY
    )
    eval_batch_size: int = Field(default=1024, ge=1, json_schema_extra=APP_ONLY)
    # Test-only: "kind@task,..." makes clients corrupt those tasks' replies on purpose.
    test_faults: str = Field(default="", json_schema_extra=APP_ONLY)


class EngineSettings(
    RunSettings,
    TrainingSettings,
    PrivacySettings,
    SecureSettings,
    LatencySettings,
    BudgetSettings,
    TrackingSettings,
):
    """Every section but fedstale's own app's: what a library run takes too."""


class RunConfig(EngineSettings, AppSettings):
    """Every key shared by the rules (see pyproject.toml for their meaning), in sections: a
    component that reads one section takes that section's type (a RunConfig is each)."""

    strategy: str = "fedbuff"
    # `buffer-size` is the buffered rules' key (fedstale.strategies.buffer.BufferParams);
    # a rule written for an earlier fedstale reads it here until 0.2, with a warning
    _buffer_size: int = PrivateAttr(default=5)

    @classmethod
    def fields_read_by(cls, reader: str) -> tuple[str, ...]:
        """The field names whose reader (READERS) is `reader`, in declaration order."""
        return _fields_read_by(cls, reader)

    @classmethod
    def app_only_keys(cls) -> set[str]:
        """Keys only fedstale's own app reads; the library takes the rest and leaves these
        out of config.json."""
        return {cls.model_fields[n].alias or n for n in cls.fields_read_by("app")}

    @field_validator("dataset", "model", "loss", "metric")
    @classmethod
    def _named_or_reference(cls, value: str, info: ValidationInfo) -> str:
        return name_or_reference(info.field_name, value)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_buffer_size(
        cls, values: Any, handler: ModelWrapValidatorHandler[RunConfig]
    ) -> RunConfig:
        run = handler(values)
        given = (
            values.get("buffer-size", values.get("buffer_size"))
            if isinstance(values, Mapping)
            else None
        )
        if isinstance(given, int | str) and str(given).strip().isdigit():  # the rules check it
            run._buffer_size = int(given)
        return run

    @property
    def buffer_size(self) -> int:
        """Deprecated: a buffered rule declares `buffer-size` (BufferParams) and reads
        `self.params.buffer_size`; read here until fedstale 0.2."""
        warnings.warn(
            "run.buffer_size is deprecated: buffer-size is the buffered rules' key; derive "
            "your rule's Params from fedstale.strategies.buffer.BufferParams and read "
            "self.params.buffer_size (run.buffer_size is read until fedstale 0.2)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._buffer_size

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        _check_consistency(self)
        return self

    @property
    def secagg_range(self) -> float:
        """R, the range each coordinate of a masked delta is clipped to."""
        return self.secagg_clip_range or self.dp_clipping_norm or 1.0

    @property
    def faults(self) -> dict[int, str]:
        """Task id -> fault kind, from `test-faults`."""
        return parse_faults(self.test_faults)

    @property
    def model_name(self) -> str:
        """The model to build: `model`, or for `auto` the dataset's own (a user's dataset:
        mlp)."""
        if self.model != "auto":
            return self.model
        return "mlp" if is_reference(self.dataset) else DEFAULT_MODEL[self.dataset]

    @property
    def num_classes(self) -> int:
        """Classes of a built-in dataset (a user's dataset: known once loaded)."""
        return NUM_CLASSES[self.dataset]

    @property
    def own_code(self) -> bool:
        """The run names a user's model, dataset, loss or metric, or a non-default built-in
        loss or metric: what `fedstale check` tries on a batch before the run."""
        defaults = (self.loss, self.metric) == ("cross-entropy", "accuracy")
        own = is_reference(self.dataset) or is_reference(self.model)
        return not defaults or own or is_torchvision_name(self.model)


class RuleSettings(Protocol):
    """What a rule reads of the run (`Strategy.run`, `Strategy.check`): a `RunConfig` is
    one; a rule's own keys are its `Params`. A type checker holds a rule to these."""

    @property
    def strategy(self) -> str: ...
    @property
    def num_clients(self) -> int: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def prefetch(self) -> bool: ...
    @property
    def seed(self) -> int: ...
    @property
    def clips(self) -> bool: ...
    @property
    def lr(self) -> float: ...
    @property
    def lr_decay(self) -> float: ...
    @property
    def server_step(self) -> str: ...
    @property
    def momentum(self) -> float: ...
    @property
    def proximal_mu(self) -> float: ...
    @property
    def local_epochs(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def local_steps(self) -> int: ...


class ClientSettings(Protocol):
    """What fedstale's client side reads of the run (the ClientApp, the local transports,
    a task's data, model and scoring): a `RunConfig` is one. The task's training settings
    come in the task itself (`TaskSpec`)."""

    def __hash__(self) -> int: ...  # a process keeps one model per config (client_model)
    @property
    def dataset(self) -> str: ...
    @property
    def data_dir(self) -> str: ...
    @property
    def test_split(self) -> str: ...
    @property
    def partition(self) -> str: ...
    @property
    def dirichlet_alpha(self) -> float: ...
    @property
    def dirichlet_convention(self) -> str: ...
    @property
    def classes_per_client(self) -> int: ...
    @property
    def client_val_fraction(self) -> float: ...
    @property
    def num_clients(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def model_name(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def eval_batch_size(self) -> int: ...
    @property
    def loss(self) -> str: ...
    @property
    def metric(self) -> str: ...
    @property
    def client_threads(self) -> int: ...
    @property
    def trainer(self) -> str: ...
    @property
    def faults(self) -> dict[int, str]: ...
    @property
    def secure_aggregation(self) -> bool: ...


CHOICES = {"dataset": DATASETS, "model": MODELS, "loss": LOSSES, "metric": METRICS}
ROLES = {"dataset": "loader", "model": "factory", "loss": "function", "metric": "function"}


def is_reference(value: str) -> bool:
    """`value` has the form 'package.module:attribute' (a user's code)."""
    return bool(REFERENCE.match(value))


TORCHVISION_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def is_torchvision_name(model: str) -> bool:
    """`model` names a model of `torchvision.models` (checked when the model is built)."""
    return model not in MODELS and bool(TORCHVISION_NAME.match(model))


def torchvision_install() -> str:
    """The command that adds the torchvision made for the installed torch and leaves that
    torch alone (torchvision 0.<N + 15> goes with torch 2.<N>): `pip install
    'fedstale[vision]'` resolves the newest pair and can replace a CUDA torch."""
    try:
        installed = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "pip install 'fedstale[vision]'"
    major, minor = (int(part) for part in re.findall(r"\d+", installed)[:2])
    if major != 2:
        return f"pip install the torchvision made for your torch {installed}"
    return f"pip install 'torchvision==0.{minor + 15}.*' (the one for your torch {installed})"


def name_or_reference(key: str, value: str) -> str:
    """A built-in name of `key`, or a 'package.module:attribute' reference; for `model`,
    also a torchvision model's name where torchvision is installed (never imported here)."""
    if value in CHOICES[key] or is_reference(value):
        return value
    if key == "model" and is_torchvision_name(value):
        if importlib.util.find_spec("torchvision") is None:
            raise ValueError(
                f"model '{value}' is not fedstale's ({', '.join(MODELS)}), and torchvision, "
                f"whose models it may name, is not installed: {torchvision_install()}"
            )
        return value
    raise ValueError(
        f"unknown {key} '{value}'; choose one of {', '.join(CHOICES[key])} "
        f"or name your own {ROLES[key]} as 'package.module:{ROLES[key]}'"
    )


FAULT_KINDS = (
    "nan",
    "inf",
    "shape",
    "dtype",
    "unknown-task",
    "replay",
    "no-metric",
    "bad-metric",
    "mistyped-metric",
    "sketch-length",
    "oversized",
    "extra-set",
    "missing-set",
)


def parse_faults(text: str) -> dict[int, str]:
    faults: dict[int, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, task = item.partition("@")
        if kind not in FAULT_KINDS or not task.isdigit():
            raise ValueError(
                f"test-faults item '{item}' is not <kind>@<task id>, kind in {FAULT_KINDS}"
            )
        faults[int(task)] = kind
    return faults


def _check_consistency(cfg: RunConfig) -> None:
    parse_faults(cfg.test_faults)
    if cfg.latency_min > cfg.latency_max:
        raise ValueError(
            f"latency-min ({cfg.latency_min}) is above latency-max ({cfg.latency_max})"
        )
    if cfg.concurrency > cfg.num_clients:
        raise ValueError(
            f"concurrency ({cfg.concurrency}) exceeds num-clients ({cfg.num_clients}); "
            "a client never trains two tasks at once"
        )
    _check_task(cfg)
    if cfg.test_split == "local" and cfg.client_val_fraction <= 0:
        raise ValueError(
            "test-split=local tests every client on its own held-out share; "
            "set client-val-fraction above 0 (PACE's protocol: 0.25)"
        )
    _check_privacy(cfg)
    _check_secure(cfg)
    if cfg.prefetch and cfg.clock != "wall":
        raise ValueError("prefetch queues tasks on real nodes; it needs clock=wall")
    budgets = (
        cfg.max_virtual_time,
        cfg.max_versions,
        cfg.max_updates,
        cfg.target_accuracy,
        cfg.max_wall_seconds,
    )
    if not any(budgets):
        raise ValueError(
            "no budget set: give max-virtual-time, max-versions, max-updates, "
            "target-accuracy or max-wall-seconds a non-zero value"
        )


def _check_privacy(cfg: RunConfig) -> None:
    if cfg.dp_noise_multiplier > 0 and cfg.dp_clipping_norm <= 0:
        raise ValueError(
            "dp-noise-multiplier needs a clipping norm: set dp-clipping-norm > 0 (the largest "
            "L2 norm of one client's update; Flower's clipping_norm)"
        )
    if cfg.dp_max_epsilon > 0 and cfg.dp_noise_multiplier <= 0:
        raise ValueError("dp-max-epsilon needs noise: set dp-noise-multiplier > 0")
    omits = cfg.dp_client_values == "omit" or (
        cfg.dp_client_values == "auto" and cfg.dp_noise_multiplier > 0
    )
    if omits and cfg.eval_target == "per-client":
        raise ValueError(
            f"dp-client-values={cfg.dp_client_values} leaves out what the DP guarantee does "
            "not cover, and per-client evaluation scores the clients' own data: use "
            "eval-target=global, or dp-client-values=keep to keep values outside the guarantee"
        )
    if cfg.dp_secure_noise and cfg.dp_noise_multiplier <= 0:
        raise ValueError("dp-secure-noise draws noise: set dp-noise-multiplier > 0, or drop it")
    if cfg.dp_secure_noise and cfg.dp_noise_seed >= 0:
        raise ValueError(
            "dp-secure-noise makes the noise unpredictable and dp-noise-seed replayable: choose one"
        )
    if cfg.dp_noise_seed >= 0 and cfg.dp_noise_multiplier <= 0:
        raise ValueError("dp-noise-seed seeds noise: set dp-noise-multiplier > 0, or drop it")


def _check_secure(cfg: RunConfig) -> None:
    if not cfg.secure_aggregation:
        return
    if cfg.clips and cfg.dp_clipping == "server":
        raise ValueError(
            "secure-aggregation hides each update from the server, which cannot clip it: "
            "use dp-clipping=client (the ClientApp clips, e.g. Flower's fixedclipping_mod)"
        )
    if 0 < cfg.secagg_recovery <= cfg.secagg_privacy:
        raise ValueError(
            f"secagg-recovery {cfg.secagg_recovery} must exceed secagg-privacy "
            f"{cfg.secagg_privacy}: U holders recover a buffer, T learn nothing"
        )
    if cfg.trainer == "cohort":
        raise ValueError("secure-aggregation masks each task's reply: use trainer=auto")


def _check_task(cfg: RunConfig) -> None:
    """Model, dataset, loss and rule fit together (a user's dataset is checked once loaded:
    fedstale/common/usercode.py require_dataset)."""
    own_data, own_model = is_reference(cfg.dataset), is_reference(cfg.model)
    built_in = not (own_data or own_model or cfg.model == "auto" or is_torchvision_name(cfg.model))
    if built_in and cfg.dataset not in MODEL_DATASETS[cfg.model]:
        raise ValueError(f"model '{cfg.model}' does not fit dataset '{cfg.dataset}'")
    # A user's dataset has its classes counted once loaded.
    pathological = not own_data and cfg.partition == "pathological"
    if pathological and cfg.classes_per_client > cfg.num_classes:
        raise ValueError(
            f"classes-per-client ({cfg.classes_per_client}) exceeds the "
            f"{cfg.num_classes} classes of {cfg.dataset}"
        )


def describe_validation_error(err: ValidationError) -> str:
    """The first pydantic error as one line: key, value, what is wrong."""
    first = err.errors()[0]
    key = ".".join(str(part) for part in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if not key:
        return f"run config: {message}; {FIX_HINT}"
    return f"run config: '{key}' = {first.get('input')!r}: {message}; {FIX_HINT}"


def parse_model(model: type[ModelT], values: Mapping[str, Any]) -> ModelT:
    """Validate `values` into `model`, raising a one-line `ConfigError` on failure."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err)) from None


def parse_run_config(values: Mapping[str, Any]) -> RunConfig:
    """The shared part of the run config (what clients need); extra keys are ignored."""
    return parse_model(RunConfig, values)
