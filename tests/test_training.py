"""Local training: the linear model's closed-form SGD is the autograd SGD."""

from __future__ import annotations

import pytest
import torch

from client_app.training import local_train, sgd_autograd
from common.models import build_model


@pytest.mark.parametrize("proximal_mu", [0.0, 0.3])
def test_closed_form_sgd_of_the_linear_model_equals_autograd(proximal_mu: float) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(150, 1, 6, 6), torch.randint(0, 4, (150,))
    fast, reference = (build_model("linear", (1, 6, 6), 4, seed=1) for _ in range(2))
    settings = {"epochs": 3, "batch_size": 32, "lr": 0.5, "seed": 9, "proximal_mu": proximal_mu}
    fast_loss = local_train(fast, x, y, **settings)
    generator = torch.Generator().manual_seed(9)
    batches = [torch.randperm(150, generator=generator).split(32) for _ in range(3)]
    reference_loss = sgd_autograd(reference, x, y, batches, 0.5, proximal_mu)
    assert fast_loss == pytest.approx(reference_loss, rel=1e-5)
    for trained, expected in zip(fast.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-6)
    moved = fast.fc.weight - build_model("linear", (1, 6, 6), 4, seed=1).fc.weight
    assert moved.abs().max() > 0.01  # it trained
