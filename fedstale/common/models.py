"""The FedPSA paper's models (or a user's factory named 'package.module:function', or a
model of torchvision's by name where torchvision is installed), flat-vector views of their
parameters, and evaluation."""

from __future__ import annotations

from importlib.metadata import version

import numpy as np
import torch
from torch import nn

from fedstale.common.config import (
    MODELS,
    ConfigError,
    is_reference,
    is_torchvision_name,
    torchvision_install,
)
from fedstale.common.layout import ParamLayout
from fedstale.common.objectives import Objective, objective
from fedstale.common.references import accepts, call, resolve

FACTORY_CONTRACT = "expected a torch.nn.Module with parameters"


class LinearModel(nn.Module):
    """FMNIST in the paper: one fully-connected layer 784 -> 10, bias initialised to zero."""

    def __init__(self, in_features: int = 784, num_classes: int = 10) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def softmax_residual(
    weight: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, float]:
    """LinearModel in closed form: per sample, r = d(cross-entropy)/d(logits) =
    softmax(x W^T + b) - onehot(y), and the mean cross-entropy. A sample's gradients are
    outer(r_k, x_k) for W and r_k for b (x already flattened)."""
    logits = x @ weight.T + bias
    logits -= logits.max(1, keepdims=True)
    exp = np.exp(logits)
    total = exp.sum(1, keepdims=True)
    rows = np.arange(len(y))
    mean_loss = float(np.mean(np.log(total[:, 0]) - logits[rows, y]))
    residual = exp / total
    residual[rows, y] -= 1.0
    return residual, mean_loss


class MnistCNN(nn.Module):
    """MNIST: conv5x5(32)-pool-conv5x5(64)-pool-fc512-fc10 (FLGo's layout)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(64 * 4 * 4, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class CifarCNN(nn.Module):
    """CIFAR-10/100: conv5x5(64)-pool-conv5x5(64)-pool-fc384-fc192-fc(classes)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        self.fc1 = nn.Linear(64 * 5 * 5, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc3 = nn.Linear(192, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc3(torch.relu(self.fc2(x)))


class LeNet(nn.Module):
    """pFedGraph's CNN (LeNet-5): conv5x5(6)-pool-conv5x5(16)-pool-fc120-fc84-fc(classes).
    28x28 inputs are padded by 2 so that both sizes end at 16 x 5 x 5 (61,706 parameters
    for Fashion-MNIST, 62,006 for CIFAR-10)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int = 10) -> None:
        super().__init__()
        channels, height = input_shape[0], input_shape[1]
        self.conv1 = nn.Conv2d(channels, 6, 5, padding=2 if height == 28 else 0)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(nn.functional.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(nn.functional.relu(self.conv2(x)), 2)
        x = nn.functional.relu(self.fc1(x.flatten(1)))
        return self.fc3(nn.functional.relu(self.fc2(x)))


class MLP(nn.Module):
    """A small MLP for scikit-learn digits (8x8) or any flattened input."""

    def __init__(self, in_features: int = 64, num_classes: int = 10, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights."""
    torch.manual_seed(seed)
    if is_reference(name):
        return own_model(name, input_shape, num_classes)
    in_features = int(np.prod(input_shape))
    if name == "linear":
        return LinearModel(in_features, num_classes)
    if name == "cnn-mnist":
        return MnistCNN(num_classes)
    if name == "cnn-cifar":
        return CifarCNN(num_classes)
    if name == "mlp":
        return MLP(in_features, num_classes)
    if name == "lenet":
        return LeNet(input_shape, num_classes)
    if is_torchvision_name(name):
        return torchvision_model(name, input_shape, num_classes)
    raise ValueError(f"unknown model '{name}'")


class GreyToRGB(nn.Module):
    """Repeats a one-channel image into the three channels torchvision's models expect."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.expand(-1, 3, -1, -1))


def torchvision_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """`torchvision.models.<name>` with `num_classes` outputs, freshly initialised (no
    pretrained weights: nothing is downloaded); a one-channel image is repeated into three.
    Or one ConfigError line."""
    try:
        from torchvision import models
    except ImportError as err:  # found by the config check, broken here
        raise ConfigError(
            f"model={name}: torchvision does not import ({err}); {torchvision_install()}"
        ) from None
    if name not in models.list_models():
        raise ConfigError(
            f"model={name}: neither fedstale's ({', '.join(MODELS)}) nor a model of "
            f"torchvision {version('torchvision')} (torchvision.models.list_models())"
        )
    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise ConfigError(
            f"model={name}: torchvision's models take images of 1 or 3 channels, (C, H, W); "
            f"this dataset's samples are {tuple(input_shape)}"
        )
    model = models.get_model(name, weights=None, num_classes=num_classes)
    return GreyToRGB(model) if input_shape[0] == 1 else model


def own_model(reference: str, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """A user's factory, called as factory(input_shape, num_outputs) or, when it takes no
    arguments, factory()."""
    factory = resolve("model", reference)
    args = (tuple(input_shape), num_outputs)
    if not accepts(factory, *args):
        if not accepts(factory):
            raise ConfigError(
                f"model={reference}: takes neither (input_shape, num_outputs) nor no arguments"
            )
        args = ()
    model = call("model", reference, factory, *args)
    if not isinstance(model, nn.Module) or not any(True for _ in model.parameters()):
        raise ConfigError(
            f"model={reference}: returned a {type(model).__name__}; {FACTORY_CONTRACT}"
        )
    return model


def output_width(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """The size of `model`'s last output dimension (its classes) for one zero sample of
    `input_shape`, in eval mode (a batch of one); the model's mode is restored."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        width = int(model(torch.zeros(1, *input_shape)).shape[-1])
    model.train(was_training)
    return width


def get_flat(model: nn.Module) -> np.ndarray:
    return torch.cat(
        [t.detach().reshape(-1).float().cpu() for t in model.state_dict().values()]
    ).numpy()


def set_flat(model: nn.Module, flat: np.ndarray) -> None:
    layout = ParamLayout.of(model)
    tensors = {
        k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in layout.unflatten(flat).items()
    }
    model.load_state_dict(tensors)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int = 1024,
    scoring: Objective | None = None,
) -> tuple[float, float]:
    """(metric, mean loss) of `model` on (x, y): accuracy and cross-entropy unless
    `scoring` says otherwise."""
    if len(y) == 0:
        return 0.0, 0.0
    scoring = scoring or objective()
    model.eval()
    device = next(model.parameters()).device
    outputs, loss_sum = [], 0.0
    for start in range(0, len(y), batch_size):
        xb = x[start : start + batch_size].to(device)
        yb = y[start : start + batch_size].to(device)
        output = model(xb)
        loss_sum += scoring.summed_loss(output, yb)
        outputs.append(output)
    return float(scoring.metric(torch.cat(outputs), y.to(device))), loss_sum / len(y)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA device is visible; use device=auto or cpu")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
