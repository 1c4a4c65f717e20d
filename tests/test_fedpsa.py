"""FedPSA, CA2FL and FedFa against hand-worked values; sensitivity and sketch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedstale.common.calibration import gaussian_batch
from fedstale.common.models import build_model, get_flat, set_flat
from fedstale.common.schema import InvalidReply
from fedstale.common.sensitivity import (
    SKETCH_BLOCK,
    _block_seed,
    sensitivity,
    sketch,
    vmap_sensitivity,
)
from fedstale.strategies.base import Update, View, step_scale
from fedstale.strategies.buffer import BufferParams
from fedstale.strategies.ca2fl import CA2FL, CA2FLParams
from fedstale.strategies.fedbuff import FedBuff, FedBuffParams
from fedstale.strategies.fedfa import FedFa
from fedstale.strategies.fedpsa import FedPSA, FedPSAKeys, FedPSAParams, cosine, sketch_for_task
from tests.helpers import V0, bind_server, run_config, update


def psa_update(
    delta: list[float], sketch_vec: list[float], reported: float | None = None
) -> Update:
    vector = np.asarray(delta, dtype=np.float32)
    norm = float(np.dot(vector, vector)) if reported is None else reported
    return Update(
        client=0,
        task_id=0,
        base_version=0,
        staleness=0,
        num_examples=1,
        vector=vector,
        signals={FedPSAKeys.SKETCH: np.asarray(sketch_vec), FedPSAKeys.UPDATE_NORM_SQ: norm},
    )


def make_fedpsa(ablation: str = "none") -> FedPSA:
    params = FedPSAParams(
        buffer_size=2, fedpsa_queue=3, fedpsa_gamma=5.0, fedpsa_delta=0.5, fedpsa_ablation=ablation
    )
    strategy = FedPSA(run_config(), params, np.zeros(2))
    strategy.bind_sketcher(lambda flat: np.array([1.0, 0.0]))
    return strategy


def test_fedpsa_uniform_before_the_queue_fills_then_softmax() -> None:
    strategy = make_fedpsa()
    assert not strategy.on_update(psa_update([1, 0], [1, 0]), V0).changed
    first = strategy.on_update(psa_update([0, 1], [0, 1]), V0)
    # queue [1, 1] not full yet: uniform weights 1/2
    assert [r["weight"] for r in first.records] == [0.5, 0.5]
    np.testing.assert_allclose(strategy.model, [0.5, 0.5])
    assert strategy.m0 is None

    strategy.on_update(psa_update([2, 0], [1, 0]), V0)  # queue [1, 1, 4] full: M_0 = 2
    assert strategy.m0 == pytest.approx(2.0)
    second = strategy.on_update(psa_update([0, 1], [0, 1]), V0)  # queue [1, 4, 1]: M_cur = 2
    # Temp = 5 * 2 / 2 + 0.5 = 5.5; kappa = [1, 0]; softmax([1, 0] / 5.5)
    e = math.exp(1 / 5.5)
    weights = [e / (e + 1), 1 / (e + 1)]
    assert [r["temp"] for r in second.records] == [5.5, 5.5]
    assert [r["kappa"] for r in second.records] == [1.0, 0.0]
    np.testing.assert_allclose([r["weight"] for r in second.records], weights)
    np.testing.assert_allclose(strategy.model, [0.5 + 2 * weights[0], 0.5 + weights[1]], rtol=1e-6)


def test_fedpsa_thermometer_cools_as_updates_shrink() -> None:
    strategy = make_fedpsa()
    for delta in ([2, 0], [0, 2], [2, 0]):  # m = 4, 4, 4 -> M_0 = 4
        strategy.on_update(psa_update(delta, [1, 0]), V0)
    for delta in ([1, 0], [0, 1], [1, 0]):  # m = 1 -> M_cur = 1
        strategy.observe(psa_update(delta, [1, 0]))
    assert strategy.temperature() == pytest.approx(5 * 1 / 4 + 0.5)
    assert make_fedpsa("no-thermometer").temperature() == pytest.approx(5.5)
    frozen = make_fedpsa("no-both")
    for delta in ([2, 0], [0, 2], [2, 0], [1, 0]):
        frozen.observe(psa_update(delta, [1, 0]))
    assert frozen.temperature() == pytest.approx(5.5)
    assert frozen.sketch_of == "params" and make_fedpsa().sketch_of == "sensitivity"


def test_fedpsa_rejects_a_wrong_reported_norm() -> None:
    with pytest.raises(InvalidReply, match="reported"):
        make_fedpsa().validate(psa_update([3, 4], [1, 0], reported=24.0))
    make_fedpsa().validate(psa_update([3, 4], [1, 0]))


def test_cosine_clamps_zero_norms() -> None:
    assert cosine(np.zeros(3), np.ones(3)) == 0.0
    assert cosine(np.array([1.0, 1.0]), np.array([2.0, 2.0])) == pytest.approx(1.0)


def test_ca2fl_by_hand() -> None:
    strategy = CA2FL(run_config(num_clients=3), CA2FLParams(buffer_size=2), np.zeros(2))
    strategy.on_update(update([2, 0], client=0), V0)
    assert strategy.on_update(update([0, 4], client=1), V0).changed
    # first flush: v = S / K = ([2, 0] + [0, 4]) / 2
    np.testing.assert_allclose(strategy.model, [1, 2])
    np.testing.assert_allclose(strategy.cache_mean, [2 / 3, 4 / 3])
    strategy.on_update(update([4, 0], client=0), V0)  # S = [4, 0] - h_0 = [2, 0]
    strategy.on_update(update([3, 3], client=2), V0)  # S = [5, 3]
    # v = h + S / K = [2/3, 4/3] + [2.5, 1.5]
    np.testing.assert_allclose(strategy.model, [1 + 2 / 3 + 2.5, 2 + 4 / 3 + 1.5], rtol=1e-6)
    np.testing.assert_allclose(strategy.cache_mean, [7 / 3, 7 / 3], rtol=1e-6)


def test_fedfa_sliding_window_mean() -> None:
    strategy = FedFa(run_config(), BufferParams(buffer_size=2), np.zeros(1))
    for model, expected in (([2.0], 2.0), ([4.0], 3.0), ([9.0], 6.5)):
        assert strategy.on_update(update(model), V0).changed
        np.testing.assert_allclose(strategy.model, [expected])


def test_sensitivity_matches_a_direct_computation_of_eq8() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
    per_sample = []
    for k in range(5):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[k : k + 1]), y[k : k + 1]).backward()
        per_sample.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    grads = torch.stack(per_sample)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    g, fisher = grads.mean(0), (grads**2).mean(0)
    expected = (g * theta - 0.5 * fisher * theta**2).abs()
    torch.testing.assert_close(sensitivity(model, x, y), expected, rtol=1e-5, atol=1e-7)


def test_linear_model_closed_form_sensitivity_equals_the_per_sample_gradient_one() -> None:
    model = build_model("linear", (1, 4, 4), 3, seed=2)
    with torch.no_grad():
        model.fc.bias.copy_(torch.tensor([0.3, -0.2, 0.1]))  # a non-zero bias term
    x, y = torch.randn(7, 1, 4, 4), torch.tensor([0, 1, 2, 2, 1, 0, 1])
    closed_form = sensitivity(model, x, y)
    assert closed_form.shape == (3 * 16 + 3,)
    torch.testing.assert_close(closed_form, vmap_sensitivity(model, x, y), rtol=1e-4, atol=1e-8)


def test_sketch_equals_the_explicit_projection_block_by_block() -> None:
    d, k = SKETCH_BLOCK + 100, 4
    vector = torch.randn(d, generator=torch.Generator().manual_seed(3))
    blocks = []
    for block, start in enumerate(range(0, d, SKETCH_BLOCK)):
        generator = torch.Generator().manual_seed(_block_seed(7, block))
        blocks.append(torch.randn((k, min(SKETCH_BLOCK, d - start)), generator=generator))
    explicit = (torch.cat(blocks, dim=1).double() / math.sqrt(k)) @ vector.double()
    # float32 products summed over d ~ 3e4 terms of size ~1: absolute error ~1e-4
    np.testing.assert_allclose(sketch(vector, k, seed=7), explicit.numpy(), rtol=1e-5, atol=1e-3)


def test_sketch_cosine_approximates_the_full_cosine() -> None:
    rng = np.random.default_rng(0)
    errors = {16: [], 256: []}
    for _ in range(40):
        a = rng.normal(size=4000)
        b = 0.6 * a + 0.8 * rng.normal(size=4000)
        full = cosine(a, b)
        for k in errors:
            seed = int(rng.integers(1 << 30))
            approx = cosine(
                sketch(torch.from_numpy(a), k, seed), sketch(torch.from_numpy(b), k, seed)
            )
            errors[k].append(abs(approx - full))
    assert np.mean(errors[256]) < 0.05  # JL: error ~ 1/sqrt(k)
    assert np.mean(errors[16]) < 0.25
    assert np.mean(errors[256]) < np.mean(errors[16])


def test_client_and_server_sketch_identically() -> None:
    run = run_config(dataset="digits", num_clients=10, strategy="fedpsa")
    strategy = FedPSA(run, FedPSAParams(), np.zeros(1))
    bind_server(run, strategy)
    model = build_model("mlp", (1, 8, 8), 10, seed=11)
    flat = get_flat(model)
    client_side = build_model("mlp", (1, 8, 8), 10, seed=0)
    set_flat(client_side, flat)
    client_sketch = sketch_for_task(client_side, strategy.task_extra(3), (1, 8, 8), 10)
    assert strategy.sketch_global is not None
    np.testing.assert_array_equal(strategy.sketch_global(flat), client_sketch)
    assert client_sketch.shape == (16,)


def test_sensitivity_in_sample_chunks_equals_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedstale.common.sensitivity as module

    model = build_model("mlp", (1, 8, 8), 10, seed=1)
    x, y = gaussian_batch(3, (1, 8, 8), 10, 12)
    whole = sensitivity(model, x, y)
    monkeypatch.setattr(module, "GRAD_CHUNK_BYTES", 1)  # one sample at a time
    torch.testing.assert_close(sensitivity(model, x, y), whole, rtol=1e-5, atol=1e-9)


def test_client_lr_server_step_scales_every_buffered_rule() -> None:
    """server-step=client-lr (FLGo's convention): the step times lr0 * decay^version."""
    run = run_config(num_clients=2, server_step="client-lr", lr=0.1, lr_decay=0.5)
    scale = 0.1 * 0.5**3  # version 3

    fedbuff = FedBuff(run, FedBuffParams(buffer_size=2), np.zeros(1))
    at_v3 = View(version=3)
    fedbuff.on_update(update([2.0], staleness=3), at_v3)
    fedbuff.on_update(update([4.0], staleness=0), at_v3)
    # scale / K * ((1 + 3) ** -0.5 * 2 + 4) = 0.0125 / 2 * 5
    np.testing.assert_allclose(fedbuff.model, [scale / 2 * 5], rtol=1e-6)

    ca2fl = CA2FL(run, CA2FLParams(buffer_size=2), np.zeros(1))
    ca2fl.on_update(update([2.0], client=0), at_v3)
    ca2fl.on_update(update([4.0], client=1), at_v3)
    np.testing.assert_allclose(ca2fl.model, [scale * 3], rtol=1e-6)  # scale * S / K

    fedpsa = FedPSA(run, FedPSAParams(buffer_size=2, fedpsa_queue=5), np.zeros(1))
    fedpsa.bind_sketcher(lambda flat: np.array([1.0, 0.0]))
    fedpsa.on_update(psa_update([2.0], [1, 0]), at_v3)
    outcome = fedpsa.on_update(psa_update([4.0], [0, 1]), at_v3)
    # queue not full: uniform 1/2, times the scale
    assert [r["weight"] for r in outcome.records] == pytest.approx([scale / 2, scale / 2])
    np.testing.assert_allclose(fedpsa.model, [scale * 3], rtol=1e-6)

    spec = FedBuff(run_config(), FedBuffParams(buffer_size=1), np.zeros(1))
    assert step_scale(spec.run, 3) == 1.0
