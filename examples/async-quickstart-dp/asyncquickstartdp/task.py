"""asyncquickstartdp: the model, the data and the training, as in Flower's PyTorch quickstart.

The data are scikit-learn's handwritten digits (8x8 images, 10 classes; they ship with
scikit-learn, nothing to download), split evenly among the nodes by partition id.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TEST_FRACTION = 0.2


class Net(nn.Module):
    """A small MLP: 64 pixels -> 64 hidden -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)


def _loader(x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
        batch_size=batch_size,
        shuffle=shuffle,
    )


def load_data(partition_id: int, num_partitions: int, batch_size: int) -> tuple[DataLoader, ...]:
    """This node's share of the training images: (train loader, test loader)."""
    x, y = _digits()
    cut = int(len(y) * (1 - TEST_FRACTION))
    train_idx = np.array_split(np.arange(cut), num_partitions)[partition_id]
    test_idx = np.array_split(np.arange(cut, len(y)), num_partitions)[partition_id]
    return (
        _loader(x[train_idx], y[train_idx], batch_size, shuffle=True),
        _loader(x[test_idx], y[test_idx], batch_size, shuffle=False),
    )


def load_centralized_dataset() -> DataLoader:
    """The held-out images, for the server's evaluation of the global model."""
    x, y = _digits()
    cut = int(len(y) * (1 - TEST_FRACTION))
    return _loader(x[cut:], y[cut:], 256, shuffle=False)


def train(net: Net, trainloader: DataLoader, epochs: int, lr: float, device: str) -> float:
    """Train the model on the training set; the mean training loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net: Net, testloader: DataLoader, device: str) -> tuple[float, float]:
    """Validate the model on the test set: (loss, accuracy)."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item() * len(labels)
            correct += (outputs.argmax(1) == labels.to(device)).sum().item()
    total = len(testloader.dataset)
    return loss / total, correct / total
