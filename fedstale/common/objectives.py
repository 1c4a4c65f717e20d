"""What local training minimises (`loss`) and what evaluation reports (`metric`): built-in
names or a user's 'package.module:function'.

- loss(output, target) -> a scalar tensor: the batch's mean loss (autograd flows through it).
- metric(output, target) -> a float over a whole split, higher is better: it is what
  metrics.jsonl, summary.json and `target-accuracy` call accuracy.

`output` is the model's output for a batch, `target` the labels as the dataset gives them
(int64 class labels, or float32 regression targets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from fedstale.common.references import is_reference, resolve

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MetricFn = Callable[[torch.Tensor, torch.Tensor], float]
SumFn = Callable[[torch.Tensor, torch.Tensor], float]


def as_target(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A regression model's (B, 1) output seen as (B,) targets' shape."""
    return output.reshape(target.shape) if output.numel() == target.numel() else output


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(as_target(output, target), target)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    return int((output.argmax(1) == target).sum()) / len(target)


def neg_mse(output: torch.Tensor, target: torch.Tensor) -> float:
    return -float(nn.functional.mse_loss(as_target(output, target), target))


def summed_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(output, target, reduction="sum"))


LOSSES: dict[str, LossFn] = {"cross-entropy": nn.functional.cross_entropy, "mse": mse}
METRICS: dict[str, MetricFn] = {"accuracy": accuracy, "neg-mse": neg_mse}
CLASS_LOSSES = {"cross-entropy"}  # built-ins that need integer class labels
CLASS_METRICS = {"accuracy"}
CROSS_ENTROPY = "cross-entropy"


@dataclass(frozen=True)
class Objective:
    """A run's loss and metric, resolved."""

    loss: LossFn
    metric: MetricFn

    @property
    def closed_form(self) -> bool:
        """The loss is the one the linear model's closed-form trainer computes."""
        return self.loss is nn.functional.cross_entropy

    def summed_loss(self, output: torch.Tensor, target: torch.Tensor) -> float:
        """The batch's loss summed over its samples (for a mean over a whole split)."""
        if self.closed_form:
            return summed_cross_entropy(output, target)
        return float(self.loss(output, target)) * len(target)


def target_problem(loss: str, metric: str, regression: bool) -> str:
    """Why a built-in `loss` or `metric` does not fit the dataset's labels, or ""."""
    for key, name, for_classes in (
        ("loss", loss, CLASS_LOSSES),
        ("metric", metric, CLASS_METRICS),
    ):
        if is_reference(name):
            continue
        if regression and name in for_classes:
            return (
                f"{key}={name} needs integer class labels and the dataset gives float "
                "targets; use loss=mse metric=neg-mse (or your own)"
            )
        if not regression and name not in for_classes:
            return (
                f"{key}={name} needs float targets and the dataset gives integer class "
                "labels; use loss=cross-entropy metric=accuracy (or your own)"
            )
    return ""


def _named(key: str, name: str, builtins: dict) -> Callable:
    return resolve(key, name) if is_reference(name) else builtins[name]


@cache
def objective(loss: str = CROSS_ENTROPY, metric: str = "accuracy") -> Objective:
    """The run's `loss` and `metric` (names validated by RunConfig); an import problem is
    one ConfigError line."""
    return Objective(_named("loss", loss, LOSSES), _named("metric", metric, METRICS))
