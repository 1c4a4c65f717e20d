"""Local training: E epochs of minibatch SGD, optionally with a proximal term.

The same function serves the ClientApp and the bare-PyTorch reference in bench/.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.models import LinearModel, softmax_residual


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
    closed_form: bool = True,
) -> float:
    """Train `model` in place; returns the mean minibatch loss (cross-entropy, without the
    proximal term) of the last epoch. Batches come from one seeded permutation per epoch.
    `closed_form` lets the linear model on CPU skip autograd (same SGD, tested)."""
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randperm(len(y), generator=generator).split(batch_size) for _ in range(epochs)]
    if closed_form and isinstance(model, LinearModel) and x.device.type == "cpu":
        return sgd_softmax_regression(model, x, y, batches, lr, proximal_mu)
    return sgd_autograd(model, x, y, batches, lr, proximal_mu)


def sgd_autograd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: list[tuple[torch.Tensor, ...]],
    lr: float,
    proximal_mu: float,
) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    model.train()
    last_epoch_loss = 0.0
    for epoch in batches:
        total = 0.0
        for idx in epoch:
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # Gradient of mu/2 ||w - w_start||^2, added directly (cheaper than autograd).
            for param, start in zip(model.parameters(), anchor, strict=False):
                param.grad.add_(param.detach() - start, alpha=proximal_mu)
            optimizer.step()
            total += float(loss.detach())
        last_epoch_loss = total / max(len(epoch), 1)
    return last_epoch_loss


def sgd_softmax_regression(
    model: LinearModel,
    x: torch.Tensor,
    y: torch.Tensor,
    batches: list[tuple[torch.Tensor, ...]],
    lr: float,
    proximal_mu: float,
) -> float:
    """The same SGD as `sgd_autograd` for the paper's linear model, with its closed-form
    gradient in NumPy: at 64-sample batches autograd's per-step dispatch costs ~5x the math.
    Updates the model's parameters in place through shared memory."""
    weight, bias = model.fc.weight.data.numpy(), model.fc.bias.data.numpy()
    start_weight, start_bias = weight.copy(), bias.copy()
    features, labels = x.flatten(1).numpy(), y.numpy()
    last_epoch_loss = 0.0
    for epoch in batches:
        total = 0.0
        for idx in epoch:
            rows = idx.numpy()
            xb = features[rows]
            residual, loss = softmax_residual(weight, bias, xb, labels[rows])
            residual /= len(rows)
            grad_weight, grad_bias = residual.T @ xb, residual.sum(0)
            if proximal_mu > 0:
                grad_weight += proximal_mu * (weight - start_weight)
                grad_bias += proximal_mu * (bias - start_bias)
            weight -= np.float32(lr) * grad_weight
            bias -= np.float32(lr) * grad_bias
            total += loss
        last_epoch_loss = total / max(len(epoch), 1)
    return last_epoch_loss
