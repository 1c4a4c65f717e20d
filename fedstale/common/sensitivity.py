"""FedPSA's behavioural signal (FedPSA paper, Sec. 5.2 and 5.4).

- Calibration batch D_b: B samples shared by every client and the server
  (fedstale/common/calibration.py: Gaussian from a seed by default, or a real held-out batch).
  The Gaussian batch's labels are uniformly random, or (`calib-labels` = `self`) each
  sketched model's own argmax predictions on its inputs, so every model's loss gradient
  depends on the model (with random labels it barely does, and kappa is ~1 everywhere).
- Parameter sensitivity (eq. 8): s = |g * theta - 0.5 * F * theta^2|, g the gradient of the
  mean loss on D_b, F = (1/B) sum_k g_k^2 the empirical Fisher diagonal (eq. 6) from
  per-sample gradients g_k, computed batched with torch.func (vmap over grad).
- Sketch (eq. 11): R s with R (k x d) of i.i.d. N(0, 1/k) entries, generated from a shared
  seed one block of columns at a time, so the k x d matrix never sits in memory. Every block
  has its own seed, so client and server build identical blocks.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedstale.common.calibration import Batch
from fedstale.common.models import LinearModel, softmax_residual

LABELS = ("random", "self")  # where the Gaussian batch's labels come from
SKETCH_BLOCK = 1 << 15  # columns of R per block (fixed: part of what makes R reproducible)
GRAD_CHUNK_BYTES = 16 << 20  # per-sample gradients held at once, so big models stay small


def per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> (B, *shape) gradients of each sample's cross-entropy, batched with vmap."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def sample_loss(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (xb.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, yb.unsqueeze(0))

    return vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)


def sensitivity(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 8 for every parameter, flattened in `named_parameters` order (float32)."""
    if isinstance(model, LinearModel):
        return linear_sensitivity(model, x, y)
    return vmap_sensitivity(model, x, y)


def linear_sensitivity(model: LinearModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 8 for the paper's linear model in closed form: with r_k the softmax residual,
    sum_k g_k = R^T X and sum_k g_k^2 = (R * R)^T (X * X) (and R, R * R summed for b)."""
    weight, bias = (p.detach().cpu().numpy() for p in (model.fc.weight, model.fc.bias))
    features = x.flatten(1).cpu().numpy().astype(np.float32)
    residual, _ = softmax_residual(weight, bias, features, y.cpu().numpy())
    squared = residual * residual
    pieces = []
    for theta, grad_sum, square_sum in (
        (weight, residual.T @ features, squared.T @ (features * features)),
        (bias, residual.sum(0), squared.sum(0)),
    ):
        g, fisher = grad_sum / len(y), square_sum / len(y)
        pieces.append(np.abs(g * theta - 0.5 * fisher * theta**2).reshape(-1))
    return torch.from_numpy(np.concatenate(pieces).astype(np.float32)).to(model.fc.weight.device)


def vmap_sensitivity(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Eq. 8 for any model, per-sample gradients from torch.func.

    Per-sample gradients are taken a chunk of samples at a time (at most GRAD_CHUNK_BYTES
    of them), accumulating sum g_k and sum g_k^2, so memory does not grow with B * d."""
    was_training = model.training
    model.eval()
    params = dict(model.named_parameters())
    size = sum(p.numel() for p in params.values())
    chunk = max(1, GRAD_CHUNK_BYTES // (4 * size))
    grad_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    square_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    for start in range(0, len(y), chunk):
        grads = per_sample_grads(model, x[start : start + chunk], y[start : start + chunk])
        for name, g_k in grads.items():
            grad_sum[name] += g_k.sum(0)
            square_sum[name] += (g_k**2).sum(0)
        del grads
    model.train(was_training)
    pieces = []
    for name, theta in params.items():
        g, fisher, t = grad_sum[name] / len(y), square_sum[name] / len(y), theta.detach()
        pieces.append((g * t - 0.5 * fisher * t**2).abs().reshape(-1))
    return torch.cat(pieces).float()


def parameters_vector(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float()


def _block_seed(seed: int, block: int) -> int:
    return int(np.random.SeedSequence([seed, block, 0x5C]).generate_state(1)[0] & 0x7FFFFFFF)


def sketch(vector: torch.Tensor, k: int, seed: int) -> np.ndarray:
    """R @ vector with R ~ N(0, 1/k), built block by block (peak extra memory: k x block)."""
    flat = vector.detach().reshape(-1).float().cpu()
    out = torch.zeros(k, dtype=torch.float64)
    generator = torch.Generator()
    for block, start in enumerate(range(0, flat.numel(), SKETCH_BLOCK)):
        part = flat[start : start + SKETCH_BLOCK]
        generator.manual_seed(_block_seed(seed, block))
        r_block = torch.randn((k, part.numel()), generator=generator)
        out += (r_block @ part).double()
    return (out / np.sqrt(k)).numpy()


def model_sketch(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    k: int,
    seed: int,
    of: str = "sensitivity",
) -> np.ndarray:
    """The k-float sketch of a model: of its sensitivity on `batch`, or of its raw
    parameters (the `no-sensitivity` ablation)."""
    device = next(model.parameters()).device
    if of == "params":
        return sketch(parameters_vector(model), k, seed)
    x, y = batch
    return sketch(sensitivity(model, x.to(device), y.to(device)), k, seed)


def self_labelled(model: nn.Module, batch: Batch) -> Batch:
    """`batch`'s inputs labelled by `model`'s own argmax predictions, taken in eval mode
    (the mode of its sensitivity)."""
    x, _ = batch
    was_training = model.training
    model.eval()
    with torch.no_grad():
        y = model(x.to(next(model.parameters()).device)).argmax(dim=1).cpu()
    model.train(was_training)
    return x, y


def loss_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The flat gradient of the mean cross-entropy on (x, y), in parameter order."""
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return flat.detach().double()
