"""The federated view of a dataset: the test set and every client's train/validation split.

Both the server (test set) and the clients (their own shares) build it from the run config
alone, so nothing but the seed has to travel. Built once per process and cached; a client's
share is also cached on disk (shares.py). Beside it: the checks of a user's own code
(usercode.py) and the run's model (run_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from fedstale.common.config import AppSettings, ClientSettings
from fedstale.common.data import Dataset, load_dataset, normalize
from fedstale.common.partition import partition, split_validation

HOLDOUT_FRACTION = 0.1


@dataclass(frozen=True)
class Federation:
    dataset: str
    x_pool: np.ndarray
    y_pool: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_idx: tuple[np.ndarray, ...]
    val_idx: tuple[np.ndarray, ...]
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_pool.shape[1:])


@dataclass(frozen=True)
class FederationKey:
    """The run-config fields that determine the federation (hashable cache key)."""

    dataset: str
    data_dir: str
    test_split: str
    partition: str
    alpha: float
    convention: str
    classes_per_client: int
    val_fraction: float
    num_clients: int
    seed: int

    @classmethod
    def of(cls, cfg: ClientSettings) -> FederationKey:
        return cls(
            cfg.dataset,
            cfg.data_dir,
            cfg.test_split,
            cfg.partition,
            cfg.dirichlet_alpha,
            cfg.dirichlet_convention,
            cfg.classes_per_client,
            cfg.client_val_fraction,
            cfg.num_clients,
            cfg.seed,
        )


def effective_test_split(cfg: AppSettings) -> str:
    """The test split a run really uses."""
    return _split_of(cfg.test_split, load_dataset(cfg.dataset, cfg.data_dir))


def _split_of(test_split: str, data: Dataset) -> str:
    """`standard` falls back to a 10% holdout for a dataset without a standard test split
    (digits)."""
    return "holdout" if test_split == "standard" and data.x_test is None else test_split


def _pool_and_test(key: FederationKey) -> tuple[np.ndarray, ...]:
    data = load_dataset(key.dataset, key.data_dir)
    split = _split_of(key.test_split, data)
    if split == "standard":
        return data.x_train, data.y_train, data.x_test, data.y_test
    x_all = data.x_train if data.x_test is None else np.concatenate([data.x_train, data.x_test])
    y_all = data.y_train if data.y_test is None else np.concatenate([data.y_train, data.y_test])
    if split == "local":
        # Every sample is some client's; the test set is the union of their local splits.
        return x_all, y_all, x_all[:0], y_all[:0]
    # A hold-out of 10% of all data (the paper's wording; digits has no standard split).
    order = np.random.default_rng([key.seed, 0x7E57]).permutation(len(y_all))
    num_test = int(round(HOLDOUT_FRACTION * len(y_all)))
    test, pool = np.sort(order[:num_test]), np.sort(order[num_test:])
    return x_all[pool], y_all[pool], x_all[test], y_all[test]


@cache
def build_federation(key: FederationKey) -> Federation:
    x_pool, y_pool, x_test, y_test = _pool_and_test(key)
    shares = partition(
        y_pool,
        key.num_clients,
        key.partition,
        key.seed,
        alpha=key.alpha,
        convention=key.convention,
        classes_per_client=key.classes_per_client,
    )
    splits = [
        split_validation(share, key.val_fraction, key.seed, client)
        for client, share in enumerate(shares)
    ]
    if key.test_split == "local":
        local_test = np.concatenate([held_out for _, held_out in splits])
        x_test, y_test = x_pool[local_test], y_pool[local_test]
    return Federation(
        dataset=key.dataset,
        x_pool=x_pool,
        y_pool=y_pool,
        x_test=x_test,
        y_test=y_test,
        train_idx=tuple(s[0] for s in splits),
        val_idx=tuple(s[1] for s in splits),
        num_classes=load_dataset(key.dataset, key.data_dir).num_classes,
    )


def federation_of(key: FederationKey) -> Federation:
    return build_federation(key)


def as_tensors(fed: Federation, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(normalize(x, fed.dataset)), torch.from_numpy(y)


@cache
def _test_tensors(key: FederationKey) -> tuple[torch.Tensor, ...]:
    fed = build_federation(key)
    return as_tensors(fed, fed.x_test, fed.y_test)


def test_data(key: FederationKey) -> tuple[torch.Tensor, ...]:
    return _test_tensors(key)
