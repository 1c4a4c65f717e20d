"""Local training: minibatch SGD (or Adam) for E epochs or a fixed number of steps, with
the optimiser settings a task asks for and any extra loss terms a client rule adds.

The same function serves the ClientApp and the bare-PyTorch reference in bench/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedstale.common.models import LinearModel, softmax_residual
from fedstale.common.objectives import LossFn

Step = Callable[[torch.Tensor], float]  # one optimiser step on a batch of row indices -> loss
LossTerm = Callable[[nn.Module], torch.Tensor]  # added to the run's loss (autograd only)
CROSS_ENTROPY: LossFn = nn.functional.cross_entropy


@dataclass(frozen=True)
class Optimiser:
    """What a task asks of the local optimiser (fedstale/common/schema.py TaskSpec carries it)."""

    kind: str = "sgd"  # "sgd" or "adam"
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # max gradient norm; 0 = no clipping

    @property
    def plain_sgd(self) -> bool:
        """Minibatch SGD with nothing on top: what the closed-form trainer computes."""
        return self.kind == "sgd" and not (self.momentum or self.weight_decay or self.grad_clip)


PLAIN_SGD = Optimiser()


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
    optimiser: Optimiser = PLAIN_SGD,
    steps: int = 0,
    loss_terms: Sequence[LossTerm] = (),
    loss: LossFn = CROSS_ENTROPY,
) -> float:
    """Train `model` in place; returns the mean minibatch `loss` (cross-entropy unless
    given; without the proximal term or extra loss terms) of the last pass over the data.
    Batches come from one seeded permutation per pass. `steps` > 0 trains exactly that many
    minibatch steps instead of `epochs` passes. `closed_form` lets the linear model on CPU
    skip autograd when it computes the same thing (cross-entropy, plain SGD, no extra loss
    terms; tested)."""
    linear_on_cpu = isinstance(model, LinearModel) and x.device.type == "cpu"
    plain = optimiser.plain_sgd and not loss_terms and loss is CROSS_ENTROPY
    if closed_form and linear_on_cpu and plain:
        step = softmax_regression_step(model, x, y, lr, proximal_mu)
    else:
        step = autograd_step(model, x, y, lr, proximal_mu, optimiser, loss_terms, loss)
    last_pass_loss = 0.0
    for batches in batch_plan(len(y), epochs, batch_size, seed, steps):
        losses = [step(idx) for idx in batches]
        last_pass_loss = sum(losses) / max(len(losses), 1)
    return last_pass_loss


def batch_plan(
    num_samples: int, epochs: int, batch_size: int, seed: int, steps: int = 0
) -> list[list[torch.Tensor]]:
    """The minibatches of local training, pass by pass: one seeded permutation per pass,
    `epochs` passes, or `steps` > 0 minibatches in all (none without data)."""
    generator = torch.Generator().manual_seed(seed)
    plan: list[list[torch.Tensor]] = []
    steps_left = steps
    while (len(plan) < epochs) if steps <= 0 else (steps_left > 0 and num_samples > 0):
        batches = list(torch.randperm(num_samples, generator=generator).split(batch_size))
        if steps > 0:
            batches = batches[:steps_left]
            steps_left -= len(batches)
        plan.append(batches)
    return plan


def step_count(num_samples: int, epochs: int, batch_size: int, steps: int = 0) -> int:
    """How many minibatch steps `local_train` takes on `num_samples` rows: `steps` when
    set (none without data), else `epochs` passes of ceil(num_samples / batch_size)."""
    if num_samples <= 0:
        return 0
    if steps > 0:
        return steps
    return epochs * -(-num_samples // batch_size)


def make_optimizer(
    params: list[nn.Parameter], lr: float, optimiser: Optimiser
) -> torch.optim.Optimizer:
    if optimiser.kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=optimiser.weight_decay)
    return torch.optim.SGD(
        params, lr=lr, momentum=optimiser.momentum, weight_decay=optimiser.weight_decay
    )


def autograd_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    proximal_mu: float,
    optimiser: Optimiser = PLAIN_SGD,
    loss_terms: Sequence[LossTerm] = (),
    loss_fn: LossFn = CROSS_ENTROPY,
) -> Step:
    params = list(model.parameters())
    update: Callable[[], object]
    if optimiser.plain_sgd:
        update = plain_sgd_update(params, lr)
    else:
        update = make_optimizer(params, lr, optimiser).step
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else []
    model.train()

    def step(idx: torch.Tensor) -> float:
        rows = idx.to(x.device)
        # index_select, not x[rows]: the same rows, 3-4x cheaper than advanced indexing
        # on a 64-row batch of images (docs/benchmarks.md, "Where the time goes")
        loss = loss_fn(model(x.index_select(0, rows)), y.index_select(0, rows))
        objective = loss
        for term in loss_terms:
            objective = objective + term(model)
        for param in params:
            param.grad = None
        objective.backward()
        # Gradient of mu/2 ||w - w_start||^2, added directly (cheaper than autograd).
        for param, start in zip(params, anchor, strict=False):
            param.grad.add_(param.detach() - start, alpha=proximal_mu)
        if optimiser.grad_clip > 0:
            nn.utils.clip_grad_norm_(params, optimiser.grad_clip)
        update()
        return float(loss.detach())

    return step


def plain_sgd_update(params: list[nn.Parameter], lr: float) -> Callable[[], None]:
    """torch.optim.SGD's step without momentum or weight decay, the same operation on the
    same tensors (param -= lr * grad; a parameter without a gradient is left alone), without
    the optimizer's per-step bookkeeping, which cost a sixth of a linear model's task."""

    @torch.no_grad()
    def update() -> None:
        for param in params:
            if param.grad is not None:
                param.add_(param.grad, alpha=-lr)

    return update


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
