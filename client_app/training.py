"""Local training: E epochs of minibatch SGD, optionally with a proximal term.

The same function serves the ClientApp and the bare-PyTorch reference in bench/.
"""

from __future__ import annotations

import torch
from torch import nn


def local_train(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    proximal_mu: float = 0.0,
) -> float:
    """Train `model` in place; returns the mean minibatch loss (cross-entropy, without the
    proximal term) of the last epoch."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    model.train()
    last_epoch_loss = 0.0
    for _ in range(epochs):
        total, batches = 0.0, 0
        for idx in torch.randperm(len(y), generator=generator).split(batch_size):
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # Gradient of mu/2 ||w - w_start||^2, added directly (cheaper than autograd).
            for param, start in zip(model.parameters(), anchor, strict=False):
                param.grad.add_(param.detach() - start, alpha=proximal_mu)
            optimizer.step()
            total += float(loss.detach())
            batches += 1
        last_epoch_loss = total / max(batches, 1)
    return last_epoch_loss
