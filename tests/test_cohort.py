"""Cohort training (fedstale/common/cohort.py) against per-task training: the same
parameters and last-pass loss for clients of different sizes, learning rates, proximal
terms and step budgets, and a client without data left where it started."""

from __future__ import annotations

import copy

import pytest
import torch

from fedstale.common.cohort import Member, cohort_train
from fedstale.common.models import LeNet
from fedstale.common.training import local_train


def members(model: torch.nn.Module) -> list[Member]:
    torch.manual_seed(0)
    out = []
    settings = [
        (150, 2, 0, 0.0),
        (97, 2, 0, 0.01),
        (200, 1, 5, 0.0),
        (64, 3, 0, 0.0),
        (0, 2, 0, 0.0),
    ]
    for k, (n, epochs, steps, mu) in enumerate(settings):
        start = {name: p.detach() + 0.01 * k for name, p in model.named_parameters()}
        x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
        out.append(Member(start, x, y, epochs, 64, 0.05 + 0.01 * k, k, mu, steps))
    return out


def test_a_cohort_trains_each_client_as_its_own_task_would() -> None:
    model = LeNet((1, 28, 28), 10)
    cohort = members(model)
    trained = cohort_train(model, cohort)
    for member, (params, loss) in zip(cohort, trained, strict=True):
        alone = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in alone.named_parameters():
                p.copy_(member.params[name])
        expected = local_train(
            alone,
            member.x,
            member.y,
            epochs=member.epochs,
            batch_size=member.batch_size,
            lr=member.lr,
            seed=member.seed,
            proximal_mu=member.proximal_mu,
            steps=member.steps,
            closed_form=False,
        )
        for name, p in alone.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5)
        if len(member.y):
            assert loss == pytest.approx(expected, rel=1e-5)
        else:
            assert all(torch.equal(params[n], member.params[n]) for n in params)
