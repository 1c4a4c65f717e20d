"""asyncfedpsa: a small CNN on scikit-learn's 8x8 digits, split by label skew."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

INPUT_SHAPE = (1, 8, 8)  # one sample: what FedPSA's calibration batch is made of
HELD_OUT = 300


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, *INPUT_SHAPE)
    return images, torch.tensor(y)


def node_data(partition_id: int, num_partitions: int, alpha: float) -> tuple[torch.Tensor, ...]:
    """This node's images: for each class, a Dirichlet(alpha) share over the nodes (seed 0)."""
    x, y = digits()
    x, y = x[HELD_OUT:], y[HELD_OUT:]
    rng = np.random.default_rng(0)
    mine = []
    for label in range(10):
        idx = np.flatnonzero(y.numpy() == label)
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_partitions)) * len(idx)).astype(int)
        mine.append(np.split(idx, cuts[:-1])[partition_id])
    chosen = torch.from_numpy(np.concatenate(mine))
    return x[chosen], y[chosen]


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = digits()
    return x[:HELD_OUT], y[:HELD_OUT]


def fit(net: Net, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, batch: int) -> float:
    """Plain SGD on (x, y); the last epoch's mean loss."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    losses = []
    for _ in range(epochs):
        losses = []
        for rows in torch.randperm(len(y)).split(batch):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[rows]), y[rows])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return float(np.mean(losses)) if losses else 0.0


def score(net: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of `net` on (x, y)."""
    net.eval()
    with torch.no_grad():
        logits = net(x)
    loss = nn.functional.cross_entropy(logits, y).item()
    return loss, (logits.argmax(1) == y).float().mean().item()
