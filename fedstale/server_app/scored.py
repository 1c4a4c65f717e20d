"""One evaluation of a run (a metrics.jsonl row) and the scorers that make it; shared by
the engine's scoreboard (evaluation.py) and the clients' reports (reports.py)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

Evaluator = Callable[[np.ndarray], tuple[float, float]]  # global model -> (accuracy, loss)
ClientScorer = Callable[[int, np.ndarray], tuple[float, float]]  # client, model -> same


@dataclass
class Evaluation:
    virtual_time: float
    wall_time: float
    version: int
    accuracy: float
    loss: float
    updates: int
    accuracy_std: float | None = None  # per-client evaluation only
    loss_std: float | None = None
    clients: int | None = None
    from_train_replies: int | None = None  # per-client evaluation by message only
    oldest_version: int | None = None

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def over_clients(evaluation: Evaluation, scores: list[tuple[float, float]]) -> Evaluation:
    """Fill in the unweighted mean and the population std over clients."""
    accuracies = np.array([a for a, _ in scores], dtype=np.float64)
    losses = np.array([loss for _, loss in scores], dtype=np.float64)
    evaluation.accuracy = float(accuracies.mean()) if scores else math.nan
    evaluation.loss = float(losses.mean()) if scores else math.nan
    evaluation.accuracy_std = float(accuracies.std()) if scores else math.nan
    evaluation.loss_std = float(losses.std()) if scores else math.nan
    evaluation.clients = len(scores)
    return evaluation


__all__ = ["ClientScorer", "Evaluation", "Evaluator", "over_clients"]
