"""What refuses a run before it starts because of its dataset or a user's own code: the
dataset loads, and a user's partition, model, loss and metric work on two samples."""

from __future__ import annotations

import numbers

import torch

from fedstale.common.config import ConfigError, RunConfig
from fedstale.common.data import Dataset, DatasetUnavailable, load_dataset, normalize
from fedstale.common.federation import FederationKey, build_federation
from fedstale.common.models import build_model
from fedstale.common.objectives import objective, target_problem
from fedstale.common.partition import label_problem
from fedstale.common.references import call


def require_dataset(cfg: RunConfig) -> None:
    """The run's dataset loads (found, or downloaded and checked) and, when the run names
    code of its own or a non-default loss or metric (`RunConfig.own_code`), the partition,
    model, loss and metric work on two training samples; or one ConfigError line."""
    try:
        data = load_dataset(cfg.dataset, cfg.data_dir)
    except ConfigError:
        raise
    except (DatasetUnavailable, ValueError, OSError) as err:
        raise ConfigError(f"dataset '{cfg.dataset}': {err}") from None
    if cfg.own_code:
        _check_labels(cfg, data)
        _try_batch(cfg, data)
    if cfg.partition == "dirichlet" and cfg.dirichlet_convention == "per-class":
        build_federation(FederationKey.of(cfg))  # the one partition that can refuse a seed


def _check_labels(cfg: RunConfig, data: Dataset) -> None:
    problem = label_problem(cfg.partition, data.y_train) or target_problem(
        cfg.loss, cfg.metric, data.regression
    )
    pathological = cfg.partition == "pathological"
    if not problem and pathological and cfg.classes_per_client > data.num_classes:
        problem = (
            f"classes-per-client ({cfg.classes_per_client}) exceeds its {data.num_classes} classes"
        )
    if problem:
        raise ConfigError(f"dataset={cfg.dataset}: {problem}")


def _try_batch(cfg: RunConfig, data: Dataset) -> None:
    """The model's output on two training samples, the loss and the metric on it, each of
    the type the contract names (docs/running.md, 'Your own model and data')."""
    scoring = objective(cfg.loss, cfg.metric)
    model = build_model(cfg.model_name, data.input_shape, data.num_classes, cfg.seed)
    x = torch.from_numpy(normalize(data.x_train[:2], cfg.dataset))
    y = torch.from_numpy(data.y_train[:2])
    output = call("model", cfg.model_name, model, x)
    if not isinstance(output, torch.Tensor) or output.ndim < 1 or len(output) != len(y):
        raise ConfigError(
            f"model={cfg.model_name}: its output for a batch of {len(y)} is "
            f"{_described(output)}; expected a tensor with {len(y)} rows"
        )
    loss = call("loss", cfg.loss, scoring.loss, output, y)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ConfigError(
            f"loss={cfg.loss}: returned {_described(loss)}; expected a scalar torch.Tensor "
            "that autograd can differentiate (the batch's mean loss)"
        )
    with torch.no_grad():
        score = call("metric", cfg.metric, scoring.metric, output.detach(), y)
    if not _is_number(score):
        raise ConfigError(
            f"metric={cfg.metric}: returned {_described(score)}; expected a float "
            "(higher is better)"
        )


def _is_number(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
