"""Datasets, downloads with checksums, partitioners and latency profiles."""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fedstale.common import data
from fedstale.common.config import ConfigError
from fedstale.common.download import DownloadError, RemoteFile, fetch
from fedstale.common.federation import FederationKey
from fedstale.common.latency import client_latencies, device_factors, profile_for
from fedstale.common.partition import partition, split_validation
from fedstale.common.schema import TaskSpec
from fedstale.common.training import local_train, step_count
from tests.helpers import run_config


def write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


def make_idx_set(folder: Path, n_train: int = 20, n_test: int = 6) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte.gz": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte.gz": np.arange(n_test) % 10,
    }
    for name, array in arrays.items():
        write_idx(folder / name, array)
    return {name: hashlib.md5((folder / name).read_bytes()).hexdigest() for name in arrays}


def test_read_idx_round_trip_and_truncation(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    write_idx(tmp_path / "x.gz", images)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "x.gz"), images)
    raw = gzip.decompress((tmp_path / "x.gz").read_bytes())
    (tmp_path / "bad").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="truncated"):
        data.read_idx(tmp_path / "bad")


def test_idx_dataset_from_data_dir(tmp_path: Path) -> None:
    make_idx_set(tmp_path / "mnist")
    dataset = data.load_idx_dataset("mnist", str(tmp_path))
    assert dataset.x_train.shape == (20, 1, 28, 28) and dataset.x_test.shape == (6, 1, 28, 28)
    assert dataset.y_train.dtype == np.int64


def test_idx_download_verifies_checksums(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    md5s = make_idx_set(mirror)
    monkeypatch.setitem(
        data.IDX_SOURCES,
        "mnist",
        ([f"file://{tmp_path}/missing", f"file://{mirror}"], tuple(md5s.values())),
    )
    monkeypatch.setattr(data, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.setenv("FEDSTALE_DATA", str(tmp_path / "cache"))
    dataset = data.load_idx_dataset("mnist", str(tmp_path / "dl"))
    assert len(dataset.y_train) == 20
    assert (tmp_path / "dl" / "mnist" / "train-images-idx3-ubyte.gz").is_file()


def test_download_rejects_a_bad_checksum_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f.bin").write_bytes(b"payload")
    with pytest.raises(DownloadError, match="checksum mismatch"):
        fetch(RemoteFile("f.bin", "0" * 32), [f"file://{tmp_path}/src"], tmp_path / "dst")
    assert list((tmp_path / "dst").iterdir()) == []
    good = hashlib.md5(b"payload").hexdigest()
    assert fetch(RemoteFile("f.bin", good), [f"file://{tmp_path}/src"], tmp_path / "dst").is_file()


def test_missing_dataset_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(data.IDX_SOURCES, "mnist", ([f"file://{tmp_path}/none"], ("0" * 32,) * 4))
    monkeypatch.setattr(data, "DEBIAN_DIR", tmp_path / "no-debian")
    monkeypatch.setenv("FEDSTALE_DATA", str(tmp_path / "cache"))
    with pytest.raises(data.DatasetUnavailable, match="put the four gzipped MNIST IDX files"):
        data.load_idx_dataset("mnist", "")


def cifar_batch(n: int, label_key: bytes) -> bytes:
    rng = np.random.default_rng(1)
    batch = {b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8), label_key: list(range(n))}
    return pickle.dumps(batch)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_archive_download_and_parse(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    remote = data.CIFAR_SOURCES[name][1]
    if name == "cifar10":
        members = {
            f"cifar-10-batches-py/data_batch_{i}": cifar_batch(4, b"labels") for i in range(1, 6)
        }
        members["cifar-10-batches-py/test_batch"] = cifar_batch(3, b"labels")
    else:
        members = {
            "cifar-100-python/train": cifar_batch(8, b"fine_labels"),
            "cifar-100-python/test": cifar_batch(3, b"fine_labels"),
        }
    with tarfile.open(mirror / remote.name, "w:gz") as archive:
        for member, payload in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    md5 = hashlib.md5((mirror / remote.name).read_bytes()).hexdigest()
    monkeypatch.setitem(
        data.CIFAR_SOURCES, name, ([f"file://{mirror}"], data.RemoteFile(remote.name, md5))
    )
    dataset = data.load_cifar_dataset(name, str(tmp_path / "dl"))
    assert dataset.x_train.shape[1:] == (3, 32, 32)
    assert len(dataset.y_train) == (20 if name == "cifar10" else 8)
    assert dataset.num_classes == (10 if name == "cifar10" else 100)


def test_digits_are_scikit_learns_without_importing_it() -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    dataset = data.load_digits_dataset()
    bunch = load_digits()
    assert np.array_equal(dataset.x_train, (bunch.images / 16.0).astype(np.float32)[:, None])
    assert np.array_equal(dataset.y_train, bunch.target) and dataset.y_train.dtype == np.int64
    code = "import sys; from fedstale.common.data import load_digits_dataset as f; f(); "
    code += "print(sorted(m for m in sys.modules if m.startswith('sklearn')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_digits_dataset_has_no_standard_split() -> None:
    dataset = data.load_dataset("digits")
    assert dataset.x_test is None and dataset.input_shape == (1, 8, 8)


LABELS = np.repeat(np.arange(10), 300)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "quantity-dirichlet", "pathological"])
def test_partitions_cover_every_sample_once_and_replay(scheme: str) -> None:
    parts = partition(LABELS, 20, scheme, seed=3, alpha=0.5, classes_per_client=2)
    joined = np.concatenate(parts)
    assert len(joined) == len(LABELS) and len(np.unique(joined)) == len(LABELS)
    again = partition(LABELS, 20, scheme, seed=3, alpha=0.5, classes_per_client=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition(LABELS, 20, scheme, seed=4, alpha=0.5, classes_per_client=2)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_hsu_dirichlet_gives_equal_sizes_and_skew_that_follows_alpha() -> None:
    def classes_held(alpha: float) -> float:
        parts = partition(LABELS, 20, "dirichlet", seed=0, alpha=alpha)
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 0.1 * np.mean(sizes)
        return float(
            np.mean([(np.bincount(LABELS[p], minlength=10) >= 0.05 * len(p)).sum() for p in parts])
        )

    assert classes_held(0.1) < classes_held(1.0) < classes_held(100.0)
    assert classes_held(0.1) < 2.0


def test_per_class_dirichlet_sizes_differ() -> None:
    parts = partition(LABELS, 20, "dirichlet", seed=0, alpha=0.5, convention="per-class")
    sizes = [len(p) for p in parts]
    assert max(sizes) > 2 * min(sizes)


def test_per_class_dirichlet_that_no_draw_meets_is_refused_in_one_config_line() -> None:
    labels = np.repeat(np.arange(2), 20)  # 4 clients need 5 samples each; alpha 0.001 never
    with pytest.raises(ConfigError, match=r"Dirichlet\(0.001\) over 4 clients .* 5,000 draws"):
        partition(labels, 4, "dirichlet", seed=0, alpha=0.001, convention="per-class")


def test_quantity_dirichlet_sizes_differ_above_a_floor_and_labels_stay_iid() -> None:
    parts = partition(LABELS, 20, "quantity-dirichlet", seed=0, alpha=1.0)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 75 and sizes.max() > 2 * sizes.min()  # floor min(100, 3000 / 40)
    big = parts[int(np.argmax(sizes))]  # its label mix is the global one, within noise
    assert np.abs(np.bincount(LABELS[big], minlength=10) / len(big) - 0.1).max() < 0.06
    even = partition(LABELS, 20, "quantity-dirichlet", seed=0, alpha=1000.0)
    assert np.ptp([len(p) for p in even]) < np.ptp(sizes) / 3  # alpha sets the spread


def test_pathological_gives_exactly_k_classes() -> None:
    parts = partition(LABELS, 20, "pathological", seed=0, classes_per_client=3)
    assert all(len(np.unique(LABELS[p])) == 3 for p in parts)


def test_validation_split_keeps_ten_percent() -> None:
    train, val = split_validation(np.arange(1200), 0.1, seed=0, client=5)
    assert len(val) == 120 and len(train) == 1080
    assert len(np.intersect1d(train, val)) == 0


def test_latency_profiles() -> None:
    uniform = client_latencies("uniform", 1000, 10, 500, seed=0)
    assert uniform.min() >= 10 and uniform.max() <= 500
    tail = client_latencies("long-tail", 1000, 10, 500, seed=0)
    assert np.median(tail) < 25 and tail.max() <= 500 and tail.min() >= 10
    slow = client_latencies("slow-fraction", 100, 10, 10, seed=0, slow_fraction=0.3, slow_factor=5)
    assert sorted(np.unique(slow)) == [10, 50] and (slow == 50).sum() == 30
    profile = profile_for(run_config(num_clients=5, latency_jitter=0.2))
    draws = [profile.task_latency(2, t) for t in range(50)]
    base = profile.base[2]
    assert min(draws) >= 0.8 * base and max(draws) <= 1.2 * base and len(set(draws)) > 1
    assert profile.task_latency(2, 7) == profile.task_latency(2, 7)


def task(epochs: int = 2, batch: int = 64, steps: int = 0) -> TaskSpec:
    return TaskSpec(0, 0, 0.1, epochs, batch, 0, local_steps=steps)


def test_proportional_latency_is_steps_times_step_time_times_device_factor() -> None:
    """Clients of 100 and 30 samples, 2 epochs of batch 64: 2 x 2 and 2 x 1 steps; 1.5
    units a step; half the clients (one) 3x slower; 10 units of network."""
    run = run_config(
        num_clients=2,
        concurrency=1,
        latency="proportional",
        latency_step_time=1.5,
        slow_fraction=0.5,
        slow_factor=3.0,
        latency_network=10.0,
    )
    profile = profile_for(run, np.array([100, 30]))
    factors = device_factors(2, run.seed, 0.5, 3.0)
    assert sorted(factors) == [1.0, 3.0]
    assert profile.task_latency(0, 0, task()) == 4 * 1.5 * factors[0] + 10
    assert profile.task_latency(1, 0, task()) == 2 * 1.5 * factors[1] + 10
    assert profile.task_latency(1, 0, task(epochs=5)) == 5 * 1.5 * factors[1] + 10
    assert profile.task_latency(0, 0, task(steps=7)) == 7 * 1.5 * factors[0] + 10
    with pytest.raises(ConfigError, match="latency=proportional needs each client's data size"):
        profile_for(run)


def test_proportional_latency_jitters_and_takes_slow_fraction_from_the_seed() -> None:
    run = run_config(num_clients=100, latency="proportional", latency_jitter=0.2)
    factors = device_factors(100, run.seed, run.slow_fraction, run.slow_factor)
    assert (factors == 5.0).sum() == 30 and (factors == 1.0).sum() == 70  # the defaults
    assert not np.array_equal(factors, device_factors(100, run.seed + 1, 0.3, 5.0))
    profile = profile_for(run, np.full(100, 640))
    draws = [profile.task_latency(3, t, task()) for t in range(40)]
    exact = 20 * factors[3]
    assert min(draws) >= 0.8 * exact and max(draws) <= 1.2 * exact and len(set(draws)) > 1


@pytest.mark.parametrize(
    ("n", "epochs", "batch", "steps"), [(130, 2, 64, 0), (5, 3, 2, 0), (9, 1, 4, 7), (0, 2, 4, 3)]
)
def test_step_count_is_what_local_train_steps(n: int, epochs: int, batch: int, steps: int) -> None:
    import torch

    taken: list[int] = []

    def counter(model: torch.nn.Module) -> torch.Tensor:
        taken.append(1)
        return torch.zeros(())

    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(n, 3), torch.randint(0, 2, (n,))
    local_train(
        model,
        x,
        y,
        epochs=epochs,
        batch_size=batch,
        lr=0.1,
        seed=0,
        steps=steps,
        loss_terms=[counter],
    )
    assert len(taken) == step_count(n, epochs, batch, steps)


def test_client_share_disk_cache_gives_the_same_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedstale.common import federation, run_model, shares

    cfg = run_config(dataset="digits", num_clients=5)
    monkeypatch.setenv(shares.CACHE_ENV, "")
    fresh_x, fresh_y = shares.client_data(FederationKey.of(cfg), 3, "train")
    shares._client_tensors.cache_clear()
    monkeypatch.setenv(shares.CACHE_ENV, str(tmp_path))
    written_x, written_y = shares.client_data(FederationKey.of(cfg), 3, "train")
    assert len(list(tmp_path.glob("*/train-3.npz"))) == 1
    shares._client_tensors.cache_clear()
    federation.build_federation.cache_clear()
    read_x, read_y = shares.client_data(FederationKey.of(cfg), 3, "train")
    assert federation.build_federation.cache_info().currsize == 0  # served from disk
    for x, y in ((written_x, written_y), (read_x, read_y)):
        assert np.array_equal(x.numpy(), fresh_x.numpy())
        assert np.array_equal(y.numpy(), fresh_y.numpy())
    # the model's input shape comes from the dataset, remembered on disk per dataset
    run_model.dataset_shape.cache_clear()
    assert run_model.data_shape(cfg) == ((1, 8, 8), 10)
    assert federation.build_federation.cache_info().currsize == 0
    assert len(list(tmp_path.glob("*/shape.json"))) == 1
    run_model.dataset_shape.cache_clear()
    shares._client_tensors.cache_clear()
