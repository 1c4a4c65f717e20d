"""The federated view of a dataset: the test set and every client's train/validation split.

Both the server (test set) and the clients (their own shares) build it from the run config
alone, so nothing but the seed has to travel. Built once per process and cached; a client's
share is also cached on disk, since a deployed SuperNode starts a fresh ClientApp process
for every task and rebuilding the whole federation there would cost ~0.3 s a task.
"""

from __future__ import annotations

import hashlib
import numbers
import os
from dataclasses import astuple, dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from fedstale.common.config import ConfigError, RunConfig, is_reference
from fedstale.common.data import Dataset, DatasetUnavailable, load_dataset, normalize
from fedstale.common.files import write_atomically
from fedstale.common.models import build_model, resolve_device
from fedstale.common.objectives import objective, target_problem
from fedstale.common.partition import label_problem, partition, split_validation
from fedstale.common.references import call

HOLDOUT_FRACTION = 0.1
CACHE_ENV = "FEDSTALE_CACHE_DIR"
CACHE_FORMAT = 1


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
    def of(cls, cfg: RunConfig) -> FederationKey:
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


def require_dataset(cfg: RunConfig) -> None:
    """The run's dataset loads (found, or downloaded and checked) and, when the run names
    code of its own or a non-default loss or metric (`RunConfig.own_code`), the partition,
    model, loss and metric work on two training samples; or one ConfigError line."""
    try:
        data = load_dataset(cfg.dataset, cfg.data_dir)
    except ConfigError:
        raise
    except (DatasetUnavailable, ValueError, OSError) as err:
        raise ConfigError(f"dataset '{cfg.dataset}': {err}") from None
    if cfg.own_code:
        _check_labels(cfg, data)
        _try_batch(cfg, data)
    if cfg.partition == "dirichlet" and cfg.dirichlet_convention == "per-class":
        build_federation(FederationKey.of(cfg))  # the one partition that can refuse a seed


def _check_labels(cfg: RunConfig, data: Dataset) -> None:
    problem = label_problem(cfg.partition, data.y_train) or target_problem(
        cfg.loss, cfg.metric, data.regression
    )
    pathological = cfg.partition == "pathological"
    if not problem and pathological and cfg.classes_per_client > data.num_classes:
        problem = (
            f"classes-per-client ({cfg.classes_per_client}) exceeds its {data.num_classes} classes"
        )
    if problem:
        raise ConfigError(f"dataset={cfg.dataset}: {problem}")


def _try_batch(cfg: RunConfig, data: Dataset) -> None:
    """The model's output on two training samples, the loss and the metric on it, each of
    the type the contract names (docs/running.md, 'Your own model and data')."""
    scoring = objective(cfg.loss, cfg.metric)
    model = build_model(cfg.model_name, data.input_shape, data.num_classes, cfg.seed)
    x = torch.from_numpy(normalize(data.x_train[:2], cfg.dataset))
    y = torch.from_numpy(data.y_train[:2])
    output = call("model", cfg.model_name, model, x)
    if not isinstance(output, torch.Tensor) or output.ndim < 1 or len(output) != len(y):
        raise ConfigError(
            f"model={cfg.model_name}: its output for a batch of {len(y)} is "
            f"{_described(output)}; expected a tensor with {len(y)} rows"
        )
    loss = call("loss", cfg.loss, scoring.loss, output, y)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise ConfigError(
            f"loss={cfg.loss}: returned {_described(loss)}; expected a scalar torch.Tensor "
            "that autograd can differentiate (the batch's mean loss)"
        )
    with torch.no_grad():
        score = call("metric", cfg.metric, scoring.metric, output.detach(), y)
    if not _is_number(score):
        raise ConfigError(
            f"metric={cfg.metric}: returned {_described(score)}; expected a float "
            "(higher is better)"
        )


def _is_number(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def effective_test_split(cfg: RunConfig) -> str:
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


def federation_of(cfg: RunConfig) -> Federation:
    return build_federation(FederationKey.of(cfg))


def as_tensors(fed: Federation, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(normalize(x, fed.dataset)), torch.from_numpy(y)


def cache_dir() -> Path | None:
    """Where client shares are cached (`FEDSTALE_CACHE_DIR`, default ~/.cache/fedstale;
    set it to an empty string to turn the cache off)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is None:
        return Path.home() / ".cache" / "fedstale" / "shares"
    return Path(configured) if configured else None


def _share_file(key: FederationKey, client: int, split: str) -> Path | None:
    root = cache_dir()
    # A user's loader may return other data for the same reference: never cache its shares.
    if root is None or is_reference(key.dataset):
        return None
    digest = hashlib.sha256(repr((CACHE_FORMAT, astuple(key))).encode()).hexdigest()[:20]
    return root / digest / f"{split}-{client}.npz"


def _store(path: Path, arrays: dict[str, np.ndarray]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda handle: np.savez(handle, **arrays))
    except OSError:
        pass  # a read-only home only costs speed


SHARE = ("x", "y", "input_shape", "num_classes")
SHAPE = ("input_shape", "num_classes")


def _share_arrays(
    key: FederationKey, client: int, split: str, names: tuple[str, ...] = SHARE
) -> dict[str, np.ndarray]:
    """`names` of the normalised share with the dataset's shape facts, from disk when
    cached (an .npz member is read only when asked for)."""
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
        "input_shape": np.array(fed.input_shape, dtype=np.int64),
        "num_classes": np.array(fed.num_classes, dtype=np.int64),
    }
    if path is not None:
        _store(path, arrays)
    return arrays


@cache
def _client_tensors(key: FederationKey, client: int, split: str) -> tuple[torch.Tensor, ...]:
    arrays = _share_arrays(key, client, split)
    return torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])


def client_data(cfg: RunConfig, client: int, split: str = "train") -> tuple[torch.Tensor, ...]:
    """(x, y) tensors of one client's `train` or `val` split, normalised, cached."""
    if not 0 <= client < cfg.num_clients:
        raise ValueError(f"client {client} outside 0..{cfg.num_clients - 1}")
    return _client_tensors(FederationKey.of(cfg), client, split)


def client_holdout(cfg: RunConfig, client: int) -> tuple[torch.Tensor, ...]:
    """The split a client's own model is scored on: its held-out split, or its training
    split when it has none (client-val-fraction 0)."""
    x, y = client_data(cfg, client, "val")
    return (x, y) if len(y) else client_data(cfg, client, "train")


@cache
def _data_shape(key: FederationKey) -> tuple[tuple[int, ...], int]:
    arrays = _share_arrays(key, 0, "train", SHAPE)
    return tuple(int(v) for v in arrays["input_shape"]), int(arrays["num_classes"])


def data_shape(cfg: RunConfig) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) without building the federation when cached."""
    return _data_shape(FederationKey.of(cfg))


def run_model(cfg: RunConfig) -> torch.nn.Module:
    """The run's model, freshly initialised from its seed, on its device: the same weights
    on the server and on every client."""
    input_shape, num_classes = data_shape(cfg)
    model = build_model(cfg.model_name, input_shape, num_classes, cfg.seed)
    return model.to(resolve_device(cfg.device))


@cache
def _test_tensors(key: FederationKey) -> tuple[torch.Tensor, ...]:
    fed = build_federation(key)
    return as_tensors(fed, fed.x_test, fed.y_test)


def test_data(cfg: RunConfig) -> tuple[torch.Tensor, ...]:
    return _test_tensors(FederationKey.of(cfg))
