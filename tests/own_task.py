"""A user's own task, as docs/running.md ('Your own model and data') describes it: tests
copy this file outside the repository and name its functions in the run config
(`dataset=own_task:blobs model=own_task:net`, ...). Nothing here imports fedstale."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def blobs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Classification: 3 Gaussian blobs in 8 dimensions; 480 training, 120 test samples."""
    rng = np.random.default_rng(0)
    centres = rng.normal(0.0, 1.5, (3, 8))
    labels = rng.integers(0, 3, 600)
    points = (centres[labels] + rng.normal(0.0, 1.0, (600, 8))).astype(np.float32)
    return points[:480], labels[:480], points[480:], labels[480:]


class Net(nn.Module):
    def __init__(self, input_shape: tuple[int, ...], num_outputs: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(int(np.prod(input_shape)), 16)
        self.out = nn.Linear(16, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x.flatten(1))))


def net(input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """The factory: called with the data's input shape and the number of outputs."""
    return Net(input_shape, num_outputs)


def line() -> tuple[np.ndarray, np.ndarray, None, None]:
    """Regression: y = x . w + 0.5 + noise, float targets, no test split of its own (the
    run then holds out 10%)."""
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 1.0, (400, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.5 + rng.normal(0.0, 0.1, 400)).astype(np.float32)
    return x, y, None, None


def linear() -> nn.Module:
    """A factory that takes no arguments."""
    return nn.Linear(4, 1)


def neg_mae(output: torch.Tensor, target: torch.Tensor) -> float:
    """A metric: minus the mean absolute error (higher is better)."""
    return -float((output.reshape(target.shape) - target).abs().mean())
