"""The paper's models and the flat-vector view of their parameters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedstale.common.layout import ParamLayout
from fedstale.common.models import build_model, evaluate, get_flat, set_flat


@pytest.mark.parametrize(
    ("name", "shape", "classes", "params"),
    [
        ("linear", (1, 28, 28), 10, 7_850),
        ("cnn-mnist", (1, 28, 28), 10, 582_026),
        ("cnn-cifar", (3, 32, 32), 10, 797_962),
        ("cnn-cifar", (3, 32, 32), 100, 815_332),
        ("mlp", (1, 8, 8), 10, 4_810),
    ],
)
def test_models_build_and_run(name: str, shape: tuple, classes: int, params: int) -> None:
    model = build_model(name, shape, classes, seed=0)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, *shape)).shape == (2, classes)


def test_linear_bias_starts_at_zero_and_seed_fixes_weights() -> None:
    a, b = (build_model("linear", (1, 28, 28), 10, seed=3) for _ in range(2))
    assert torch.equal(a.fc.bias, torch.zeros(10))
    assert np.array_equal(get_flat(a), get_flat(b))


def test_flat_round_trip() -> None:
    model = build_model("cnn-mnist", (1, 28, 28), 10, seed=0)
    layout = ParamLayout.of(model)
    flat = get_flat(model)
    assert flat.dtype == np.float32 and flat.size == layout.total
    arrays = layout.unflatten(flat * 2)
    assert list(arrays) == list(model.state_dict())
    set_flat(model, layout.flatten(arrays))
    np.testing.assert_allclose(get_flat(model), flat * 2)


def test_evaluate_counts_correct_predictions() -> None:
    model = build_model("linear", (1, 2, 1), 2, seed=0)
    with torch.no_grad():
        model.fc.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    x = torch.tensor([[[[2.0], [0.0]]], [[[0.0], [2.0]]], [[[3.0], [1.0]]]])
    accuracy, loss = evaluate(model, x, torch.tensor([0, 1, 1]))
    assert accuracy == pytest.approx(2 / 3) and loss > 0


def test_a_torchvision_name_without_torchvision_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`model=resnet18` names torchvision's model; where torchvision is not installed the
    config says so, and how to get it, before anything runs (torchvision never imported)."""
    import importlib.metadata
    import importlib.util
    import sys

    from fedstale.common.config import ConfigError, is_torchvision_name
    from fedstale.strategies.registry import load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchvision" else real(name, *a),
    )
    assert is_torchvision_name("resnet18") and not is_torchvision_name("lenet")
    assert not is_torchvision_name("my_task:net")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.11.0+cu130")
    with pytest.raises(ConfigError, match=r"pip install 'torchvision==0\.26\.\*'") as caught:
        load_config({"model": "resnet18"})  # the torchvision of the user's CUDA torch
    assert "\n" not in str(caught.value) and "torchvision" not in sys.modules
    assert "torch 2.11.0+cu130" in str(caught.value)

    def no_torch(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_torch)
    with pytest.raises(ConfigError, match=r"pip install 'fedstale\[vision\]'"):
        load_config({"model": "resnet18"})


def test_a_torchvision_model_is_built_by_name_and_fits_grey_images() -> None:
    """Where torchvision imports (tests/test_environments.py runs this in its own
    virtualenv with torch 2.14.1 and torchvision 0.29.1)."""
    pytest.importorskip("torchvision")
    from fedstale.common.config import ConfigError

    model = build_model("resnet18", (1, 28, 28), 10, seed=0)
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    again = build_model("resnet18", (1, 28, 28), 10, seed=0)
    assert np.array_equal(get_flat(model), get_flat(again))
    assert build_model("mobilenet_v3_small", (3, 32, 32), 5, seed=0)(
        torch.zeros(1, 3, 32, 32)
    ).shape == (1, 5)
    with pytest.raises(ConfigError, match=r"neither fedstale's .* nor a model of torchvision"):
        build_model("resnet81", (1, 28, 28), 10, seed=0)
    with pytest.raises(ConfigError, match=r"images of 1 or 3 channels, \(C, H, W\)"):
        build_model("resnet18", (64,), 10, seed=0)
