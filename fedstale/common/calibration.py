"""FedPSA's shared calibration batch D_b (FedPSA paper Sec. 5.2; the Table 5 ablation).

- `gaussian` (default): i.i.d. N(0, 1) inputs of the model's input shape with uniformly
  random labels, generated from a seed, so only the seed travels (`fedpsa-calib-labels =
  self` replaces the labels, per sketched model: fedstale/common/sensitivity.py).
- `real`: `B` samples of the held-out test split, drawn by the server from the seed. The
  server sends them once, with a client's first FedPSA task (ConfigRecord bytes); later
  tasks carry only their digest. The client keeps the batch in memory and in its cache
  folder; a client that lost it answers with an error, and the server sends it again.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch

from fedstale.common.files import write_atomically
from fedstale.common.shares import cache_dir

Batch = tuple[torch.Tensor, torch.Tensor]
SOURCES = ("gaussian", "real")
_held: dict[str, Batch] = {}


class MissingCalibration(RuntimeError):
    """A task refers to a real calibration batch this client does not hold."""


def gaussian_batch(seed: int, input_shape: tuple[int, ...], num_classes: int, size: int) -> Batch:
    """Gaussian inputs and uniform labels from `seed`; identical wherever it is built."""
    generator = torch.Generator().manual_seed(int(seed))
    x = torch.randn((size, *input_shape), generator=generator)
    y = torch.randint(0, num_classes, (size,), generator=generator)
    return x, y


def real_batch(x_pool: torch.Tensor, y_pool: torch.Tensor, seed: int, size: int) -> Batch:
    """`size` distinct samples of a held-out pool, chosen by `seed`."""
    if size > len(y_pool):
        raise ValueError(f"a real calibration batch of {size} exceeds the {len(y_pool)} held out")
    rows = np.random.default_rng([int(seed), 0xCA1]).choice(len(y_pool), size, replace=False)
    index = torch.from_numpy(np.sort(rows))
    return x_pool[index].float().contiguous(), y_pool[index].long().contiguous()


def digest(batch: Batch) -> str:
    x, y = batch
    h = hashlib.sha256(x.float().numpy().tobytes())
    h.update(y.long().numpy().tobytes())
    return h.hexdigest()[:32]


def encode(batch: Batch) -> tuple[bytes, bytes, str]:
    """A real batch as it travels (what is sent once): input bytes, label bytes, digest."""
    x, y = batch
    return x.float().numpy().tobytes(), y.long().numpy().tobytes(), digest(batch)


def decode(
    raw_x: bytes, raw_y: bytes, size: int, named: str, input_shape: tuple[int, ...]
) -> Batch:
    """The batch `encode` sent, checked against its size and its digest `named`."""
    if len(raw_x) != 4 * size * math.prod(input_shape) or len(raw_y) != 8 * size:
        raise ValueError(
            f"calibration batch bytes ({len(raw_x)}, {len(raw_y)}) do not hold {size} "
            f"samples of shape {input_shape}"
        )
    x = np.frombuffer(raw_x, dtype=np.float32).reshape(size, *input_shape)
    y = np.frombuffer(raw_y, dtype=np.int64)
    batch = (torch.from_numpy(x.copy()), torch.from_numpy(y.copy()))
    if digest(batch) != named:
        raise ValueError("calibration batch does not match its digest")
    return batch


def _cached_file(key: str) -> Path | None:
    folder = cache_dir()
    return None if folder is None else folder / "calibration" / f"{key}.npz"


def keep(batch: Batch, key: str) -> None:
    """Hold a decoded batch (its digest already checked) in memory and in the cache."""
    _held[key] = batch
    path = _cached_file(key)
    if path is not None and not path.exists():
        arrays = {"x": batch[0].numpy(), "y": batch[1].numpy()}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda sink: np.savez(sink, **arrays))


def held(key: str) -> Batch | None:
    if key in _held:
        return _held[key]
    path = _cached_file(key)
    if path is None or not path.exists():
        return None
    with np.load(path) as saved:
        batch = (torch.from_numpy(saved["x"]), torch.from_numpy(saved["y"]))
    if digest(batch) != key:
        return None
    _held[key] = batch
    return batch


def real_for_task(
    named: str, sent: tuple[bytes, bytes] | None, size: int, input_shape: tuple[int, ...]
) -> Batch:
    """The real batch a task names by its digest: decoded and kept when the task carries
    its bytes (`sent`), else the one this client holds."""
    if sent is not None:
        batch = decode(*sent, size, named, input_shape)
        keep(batch, named)
        return batch
    batch = held(named)
    if batch is None:
        raise MissingCalibration(
            "this client does not hold the real calibration batch the task names; "
            "the server sends it again with the next task"
        )
    return batch
