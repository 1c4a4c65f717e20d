"""Local training: the linear model's closed-form SGD is the autograd SGD."""

from __future__ import annotations

import pytest
import torch

from fedstale.common.models import build_model, get_flat
from fedstale.common.training import local_train


@pytest.mark.parametrize("proximal_mu", [0.0, 0.3])
def test_closed_form_sgd_of_the_linear_model_equals_autograd(proximal_mu: float) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(150, 1, 6, 6), torch.randint(0, 4, (150,))
    fast, reference = (build_model("linear", (1, 6, 6), 4, seed=1) for _ in range(2))
    settings = {"epochs": 3, "batch_size": 32, "lr": 0.5, "seed": 9, "proximal_mu": proximal_mu}
    fast_loss = local_train(fast, x, y, **settings)
    reference_loss = local_train(reference, x, y, **settings, closed_form=False)
    assert fast_loss == pytest.approx(reference_loss, rel=1e-5)
    for trained, expected in zip(fast.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(trained, expected, rtol=1e-5, atol=1e-6)
    moved = fast.fc.weight - build_model("linear", (1, 6, 6), 4, seed=1).fc.weight
    assert moved.abs().max() > 0.01  # it trained


@pytest.mark.parametrize("trainer", ["auto", "autograd"])
def test_the_trainer_key_picks_the_client_sgd(trainer: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import fedstale.common.training as training
    from fedstale.client_app.task import client_model, train_task
    from fedstale.common.schema import ReplyKeys, TaskSpec
    from tests.helpers import run_config

    used: list[str] = []
    for name in ("autograd_step", "softmax_regression_step"):
        original = getattr(training, name)

        def spy(*args, _name=name, _fn=original, **kwargs):  # type: ignore[no-untyped-def]
            used.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(training, name, spy)
    cfg = run_config(dataset="fmnist", model="linear", trainer=trainer, device="cpu")
    model, layout = client_model(cfg)
    spec = TaskSpec(task_id=1, version=0, lr=0.1, local_epochs=1, batch_size=16, seed=0)
    metrics, delta, _ = train_task(cfg, 0, spec.to_config(), layout.unflatten(get_flat(model)))
    assert used == ["softmax_regression_step" if trainer == "auto" else "autograd_step"]
    assert metrics[ReplyKeys.TRAIN_LOSS] > 0 and any(abs(v).max() > 0 for v in delta.values())
