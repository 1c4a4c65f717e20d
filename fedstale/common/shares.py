"""Each client's share of the federation, cached on disk: a deployed SuperNode starts a
fresh ClientApp process for every task, and rebuilding the whole federation there would
cost ~0.3 s a task. A share is the client's normalised train or validation split."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import astuple
from functools import cache
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from fedstale.common.config import is_reference
from fedstale.common.data import normalize
from fedstale.common.federation import FederationKey, build_federation
from fedstale.common.files import write_atomically

CACHE_ENV = "FEDSTALE_CACHE_DIR"
CACHE_FORMAT = 1


def cache_dir() -> Path | None:
    """Where client shares are cached (`FEDSTALE_CACHE_DIR`, default ~/.cache/fedstale;
    set it to an empty string to turn the cache off)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is None:
        return Path.home() / ".cache" / "fedstale" / "shares"
    return Path(configured) if configured else None


def cached_file(dataset: str, identity: tuple[Any, ...], name: str) -> Path | None:
    """Where the cache keeps file `name` of what `identity` determines, or None: the cache
    is off, or the dataset is a user's loader, which may return other data for the same
    reference (never cached)."""
    root = cache_dir()
    if root is None or is_reference(dataset):
        return None
    digest = hashlib.sha256(repr((CACHE_FORMAT, identity)).encode()).hexdigest()[:20]
    return root / digest / name


def store(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a cache file at once or not at all; a read-only home only costs speed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, write)
    except OSError:
        pass


def _share_file(key: FederationKey, client: int, split: str) -> Path | None:
    return cached_file(key.dataset, astuple(key), f"{split}-{client}.npz")


SHARE = ("x", "y")


def _share_arrays(
    key: FederationKey, client: int, split: str, names: tuple[str, ...] = SHARE
) -> dict[str, np.ndarray]:
    """`names` of the normalised share, from disk when cached (an .npz member is read only
    when asked for)."""
    path = _share_file(key, client, split)
    if path is not None and path.is_file():
        try:
            with np.load(path) as stored:
                return {name: stored[name] for name in names}
        except (OSError, ValueError, KeyError):
            pass  # a damaged file is rebuilt below
    fed = build_federation(key)
    idx = (fed.train_idx if split == "train" else fed.val_idx)[client]
    arrays = {
        "x": normalize(fed.x_pool[idx], fed.dataset),
        "y": fed.y_pool[idx],
    }
    if path is not None:
        store(path, lambda handle: np.savez(handle, **arrays))
    return arrays


@cache
def _client_tensors(key: FederationKey, client: int, split: str) -> tuple[torch.Tensor, ...]:
    arrays = _share_arrays(key, client, split)
    return torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])


def client_data(key: FederationKey, client: int, split: str = "train") -> tuple[torch.Tensor, ...]:
    """(x, y) tensors of one client's `train` or `val` split, normalised, cached."""
    if not 0 <= client < key.num_clients:
        raise ValueError(f"client {client} outside 0..{key.num_clients - 1}")
    return _client_tensors(key, client, split)


def client_holdout(key: FederationKey, client: int) -> tuple[torch.Tensor, ...]:
    """The split a client's own model is scored on: its held-out split, or its training
    split when it has none (client-val-fraction 0)."""
    x, y = client_data(key, client, "val")
    return (x, y) if len(y) else client_data(key, client, "train")
