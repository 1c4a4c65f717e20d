"""Local training: E epochs of minibatch SGD, optionally with a proximal term.

The same function serves the ClientApp and the bare-PyTorch reference in bench/.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from common.models import LinearModel, softmax_residual

Step = Callable[[torch.Tensor], float]  # one SGD step on a batch of row indices -> its loss


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
    if closed_form and isinstance(model, LinearModel) and x.device.type == "cpu":
        step = softmax_regression_step(model, x, y, lr, proximal_mu)
    else:
        step = autograd_step(model, x, y, lr, proximal_mu)
    generator = torch.Generator().manual_seed(seed)
    last_epoch_loss = 0.0
    for _ in range(epochs):
        batches = torch.randperm(len(y), generator=generator).split(batch_size)
        losses = [step(idx) for idx in batches]
        last_epoch_loss = sum(losses) / max(len(losses), 1)
    return last_epoch_loss


def autograd_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float, proximal_mu: float
) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    anchor = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    model.train()

    def step(idx: torch.Tensor) -> float:
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Gradient of mu/2 ||w - w_start||^2, added directly (cheaper than autograd).
        for param, start in zip(model.parameters(), anchor, strict=False):
            param.grad.add_(param.detach() - start, alpha=proximal_mu)
        optimizer.step()
        return float(loss.detach())

    return step


def softmax_regression_step(
    model: LinearModel, x: torch.Tensor, y: torch.Tensor, lr: float, proximal_mu: float
) -> Step:
    """The same SGD step as `autograd_step` for the paper's linear model, with its
    closed-form gradient in NumPy: at 64-sample batches autograd's per-step dispatch costs
    ~5x the math. Updates the model's parameters in place through shared memory."""
    weight, bias = model.fc.weight.data.numpy(), model.fc.bias.data.numpy()
    start_weight, start_bias = weight.copy(), bias.copy()
    features, labels = x.flatten(1).numpy(), y.numpy()

    def step(idx: torch.Tensor) -> float:
        rows = idx.numpy()
        xb = features[rows]
        residual, loss = softmax_residual(weight, bias, xb, labels[rows])
        residual /= len(rows)
        grad_weight, grad_bias = residual.T @ xb, residual.sum(0)
        if proximal_mu > 0:
            grad_weight += proximal_mu * (weight - start_weight)
            grad_bias += proximal_mu * (bias - start_bias)
        weight[...] -= np.float32(lr) * grad_weight  # in place: the model's own memory
        bias[...] -= np.float32(lr) * grad_bias
        return loss

    return step
