"""FedPSA's real calibration batch (sent once, kept by the client) and the Sec. 6.6
diagnostic (kappa against the client-server gradient alignment)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedstale.common.calibration as calibration
from bench.kappa_alignment import analyse, binned, correlations
from fedstale.common import federation
from fedstale.common.calibration import MissingCalibration, decode, encode, real_batch
from fedstale.common.config import ConfigError
from fedstale.common.federation import FederationKey
from fedstale.common.models import build_model, get_flat, set_flat
from fedstale.common.sensitivity import loss_gradient
from fedstale.strategies.base import Update, View
from fedstale.strategies.fedpsa import (
    FedPSA,
    FedPSAKeys,
    FedPSAParams,
    diagnostic_batch,
    sketch_for_task,
)
from tests.helpers import bind_server, run_config

SHAPE = (1, 8, 8)


def digits_fedpsa(**params: object) -> FedPSA:
    run = run_config(dataset="digits", num_clients=10, strategy="fedpsa")
    model = build_model(run.model_name, SHAPE, 10, run.seed)
    strategy = FedPSA(run, FedPSAParams(**{"buffer_size": 2, **params}), get_flat(model))
    bind_server(run, strategy)
    return strategy


def forget_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a fresh ClientApp process holds in memory: nothing."""
    monkeypatch.setattr(calibration, "_held", {})


def test_real_batch_is_sent_once_kept_on_disk_and_resent_when_lost(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("FEDSTALE_CACHE_DIR", str(tmp_path))
    forget_held(monkeypatch)
    strategy = digits_fedpsa(fedpsa_calib_source="real", fedpsa_calib_size=16)
    first = strategy.task_extra(3)
    payload = first[FedPSAKeys.CALIB_X]
    assert isinstance(payload, bytes) and len(payload) == 16 * 64 * 4  # float32 8x8 images
    strategy.on_dispatch(3)
    later = strategy.task_extra(3)
    assert FedPSAKeys.CALIB_X not in later
    assert later[FedPSAKeys.CALIB_DIGEST] == first[FedPSAKeys.CALIB_DIGEST]

    model = build_model("mlp", SHAPE, 10, seed=5)
    flat = get_flat(model)
    assert strategy.sketch_global is not None
    server_sketch = strategy.sketch_global(flat)
    np.testing.assert_array_equal(sketch_for_task(model, first, SHAPE, 10), server_sketch)
    forget_held(monkeypatch)  # the next task runs in a fresh process: read from disk
    np.testing.assert_array_equal(sketch_for_task(model, later, SHAPE, 10), server_sketch)

    for cached in tmp_path.rglob("*.npz"):
        cached.unlink()
    forget_held(monkeypatch)
    with pytest.raises(MissingCalibration, match="sends it again"):
        sketch_for_task(model, later, SHAPE, 10)
    strategy.on_task_lost(3)  # the error reply retires the task: the next one carries it
    assert FedPSAKeys.CALIB_X in strategy.task_extra(3)


def test_real_and_gaussian_batches_give_different_kappas_of_the_same_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forget_held(monkeypatch)
    real = digits_fedpsa(fedpsa_calib_source="real")
    gaussian = digits_fedpsa()
    flat = get_flat(build_model("mlp", SHAPE, 10, seed=5))
    assert real.sketch_global is not None and gaussian.sketch_global is not None
    assert not np.allclose(real.sketch_global(flat), gaussian.sketch_global(flat))
    assert gaussian.task_extra(0)[FedPSAKeys.CALIB_SOURCE] == "gaussian"
    assert FedPSAKeys.CALIB_X not in gaussian.task_extra(0)


def test_a_real_batch_larger_than_the_test_split_is_one_config_line() -> None:
    with pytest.raises(ConfigError, match=r"^fedpsa-calib-size: a real calibration batch of "):
        digits_fedpsa(fedpsa_calib_source="real", fedpsa_calib_size=100_000)


def test_real_batch_is_deterministic_distinct_and_checked() -> None:
    x_pool = torch.arange(40, dtype=torch.float32).reshape(20, 1, 2)
    y_pool = torch.arange(20)
    x, y = real_batch(x_pool, y_pool, seed=1, size=8)
    assert torch.equal(y, real_batch(x_pool, y_pool, seed=1, size=8)[1])
    assert not torch.equal(y, real_batch(x_pool, y_pool, seed=2, size=8)[1])
    assert len(set(y.tolist())) == 8
    torch.testing.assert_close(x[:, 0, 0], 2.0 * y.float())  # rows stay with their labels
    with pytest.raises(ValueError, match="exceeds"):
        real_batch(x_pool, y_pool, seed=1, size=21)

    raw_x, raw_y, named = encode((x, y))
    decoded = decode(raw_x, raw_y, 8, named, (1, 2))
    assert torch.equal(decoded[0], x) and torch.equal(decoded[1], y)
    with pytest.raises(ValueError, match="do not hold"):
        decode(raw_x, raw_y, 7, named, (1, 2))
    tampered = bytearray(raw_x)
    tampered[0] ^= 0xFF
    with pytest.raises(ValueError, match="digest"):
        decode(bytes(tampered), raw_y, 8, named, (1, 2))


def psa_update(version: int, delta: np.ndarray, task: int, base: int) -> Update:
    return Update(
        client=task,
        task_id=task,
        base_version=base,
        staleness=version - base,
        num_examples=1,
        vector=delta.astype(np.float32),
        signals={
            FedPSAKeys.SKETCH: np.ones(16),
            FedPSAKeys.UPDATE_NORM_SQ: float(np.dot(delta, delta)),
        },
    )


def test_diagnostic_alignment_equals_eq22_by_hand() -> None:
    strategy = digits_fedpsa(fedpsa_diagnostic=True)
    w0 = strategy.model.copy()
    rng = np.random.default_rng(0)
    deltas = [rng.normal(0, 0.05, w0.size) for _ in range(4)]
    strategy.on_update(psa_update(0, deltas[0], 0, 0), View(version=0))
    first = strategy.on_update(psa_update(0, deltas[1], 1, 0), View(version=0))
    w1 = strategy.model.copy()
    strategy.on_update(psa_update(1, deltas[2], 2, 1), View(version=1))
    second = strategy.on_update(psa_update(1, deltas[3], 3, 0), View(version=1))  # stale: base 0

    run = strategy.run
    x, y = diagnostic_batch(*federation.test_data(FederationKey.of(run)), run.seed)
    model = build_model(run.model_name, SHAPE, 10, run.seed)

    def gradient(flat: np.ndarray) -> torch.Tensor:
        set_flat(model, flat.astype(np.float32))
        return loss_gradient(model, x, y)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b / (a.norm() * b.norm()))

    expected_first = [cos(gradient(w0 + d), gradient(w0)) for d in deltas[:2]]
    bases = ((w1, deltas[2]), (w0, deltas[3]))
    expected_second = [cos(gradient(b + d), gradient(w1)) for b, d in bases]
    np.testing.assert_allclose([r["align"] for r in first.records], expected_first, rtol=1e-4)
    np.testing.assert_allclose([r["align"] for r in second.records], expected_second, rtol=1e-4)


def test_binned_correlations_by_hand() -> None:
    kappa = np.array([0.05, 0.07, 0.15, 0.25, 0.26])
    align = np.array([0.0, 0.2, 0.5, 0.8, 1.0])
    bins = binned(kappa, align, 0.1)
    assert [b["count"] for b in bins] == [2, 1, 2]
    np.testing.assert_allclose([b["centre"] for b in bins], [0.05, 0.15, 0.25])
    np.testing.assert_allclose([b["mean_align"] for b in bins], [0.1, 0.5, 0.9])
    pearson, spearman = correlations(np.array([0.05, 0.15, 0.25]), np.array([0.1, 0.5, 0.9]))
    assert pearson == pytest.approx(1.0) and spearman == pytest.approx(1.0)
    assert np.isnan(correlations(np.ones(4), np.arange(4.0))[0])
    updates = [{"kappa": float(k), "align": float(a)} for k, a in zip(kappa, align, strict=True)]
    result = analyse([*updates, {"kappa": 0.5}], 0.1)
    assert result["updates"] == 5 and result["binned"][1] == pytest.approx(1.0)
