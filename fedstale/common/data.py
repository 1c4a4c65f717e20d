"""Datasets as numpy arrays: IDX (Fashion-MNIST, MNIST), CIFAR pickles, scikit-learn digits,
and a user's loader named as 'package.module:function' (`load_own_dataset`).

Lookup order for a downloadable dataset: the run's `data-dir`, then Debian's
`/usr/share/datasets/<name>` (Fashion-MNIST ships as `dataset-fashion-mnist`), then a
checksummed download into `data-dir` (or `~/.cache/fedstale`). When all three fail the
error says in one line how to get the files. torchvision is never imported.
"""

from __future__ import annotations

import gzip
import os
import pickle
import tarfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from fedstale.common.config import ConfigError, is_reference
from fedstale.common.download import DownloadError, RemoteFile, fetch
from fedstale.common.references import accepts, call, resolve

DEBIAN_DIR = Path("/usr/share/datasets")
IDX_NAMES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
# Checksums of the upstream files (as published with torchvision's dataset classes).
IDX_SOURCES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "fmnist": (
        ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com"],
        (
            "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "25c81989df183df01b3e8a0aad5dffbe",
            "bef4ecab320f06d8554ea6380940ec79",
            "bb300cfdad3c16e7a12a480ee83cd310",
        ),
    ),
    "mnist": (
        ["https://ossci-datasets.s3.amazonaws.com/mnist", "http://yann.lecun.com/exdb/mnist"],
        (
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "d53e105ee54ea40749a09fcbcd1e9432",
            "9fb629c4189551a2d022fa330f9573f3",
            "ec29112dd5afa0611ce80d1b7f02629c",
        ),
    ),
}
CIFAR_SOURCES: dict[str, tuple[list[str], RemoteFile]] = {
    "cifar10": (
        ["https://www.cs.toronto.edu/~kriz"],
        RemoteFile("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),
    ),
    "cifar100": (
        ["https://www.cs.toronto.edu/~kriz"],
        RemoteFile("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),
    ),
}
DEBIAN_NAMES = {"fmnist": "fashion-mnist", "mnist": "mnist"}
HOW_TO_GET = {
    "fmnist": "install Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
    " or put the four gzipped IDX files in data-dir",
    "mnist": "put the four gzipped MNIST IDX files in data-dir",
    "cifar10": "put cifar-10-python.tar.gz in data-dir",
    "cifar100": "put cifar-100-python.tar.gz in data-dir",
}
# Per-channel normalisation: FLGo's transforms (the FedPSA paper's harness; FLGo applies
# MNIST's statistics to Fashion-MNIST too), the training-set statistics elsewhere.
STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fmnist": ((0.1307,), (0.3081,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "digits": ((0.3,), (0.38,)),
}


class DatasetUnavailable(RuntimeError):
    """The dataset's files are nowhere to be found and cannot be downloaded."""


@dataclass(frozen=True)
class Dataset:
    """Raw arrays: images as uint8 (N, C, H, W) (digits: float32 in [0, 1]), labels int64.
    A user's dataset: float32 inputs as its loader gave them, int64 class labels or float32
    regression targets; `num_classes` is then the model's number of outputs (1 for (N,)
    targets, k for (N, k)).

    `x_test` is None for a dataset without a standard test split (digits).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def regression(self) -> bool:
        """Float targets rather than class labels."""
        return bool(np.issubdtype(self.y_train.dtype, np.floating))


def read_idx(path: Path) -> np.ndarray:
    """Read a (possibly gzipped) IDX file: big-endian dims after a 4-byte magic."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims)) if dims else 0
    if len(raw) - offset != expected:
        raise ValueError(f"{path} is truncated: {len(raw) - offset} bytes for shape {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims)


def default_cache_dir() -> Path:
    return Path(os.environ.get("FEDSTALE_DATA", Path.home() / ".cache" / "fedstale"))


def candidate_dirs(name: str, data_dir: str) -> list[Path]:
    dirs = [Path(data_dir).expanduser() / sub for sub in (name, "")] if data_dir else []
    if name in DEBIAN_NAMES:
        dirs.append(DEBIAN_DIR / DEBIAN_NAMES[name])
    dirs.append(default_cache_dir() / name)
    return dirs


def _find_idx_dir(name: str, data_dir: str) -> Path | None:
    for folder in candidate_dirs(name, data_dir):
        if all((folder / file).is_file() for file in IDX_NAMES):
            return folder
    return None


def load_idx_dataset(name: str, data_dir: str, mirrors: list[str] | None = None) -> Dataset:
    folder = _find_idx_dir(name, data_dir)
    if folder is None:
        default_mirrors, md5s = IDX_SOURCES[name]
        folder = _download_dir(name, data_dir)
        try:
            for file, md5 in zip(IDX_NAMES, md5s, strict=True):
                fetch(RemoteFile(file, md5), mirrors or default_mirrors, folder)
        except DownloadError as err:
            raise DatasetUnavailable(f"{name} not found and {err}; {HOW_TO_GET[name]}") from None
    x_train, y_train, x_test, y_test = (read_idx(folder / file) for file in IDX_NAMES)
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise ValueError(f"{folder}: image and label counts differ")
    return Dataset(
        name=name,
        x_train=x_train[:, None],
        y_train=y_train.astype(np.int64),
        x_test=x_test[:, None],
        y_test=y_test.astype(np.int64),
        num_classes=10,
    )


def _download_dir(name: str, data_dir: str) -> Path:
    return Path(data_dir).expanduser() / name if data_dir else default_cache_dir() / name


def _read_cifar_member(archive: tarfile.TarFile, member: str, label_key: bytes) -> tuple:
    handle = archive.extractfile(member)
    if handle is None:
        raise ValueError(f"{member} missing from the CIFAR archive")
    batch = pickle.load(handle, encoding="bytes")
    images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return images, np.asarray(batch[label_key], dtype=np.int64)


def load_cifar_dataset(name: str, data_dir: str, mirrors: list[str] | None = None) -> Dataset:
    default_mirrors, remote = CIFAR_SOURCES[name]
    archive_path = next(
        (d / remote.name for d in candidate_dirs(name, data_dir) if (d / remote.name).is_file()),
        None,
    )
    if archive_path is None:
        try:
            archive_path = fetch(remote, mirrors or default_mirrors, _download_dir(name, data_dir))
        except DownloadError as err:
            raise DatasetUnavailable(f"{name} not found and {err}; {HOW_TO_GET[name]}") from None
    if name == "cifar10":
        train_members = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)]
        test_member, label_key, classes = "cifar-10-batches-py/test_batch", b"labels", 10
    else:
        train_members = ["cifar-100-python/train"]
        test_member, label_key, classes = "cifar-100-python/test", b"fine_labels", 100
    with tarfile.open(archive_path, "r:gz") as archive:
        parts = [_read_cifar_member(archive, m, label_key) for m in train_members]
        x_test, y_test = _read_cifar_member(archive, test_member, label_key)
    return Dataset(
        name=name,
        x_train=np.concatenate([p[0] for p in parts]),
        y_train=np.concatenate([p[1] for p in parts]),
        x_test=x_test,
        y_test=y_test,
        num_classes=classes,
    )


def load_digits_dataset() -> Dataset:
    table = digits_table()
    images = (table[:, :-1].reshape(-1, 8, 8) / 16.0).astype(np.float32)[:, None]
    return Dataset("digits", images, table[:, -1].astype(np.int64), None, None, 10)


def digits_table() -> np.ndarray:
    """scikit-learn's bundled digits (64 pixels and the label per row), read from its CSV as
    `load_digits` reads it, without importing scikit-learn: that import cost 0.7-1.5 s of
    CPU in every process that loads the data (each ClientApp task of a deployment)."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder, "datasets", "data", "digits.csv.gz")
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                return np.loadtxt(handle, delimiter=",")
    from sklearn.datasets import load_digits  # a layout of scikit-learn's files not known

    bunch = load_digits()
    return np.column_stack([bunch.data, bunch.target])


OWN_CONTRACT = (
    "expected (x_train, y_train, x_test, y_test) numpy arrays (the test pair may be None)"
)


def load_own_dataset(reference: str) -> Dataset:
    """A user's loader, called with no arguments; its result checked against the contract
    (one ConfigError line naming what is wrong)."""
    loader = resolve("dataset", reference)
    if not accepts(loader):
        raise ConfigError(f"dataset={reference}: the loader must take no arguments")
    result = call("dataset", reference, loader)
    try:
        return own_dataset(reference, result)
    except ValueError as err:
        raise ConfigError(f"dataset={reference}: {err}") from None


def own_dataset(name: str, result: object) -> Dataset:
    if not isinstance(result, tuple | list) or len(result) != 4:
        raise ValueError(f"returned {_kind(result)}; {OWN_CONTRACT}")
    x_train, y_train = _features(result[0], "x_train"), _targets(result[1], "y_train")
    x_test, y_test = result[2], result[3]
    if (x_test is None) != (y_test is None):
        raise ValueError("x_test and y_test must both be arrays or both be None")
    _same_length(x_train, y_train, "train")
    if x_test is not None:
        x_test, y_test = _features(x_test, "x_test"), _targets(y_test, "y_test")
        _same_length(x_test, y_test, "test")
        if x_test.shape[1:] != x_train.shape[1:] or y_test.dtype != y_train.dtype:
            raise ValueError("the test arrays' sample shape or label type differ from train's")
        if y_test.shape[1:] != y_train.shape[1:]:
            raise ValueError("the test targets' shape differs from train's")
    return Dataset(name, x_train, y_train, x_test, y_test, _outputs(y_train, y_test))


def _kind(value: object) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _features(value: object, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim < 2 or len(value) == 0:
        raise ValueError(f"{name} is {_kind(value)}; expected a numpy array (N, *input_shape)")
    if not np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_:
        raise ValueError(f"{name} has dtype {value.dtype}; expected numbers")
    return value.astype(np.float32, copy=False)


def _targets(value: object, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim not in (1, 2):
        raise ValueError(
            f"{name} is {_kind(value)}; expected a numpy array: (N,) int class labels, "
            "or (N,) / (N, k) float targets"
        )
    if np.issubdtype(value.dtype, np.floating):
        return value.astype(np.float32, copy=False)
    if not np.issubdtype(value.dtype, np.integer) or value.ndim != 1:
        raise ValueError(f"{name} has dtype {value.dtype} and shape {value.shape}; {OWN_CONTRACT}")
    if value.min() < 0:
        raise ValueError(f"{name} holds a negative class label; use 0..C-1")
    return value.astype(np.int64, copy=False)


def _same_length(x: np.ndarray, y: np.ndarray, split: str) -> None:
    if len(x) != len(y):
        raise ValueError(f"x_{split} has {len(x)} samples, y_{split} {len(y)}")


def _outputs(y_train: np.ndarray, y_test: np.ndarray | None) -> int:
    """Classes (the largest label + 1), or the width of float targets."""
    if np.issubdtype(y_train.dtype, np.floating):
        return 1 if y_train.ndim == 1 else int(y_train.shape[1])
    top = y_train.max() if y_test is None or len(y_test) == 0 else max(y_train.max(), y_test.max())
    return int(top) + 1


@cache
def load_dataset(name: str, data_dir: str = "") -> Dataset:
    """Load a dataset once per process."""
    if is_reference(name):
        return load_own_dataset(name)
    if name in IDX_SOURCES:
        return load_idx_dataset(name, data_dir)
    if name in CIFAR_SOURCES:
        return load_cifar_dataset(name, data_dir)
    if name == "digits":
        return load_digits_dataset()
    raise ValueError(f"unknown dataset '{name}'")


def normalize(images: np.ndarray, dataset: str) -> np.ndarray:
    """uint8 (or [0, 1] float) images -> float32 standardised per channel; a user's inputs
    are used as its loader gave them."""
    if dataset not in STATS:
        return images.astype(np.float32)
    scaled = images.astype(np.float32)
    if images.dtype == np.uint8:
        scaled /= 255.0
    mean, std = (np.asarray(v, dtype=np.float32).reshape(1, -1, 1, 1) for v in STATS[dataset])
    return (scaled - mean) / std
